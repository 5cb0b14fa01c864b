"""The step driver shared by the integrations, on a plain torch loop, and
``start(first_step=...)``."""

import logging

import pytest
import torch

from support import TinyMLP, make_batches, rows_of
from msprobe.core.monitor_v2.errors import ConfigError
from msprobe.core.monitor_v2.integrations._common import FrameworkStepMonitor
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2


def _steps_written(out):
    return sorted({int(r["step"]) for r in rows_of(out, "weight_grad")})


def test_first_step_numbers_a_resumed_run(tmp_path):
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": {"weight_grad": {"enabled": True}}})
    mon.start(model, optimizer, first_step=5)
    for x, y in make_batches(2):
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert mon.current_step == 7
    mon.stop()
    assert _steps_written(tmp_path / "out") == [5, 6]


@pytest.mark.parametrize("bad", [-1, 1.0, "3", True])
def test_first_step_must_be_a_non_negative_integer(tmp_path, bad):
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out")})
    with pytest.raises(ConfigError, match="first_step"):
        mon.start(TinyMLP(), first_step=bad)


def test_driver_follows_the_framework_step_and_says_a_skip_once(tmp_path, caplog):
    out = tmp_path / "out"
    driver = FrameworkStepMonitor({"output_dir": str(out), "patch_optimizer_step": True,
                                   "monitors": {"weight_grad": {"enabled": True}}}, integration="test")
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    driver.start(model, optimizer, global_step=2)
    batches = make_batches(4)
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        for step, (x, y) in enumerate(batches, start=2):
            torch.nn.functional.mse_loss(model(x), y).backward()
            if step not in (3, 4):  # the framework skipped these updates (overflow)
                optimizer.step()
            optimizer.zero_grad()
            driver.sync(step + 1)
            assert driver.monitor.current_step == step + 1
    driver.stop()
    driver.stop()
    assert driver.monitor is None and not optimizer._optimizer_step_post_hooks
    skips = [r for r in caplog.records if "without an optimizer update" in r.getMessage()]
    assert len(skips) == 1 and "step 3 " in skips[0].getMessage()
    rows = rows_of(out, "weight_grad")
    assert _steps_written(out) == [2, 3, 4, 5]
    assert sorted({int(r["step"]) for r in rows if r["scope"] == "reduced"}) == [2, 5]


def test_driver_checks_the_config_when_built(tmp_path):
    with pytest.raises(ConfigError, match="step_interval"):
        FrameworkStepMonitor({"output_dir": str(tmp_path), "step_interval": 0})
