"""The optional ``zeros`` statistic: the number of elements exactly equal to zero.

Checked against NumPy (``np.count_nonzero(a == 0)`` on a copy) for every dtype the
engine reads, several shapes and layouts, empty tensors, ``-0.0`` (a zero) and NaN (not
one), on both reduction paths (the one-pass C kernel and ATen only, as in
``test_stats_engine.py``), then end to end: the CSV column, its place after the five
statistics of the user document, merged calls, and the default header without it."""

import csv
import logging
import math

import numpy as np
import pytest
import torch

from support import TinyMLP, make_batches, rows_of
from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.config import load_config
from msprobe.core.monitor_v2.frameworks.pytorch.stats import StatPlan, TorchStatsEngine
from msprobe.core.monitor_v2.stats import merge_records
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

FIVE = ("min", "max", "mean", "norm", "nans")
SIX = FIVE + ("zeros",)


@pytest.fixture(params=["native", "aten"])
def stats_path(request, monkeypatch):
    if request.param == "aten":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
        assert TorchStatsEngine()._native is None
    else:
        monkeypatch.delenv(native.ENV_SWITCH, raising=False)
        assert native.load() is not None, "the one-pass kernel did not build: is a C compiler (gcc) installed?"
    return request.param


def np_zeros(t: torch.Tensor) -> int:
    """The reference, on a NumPy copy (bf16, which NumPy lacks, through an exact fp32 copy)."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.dtype == torch.bfloat16:
        t = t.float()
    a = t.cpu().numpy().copy()
    return int(np.count_nonzero(a == 0))


def with_zeros(shape, dtype, seed=0) -> torch.Tensor:
    """Values of ``dtype`` where about a third are exactly zero, some of them ``-0.0``."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in (torch.int64, torch.int32, torch.uint8):
        return torch.randint(0, 3, shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    v[v.abs() < 0.43] = 0.0
    v[(v == 0) & (torch.rand(shape, generator=g, dtype=torch.float64) < 0.5)] = -0.0
    if dtype.is_complex:
        return torch.complex(v, torch.where(v == 0, v, v * 0.5)).to(dtype)
    return v.to(dtype)


def make(kind: str, dtype) -> torch.Tensor:
    if kind == "scalar0":
        return torch.zeros((), dtype=dtype)
    if kind == "1d":
        return with_zeros((37,), dtype)
    if kind == "3d":
        return with_zeros((3, 4, 5), dtype, 1)
    if kind == "transposed":
        t = with_zeros((40, 70), dtype, 2).t()
        assert not t.is_contiguous()
        return t
    if kind == "slice":
        t = with_zeros((60, 90), dtype, 3)[::2, 1::3]
        assert not t.is_contiguous()
        return t
    if kind == "blocks":  # crosses the kernel's 4096-element blocks and leaves an odd tail
        return with_zeros((4096 * 3 + 21,), dtype, 4)
    if kind == "empty":
        return with_zeros((0,), dtype)
    if kind == "empty3d":
        return with_zeros((3, 0, 2), dtype)
    raise ValueError(kind)


def stats_of(t, ops=SIX, engine=None):
    engine = engine or TorchStatsEngine()
    rec = engine.record(t, StatPlan.from_ops(ops), 0, "t", "s")
    on_host = isinstance(rec.zeros, int)  # before to_host: only the kernel (or an empty tensor) gives ints
    engine.to_host([rec])
    (row,) = merge_records(0, [rec])
    return {op: row.stat.value(op) for op in ops}, on_host


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.complex64]
KINDS = ["scalar0", "1d", "3d", "transposed", "slice", "blocks", "empty", "empty3d"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_zeros_matches_numpy(stats_path, dtype, kind):
    t = make(kind, dtype)
    want = np_zeros(t)
    if kind not in ("empty", "empty3d") and dtype != torch.bool and kind != "scalar0":
        assert 0 < want < t.numel(), "the case must hold zeros and non-zeros"
    got, on_host = stats_of(t)
    assert isinstance(got["zeros"], int) and not isinstance(got["zeros"], bool)
    assert got["zeros"] == want, (got["zeros"], want)
    # the five statistics are those of the same tensor without zeros asked for
    five, _ = stats_of(t, FIVE)
    for op in FIVE:
        assert got[op] == five[op] or (math.isnan(got[op]) and math.isnan(five[op])), op
    native_read = stats_path == "native" and dtype in (torch.float32, torch.float16, torch.bfloat16) \
        and t.is_contiguous() and t.numel() > 0
    # the one-pass kernel gives host values at once: proof that its zero count was used
    assert on_host == (native_read or t.numel() == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_negative_zero_counts_and_nan_and_inf_do_not(stats_path, dtype):
    t = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-3, -0.0, 2.0] * 700, dtype=dtype)
    assert torch.signbit(t[1])
    got, _ = stats_of(t)
    assert got["zeros"] == np_zeros(t) == 3 * 700
    assert got["nans"] == 700 and math.isnan(got["norm"])


