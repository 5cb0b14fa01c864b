"""Online alerts: a NaN and a gradient spike injected at known steps are logged the step
they are written, naming the tensor; bad `alert` settings fail at construction."""

import logging

import pytest
import torch

from conftest import TinyMLP, loss_fn, make_batches
from msprobe.core.monitor_v2.errors import ConfigError
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2


def alerts(caplog):
    return [r.getMessage() for r in caplog.records if "monitor_v2 alert:" in r.getMessage()]


def train(write_config, alert, steps, nan_step=None, spike_step=None):
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {"alert": alert, "monitors": {"module": {"enabled": True, "targets": ["fc2"]},
                                        "weight_grad": {"enabled": True}}}
    mon = TrainerMonitorV2(write_config(cfg))
    mon.start(model=model, optimizer=opt)
    for s, (x, y) in enumerate(make_batches(steps)):
        if s == spike_step:
            x = x * 1000.0
        handle = None
        if s == nan_step:
            # NaN out of fc1 (not monitored): the first non-finite row is fc2's input
            handle = model.fc1.register_forward_hook(lambda m, i, o: o * float("nan"))
        loss_fn(model, x, y).backward()
        if handle is not None:
            handle.remove()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return mon


def test_first_nonfinite_value_is_logged_the_step_it_happens(write_config, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    train(write_config, {"spike_factor": None}, steps=6, nan_step=3)
    messages = alerts(caplog)
    assert messages, "no alert"
    first = messages[0]
    assert "step 3" in first and "first non-finite value of the run" in first
    assert "module fc2.input.0 (scope forward" in first
    assert all("spike" not in m for m in messages)


def test_gradient_spike_is_logged_against_the_tensors_own_history(write_config, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    # the spike is in the last step (the update it causes would make later steps spike too)
    train(write_config, {"nonfinite": True, "spike_factor": 20, "spike_warmup": 5}, steps=10, spike_step=9)
    spikes = [m for m in alerts(caplog) if "norm spike" in m]
    assert spikes, alerts(caplog)
    assert all("step 9" in m for m in spikes)
    assert any("module fc2.input.0 (scope forward" in m for m in spikes)
    assert any("weight_grad fc1.weight (scope unreduced" in m for m in spikes)


def test_no_alert_on_a_healthy_run(write_config, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    train(write_config, True, steps=12)
    assert alerts(caplog) == []


@pytest.mark.parametrize("alert, field", [
    ({"spike_factor": 1}, "alert.spike_factor"),
    ({"spike_factor": "10"}, "alert.spike_factor"),
    ({"spike_window": 2}, "alert.spike_window"),
    ({"spike_warmup": 0}, "alert.spike_warmup"),
    ({"nonfinite": "yes"}, "alert.nonfinite"),
    ({"spike_facter": 10}, "alert.spike_facter"),
    ("on", "alert"),
])
def test_bad_alert_settings_fail_at_construction(write_config, alert, field):
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2(write_config({"alert": alert}))
    assert info.value.field == field
