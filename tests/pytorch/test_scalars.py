"""``TrainerMonitorV2.log_scalars``: the loss and the global gradient norm of a real
training run (test_module's tiny GPT, AdamW), written as ``scalars`` rows and checked
against the values the test computed itself, read back with the csv module; the step
rules (the step being trained, the one just ended, the schedule), the argument errors,
and that training computes the same with and without it."""

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from support import read_csv, rows_of
from test_module import TinyGPT, make_data

from msprobe.core.monitor_v2.errors import MonitorStateError, ScalarError
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

HEADER = ["vpp_stage", "step", "module_name", "scope", "min", "max", "mean", "norm", "nans"]
LOGGER = "msprobe.monitor_v2"


def _train(mon, steps: int, *, manual: bool, log: str = "after"):
    """Train the tiny GPT ``steps`` steps; the loss (a 0-d tensor with its graph) and the
    clipped gradient norm (a Python float) logged each step, before ``mon.step()`` (manual
    stepping) or after the patched ``optimizer.step()`` ended the step. Returns the losses
    and norms as the training computed them, and the final parameters."""
    model = TinyGPT(ckpt=None, inplace=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mon is not None:
        mon.start(model=model, optimizer=opt)
    losses, norms = [], []
    for step, (idx, tgt) in enumerate(make_data(steps)):
        loss = model(idx, targets=tgt).loss
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
        norms.append(norm)
        if mon is not None:
            if manual:
                mon.log_scalars(step, {"loss": loss}, grad_norm=norm)
                mon.step()
            else:
                mon.log_scalars(step, loss=loss, grad_norm=norm)
    if mon is not None:
        mon.stop()
    return losses, norms, [p.detach().clone() for p in model.parameters()]


def _scalars(out: Path):
    rows = rows_of(out, "scalars")
    for path in sorted((out / "rank_0").glob("scalars_step*.csv")):
        with open(path) as f:
            assert f.readline().strip().split(",") == HEADER
    return rows


def _check_row(row, step: int, name: str, expected: float) -> None:
    assert (row["vpp_stage"], row["step"], row["module_name"], row["scope"]) == ("0", str(step), name, "scalars")
    for op in ("min", "max", "mean"):
        assert float(row[op]) == pytest.approx(expected, rel=1e-8, abs=0), (name, step, op)
    assert float(row["norm"]) == pytest.approx(abs(expected), rel=1e-8, abs=0)
    assert row["nans"] == "0"


@pytest.mark.parametrize("manual", [False, True], ids=["patched-step", "manual-step"])
def test_loss_and_grad_norm_rows(write_config, tmp_path, manual):
    cfg = {"monitors": {"weight_grad": {"enabled": True}}, "step_interval": 2, "step_count_per_record": 2}
    if manual:
        cfg["patch_optimizer_step"] = False
        cfg["async_write"] = True
    mon = TrainerMonitorV2(write_config(cfg))
    losses, norms, params = _train(mon, 6, manual=manual)
    out = tmp_path / "out"
    rows = _scalars(out)
    # written steps 0, 2, 4 (step_interval 2), in windows of two steps
    assert sorted(p.name for p in (out / "rank_0").glob("scalars_*.csv")) == [
        "scalars_step0-1.csv", "scalars_step2-3.csv", "scalars_step4-5.csv"]
    assert [(r["step"], r["module_name"]) for r in rows] == [
        (str(s), n) for s in (0, 2, 4) for n in ("loss", "grad_norm")]
    for r in rows:
        s = int(r["step"])
        if r["module_name"] == "loss":
            # the fp32 loss, exactly (nine significant digits reproduce any fp32 value)
            expected = float(losses[s])
            assert np.float32(r["mean"]) == losses[s].numpy()
        else:
            expected = norms[s]
        _check_row(r, s, r["module_name"], expected)
    # the rows of the other monitors are on the same steps
    assert sorted({int(r["step"]) for r in rows_of(out, "weight_grad")}) == [0, 2, 4]
    # training computes the same without the monitor
    plain_losses, plain_norms, plain_params = _train(None, 6, manual=manual)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    assert norms == plain_norms
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


def test_last_step_logged_after_it_ended_is_written_by_stop(write_config, tmp_path):
    """The patched case: the last step's loss is logged after optimizer.step() ended it;
    stop() writes it. A value logged twice in a step makes one merged row; NaN and inf are
    values like any other."""
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.start(model=model, optimizer=opt)
    for step in range(2):
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        mon.log_scalars(step, loss=torch.tensor(2.0, dtype=torch.bfloat16), nan=float("nan"),
                        ninf=-math.inf, n=np.float32(-3))
        mon.log_scalars(step, twice=1.0)
        mon.log_scalars(step, twice=3)
    mon.stop()
    rows = rows_of(tmp_path / "out", "scalars")
    assert [(r["step"], r["module_name"]) for r in rows] == [
        (str(s), n) for s in (0, 1) for n in ("loss", "nan", "ninf", "n", "twice")]
    last = {r["module_name"]: r for r in rows if r["step"] == "1"}
    _check_row(last["loss"], 1, "loss", 2.0)
    _check_row(last["n"], 1, "n", -3.0)
    assert [last["nan"][op] for op in ("min", "max", "mean", "norm", "nans")] == ["nan"] * 4 + ["1"]
    assert [last["ninf"][op] for op in ("min", "max", "mean", "norm", "nans")] == ["-inf"] * 3 + ["inf", "0"]
    twice = last["twice"]  # merged as every row: min, max, mean of the values; norm of both
    assert (float(twice["min"]), float(twice["max"]), float(twice["mean"])) == (1.0, 3.0, 2.0)
    assert float(twice["norm"]) == pytest.approx(math.sqrt(10.0), rel=1e-8)


def test_other_steps_are_dropped_with_one_warning(write_config, tmp_path, caplog):
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}},
                                         "patch_optimizer_step": False}))
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.start(model=model, optimizer=opt, first_step=100)  # the framework's numbers from 100
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for step in range(100, 103):
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
            mon.log_scalars(step - 100, loss=1.0)  # the loop's own counter: another numbering
            mon.log_scalars(step, loss=float(step))
            mon.step()
    mon.stop()
    said = [r.getMessage() for r in caplog.records if "log_scalars(0, ...)" in r.getMessage()]
    assert len(said) == 1 and "names neither the step being trained (100)" in said[0]
    assert not any("log_scalars(1, ...)" in r.getMessage() for r in caplog.records)  # once
    rows = rows_of(tmp_path / "out", "scalars")
    assert [(r["step"], r["mean"]) for r in rows] == [("100", "100"), ("101", "101"), ("102", "102")]


