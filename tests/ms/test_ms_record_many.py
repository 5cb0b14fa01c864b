"""MindSpore ``record_many`` on the host path: the tensors the one-pass kernel reads go to
it in one ``stats_many`` call, the others (empty, dtypes without a kernel code, tensors
MindSpore cannot read) take ``record``'s path in their place.

Checked on a real model and optimizer (an MLP's parameters, its gradients, ``nn.Adam``'s
moments) plus fp16, bf16, NaN, empty, transposed, integer, fp64 and float8 tensors:
the values against NumPy in fp64 on copies, each record against ``record`` of the same
tensor to the bit, and the rows of a short training (weight_grad, param, optimizer,
module) against the same training with batching switched off."""

import logging
import math

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, ms, mse, nn, np, np_stats  # noqa: E402

from msprobe.core.monitor_v2 import native  # noqa: E402
from msprobe.core.monitor_v2.frameworks.mindspore.stats import MsStatsEngine  # noqa: E402
from msprobe.core.monitor_v2.stats import StatPlan, merge_records  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

SIX = StatPlan.from_ops(["min", "max", "mean", "norm", "nans", "zeros"])
FIVE = StatPlan.from_ops(["min", "max", "mean", "norm", "nans"])
KERNEL_DTYPES = (ms.float32, ms.float16, ms.bfloat16)


class Spy:
    """The engine's kernel, with the calls made through it counted (every call goes to
    the real kernel)."""

    def __init__(self, kernel):
        self._kernel = kernel
        self.dtype_codes = kernel.dtype_codes
        self.calls = []

    def stats_many(self, pointers, counts, codes, threads, zeros):
        self.calls.append(("stats_many", list(counts)))
        return self._kernel.stats_many(pointers, counts, codes, threads, zeros)

    def host_records(self, keys, pointers, counts, codes, threads, nans, zeros, host):
        self.calls.append(("stats_many", list(counts)))  # the one batched kernel call, records built with it
        return self._kernel.host_records(keys, pointers, counts, codes, threads, nans, zeros, host)

    def stats(self, *args):
        self.calls.append(("stats", args[1]))
        return self._kernel.stats(*args)

    def stats_zeros(self, *args):
        self.calls.append(("stats_zeros", args[1]))
        return self._kernel.stats_zeros(*args)


def kernel_engine() -> MsStatsEngine:
    if native.load() is None:
        pytest.fail("the one-pass kernel did not build: is a C compiler (gcc) installed?")
    engine = MsStatsEngine(read_host=True)
    assert engine._native is not None
    engine._native = Spy(engine._native)
    return engine


def trained_tensors():
    """``(name, tensor)``: a trained MLP's parameters, gradients and Adam moments (the
    tensors weight_grad, param and optimizer read), and tensors of other kinds."""
    net = MLP(seed=2, d_hidden=32)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    for x, y in batches(2, d_in=4):
        _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
        opt(grads)
    out = [(p.name, p) for p in opt.parameters]
    out += [(f"grad {p.name}", g) for p, g in zip(opt.parameters, grads)]
    out += [(m.name, m) for m in list(opt.moment1) + list(opt.moment2)]
    rng = np.random.default_rng(5)
    w = rng.standard_normal((33, 65)).astype(np.float32)
    w[w > 1.5] = 0.0
    with_nan = w.copy()
    with_nan[3, 4] = math.nan
    eighths = (np.arange(-40, 41, dtype=np.float32) / 8.0)  # exact in fp16 and bf16, one 0
    eighths_nan = eighths.copy()
    eighths_nan[7] = math.nan
    out += [
        ("fp16", ms.Tensor(eighths).astype(ms.float16)),
        ("fp16 NaN", ms.Tensor(eighths_nan).astype(ms.float16)),
        ("bf16", ms.Tensor(eighths).astype(ms.bfloat16)),
        ("fp32 NaN", ms.Tensor(with_nan)),
        ("fp32 empty", ms.Tensor(np.zeros((0, 4), np.float32))),
        ("fp32 transposed view", ms.Tensor(w).transpose(1, 0)),
        ("int32", ms.Tensor(np.arange(-5, 9, dtype=np.int32))),
        ("fp64", ms.Tensor(w.astype(np.float64))),
        ("fp16 from the model", net.fc1.weight.astype(ms.float16)),
    ]
    return out


