"""Incident mode with a real model in one process: a config edited mid-run
(``"dynamic": true``, written with ``msprobe-monitor control``'s function), per-monitor
``steps``, an invalid edit, a monitor turned off, and ``alert.on_anomaly``."""

import json
import logging

import torch

from support import loss_fn, make_batches, rows_of
from support.models import TinyMLP

from msprobe.core.monitor_v2.analysis.control import ControlEdit, control
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
              "_backward_hooks", "_backward_pre_hooks")


def write(path, config):
    path.write_text(json.dumps(config))


def train(mon, model, opt, steps, before_step=None):
    batches = make_batches(steps)
    for step, (x, y) in enumerate(batches):
        if before_step is not None:
            before_step(step)
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def steps_of(rows):
    return sorted({int(r["step"]) for r in rows})


def hooks_of(model):
    """Each module's hooks, and whether its forward is the monitor's (an instance attribute)."""
    return {name: tuple(len(getattr(m, d) or {}) for d in HOOK_DICTS) + tuple(k in vars(m) for k in ("forward", "_replicate_for_data_parallel"))
            for name, m in model.named_modules()}


def setup(tmp_path, **extra):
    cfg = tmp_path / "monitor_config.json"
    write(cfg, {"output_dir": str(tmp_path / "out"), "dynamic": True,
                "monitors": {"weight_grad": {"enabled": True}, "module": {"enabled": False}}, **extra})
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return cfg, model, opt


def test_edit_mid_run_writes_module_rows_for_exactly_the_requested_steps(tmp_path):
    cfg, model, opt = setup(tmp_path)
    mon = TrainerMonitorV2(str(cfg))
    mon.start(model, opt)

    def edit(step):
        if step in (3, 10):  # read at the end of this step, applied from the next
            control(str(cfg), ControlEdit(enable="module", targets=["fc2"], steps=3))

    train(mon, model, opt, 16, edit)
    out = tmp_path / "out"
    module = rows_of(out, "module")
    # the same command again re-arms the entry (control writes "_armed")
    assert steps_of(module) == [4, 5, 6, 11, 12, 13]
    assert {r["module_name"].split(".")[0] for r in module} == {"fc2"}
    assert steps_of(rows_of(out, "weight_grad")) == list(range(16))


def test_invalid_edit_is_refused_once_and_the_running_config_stays(tmp_path, caplog):
    cfg, model, opt = setup(tmp_path)
    mon = TrainerMonitorV2(str(cfg))
    mon.start(model, opt)
    bad = {"output_dir": str(tmp_path / "out"), "dynamic": True,
           "monitors": {"weight_grad": {"enabled": True}, "module": {"enabled": True, "steps": 0}}}

    def edit(step):
        if step in (2, 4):  # the same bad content twice (a new inode and mtime the second time)
            write(cfg, bad)
        if step == 6:
            control(str(cfg), ControlEdit(enable="module", steps=2, disable=[]))

    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        train(mon, model, opt, 10, edit)
    refused = [r.getMessage() for r in caplog.records if "is refused" in r.getMessage()]
    assert len(refused) == 1, refused
    assert "monitors.module.steps" in refused[0] and "0" in refused[0]
    out = tmp_path / "out"
    assert steps_of(rows_of(out, "weight_grad")) == list(range(10))
    assert steps_of(rows_of(out, "module")) == [7, 8]  # a later valid edit still applies


def test_monitor_turned_off_removes_its_hooks_and_flushes_its_rows(tmp_path):
    cfg, model, opt = setup(tmp_path)
    write(cfg, {"output_dir": str(tmp_path / "out"), "dynamic": True, "step_count_per_record": 4,
                "monitors": {"weight_grad": {"enabled": True}, "module": {"enabled": True}}})
    before = hooks_of(model)
    mon = TrainerMonitorV2(str(cfg))
    mon.start(model, opt)
    during = hooks_of(model)
    assert during != before
    seen = {}

    def edit(step):
        if step == 2:
            control(str(cfg), ControlEdit(disable=["module"]))
        seen[step] = hooks_of(model)

    batches = make_batches(6)
    for step, (x, y) in enumerate(batches):
        edit(step)
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        if step == 3:
            # off from step 3: its rows of steps 0..2 are on disk before stop()
            assert steps_of(rows_of(tmp_path / "out", "module")) == [0, 1, 2]
    # hooks gone from the step the edit applied: what is left is weight_grad's own (the
    # model's forward pre-hook that marks where its micro-batches begin)
    assert seen[3] == hooks_of_weight_grad_alone(tmp_path)
    assert [m.name for m in mon.monitors] == ["weight_grad"]
    mon.stop()
    assert hooks_of(model) == before


def hooks_of_weight_grad_alone(tmp_path):
    """``hooks_of`` a model that only weight_grad monitors."""
    model = TinyMLP()
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "alone"), "monitors": {"weight_grad": {"enabled": True}}})
    mon.start(model, torch.optim.SGD(model.parameters(), lr=0.05))
    hooks = hooks_of(model)
    mon.stop()
    return hooks


