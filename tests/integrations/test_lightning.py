"""Lightning with MonitorLightningCallback: one process, and 2 processes (DDP, gloo,
torchrun). See lightning_app.py for the training and its references."""

import logging
from pathlib import Path

import torch

from support.extras import require

require("lightning", "the Lightning callback tests fit a LightningModule with it")

from support import run_torchrun  # noqa: E402
from lightning_app import CONFIG_MONITORS, check_run, fit  # noqa: E402


def test_lightning_single_process(tmp_path, caplog):
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        module, monitored, probe = fit({"output_dir": str(out), "monitors": CONFIG_MONITORS})
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    check_run(out, module, monitored, probe)
    plain, _, _ = fit()
    assert torch.equal(torch.stack(module.losses), torch.stack(plain.losses))
    for (n, p), (_, q) in zip(module.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q), n


def test_lightning_ddp_two_processes(tmp_path):
    out = tmp_path / "out"
    run_torchrun(Path(__file__).with_name("lightning_ddp_worker.py"), out, nproc=2, timeout=300)
    for rank in range(2):
        saved = torch.load(out / f"ref_rank{rank}.pt", weights_only=False)
        assert saved["ok"], saved
        # DDPStrategy's DDP (no bucket view) is named to the monitor: the local gradients
        # of each backward pass are read in one batch at its end, and are still the local ones
        assert saved["batched"] and all(saved["batched"]), saved["batched"]
    # Each rank wrote its own local gradients; DDP averages them into 'reduced'.
    assert (out / "rank_0").is_dir() and (out / "rank_1").is_dir()


def test_plain_start_on_a_lightning_optimizer_hooks_the_wrapped_one(tmp_path):
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from support import TinyMLP, make_batches
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    model = TinyMLP()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": {"weight_grad": {"enabled": True}}})
    mon.start(model, LightningOptimizer(inner))
    x, y = make_batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    inner.step()  # what Lightning's precision plugin calls
    assert mon.current_step == 1 and len(inner._optimizer_step_pre_hooks) == 1
    mon.stop()
    assert not inner._optimizer_step_pre_hooks