def same_record(a, b) -> bool:
    va, vb = a.vector, b.vector
    same_vector = (va is None and vb is None) or (
        va is not None and vb is not None and len(va) == len(vb)
        and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(va, vb)))
    return (same_vector and type(a.vector) is type(b.vector) and a.nans == b.nans and a.numel == b.numel
            and a.zeros == b.zeros and (a.vpp_stage, a.name, a.scope, a.micro_step)
            == (b.vpp_stage, b.name, b.scope, b.micro_step))


@pytest.mark.parametrize("plan", [SIX, FIVE], ids=["with zeros", "without zeros"])
def test_one_kernel_call_numpy_values_and_per_tensor_record_to_the_bit(plan, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    engine = kernel_engine()
    named = trained_tensors()
    named.insert(5, ("float8", ms.Tensor(np.zeros(4, np.uint8), dtype=ms.float8_e4m3fn)))
    assert not named[-4][1].is_contiguous()  # the transposed view is one (asnumpy gives a contiguous copy)
    refs = {name: t.asnumpy().copy() for name, t in named if name != "float8"}
    tensors = [t for _, t in named]
    keys = [(0, name, "s", None) for name, _ in named]

    records = engine.record_many(tensors, plan, keys)

    eligible = [t.size for _, t in named if t.dtype in KERNEL_DTYPES and t.size]
    assert len(eligible) >= 20
    assert engine._native.calls == [("stats_many", eligible)]  # one call, no per-tensor kernel call
    assert [(r.vpp_stage, r.name, r.scope, r.micro_step) for r in records] == keys
    by_name = {r.name: r for r in records}
    assert by_name["float8"].vector is None and by_name["float8"].numel == 0  # unobserved in its place
    said = [r.getMessage() for r in caplog.records if "cannot reduce" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("monitor_v2: float8 is a Float8E4M3FN tensor"), said

    engine.to_host(records)  # nothing to move: host records stay as they are
    stats = {row.name: row.stat for row in merge_records(0, records)}
    assert set(stats) == set(refs)
    for name, ref in refs.items():
        want = np_stats(ref)
        if plan.zeros:
            want["zeros"] = int(np.count_nonzero(ref == 0))
        for op, value in want.items():
            got = stats[name].value(op)
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(got), (name, op, got)
            else:
                assert got == pytest.approx(value, rel=1e-5, abs=1e-6), (name, op, got, value)
    assert stats["fp32 NaN"].value("nans") == 1 and stats["fp16 NaN"].value("nans") == 1
    assert math.isnan(stats["fp16 NaN"].value("max")) and stats["fp16"].value("max") == 5.0
    if plan.zeros:
        assert stats["fp16"].value("zeros") == 1 and stats["fp32 NaN"].value("zeros") > 0

    engine._native.calls.clear()
    one_by_one = [engine.record(t, plan, *key) for t, key in zip(tensors, keys)]
    assert all(call[0] != "stats_many" for call in engine._native.calls)
    for batched, single in zip(records, one_by_one):
        assert same_record(batched, single), (batched.name, batched.vector, single.vector)


def test_few_tensors_and_the_switch_take_record(monkeypatch):
    """Below the batch size, and with batching off, every tensor is one ``record``."""
    engine = kernel_engine()
    named = trained_tensors()[:8]
    tensors, keys = [t for _, t in named], [(0, n, "s", None) for n, _ in named]
    engine.record_many(tensors[:2], FIVE, keys[:2])
    assert [c[0] for c in engine._native.calls] == ["stats", "stats"]
    engine._native.calls.clear()
    monkeypatch.setattr(MsStatsEngine, "_batched", False)
    records = engine.record_many(tensors, FIVE, keys)
    assert [c[0] for c in engine._native.calls] == ["stats"] * 8
    monkeypatch.setattr(MsStatsEngine, "_batched", True)
    engine._native.calls.clear()
    assert all(same_record(a, b) for a, b in zip(engine.record_many(tensors, FIVE, keys), records))
    assert [c[0] for c in engine._native.calls] == ["stats_many"]


class Deep(nn.Cell):
    """Six Dense layers with LayerNorms: 20 parameter tensors, enough to be batched."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(7)
        self.layers = nn.CellList()
        for _ in range(5):
            dense = nn.Dense(8, 8)
            dense.weight.set_data(ms.Tensor((rng.standard_normal((8, 8)) * 0.4).astype(np.float32)))
            dense.bias.set_data(ms.Tensor((rng.standard_normal(8) * 0.1).astype(np.float32)))
            self.layers.append(nn.SequentialCell([dense, nn.LayerNorm((8,)), nn.ReLU()]))
        self.head = nn.Dense(8, 3)
        self.head.weight.set_data(ms.Tensor((rng.standard_normal((3, 8)) * 0.4).astype(np.float32)))

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def run(tmp_path, sub, batched, monkeypatch, acc=1):
    monkeypatch.setattr(MsStatsEngine, "_batched", batched)
    ms.set_seed(0)
    net = Deep()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=0.01, weight_decay=0.01)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    out = tmp_path / sub
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {
        "weight_grad": {"enabled": True, "ops": ["min", "max", "mean", "norm", "nans", "zeros"]},
        "param": {"enabled": True}, "optimizer": {"enabled": True},
        "module": {"enabled": True, "targets": []}}}, fr="ms")
    mon.start(model=net, optimizer=opt, grad_acc_steps=acc)
    data = batches(3 * acc, d_in=8)
    for s in range(3):
        total = None
        for x, y in data[s * acc:(s + 1) * acc]:
            _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
            total = g if total is None else tuple(a + b for a, b in zip(total, g))
        opt(total)
    mon.stop()
    weights = {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}
    return out, weights


@pytest.mark.parametrize("acc", [1, 2])
def test_training_rows_equal_those_written_without_batching(tmp_path, monkeypatch, acc):
    out_on, w_on = run(tmp_path, "on", True, monkeypatch, acc)
    out_off, w_off = run(tmp_path, "off", False, monkeypatch, acc)
    for name in w_on:
        assert np.array_equal(w_on[name], w_off[name]), name  # the same training
    for monitor, per_step in (("weight_grad", 2 * 22), ("param", 2 * 22), ("optimizer", 2 * 22)):
        on, off = rows_of(out_on, monitor), rows_of(out_off, monitor)
        assert len(on) == 3 * per_step, (monitor, len(on))
        assert on == off, monitor
    on, off = rows_of(out_on, "module"), rows_of(out_off, "module")
    assert len(on) > 3 * 20 and on == off
    # the rows are the statistics of the tensors, not of something else read the same twice
    final = {r["module_name"]: r for r in rows_of(out_on, "param") if r["step"] == "2"
             and r["scope"] == "param_updated"}
    for name, value in w_on.items():
        assert float(final[name]["norm"]) == pytest.approx(float(np.linalg.norm(value.astype(np.float64))), rel=1e-5)


class TwoBranches(nn.Cell):
    """A trunk of four Dense layers and a head."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(11)
        self.trunk = nn.SequentialCell([nn.Dense(4, 4) for _ in range(4)])
        for name, p in self.trunk.parameters_and_names():
            p.set_data(ms.Tensor((rng.standard_normal(p.shape) * 0.5).astype(np.float32)))
        self.head = nn.Dense(4, 3)

    def construct(self, x):
        return self.head(self.trunk(x))


def test_parameters_with_fewer_passes_than_announced_are_read_in_one_call(tmp_path):
    """``grad_acc_steps=2``, the second micro-batch differentiated with respect to the
    head only: the trunk's eight parameters get one pass, and their ``unreduced`` rows
    (read at the optimizer step, in one ``record_many``) hold that pass; the head's rows
    the sum of both."""
    net = TwoBranches()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    head = [p for p in opt.parameters if p.name.startswith("head.")]
    grad_all = ms.value_and_grad(mse(net), None, opt.parameters)
    grad_head = ms.value_and_grad(mse(net), None, head)
    names = [n for n, _ in net.parameters_and_names()]
    assert names == [p.name for p in opt.parameters]  # the gradients' order
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True}}}, fr="ms")
    mon.start(model=net, optimizer=opt, grad_acc_steps=2)
    (x1, y1), (x2, y2) = batches(2)
    _, g1 = grad_all(ms.Tensor(x1), ms.Tensor(y1))
    first = [t.asnumpy().copy() for t in g1]
    _, g2 = grad_head(ms.Tensor(x2), ms.Tensor(y2))
    second = [t.asnumpy().copy() for t in g2]
    totals = list(first)
    totals[-2] = totals[-2] + second[0]
    totals[-1] = totals[-1] + second[1]
    opt(tuple(ms.Tensor(t) for t in totals))
    mon.stop()
    rows = {r["module_name"]: r for r in rows_of(out, "weight_grad") if r["scope"] == "unreduced"}
    assert set(rows) == set(names) and names[-2:] == ["head.weight", "head.bias"]
    for i, name in enumerate(names):
        want = np_stats(totals[i] if name.startswith("head.") else first[i])
        for op in ("min", "max", "mean", "norm"):
            assert float(rows[name][op]) == pytest.approx(want[op], rel=1e-5, abs=1e-7), (name, op)
    assert sum(name.startswith("trunk.") for name in names) == 8