def test_smallest_subnormals_are_not_zero(stats_path):
    tiny = torch.tensor([torch.finfo(torch.float32).tiny / 4, -1e-45, 0.0] * 5000, dtype=torch.float32)
    assert np_zeros(tiny) == 5000
    assert stats_of(tiny)[0]["zeros"] == 5000
    half = torch.tensor([6e-8, -6e-8, 0.0] * 5000, dtype=torch.float16)  # fp16's smallest subnormal
    assert np_zeros(half) == 5000
    assert stats_of(half)[0]["zeros"] == 5000


def test_large_tensor_split_over_threads_and_chunks(stats_path):
    """2^21 + 4099 elements: the kernel splits it over threads, the bf16 ATen path casts it
    in 2^20-element chunks, the general ATen path counts in 2^22-element chunks."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            t = with_zeros(((1 << 21) + 4099,), dtype, 7)
            t[(1 << 20) - 1: (1 << 20) + 1] = 0.0  # zeros on both sides of a split
            assert stats_of(t, ("norm", "zeros"))[0]["zeros"] == np_zeros(t)
        big = with_zeros(((1 << 22) + 17,), torch.float64, 8)
        assert stats_of(big, ("zeros",))[0]["zeros"] == np_zeros(big)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.filterwarnings("ignore:Sparse:UserWarning")
def test_sparse_gradients_count_the_elements_not_stored(stats_path):
    i = torch.tensor([[0, 2, 2, 5], [1, 0, 0, 3]])
    v = torch.tensor([1.5, 0.0, -0.0, 2.0])  # (2, 0) is stored twice: 0 + -0 = 0
    coo = torch.sparse_coo_tensor(i, v, (6, 4))
    assert stats_of(coo, ("nans", "zeros"))[0]["zeros"] == np_zeros(coo) == 22
    csr = torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 2.0]]).to_sparse_csr()
    assert stats_of(csr, ("zeros",))[0]["zeros"] == np_zeros(csr) == 6


def test_merged_calls_sum_their_zero_counts(stats_path):
    engine = TorchStatsEngine()
    a, b = with_zeros((50,), torch.float32, 1), with_zeros((30, 3), torch.float64, 2)
    plan = StatPlan.from_ops(SIX)
    recs = [engine.record(a, plan, 0, "m", "s"), engine.record(b, plan, 0, "m", "s")]
    engine.to_host(recs)
    (row,) = merge_records(0, recs)
    assert row.stat.value("zeros") == np_zeros(a) + np_zeros(b)


def test_cached_tensor_keeps_its_zero_count_per_plan(stats_path):
    """The module monitor's cache is keyed by the plan: a tensor seen first without
    zeros is counted when a plan with zeros meets it."""
    engine = TorchStatsEngine()
    t = with_zeros((64,), torch.float32, 5)
    r1 = engine.record(t, StatPlan.from_ops(FIVE), 0, "a", "s", cache=True)
    r2 = engine.record(t, StatPlan.from_ops(SIX), 0, "b", "s", cache=True)
    r3 = engine.record(t, StatPlan.from_ops(SIX), 0, "c", "s", cache=True)
    engine.to_host([r1, r2, r3])
    assert r1.zeros is None and r2.zeros == r3.zeros == np_zeros(t)


# ------------------------------------------------------------------------ config and CSV
def test_config_accepts_zeros_after_the_five_in_their_order(tmp_path, caplog):
    cfg = load_config({"output_dir": str(tmp_path), "monitors": {
        "module": {"ops": ["zeros", "norm"]}, "param": {"enabled": True, "ops": ["zeros"]},
        "weight_grad": {"enabled": True, "ops": ["nans", "zeros", "max", "min", "mean", "norm"]},
        "optimizer": {"enabled": True}}})
    assert cfg.monitors["module"].ops == ("norm", "zeros")
    assert cfg.monitors["param"].ops == ("zeros",)
    assert cfg.monitors["weight_grad"].ops == SIX
    assert cfg.monitors["optimizer"].ops == FIVE  # the default never includes zeros
    with caplog.at_level(logging.WARNING, "msprobe.monitor_v2"):
        cfg = load_config({"output_dir": str(tmp_path), "monitors": {"module": {"ops": ["zero", "norm"]}}})
    assert cfg.monitors["module"].ops == ("norm",)
    assert "['zero']" in caplog.text and "nans, zeros" in caplog.text


def _train(cfg_path, model, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(cfg_path)
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def _header(out, monitor):
    path = sorted((out / "rank_0").glob(f"{monitor}_step*.csv"))[0]
    with open(path, newline="") as f:
        return next(csv.reader(f))


def test_csv_zeros_column_against_numpy_on_a_relu_model(tmp_path, write_config):
    model = TinyMLP(d_hidden=64, seed=3)
    with torch.no_grad():
        model.fc1.weight[::3] = 0.0  # exact zeros in a parameter
        model.fc2.bias[1] = -0.0
    reference = TinyMLP(d_hidden=64, seed=3)
    reference.load_state_dict(model.state_dict())
    out = tmp_path / "out"
    cfg = write_config({"monitors": {"module": {"targets": ["fc1", "act"], "ops": ["zeros", "max"]},
                                     "param": {"enabled": True, "ops": ["norm", "zeros"]}}})
    _train(cfg, model, steps=1)
    assert _header(out, "module")[-2:] == ["max", "zeros"]
    assert _header(out, "param")[-2:] == ["norm", "zeros"]
    (x, y), = make_batches(1)
    h = reference.fc1(x)
    relu = torch.relu(h)
    rows = {(r["module_name"], r["scope"]): r for r in rows_of(out, "module")}
    assert int(rows[("fc1.output.0", "forward")]["zeros"]) == np_zeros(h)
    assert int(rows[("act.output.0", "forward")]["zeros"]) == np_zeros(relu) > 0
    params = {(r["module_name"], r["scope"]): r for r in rows_of(out, "param")}
    for name, p in reference.named_parameters():
        assert int(params[(name, "param_origin")]["zeros"]) == np_zeros(p), name
    assert np_zeros(reference.fc1.weight) >= 6 * 22


def test_default_header_has_no_zeros_column(tmp_path, write_config):
    out = tmp_path / "out"
    cfg = write_config({"monitors": {"module": {}, "weight_grad": {"enabled": True}}})
    _train(cfg, TinyMLP())
    assert _header(out, "module") == ["vpp_stage", "step", "module_name", "scope"] + list(FIVE)
    assert _header(out, "weight_grad") == ["vpp_stage", "step", "module_name", "scope", "micro_step"] + list(FIVE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the device path of zeros runs there")
def test_zeros_on_a_gpu_stay_on_the_device_until_to_host():
    engine = TorchStatsEngine()
    tensors = [with_zeros((4099,), dt, i).cuda() for i, dt in enumerate((torch.float32, torch.bfloat16,
                                                                          torch.float16, torch.int32))]
    tensors.append(with_zeros(((1 << 22) + 5,), torch.float32, 9).cuda())  # counted in chunks
    plan = StatPlan.from_ops(SIX)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        recs = [engine.record(t, plan, 0, f"t{i}", "s") for i, t in enumerate(tensors)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(isinstance(r.zeros, torch.Tensor) and r.zeros.is_cuda for r in recs)
    engine.to_host(recs)
    for rec, t in zip(recs, tensors):
        assert rec.zeros == np_zeros(t), rec.name