def test_turned_on_mid_run_attaches_as_start_would(tmp_path):
    """The rows of a monitor turned on at step 3 are those of a run that had it from the start."""
    cfg, model, opt = setup(tmp_path)
    ref_model = TinyMLP()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    ref = TrainerMonitorV2({"output_dir": str(tmp_path / "ref"), "monitors": {"module": {"enabled": True}}})
    ref.start(ref_model, ref_opt)
    train(ref, ref_model, ref_opt, 6)
    mon = TrainerMonitorV2(str(cfg))
    mon.start(model, opt)
    train(mon, model, opt, 6, lambda s: s == 2 and control(str(cfg), ControlEdit(enable="module")))
    got = [r for r in rows_of(tmp_path / "out", "module")]
    want = [r for r in rows_of(tmp_path / "ref", "module") if int(r["step"]) >= 3]
    assert got == want
    assert torch.equal(model.fc1.weight, ref_model.fc1.weight)  # training unchanged


def test_schedule_edit_applies_from_the_next_step(tmp_path):
    cfg, model, opt = setup(tmp_path)
    mon = TrainerMonitorV2(str(cfg))
    mon.start(model, opt)
    train(mon, model, opt, 12, lambda s: s == 3 and control(
        str(cfg), ControlEdit(sets=[("step_interval", 4), ("start_step", 4)])))
    assert steps_of(rows_of(tmp_path / "out", "weight_grad")) == [0, 1, 2, 3, 4, 8]


def test_restart_only_field_is_said_and_the_rest_applies(tmp_path, caplog):
    cfg, model, opt = setup(tmp_path)
    mon = TrainerMonitorV2(str(cfg))
    mon.start(model, opt)
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        train(mon, model, opt, 6, lambda s: s == 1 and control(
            str(cfg), ControlEdit(enable="module", sets=[("async_write", True)])))
    assert any("async_write, which only a restart applies" in r.getMessage() for r in caplog.records)
    assert steps_of(rows_of(tmp_path / "out", "module")) == [2, 3, 4, 5]


def test_per_monitor_steps_at_start(tmp_path):
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "step_interval": 3,
                            "monitors": {"weight_grad": {"enabled": True}, "module": {"steps": 2}}})
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = hooks_of(model)
    mon.start(model, opt, first_step=5)
    train(mon, model, opt, 8)
    # a timed monitor is written on every step of its window; the others follow the schedule
    assert steps_of(rows_of(tmp_path / "out", "module")) == [5, 6]
    assert steps_of(rows_of(tmp_path / "out", "weight_grad")) == [6, 9, 12]
    assert hooks_of(model) == before


def nan_in_fc2_at_step_4(tmp_path, caplog, monitors, escalate_steps, steps):
    """A TinyMLP whose fc2.weight gets a NaN before step 4, with ``monitors`` and an
    ``on_anomaly`` that turns ``module`` on for ``escalate_steps`` steps, targets "auto".
    Returns the output directory, the model and the messages logged."""
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {m: {"enabled": True} for m in monitors},
                            "alert": {"on_anomaly": {"steps": escalate_steps,
                                                     "monitors": {"module": {"targets": "auto"}}}}})
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon.start(model, opt)

    def inject(step):
        if step == 4:
            with torch.no_grad():
                model.fc2.weight[0, 0] = float("nan")

    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        train(mon, model, opt, steps, inject)
    return out, model, [r.getMessage() for r in caplog.records]


def test_on_anomaly_turns_module_on_for_the_subtree_of_the_offending_tensor(tmp_path, caplog):
    out, _, messages = nan_in_fc2_at_step_4(tmp_path, caplog, ["param"], 3, 10)
    module = rows_of(out, "module")
    assert steps_of(module) == [5, 6, 7]
    assert {r["module_name"].split(".")[0] for r in module} == {"fc2"}
    line = [m for m in messages if "on_anomaly turns on" in m]
    assert len(line) == 1 and "steps 5..7" in line[0] and "'fc2'" in line[0] and "fc2.weight" in line[0]


def test_on_anomaly_auto_watches_every_module_when_every_gradient_went_nan_at_once(tmp_path, caplog):
    # weight_grad alone: the NaN in fc2.weight makes every gradient NaN in the same step, so
    # the first row in file order (fc1.weight) names no suspect and "auto" must not narrow to it
    out, model, messages = nan_in_fc2_at_step_4(tmp_path, caplog, ["weight_grad"], 2, 8)
    grads = [r for r in rows_of(out, "weight_grad") if int(r["step"]) == 4 and r["scope"] == "unreduced"]
    assert len(grads) > 1 and all(r["norm"] == "nan" for r in grads)  # the premise: all at once
    module = rows_of(out, "module")
    assert steps_of(module) == [5, 6]
    children = {name for name, _ in model.named_children()}
    assert {r["module_name"].split(".")[0] for r in module} >= children  # not narrowed to fc1
    assert any("cannot tell where it began" in m for m in messages if "first non-finite value" in m)
    line = [m for m in messages if "on_anomaly turns on" in m]
    assert len(line) == 1 and "every module" in line[0] and "none of them names the layer" in line[0]


