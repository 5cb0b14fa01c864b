"""Online alerts: a NaN and a gradient spike injected at known steps are logged the step
they are written, naming the tensor; bad `alert` settings fail at construction."""

import logging

import pytest
import torch

from support import TinyMLP, loss_fn, make_batches
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


class _Converging(torch.nn.Module):
    """A head plus a branch scaled by ``scale``: the branch's weight gradient is
    ``scale`` times a finite product, exactly 0 when ``scale`` is 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(8, 4)
        self.branch = torch.nn.Linear(8, 4)
        self.scale = 0.0

    def forward(self, x):
        return self.head(x) + self.scale * self.branch(x)


def _converged_then_noise(write_config, floor):
    """The branch's gradient is ~1e-12 for 12 steps, then ~1.5e-8 (10^4 x its median, far
    below any meaningful norm): a converged gradient reading rounding noise."""
    model = _Converging()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    alert = {"spike_factor": 10, "spike_warmup": 5}
    if floor is not None:
        alert["spike_floor"] = floor
    mon = TrainerMonitorV2(write_config({"alert": alert, "monitors": {"weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    norms = []
    g = torch.Generator().manual_seed(3)
    for s in range(16):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        model.scale = 1e-12 if s < 12 else 1e-8
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(model.branch.weight.grad.double().norm().item())
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert max(norms[:12]) < 1e-10 and 1e-9 < min(norms[12:]) < 1e-6  # the scenario is the one described
    return norms


def test_values_near_zero_are_not_spikes_below_the_floor(write_config, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    _converged_then_noise(write_config, floor=None)  # the default floor, 1e-6
    assert [m for m in alerts(caplog) if "norm spike" in m] == []


def test_without_a_floor_the_same_noise_is_a_spike(write_config, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    _converged_then_noise(write_config, floor=0)
    spikes = [m for m in alerts(caplog) if "norm spike" in m]
    assert spikes and all("weight_grad branch." in m for m in spikes), alerts(caplog)
    assert any("weight_grad branch.weight" in m for m in spikes)
    assert "step 12" in spikes[0]


@pytest.mark.parametrize("alert, field", [
    ({"spike_floor": -1}, "alert.spike_floor"),
    ({"spike_floor": "1e-6"}, "alert.spike_floor"),
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
