"""``TorchStatsEngine.record_many`` hands the CPU tensors the one-pass kernel reads to it
in one call (``NativeStats.stats_many``): every record is, to the bit, what ``record``
of its tensor alone gives, in the order of the tensors, with the others (empty, integer,
non-contiguous, fp64, meta) in their places."""

import math

import pytest
import torch

from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.frameworks.pytorch.stats import TorchStatsEngine
from msprobe.core.monitor_v2.stats import StatPlan


def _mixed_tensors():
    g = torch.Generator().manual_seed(0)
    with_nan = torch.randn(300, generator=g)
    with_nan[7] = math.nan
    with_zeros = torch.randn(64, 33, generator=g)
    with_zeros[::3] = 0.0
    return [
        torch.randn(32, 32, generator=g),
        torch.randn(5000, generator=g).bfloat16(),
        with_nan,
        torch.empty(0),
        torch.randn(8, 8, generator=g).t(),  # not contiguous: ATen
        torch.arange(10),  # integers: ATen
        with_zeros,
        torch.randn(100, generator=g).double(),  # fp64: ATen
        torch.randn(4, 4, generator=g).half(),
        torch.nn.Parameter(torch.randn(3, generator=g)),
        torch.empty(4, device="meta"),  # no data: unobserved
        torch.full((70000,), 3.0e38),  # fp32 partials beyond fp32: still finite in fp64
    ]


def _bits(value):
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_bits(v) for v in value]
    return value.hex() if isinstance(value, float) else value


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "aten"])
@pytest.mark.parametrize("ops", [["min", "max", "mean", "norm", "nans"], ["min", "max", "norm", "nans", "zeros"],
                                 ["norm"], ["mean", "zeros"]])
def test_record_many_equals_record_of_each_tensor_to_the_bit(use_native, ops):
    if use_native and native.load() is None:
        pytest.skip("no C compiler: the one-pass kernel is not built")
    tensors = _mixed_tensors()
    plan = StatPlan.from_ops(ops)
    keys = [(0, f"t{i}", "param", None) for i in range(len(tensors))]
    many_engine, single_engine = TorchStatsEngine(use_native), TorchStatsEngine(use_native)
    many = many_engine.record_many(tensors, plan, keys)
    single = [single_engine.record(t, plan, *key) for t, key in zip(tensors, keys)]
    many_engine.to_host(many)
    single_engine.to_host(single)
    assert [r.key for r in many] == keys
    for got, want in zip(many, single):
        assert (_bits(got.vector), _bits(got.nans), got.numel, _bits(got.zeros)) == \
            (_bits(want.vector), _bits(want.nans), want.numel, _bits(want.zeros)), got.name


def test_stats_many_gives_each_buffer_what_stats_of_it_alone_gives():
    kernel = native.load()
    if kernel is None:
        pytest.skip("no C compiler: the one-pass kernel is not built")
    g = torch.Generator().manual_seed(1)
    buffers = [torch.randn(n, generator=g) for n in (1, 17, 4096 + 3, 1 << 17)] + [torch.randn(999).bfloat16()]
    buffers[2][5] = math.nan
    codes = [native.F32] * 4 + [native.BF16]
    pointers = [b.data_ptr() for b in buffers]
    counts = [b.numel() for b in buffers]
    for threads in (1, 4):
        vectors, nans, zeros = kernel.stats_many(pointers, counts, codes, threads, zeros=True)
        for i, b in enumerate(buffers):
            vector, nan_count, zero_count = kernel.stats_zeros(pointers[i], counts[i], codes[i], threads)
            assert (_bits(vectors[i]), nans[i], zeros[i]) == (_bits(vector), nan_count, zero_count)
        assert kernel.stats_many(pointers, counts, codes, threads)[2] is None
    assert kernel.stats_many([], [], []) == ([], [], None)


def _kernel_tensors():
    """Only tensors the one-pass kernel reads: ``record_many`` takes its one-pass path."""
    g = torch.Generator().manual_seed(1)
    with_nan = torch.randn(40, generator=g)
    with_nan[3] = math.nan
    return [torch.randn(32, 32, generator=g), torch.randn(700, generator=g).bfloat16(), with_nan,
            torch.randn(9, generator=g).half(), torch.nn.Parameter(torch.randn(3, generator=g)),
            torch.zeros(5)]


_ONE_THE_KERNEL_DOES_NOT_READ = {
    "empty": lambda: torch.empty(0),
    "integer": lambda: torch.arange(6),
    "fp64": lambda: torch.randn(6).double(),
    "not contiguous": lambda: torch.randn(4, 4).t(),
    "negative bit": lambda: torch._neg_view(torch.randn(6)),
    "meta": lambda: torch.empty(3, device="meta"),
    "complex": lambda: torch.randn(4, dtype=torch.complex64),
    "sparse": lambda: torch.randn(3, 3).to_sparse(),
    "nested": lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged),
}


@pytest.mark.parametrize("odd", [None] + list(_ONE_THE_KERNEL_DOES_NOT_READ), ids=str)
def test_one_tensor_the_kernel_does_not_read_sends_the_list_down_the_general_path(odd):
    """Every tensor the kernel reads: one pass over the list and one kernel call; one it
    does not read anywhere in the list: the general path, each record still what
    ``record`` of its tensor alone gives."""
    if native.load() is None:
        pytest.fail("the one-pass kernel did not build: is a C compiler (gcc) installed?")
    tensors = _kernel_tensors()
    if odd is not None:
        tensors.insert(2, _ONE_THE_KERNEL_DOES_NOT_READ[odd]())
    plan = StatPlan.from_ops(["min", "max", "mean", "norm", "nans", "zeros"])
    keys = [(0, f"t{i}", "param", None) for i in range(len(tensors))]
    many_engine, single_engine = TorchStatsEngine(), TorchStatsEngine()
    many = many_engine.record_many(tensors, plan, keys)
    single = [single_engine.record(t, plan, *key) for t, key in zip(tensors, keys)]
    many_engine.to_host(many)
    single_engine.to_host(single)
    for got, want in zip(many, single):
        assert (_bits(got.vector), _bits(got.nans), got.numel, _bits(got.zeros)) == \
            (_bits(want.vector), _bits(want.nans), want.numel, _bits(want.zeros)), got.name
    assert many[0].vector[0] == float(tensors[0].min())  # and against the tensor itself
    assert many[0].vector[3] == pytest.approx(float(tensors[0].double().norm()), rel=1e-6)


@pytest.mark.parametrize("odd", [None, "fp64", "not contiguous"])
def test_the_compiled_batch_gives_the_python_batchs_records(odd):
    """``records_of`` (the extension's ``record_many`` of a list the kernel reads: the
    checks and the reads in one call) gives the records of the Python path's checks and
    ``records_many``; a list with one tensor it does not read goes to that path whole."""
    compiled, python = TorchStatsEngine(), TorchStatsEngine()
    assert compiled._records_of is not None, "the kernel was not built as an extension (Python's headers?)"
    python._records_of = None
    tensors = _kernel_tensors()
    if odd is not None:
        tensors.insert(1, _ONE_THE_KERNEL_DOES_NOT_READ[odd]())
    plan = StatPlan.from_ops(["min", "max", "mean", "norm", "nans", "zeros"])
    keys = [(i % 2, f"t{i}", "param", None if i % 3 else 1) for i in range(len(tensors))]
    got, want = compiled.record_many(tensors, plan, keys), python.record_many(tensors, plan, keys)
    compiled.to_host(got)
    python.to_host(want)
    assert [repr(r) for r in got] == [repr(r) for r in want]