def test_on_anomaly_auto_narrows_to_the_one_nan_parameter_among_all_nan_gradients(tmp_path, caplog):
    # weight_grad and param: every gradient is NaN (no suspect), but param_origin, earlier in
    # the step, has one non-finite row: fc2.weight, which names the layer
    out, _, _ = nan_in_fc2_at_step_4(tmp_path, caplog, ["weight_grad", "param"], 2, 8)
    origin = [r for r in rows_of(out, "param") if int(r["step"]) == 4 and r["scope"] == "param_origin"]
    assert [r["module_name"] for r in origin if r["nans"] != "0"] == ["fc2.weight"]
    module = rows_of(out, "module")
    assert steps_of(module) == [5, 6]
    assert {r["module_name"].split(".")[0] for r in module} == {"fc2"}


def test_async_writer_takes_the_new_outputs_in_order(tmp_path):
    cfg, model, opt = setup(tmp_path, async_write=True, step_count_per_record=5)
    mon = TrainerMonitorV2(str(cfg))
    mon.start(model, opt)
    train(mon, model, opt, 12, lambda s: s == 1 and control(
        str(cfg), ControlEdit(enable="module", ops=["norm", "nans"], steps=4)))
    out = tmp_path / "out"
    names = sorted(p.name for p in (out / "rank_0").glob("module_*.csv"))
    assert names == ["module_step2-4.csv", "module_step5-9.csv"]  # the first file named from the reload step
    module = rows_of(out, "module")
    assert steps_of(module) == [2, 3, 4, 5]
    assert set(module[0]) == {"vpp_stage", "step", "module_name", "scope", "norm", "nans"}
    assert steps_of(rows_of(out, "weight_grad")) == list(range(12))


def test_on_anomaly_with_async_write_escalates_once(tmp_path, caplog):
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "async_write": True, "monitors": {"param": {"enabled": True}},
                            "alert": {"on_anomaly": {"steps": 2, "monitors": {"module": {"targets": "auto"}}}}})
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon.start(model, opt)

    def inject(step):
        if step == 3:
            with torch.no_grad():
                model.fc1.bias[0] = float("inf")
        if step == 5:
            mon._writer.drain()  # the writer thread has checked step 3's rows by the end of step 5

    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        train(mon, model, opt, 12, inject)
    module = rows_of(out, "module")
    steps = steps_of(module)
    assert len(steps) == 2 and steps[0] in (4, 5, 6) and steps[1] == steps[0] + 1  # after the writer thread saw it
    assert {r["module_name"].split(".")[0] for r in module} == {"fc1"}
    assert len([r for r in caplog.records if "on_anomaly turns on" in r.getMessage()]) == 1


def test_on_anomaly_added_by_an_edit_is_armed(tmp_path):
    cfg, model, opt = setup(tmp_path, alert=True)
    mon = TrainerMonitorV2(str(cfg))
    mon.start(model, opt)

    def step_hook(step):
        if step == 1:
            control(str(cfg), ControlEdit(sets=[("alert", {"on_anomaly": {"steps": 2, "monitors": {
                "module": {"targets": "auto"}}}})]))
        if step == 5:
            with torch.no_grad():
                model.fc2.bias[0] = float("nan")

    train(mon, model, opt, 10, step_hook)
    module = rows_of(tmp_path / "out", "module")
    assert steps_of(module) == [6, 7]


def test_edits_and_escalation_change_nothing_the_training_computes_and_stop_removes_every_hook(tmp_path):
    # the same seed and batches twice: without the monitor, and with dynamic on, an edit that
    # turns module and param on mid-run, on_anomaly armed, alert.dump checking every update
    def run(monitored: bool):
        torch.manual_seed(0)
        model = TinyMLP()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        before = hooks_of(model)
        cfg = tmp_path / "monitor_config.json"
        write(cfg, {"output_dir": str(tmp_path / "out"), "dynamic": True,
                    "monitors": {"weight_grad": {"enabled": True}},
                    "alert": {"dump": True, "on_anomaly": {"steps": 2, "monitors": {"module": {"targets": "auto"}}}}})
        mon = TrainerMonitorV2(str(cfg)) if monitored else None
        if mon is not None:
            mon.start(model, opt)
        for step, (x, y) in enumerate(make_batches(8)):
            if mon is not None and step == 3:
                control(str(cfg), ControlEdit(enable="module", steps=2))
                control(str(cfg), ControlEdit(enable="param"))
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        if mon is not None:
            mon.stop()
        assert hooks_of(model) == before
        return model, opt

    plain, plain_opt = run(False)
    watched, watched_opt = run(True)
    assert steps_of(rows_of(tmp_path / "out", "module")) == [4, 5]  # the edit did apply
    for (name, a), b in zip(plain.named_parameters(), watched.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(plain.parameters(), watched.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain_opt.state[a][key], watched_opt.state[b][key]), key
    assert not (tmp_path / "out" / "rank_0" / "anomalies.jsonl").exists()  # nothing went wrong
