"""A monitor is never off, or writing nothing, without a word: a misspelt field gets a
"did you mean", a config with no monitor enabled warns (constructor and ``validate``),
``stop()`` names the likely cause when steps ran but no row was written, and its one
end-of-run line is visible without any logging configuration."""

import logging
import subprocess
import sys

import pytest
import torch

from support import TinyMLP, loss_fn, make_batches
from msprobe.core.monitor_v2.errors import ConfigError
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

LOGGER = "msprobe.monitor_v2"


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def train(mon, steps, manual_step=False):
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(steps):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        if manual_step:
            mon.step()
    mon.stop()


@pytest.mark.parametrize("entry, field, meant", [
    pytest.param({"weight_grad": {"enable": True}}, "monitors.weight_grad.enable", "enabled", id="enable"),
    pytest.param({"module": {"enable": False}}, "monitors.module.enable", "enabled", id="module-enable"),
    pytest.param({"module": {"target": ["fc1"]}}, "monitors.module.target", "targets", id="target"),
    pytest.param({"weight_grad": {"enabled": True, "opps": ["min"]}}, "monitors.weight_grad.opps", "ops", id="opps"),
])
def test_misspelt_field_in_a_monitor_is_an_error_with_the_field_meant(tmp_path, entry, field, meant):
    """A misspelt field is never a monitor silently off ("enable"), nor one recording every
    module ("target" for "targets"): the config is refused before training starts."""
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": entry})
    assert info.value.field == field
    assert f"unknown field '{field}'; did you mean '{meant}'?" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_no_monitor_enabled_warns_at_construction(write_config, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        TrainerMonitorV2(write_config({"monitors": {}}))
    assert any("no monitor is enabled" in m and "nothing will be written" in m for m in warnings_of(caplog))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        TrainerMonitorV2(write_config({"monitors": {"param": {"enabled": True}}}))
    assert warnings_of(caplog) == []


def test_stop_names_a_missing_step_call(write_config, caplog, tmp_path):
    mon = TrainerMonitorV2(write_config({"patch_optimizer_step": False, "monitors": {"param": {"enabled": True}}}))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        train(mon, 3)
    (msg,) = warnings_of(caplog)
    assert "rank 0 wrote no rows" in msg
    assert "optimizer.step() ran 3 time(s) but mon.step() was never called" in msg
    assert not (tmp_path / "out" / "rank_0").exists() or not list((tmp_path / "out" / "rank_0").iterdir())


def test_stop_names_a_window_that_was_never_reached(write_config, caplog):
    mon = TrainerMonitorV2(write_config({"start_step": 10, "monitors": {"param": {"enabled": True}}}))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        train(mon, 4)
    (msg,) = warnings_of(caplog)
    assert "4 step(s) ended (0..3) and none was in the collection window (start_step 10" in msg
    assert "first step written would be step 10" in msg


def test_stop_names_monitors_that_reported_nothing(write_config, caplog):
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"targets": ["no_such_module"]}}}))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        train(mon, 2)
    assert any("2 step(s) were in the collection window but the monitors (module) reported nothing" in m
               for m in warnings_of(caplog))


def test_a_run_that_writes_gives_no_warning(write_config, caplog, tmp_path):
    mon = TrainerMonitorV2(write_config({"patch_optimizer_step": False, "monitors": {"param": {"enabled": True}}}))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        train(mon, 2, manual_step=True)
    assert warnings_of(caplog) == []
    rows = sum(len(f.read_text().splitlines()) - 1 for f in (tmp_path / "out" / "rank_0").glob("*.csv"))
    assert rows > 0
    assert any(f"stopped after 2 steps; wrote {rows} rows of 2 step(s)" in r.getMessage() for r in caplog.records)


SCRIPT = """
import torch
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mon = TrainerMonitorV2({"output_dir": OUT, "monitors": {"weight_grad": {"enabled": True}}})
mon.start(model=model, optimizer=opt)
for _ in range(3):
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
mon.stop()
"""


@pytest.mark.parametrize("configure", ["", "import logging; logging.basicConfig(level=logging.INFO)\n"])
def test_end_of_run_line_is_visible_with_and_without_logging_setup(tmp_path, configure):
    out = tmp_path / "out"
    code = f"OUT = {str(out)!r}\n" + configure + SCRIPT
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "stopped after" in line]
    assert len(lines) == 1, proc.stderr
    rows = sum(len(f.read_text().splitlines()) - 1 for f in (out / "rank_0").glob("*.csv"))
    assert rows > 0
    assert f"rank 0 stopped after 3 steps; wrote {rows} rows of 3 step(s) to {out / 'rank_0'}" in lines[0]
    assert f" summary {out}" in lines[0]
    assert lines[0].startswith("INFO:msprobe.monitor_v2:") == bool(configure)
