"""Which steps are written and into which file (spec: "Config" step selection, "Output").

Expected steps and windows are written out by hand in the tables.
"""

import logging

import pytest
import torch

from msprobe.core.monitor_v2.schedule import StepSchedule
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

from support import TinyMLP, loss_fn, make_batches, read_rank_dir

LOGGER = "msprobe.monitor_v2"
PARAM_NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    """Output goes to rank_0: no launcher RANK variable leaks into these tests."""
    monkeypatch.delenv("RANK", raising=False)


def S(id_, fields, horizon, written, windows):
    """``fields``: schedule fields; steps ``0..horizon-1`` are checked: exactly
    ``written`` are written; ``windows``: step -> (a, b) of its file."""
    return pytest.param(fields, horizon, written, windows, id=id_)


SCHEDULES = [
    S("defaults", {}, 6, [0, 1, 2, 3, 4, 5], {0: (0, 0), 1: (1, 1), 7: (7, 7)}),
    S("start3", {"start_step": 3}, 9, [3, 4, 5, 6, 7, 8], {3: (3, 3), 8: (8, 8)}),
    S("stop4", {"stop_step": 4}, 8, [0, 1, 2, 3], {3: (3, 3)}),
    S("start2-stop5", {"start_step": 2, "stop_step": 5}, 8, [2, 3, 4], {2: (2, 2), 4: (4, 4)}),
    S("interval3", {"step_interval": 3}, 11, [0, 3, 6, 9], {3: (3, 3), 9: (9, 9)}),
    S("start1-interval3", {"start_step": 1, "step_interval": 3}, 11, [1, 4, 7, 10], {4: (4, 4)}),
    S("collect3", {"collect_times": 3}, 8, [0, 1, 2], {2: (2, 2)}),
    S("start2-interval2-collect3", {"start_step": 2, "step_interval": 2, "collect_times": 3}, 14,
      [2, 4, 6], {6: (6, 6)}),
    S("stop-before-collect", {"start_step": 2, "step_interval": 2, "stop_step": 5, "collect_times": 10}, 12,
      [2, 4], {}),
    S("collect-before-stop", {"stop_step": 20, "step_interval": 5, "collect_times": 2}, 25, [0, 5], {}),
    S("single-step", {"start_step": 5, "stop_step": 6}, 10, [5], {5: (5, 5)}),
    S("stop-on-interval-excluded", {"start_step": 1, "step_interval": 4, "stop_step": 9}, 14, [1, 5], {}),
    S("stop-exclusive", {"step_interval": 2, "stop_step": 7}, 10, [0, 2, 4, 6], {}),
    S("collect1", {"start_step": 4, "step_interval": 3, "collect_times": 1}, 12, [4], {4: (4, 4)}),
    S("record2", {"step_count_per_record": 2}, 5, [0, 1, 2, 3, 4],
      {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3), 4: (4, 5)}),
    S("start1-record2", {"start_step": 1, "step_count_per_record": 2}, 6, [1, 2, 3, 4, 5],
      {1: (1, 2), 2: (1, 2), 3: (3, 4), 4: (3, 4), 5: (5, 6)}),
    S("record3-interval2", {"step_interval": 2, "step_count_per_record": 3}, 9, [0, 2, 4, 6, 8],
      {0: (0, 2), 2: (0, 2), 4: (3, 5), 6: (6, 8), 8: (6, 8)}),
    S("record-larger-than-run", {"step_count_per_record": 100, "collect_times": 4}, 10, [0, 1, 2, 3],
      {0: (0, 99), 3: (0, 99)}),
    S("all-five", {"start_step": 3, "stop_step": 15, "step_interval": 2, "step_count_per_record": 4,
                   "collect_times": 4}, 20, [3, 5, 7, 9], {3: (3, 6), 5: (3, 6), 7: (7, 10), 9: (7, 10)}),
    S("all-five-stop-binds", {"start_step": 1, "stop_step": 9, "step_interval": 3, "step_count_per_record": 5,
                              "collect_times": 10}, 20, [1, 4, 7], {1: (1, 5), 4: (1, 5), 7: (6, 10)}),
    S("all-five-collect-binds", {"start_step": 10, "stop_step": 100, "step_interval": 10,
                                 "step_count_per_record": 25, "collect_times": 3}, 120, [10, 20, 30],
      {10: (10, 34), 20: (10, 34), 30: (10, 34), 35: (35, 59)}),
]


@pytest.mark.parametrize("fields, horizon, written, windows", SCHEDULES)
def test_schedule_direct(fields, horizon, written, windows):
    sched = StepSchedule(**fields)
    assert [s for s in range(horizon) if sched.is_written(s)] == written
    for step, window in windows.items():
        assert tuple(sched.window(step)) == window, step


@pytest.mark.parametrize("fields, horizon, written, windows", SCHEDULES)
def test_schedule_from_config(tmp_path, fields, horizon, written, windows):
    sched = TrainerMonitorV2({"output_dir": str(tmp_path), **fields}).schedule
    assert [s for s in range(horizon) if sched.is_written(s)] == written
    for step, window in windows.items():
        assert tuple(sched.window(step)) == window, step


# ------------------------------------------------------------------ end to end
def _train(mon, steps, manual, optimizer_cls=torch.optim.SGD, calls_per_step=1):
    torch.manual_seed(0)
    model = TinyMLP()
    opt = optimizer_cls(model.parameters(), lr=0.05)
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(steps):
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if manual:
            for _ in range(calls_per_step):
                mon.step()
    mon.stop()
    return model