def test_bad_arguments_raise_naming_them(write_config):
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    with pytest.raises(MonitorStateError, match=r"log_scalars\(\) before start\(\)"):
        mon.log_scalars(0, loss=1.0)
    model = torch.nn.Linear(3, 1)
    mon.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        cases = [
            ((0, {"": 1.0}), {}, "scalar name '' is not allowed"),
            ((0, {"a\nb": 1.0}), {}, r"scalar name 'a\\nb' is not allowed"),
            ((0, {3: 1.0}), {}, "scalar name 3 is not allowed"),
            ((0,), {"loss": "0.5"}, r"scalar 'loss': value '0.5' of type str"),
            ((0,), {"loss": True}, "scalar 'loss': value True of type bool"),
            ((0,), {"loss": None}, "scalar 'loss': value None"),
            ((0,), {"loss": torch.ones(2)}, r"scalar 'loss': a tensor of shape \(2,\) and dtype torch.float32"),
            ((0,), {"ok": torch.tensor(True)}, "scalar 'ok': a tensor of shape"),
            ((0.0,), {"loss": 1.0}, "step must be an integer"),
            ((0, {"loss": 1.0}), {"loss": 2.0}, "'loss' given both in the mapping and by keyword"),
            ((0, [1.0]), {}, "must be a mapping"),
            ((0,), {}, "no scalar given"),
        ]
        for args, kwargs, message in cases:
            with pytest.raises(ScalarError, match=message):
                mon.log_scalars(*args, **kwargs)
        assert ScalarError.__mro__[1:3] and issubclass(ScalarError, ValueError)
    finally:
        mon.stop()
    mon.log_scalars(0, loss=1.0)  # after stop(): nothing to write, no error


def test_tensor_values_are_read_with_the_step_on_the_accelerator_path(write_config, tmp_path, monkeypatch):
    """Under the accelerator path on the CPU (MSPROBE_MONITOR_ACCEL_ON_CPU): a tensor value
    is not read at the call (its record still holds the engine's device vector), and the
    row has its value once the step's statistics are copied; the just-ended step's too."""
    from msprobe.core.monitor_v2.frameworks.pytorch.stats import ACCEL_ON_CPU_ENV, DeviceStats

    monkeypatch.setenv(ACCEL_ON_CPU_ENV, "1")
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}},
                                         "patch_optimizer_step": False}))
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.start(model=model, optimizer=opt)
    values = []
    for step in range(3):
        loss = model(torch.full((2, 3), float(step))).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        values.append(loss.detach().clone())
        mon.log_scalars(step, loss=loss)
        (pending,) = mon._scalars[step]
        assert isinstance(pending.vector, DeviceStats)  # the engine's device values: not read here
        mon.step()
        if step == 2:  # logged after the step ended: written by stop()
            mon.log_scalars(step, late=loss * 2)
            (late,) = mon._scalars[step]
            assert isinstance(late.vector, DeviceStats)
    mon.stop()
    rows = rows_of(tmp_path / "out", "scalars")
    assert [(r["step"], r["module_name"]) for r in rows] == [("0", "loss"), ("1", "loss"), ("2", "loss"),
                                                             ("2", "late")]
    for r in rows:
        v = values[int(r["step"])] * (2 if r["module_name"] == "late" else 1)
        assert np.float32(r["mean"]) == v.numpy() and np.float32(r["norm"]) == abs(v.numpy())
