"""TrainerMonitorV2 with the MindSpore back end: stepping by the optimizer's hooks or by
hand (``patch_optimizer_step: false``), the written-steps schedule, the ``fr`` aliases,
and ``start()`` errors."""

import json

import numpy as np
import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import assert_row_matches, find_row, rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, grads_np, ms, mse, nn, np_stats  # noqa: E402

from msprobe.core.monitor_v2.errors import ConfigError  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402


def train(tmp_path, cfg, steps, fr="mindspore", manual_step=False):
    net = MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    out = tmp_path / "out"
    mon = TrainerMonitorV2(dict(cfg, output_dir=str(out)), fr=fr)
    mon.start(model=net, optimizer=opt)
    passed = []
    for x, y in batches(steps):
        _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
        passed.append(grads_np(g))
        opt(g)
        if manual_step:
            mon.step()
    mon.stop()
    return out, passed


@pytest.mark.parametrize("patch", [None, False])
def test_stepping_by_optimizer_or_by_hand(tmp_path, patch):
    cfg = {"monitors": {"weight_grad": {"enabled": True}}}
    if patch is not None:
        cfg["patch_optimizer_step"] = patch
    out, passed = train(tmp_path, cfg, steps=3, manual_step=True)  # manual step() ignored when patched
    assert sorted(p.name for p in (out / "rank_0").iterdir()) == \
        ["layout.json"] + [f"weight_grad_step{s}-{s}.csv" for s in range(3)]
    # one process, data parallel: every parameter whole, a replica of itself
    layout = json.loads((out / "rank_0" / "layout.json").read_text())
    assert (layout["framework"], layout["rank"], layout["world_size"], layout["groups"]) == \
        ("mindspore", 0, 1, {"dp": {"rank": 0, "size": 1}})
    for name, grad in zip(("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"), passed[0]):
        entry = layout["params"][name]
        assert entry["shape"] == list(grad.shape)
        size = grad.size
        assert entry["pieces"]["reduced"] == {"numel": size, "split": []}
    rows = rows_of(out, "weight_grad")
    for s in range(3):
        assert_row_matches(find_row(rows, step=s, module_name="fc2.weight", scope="reduced"), np_stats(passed[s][2]))


def test_schedule_start_step_interval_and_record_windows(tmp_path):
    cfg = {"start_step": 1, "step_interval": 2, "step_count_per_record": 2,
           "monitors": {"weight_grad": {"enabled": True}}}
    out, passed = train(tmp_path, cfg, steps=6, fr="MS")
    # written: 1, 3, 5; windows of 2 steps aligned at start_step: 1-2, 3-4, 5-6
    assert sorted(p.name for p in (out / "rank_0").iterdir()) == ["layout.json",
        "weight_grad_step1-2.csv", "weight_grad_step3-4.csv", "weight_grad_step5-6.csv"]
    rows = rows_of(out, "weight_grad")
    assert sorted({int(r["step"]) for r in rows}) == [1, 3, 5]
    for s in (1, 3, 5):
        assert_row_matches(find_row(rows, step=s, module_name="fc1.weight", scope="unreduced"), np_stats(passed[s][0]))


def test_rank_not_monitored_writes_nothing(tmp_path):
    out, _ = train(tmp_path, {"rank": [3], "monitors": {"weight_grad": {"enabled": True}}}, steps=2)
    assert not (out / "rank_0").exists() or not list((out / "rank_0").iterdir())


def test_start_errors(tmp_path):
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "a"), "monitors": {"weight_grad": {"enabled": True}}}, fr="ms")
    with pytest.raises(ConfigError, match="optimizer"):
        mon.start(model=MLP())
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "b"), "monitors": {"module": {}}}, fr="mindspore")
    with pytest.raises(ConfigError, match="Cell"):
        mon.start(model=object())
