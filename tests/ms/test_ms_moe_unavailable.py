"""MindSpore: the ``moe`` monitor is not available there; a config that enables it still
starts, says so once at WARNING, and the other monitors write their rows."""

import logging

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, ms, nn  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402


def test_moe_is_said_once_and_the_rest_runs(tmp_path, caplog):
    net = MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "patch_optimizer_step": False, "monitors": {
        "module": {"enabled": True}, "moe": {"enabled": True}}}, fr="mindspore")
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        mon.start(model=net, optimizer=opt)
    said = [r for r in caplog.records if "'moe' is not available" in r.getMessage()]
    assert len(said) == 1 and "mindspore" in said[0].getMessage()
    x, _ = next(iter(batches(1)))
    net(ms.Tensor(x))
    mon.step()
    mon.stop()
    assert rows_of(tmp_path / "out", "module")
    assert not list((tmp_path / "out" / "rank_0").glob("moe_*.csv"))