def E(id_, fields, steps, files, manual=False):
    """Train ``steps`` steps; ``files``: file name -> the steps it holds, in order."""
    return pytest.param(fields, steps, files, manual, id=id_)


END_TO_END = [
    E("defaults-3", {}, 3, {"param_step0-0.csv": [0], "param_step1-1.csv": [1], "param_step2-2.csv": [2]}),
    E("start2-stop5", {"start_step": 2, "stop_step": 5}, 7,
      {"param_step2-2.csv": [2], "param_step3-3.csv": [3], "param_step4-4.csv": [4]}),
    E("start1-interval2-record4", {"start_step": 1, "step_interval": 2, "step_count_per_record": 4}, 8,
      {"param_step1-4.csv": [1, 3], "param_step5-8.csv": [5, 7]}),
    E("collect2-record3", {"collect_times": 2, "step_count_per_record": 3}, 6, {"param_step0-2.csv": [0, 1]}),
    E("start3-record2-collect3", {"start_step": 3, "step_count_per_record": 2, "collect_times": 3}, 10,
      {"param_step3-4.csv": [3, 4], "param_step5-6.csv": [5]}),
    E("all-five", {"start_step": 1, "stop_step": 9, "step_interval": 2, "step_count_per_record": 3,
                   "collect_times": 3}, 12, {"param_step1-3.csv": [1, 3], "param_step4-6.csv": [5]}),
    E("record-larger-than-run", {"step_count_per_record": 5}, 2, {"param_step0-4.csv": [0, 1]}),
    E("start-after-run", {"start_step": 10}, 4, {}),
    E("patch-true", {"patch_optimizer_step": True, "start_step": 1, "stop_step": 3}, 5,
      {"param_step1-1.csv": [1], "param_step2-2.csv": [2]}),
    E("manual-start2-record2", {"patch_optimizer_step": False, "start_step": 2, "step_count_per_record": 2}, 6,
      {"param_step2-3.csv": [2, 3], "param_step4-5.csv": [4, 5]}, manual=True),
    E("manual-interval3", {"patch_optimizer_step": False, "step_interval": 3}, 7,
      {"param_step0-0.csv": [0], "param_step3-3.csv": [3], "param_step6-6.csv": [6]}, manual=True),
    E("manual-all-five", {"patch_optimizer_step": False, "start_step": 2, "stop_step": 20, "step_interval": 3,
                          "step_count_per_record": 2, "collect_times": 2}, 10,
      {"param_step2-3.csv": [2], "param_step4-5.csv": [5]}, manual=True),
]


def _steps_in(rows):
    seen = []
    for r in rows:
        s = int(r["step"])
        if not seen or seen[-1] != s:
            seen.append(s)
    return seen


@pytest.mark.parametrize("fields, steps, files, manual", END_TO_END)
def test_end_to_end_files_and_steps(tmp_path, fields, steps, files, manual):
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "monitors": {"param": {"enabled": True, "ops": ["norm"]}}, **fields}
    mon = TrainerMonitorV2(cfg)
    _train(mon, steps, manual)
    assert mon.current_step == steps
    got = read_rank_dir(out)
    assert sorted(got) == sorted(files)
    for name, rows in got.items():
        assert _steps_in(rows) == files[name], name
        # one row per parameter and scope for every written step, no duplicates
        for s in files[name]:
            keys = sorted((r["module_name"], r["scope"]) for r in rows if int(r["step"]) == s)
            assert keys == sorted((p, sc) for p in PARAM_NAMES for sc in ("param_origin", "param_updated"))


def test_manual_step_while_patched_is_ignored_and_warned_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"param": {"enabled": True, "ops": ["norm"]}}})
    _train(mon, 4, manual=True, calls_per_step=2)
    assert mon.current_step == 4
    got = read_rank_dir(out)
    assert sorted(got) == [f"param_step{s}-{s}.csv" for s in range(4)]
    for s in range(4):
        rows = got[f"param_step{s}-{s}.csv"]
        assert {r["step"] for r in rows} == {str(s)}
        assert len(rows) == 2 * len(PARAM_NAMES)
    warns = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warns) == 1, [r.getMessage() for r in warns]
    assert "step" in warns[0].getMessage()


def test_manual_step_not_patched_counts_every_call(tmp_path, caplog):
    """With patch_optimizer_step false, every step() call advances (the user owns stepping)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "patch_optimizer_step": False,
                            "monitors": {"param": {"enabled": True, "ops": ["norm"]}}})
    _train(mon, 3, manual=True, calls_per_step=2)
    assert mon.current_step == 6
    # only steps with an optimizer.step() have param rows: 0, 2, 4
    assert sorted(read_rank_dir(out)) == ["param_step0-0.csv", "param_step2-2.csv", "param_step4-4.csv"]
    assert [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING] == []


def test_patch_false_without_manual_step_stays_at_step0(tmp_path):
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "patch_optimizer_step": False, "step_count_per_record": 1,
                            "monitors": {"param": {"enabled": True, "ops": ["norm"]}}})
    _train(mon, 3, manual=False)
    assert mon.current_step == 0


def test_adam_patched_counts_steps(tmp_path):
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "start_step": 1, "step_interval": 2,
                            "monitors": {"param": {"enabled": True, "ops": ["norm"]}}})
    _train(mon, 5, manual=False, optimizer_cls=torch.optim.Adam)
    assert mon.current_step == 5
    assert sorted(read_rank_dir(out)) == ["param_step1-1.csv", "param_step3-3.csv"]
