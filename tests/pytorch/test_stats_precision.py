"""Precision of the statistics on the framework (ATen) path, the default on accelerators
and on machines without a C compiler (issue 12): finite values never report ``inf``, and
a large norm matches an fp64 NumPy reference far below ``diff``'s default tolerance.
Both paths run (``MSPROBE_MONITOR_NATIVE=0`` for ATen); values are checked against NumPy
in fp64 on a copy of the tensor."""

import math

import numpy as np
import pytest
import torch

from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.analysis.diff import DiffSettings
from msprobe.core.monitor_v2.frameworks.pytorch.stats import TorchStatsEngine
from msprobe.core.monitor_v2.stats import StatPlan, merge_records
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

from support import rows_of

ALL_OPS = ("min", "max", "mean", "norm", "nans")
# far below diff's default tolerance: a rerun of the same training must never look different
TIGHT = 1e-8


@pytest.fixture(params=["native", "aten"])
def engine(request, monkeypatch):
    if request.param == "aten":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    else:
        monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    e = TorchStatsEngine()
    assert (e._native is None) == (request.param == "aten")
    return e


def _stats(engine, t, many=False):
    plan = StatPlan.from_ops(ALL_OPS)
    if many:
        recs = engine.record_many([t], plan, [(0, "t", "s", None)])
    else:
        recs = [engine.record(t, plan, 0, "t", "s")]
    engine.to_host(recs)
    (row,) = merge_records(0, recs)
    return {op: row.stat.value(op) for op in ALL_OPS}


def _reference(t):
    a = t.detach().to(torch.float64).numpy().copy().ravel()
    return {"min": a.min(), "max": a.max(), "mean": a.mean(), "norm": math.sqrt(np.sum(a * a)),
            "nans": int(np.isnan(a).sum())}


def _check(got, want, rtol):
    for op in ("min", "max", "mean", "norm"):
        assert math.isfinite(got[op]), (op, got)
        assert math.isclose(got[op], want[op], rel_tol=rtol, abs_tol=0), (op, got[op], want[op])
    assert got["nans"] == want["nans"] == 0


def test_default_tolerance_of_diff_is_what_this_file_beats():
    assert DiffSettings().rtol >= 1e-6 > TIGHT


@pytest.mark.parametrize("many", [False, True], ids=["record", "record_many"])
def test_norm_of_4m_elements_matches_fp64(engine, many):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4 << 20, generator=g) * 3 + 1
    got, want = _stats(engine, t, many), _reference(t)
    _check(got, want, rtol=1e-6)
    assert abs(got["norm"] - want["norm"]) / want["norm"] < TIGHT
    assert abs(got["mean"] - want["mean"]) / abs(want["mean"]) < 1e-7


@pytest.mark.parametrize("scale", [1e19, 1e30, 3.0e38], ids=["1e19", "1e30", "3e38"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_large_finite_fp32_values_are_not_inf(engine, scale, layout):
    g = torch.Generator().manual_seed(1)
    t = (torch.rand(600, 700, generator=g) * 0.9 + 0.1) * scale  # every value large, finite, positive
    t[::7] *= -1
    if layout == "transposed":
        t = t.t()
    assert torch.isfinite(t).all()
    got, want = _stats(engine, t), _reference(t)
    # the norm of values near the fp32 maximum exceeds it: the statistics are fp64 on the host
    _check(got, want, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_large_low_precision_values(engine, dtype):
    big = 1e30 if dtype == torch.bfloat16 else 6e4  # fp16: squares beyond what fp16 holds
    g = torch.Generator().manual_seed(2)
    t = ((torch.rand(3 << 20, generator=g) - 0.3) * big).to(dtype)
    got, want = _stats(engine, t), _reference(t)
    _check(got, want, rtol=1e-6)


def test_real_inf_and_nan_are_still_reported(engine):
    t = torch.full((200_000,), 1e30)
    t[5] = math.inf
    got = _stats(engine, t)
    assert got["max"] == math.inf and got["norm"] == math.inf and got["mean"] == math.inf and got["nans"] == 0
    t[7] = math.nan
    got = _stats(engine, t)
    assert got["nans"] == 1 and all(math.isnan(got[op]) for op in ("min", "max", "mean", "norm"))


def test_large_gradient_through_the_trainer_on_the_aten_path(tmp_path, monkeypatch):
    """End to end: a real model whose parameters hold huge finite values; param rows on the
    ATen path are finite and match NumPy."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    monkeypatch.delenv("RANK", raising=False)
    model = torch.nn.Linear(512, 512)
    with torch.no_grad():
        model.weight.fill_(2e19)
        model.weight[::2] *= -1
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"param": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    assert mon._session.engine._native is None
    want = _reference(model.weight)
    model(torch.ones(1, 512)).sum().backward()
    opt.step()
    mon.stop()
    row = next(r for r in rows_of(tmp_path, "param") if r["module_name"] == "weight" and r["scope"] == "param_origin")
    got = {op: float(row[op]) for op in ("min", "max", "mean", "norm")}
    got["nans"] = int(row["nans"])
    _check(got, want, rtol=1e-6)


@pytest.mark.parametrize("scale", [1e-20, 1e-30, 1e-38], ids=["1e-20", "1e-30", "1e-38"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_tiny_values_keep_their_norm(engine, scale, dtype, layout):
    """Squares of values below ~1e-19 underflow in fp32 (1e-30 squares to 0): the sum of
    squares of such a tensor is taken in fp64 (one-pass kernel and ATen alike), so its norm
    matches NumPy's fp64 one instead of reading 0 or losing digits."""
    g = torch.Generator().manual_seed(3)
    t = ((torch.rand(600, 700, generator=g) * 0.9 + 0.1) * scale).to(dtype)
    t[::5] *= -1
    if layout == "transposed":
        t = t.t()
    got, want = _stats(engine, t), _reference(t)
    assert want["norm"] > 0
    _check(got, want, rtol=1e-6)
