"""Config loading and validation (spec: "Config").

Every bad config must fail at ``TrainerMonitorV2(...)`` construction with a
``ConfigError`` whose ``field`` is the dotted path of the offending field and whose
message names that field and the bad value.
"""

import json
import logging
import os

import pytest
import torch

from msprobe.core.monitor_v2.config import resolve_micro_batches
from msprobe.core.monitor_v2.errors import ConfigError
from msprobe.core.monitor_v2.schedule import StepSchedule
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

from support import TinyMLP, loss_fn, make_batches

LOGGER = "msprobe.monitor_v2"
ALL_OPS = ("min", "max", "mean", "norm", "nans")


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    """Output goes to rank_0: no launcher RANK variable leaks into these tests."""
    monkeypatch.delenv("RANK", raising=False)


def _warnings(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# --------------------------------------------------------------------- bad configs
NAME = object()  # the bad "value" is the unknown name itself: the field check covers it


def P(id_, cfg, field, value, fr=None, extra=()):
    """One bad config: ``cfg`` (a dict, or a callable of tmp_path returning one), the
    expected ``exc.field``, the bad value (its repr must be in the message), an optional
    ``fr`` argument and extra substrings the message must contain."""
    return pytest.param(cfg, field, value, fr, extra, id=id_)


def _mon(name, **fields):
    return {"monitors": {name: fields}}


BAD_CONFIGS = [
    # unknown names
    P("unknown-top-level-typo", {"start_stpe": 3}, "start_stpe", NAME, extra=("start_step",)),
    P("unknown-top-level-typo-interval", {"step_intervall": 2}, "step_intervall", NAME,
      extra=("step_interval",)),
    P("unknown-monitor-name", {"monitors": {"weight_grads": {"enabled": True}}}, "monitors.weight_grads",
      NAME, extra=("weight_grad",)),
    P("unknown-monitor-name-unrelated", {"monitors": {"activations": {}}}, "monitors.activations", NAME),
    # unknown fields inside a known monitor (issue 26: a misspelt field changed what was recorded)
    P("unknown-monitor-field-target", _mon("module", target=["fc1"]), "monitors.module.target", NAME,
      extra=("unknown field 'monitors.module.target'; did you mean 'targets'?", "starts with '_' is ignored")),
    P("unknown-monitor-field-enable", _mon("weight_grad", enable=True), "monitors.weight_grad.enable", NAME,
      extra=("did you mean 'enabled'?", "Known fields: enabled, ops, eps, monitor_mbs_grad")),
    P("unknown-monitor-field-case", _mon("param", Enabled=True), "monitors.param.Enabled", NAME,
      extra=("did you mean 'enabled'?",)),
    P("unknown-monitor-field-unrelated", _mon("optimizer", enabled=True, wg_distribution=True),
      "monitors.optimizer.wg_distribution", NAME, extra=("Known fields: enabled, ops, eps, mv_distribution",)),
    P("unknown-field-nested-in-cc_distribution", _mon("cc", cc_distribution={"enable": True, "cc_codelines": []}),
      "monitors.cc.cc_codelines", NAME, extra=("did you mean 'cc_codeline'?",)),
    # wrong types where an int is expected
    P("start_step-string", {"start_step": "3"}, "start_step", "3"),
    P("start_step-float", {"start_step": 1.5}, "start_step", 1.5),
    P("start_step-bool", {"start_step": True}, "start_step", True),
    P("stop_step-string", {"stop_step": "10"}, "stop_step", "10"),
    P("stop_step-float", {"stop_step": 10.0}, "stop_step", 10.0),
    P("stop_step-bool", {"stop_step": True}, "stop_step", True),
    P("step_interval-string", {"step_interval": "2"}, "step_interval", "2"),
    P("step_interval-float", {"step_interval": 2.0}, "step_interval", 2.0),
    P("step_interval-bool", {"step_interval": True}, "step_interval", True),
    P("step_count_per_record-string", {"step_count_per_record": "5"}, "step_count_per_record", "5"),
    P("step_count_per_record-float", {"step_count_per_record": 2.5}, "step_count_per_record", 2.5),
    P("step_count_per_record-bool", {"step_count_per_record": False}, "step_count_per_record", False),
    P("collect_times-string", {"collect_times": "3"}, "collect_times", "3"),
    P("collect_times-float", {"collect_times": 3.0}, "collect_times", 3.0),
    P("collect_times-bool", {"collect_times": True}, "collect_times", True),
    P("rank-string", {"rank": "0"}, "rank", "0"),
    P("rank-float", {"rank": 1.0}, "rank", 1.0),
    P("rank-bool", {"rank": True}, "rank", True),
    P("rank-list-item-string", {"rank": [0, "1"]}, "rank[1]", "1"),
    P("rank-list-item-float", {"rank": [0.0]}, "rank[0]", 0.0),
    P("rank-list-item-bool", {"rank": [0, False]}, "rank[1]", False),
    P("grad_acc_steps-string", _mon("weight_grad", enabled=True, grad_acc_steps="4"),
      "monitors.weight_grad.grad_acc_steps", "4"),
    P("grad_acc_steps-float", _mon("weight_grad", enabled=True, grad_acc_steps=4.0),
      "monitors.weight_grad.grad_acc_steps", 4.0),
    P("grad_acc_steps-bool", _mon("weight_grad", grad_acc_steps=True),
      "monitors.weight_grad.grad_acc_steps", True),
    P("micro_batch_number-string", _mon("weight_grad", micro_batch_number="2"),
      "monitors.weight_grad.micro_batch_number", "2"),
    P("micro_batch_number-float", _mon("weight_grad", micro_batch_number=2.0),
      "monitors.weight_grad.micro_batch_number", 2.0),
    P("micro_batch_number-bool", _mon("weight_grad", micro_batch_number=True),
      "monitors.weight_grad.micro_batch_number", True),
    # out of range
    P("start_step-negative", {"start_step": -1}, "start_step", -1),
    P("step_interval-zero", {"step_interval": 0}, "step_interval", 0),
    P("step_interval-negative", {"step_interval": -2}, "step_interval", -2),
    P("step_count_per_record-zero", {"step_count_per_record": 0}, "step_count_per_record", 0),
    P("collect_times-zero", {"collect_times": 0}, "collect_times", 0),
    P("stop_step-equal-start", {"start_step": 5, "stop_step": 5}, "stop_step", 5),
    P("stop_step-below-start", {"start_step": 5, "stop_step": 3}, "stop_step", 3),
    P("stop_step-zero-default-start", {"stop_step": 0}, "stop_step", 0),
    P("rank-negative", {"rank": -1}, "rank", -1),
    P("rank-list-item-negative", {"rank": [0, -1]}, "rank[1]", -1),
    P("grad_acc_steps-zero", _mon("weight_grad", grad_acc_steps=0), "monitors.weight_grad.grad_acc_steps", 0),
    P("micro_batch_number-zero", _mon("weight_grad", micro_batch_number=0),
      "monitors.weight_grad.micro_batch_number", 0),
    # enumerations
    P("format-tensorboard", {"format": "tensorboard"}, "format", "tensorboard", extra=("csv",)),
    P("format-not-string", {"format": 1}, "format", 1),
    P("framework-jax", {"framework": "jax"}, "framework", "jax", extra=("pytorch", "mindspore")),
    P("framework-not-string", {"framework": 1}, "framework", 1),
    P("fr-tf", {}, "fr", "tf", fr="tf", extra=("pytorch", "mindspore")),
    P("fr-tf-beats-valid-config", {"framework": "pytorch"}, "fr", "tf", fr="tf"),
    # booleans
    P("async_write-string", {"async_write": "true"}, "async_write", "true"),
    P("async_write-int", {"async_write": 1}, "async_write", 1),
    P("patch_optimizer_step-string", {"patch_optimizer_step": "false"}, "patch_optimizer_step", "false"),
    P("enabled-string", _mon("param", enabled="true"), "monitors.param.enabled", "true"),
    P("enabled-int", _mon("weight_grad", enabled=1), "monitors.weight_grad.enabled", 1),
    P("monitor_mbs_grad-string", _mon("weight_grad", enabled=True, monitor_mbs_grad="false"),
      "monitors.weight_grad.monitor_mbs_grad", "false"),
    P("param_distribution-string", _mon("param", param_distribution="yes"),
      "monitors.param.param_distribution", "yes"),
    P("mv_distribution-int", _mon("optimizer", mv_distribution=0), "monitors.optimizer.mv_distribution", 0),
    P("cc_pre_hook-string", _mon("cc", cc_pre_hook="yes"), "monitors.cc.cc_pre_hook", "yes"),
    P("cc_log_only-int", _mon("cc", cc_log_only=1), "monitors.cc.cc_log_only", 1),
    # eps
    P("eps-zero", _mon("param", enabled=True, eps=0), "monitors.param.eps", 0),
    P("eps-zero-float", _mon("param", eps=0.0), "monitors.param.eps", 0.0),
    P("eps-negative", _mon("weight_grad", eps=-1e-8), "monitors.weight_grad.eps", -1e-8),
    P("eps-string", _mon("optimizer", eps="1e-8"), "monitors.optimizer.eps", "1e-8"),
    P("eps-bool", _mon("module", eps=True), "monitors.module.eps", True),
    # lists
    P("ops-not-list", _mon("param", ops="norm"), "monitors.param.ops", "norm"),
    P("ops-object", _mon("param", ops={"norm": True}), "monitors.param.ops", {"norm": True}),
    P("ops-non-string-item", _mon("param", ops=["norm", 3]), "monitors.param.ops[1]", 3),
    P("targets-not-list", _mon("module", targets="fc1"), "monitors.module.targets", "fc1"),
    P("targets-non-string-item", _mon("module", targets=["fc1", None]), "monitors.module.targets[1]", None),
    P("cc_codeline-colon-form", _mon("cc", cc_codeline=["train.py:23"]), "monitors.cc.cc_codeline[0]",
      "train.py:23", extra=("file.py[line]",)),
    P("cc_codeline-no-line", _mon("cc", cc_codeline=["train.py[23]", "model.py[]"]),
      "monitors.cc.cc_codeline[1]", "model.py[]", extra=("file.py[line]",)),
    P("cc_codeline-not-list", _mon("cc", cc_codeline="train.py[23]"), "monitors.cc.cc_codeline", "train.py[23]"),
    P("module_ranks-negative", _mon("cc", module_ranks=[-1]), "monitors.cc.module_ranks[0]", -1),
    # structure
    P("monitor-entry-bool", {"monitors": {"param": True}}, "monitors.param", True),
    P("monitor-entry-list", {"monitors": {"weight_grad": ["enabled"]}}, "monitors.weight_grad", ["enabled"]),
    P("monitors-list", {"monitors": ["param"]}, "monitors", ["param"]),
    P("monitors-string", {"monitors": "param"}, "monitors", "param"),
    P("cc_distribution-not-object", _mon("cc", cc_distribution="on"), "monitors.cc.cc_distribution", "on"),
    P("cc_distribution-list", _mon("cc", cc_distribution=[True]), "monitors.cc.cc_distribution", [True]),
    # output_dir
    P("output_dir-below-regular-file",
      lambda tmp: (tmp / "afile").write_text("x") and {"output_dir": str(tmp / "afile" / "out")},
      "output_dir", lambda tmp: str(tmp / "afile" / "out")),
    P("output_dir-is-regular-file",
      lambda tmp: (tmp / "afile").write_text("x") and {"output_dir": str(tmp / "afile")},
      "output_dir", lambda tmp: str(tmp / "afile")),
    P("output_dir-not-string", {"output_dir": 5}, "output_dir", 5),
    P("output_dir-empty", {"output_dir": ""}, "output_dir", ""),
]


@pytest.mark.parametrize("cfg, field, value, fr, extra", BAD_CONFIGS)
def test_bad_config_raises_naming_field_and_value(tmp_path, cfg, field, value, fr, extra):
    cfg = cfg(tmp_path) if callable(cfg) else dict(cfg)
    value = value(tmp_path) if callable(value) else value
    cfg.setdefault("output_dir", str(tmp_path / "out"))
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2(cfg, fr=fr)
    exc = info.value
    msg = str(exc)
    assert exc.field == field, msg
    assert field in msg
    if value is not NAME:
        assert repr(value) in msg
    for s in extra:
        assert s in msg


@pytest.mark.parametrize(
    "cfg, field",
    [
        pytest.param({"start_step": "3"}, "start_step", id="top-level"),
        pytest.param({"monitors": {"param": {"eps": 0}}}, "monitors.param.eps", id="nested"),
        pytest.param({"stat_step": 1}, "stat_step", id="unknown"),
    ],
)
def test_bad_config_from_file_fails_the_same_way(write_config, cfg, field):
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2(write_config(cfg))
    assert info.value.field == field


def test_bad_config_creates_no_output_dir(tmp_path):
    out = tmp_path / "never"
    with pytest.raises(ConfigError):
        TrainerMonitorV2({"output_dir": str(out), "step_interval": 0})
    assert not out.exists()


@pytest.mark.parametrize(
    "typo, meant, other",
    [
        pytest.param("start_stpe", "start_step", "stop_step", id="start_stpe"),
        pytest.param("colect_times", "collect_times", "start_step", id="colect_times"),
        pytest.param("outputdir", "output_dir", "format", id="outputdir"),
        pytest.param("patch_optimiser_step", "patch_optimizer_step", "step_interval", id="patch_optimiser_step"),
    ],
)
def test_unknown_top_level_field_suggests_close_name(tmp_path, typo, meant, other):
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2({"output_dir": str(tmp_path), typo: 1})
    msg = str(info.value)
    assert info.value.field == typo
    # the close name is singled out, not only listed among all known names
    assert msg.count(meant) > msg.count(other), msg


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope" / "monitor_v2_config.json"
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2(str(path))
    assert str(path) in str(info.value)


def test_missing_config_file_pathlike(tmp_path):
    with pytest.raises(ConfigError):
        TrainerMonitorV2(tmp_path / "missing.json")


def test_invalid_json_reports_line(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text('{\n  "start_step": 1,\n  "stop_step": 4,,\n  "monitors": {}\n}\n')
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2(str(path))
    msg = str(info.value)
    assert str(path) in msg
    assert "line 3" in msg


def test_json_top_level_list(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps([{"start_step": 1}]))
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2(str(path))
    assert "list" in str(info.value)


def test_config_of_wrong_python_type():
    with pytest.raises(ConfigError):
        TrainerMonitorV2(42)


# --------------------------------------------------------------------- good configs
def test_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = TrainerMonitorV2({}).config
    assert cfg.framework == "pytorch"
    assert cfg.output_dir == str(tmp_path)  # "./", resolved at construction (issue 12)
    assert cfg.format == "csv"
    assert cfg.async_write is None  # the writer thread, waited for (writer.py); false: synchronous
    assert cfg.ranks is None
    assert cfg.patch_optimizer_step is None
    assert dict(cfg.monitors) == {}
    assert cfg.schedule == StepSchedule()
    s = cfg.schedule
    assert (s.start_step, s.step_interval, s.step_count_per_record) == (0, 1, 1)
    assert all(s.is_written(k) for k in (0, 1, 1000, 10**7))
    # the writability check leaves nothing behind
    assert os.listdir(tmp_path) == []


def test_default_output_dir_from_file_config(tmp_path, monkeypatch):
    sub = tmp_path / "work"
    sub.mkdir()
    (tmp_path / "cfg.json").write_text("{}")
    monkeypatch.chdir(sub)
    cfg = TrainerMonitorV2(str(tmp_path / "cfg.json")).config
    assert os.path.abspath(cfg.output_dir) == str(sub)


def test_default_output_dir_is_where_files_go(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"monitors": {"param": {"enabled": True, "ops": ["norm"]}}})
    mon.start(model, opt)
    for x, y in make_batches(1):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert (tmp_path / "rank_0" / "param_step0-0.csv").is_file()


def test_output_dir_nested_parents_created(tmp_path):
    out = tmp_path / "a" / "b" / "c"
    cfg = TrainerMonitorV2({"output_dir": str(out)}).config
    assert out.is_dir()
    assert cfg.output_dir == str(out)
    assert os.listdir(out) == []


@pytest.mark.parametrize(
    "framework, expected",
    [
        pytest.param("pytorch", "pytorch", id="pytorch"),
        pytest.param("PyTorch", "pytorch", id="PyTorch"),
        pytest.param("pt", "pytorch", id="pt"),
        pytest.param("torch", "pytorch", id="torch"),
        pytest.param("TORCH", "pytorch", id="TORCH"),
        pytest.param("mindspore", "mindspore", id="mindspore"),
        pytest.param("ms", "mindspore", id="ms"),
        pytest.param("MS", "mindspore", id="MS"),
        pytest.param("MindSpore", "mindspore", id="MindSpore"),
    ],
)
def test_framework_aliases(tmp_path, framework, expected):
    out = str(tmp_path / "out")
    assert TrainerMonitorV2({"framework": framework, "output_dir": out}).config.framework == expected
    assert TrainerMonitorV2({"output_dir": out}, fr=framework).config.framework == expected


@pytest.mark.parametrize(
    "config_fw, fr, expected",
    [
        pytest.param("mindspore", "pytorch", "pytorch", id="cfg-ms-fr-pytorch"),
        pytest.param("pytorch", "ms", "mindspore", id="cfg-pytorch-fr-ms"),
        pytest.param("MS", "pt", "pytorch", id="cfg-MS-fr-pt"),
        pytest.param("jax", "pt", "pytorch", id="cfg-invalid-fr-valid"),
        pytest.param(None, "MS", "mindspore", id="cfg-null-fr-MS"),
        pytest.param("torch", None, "pytorch", id="no-fr"),
    ],
)
def test_fr_wins_over_config(tmp_path, config_fw, fr, expected):
    cfg = {"output_dir": str(tmp_path / "out"), "framework": config_fw}
    assert TrainerMonitorV2(cfg, fr=fr).config.framework == expected


def test_null_values_mean_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = {
        "framework": None, "output_dir": None, "format": None, "async_write": None, "rank": None,
        "start_step": None, "stop_step": None, "step_interval": None, "step_count_per_record": None,
        "collect_times": None, "patch_optimizer_step": None,
        "monitors": {
            "module": {"enabled": None, "ops": None, "eps": None, "targets": None},
            "weight_grad": {"enabled": None, "ops": None, "eps": None, "monitor_mbs_grad": None,
                            "grad_acc_steps": None, "micro_batch_number": None},
            "optimizer": {"enabled": None, "mv_distribution": None},
            "param": {"enabled": None, "param_distribution": None},
            "cc": {"enabled": None, "cc_codeline": None, "cc_log_only": None, "cc_pre_hook": None,
                   "module_ranks": None, "cc_distribution": None},
        },
    }
    (tmp_path / "cfg.json").write_text(json.dumps(raw))
    cfg = TrainerMonitorV2(str(tmp_path / "cfg.json")).config
    default = TrainerMonitorV2({}).config
    assert cfg.framework == default.framework == "pytorch"
    assert cfg.output_dir == default.output_dir
    assert cfg.format == "csv"
    assert cfg.async_write is None
    assert cfg.ranks is None
    assert cfg.schedule == StepSchedule()
    assert cfg.patch_optimizer_step is None
    m = cfg.monitors
    assert m["module"].enabled is True
    for name in ("weight_grad", "optimizer", "param", "cc"):
        assert m[name].enabled is False, name
    for name in m:
        assert m[name].ops == ALL_OPS
        assert m[name].eps == pytest.approx(1e-8)
    assert tuple(m["module"].get("targets")) == ()
    assert m["weight_grad"].get("monitor_mbs_grad") is False
    assert m["weight_grad"].get("grad_acc_steps") is None
    assert m["weight_grad"].get("micro_batch_number") is None
    assert m["optimizer"].get("mv_distribution") is True
    assert m["param"].get("param_distribution") is True
    assert m["cc"].get("cc_log_only") is False
    assert m["cc"].get("cc_pre_hook") is False
    assert tuple(m["cc"].get("cc_codeline")) == ()
    assert tuple(m["cc"].get("module_ranks")) == ()


@pytest.mark.parametrize(
    "rank, expected",
    [
        pytest.param(0, (0,), id="int-0"),
        pytest.param(3, (3,), id="int-3"),
        pytest.param([1, 2], (1, 2), id="list"),
        pytest.param([0], (0,), id="list-one"),
        pytest.param([], None, id="empty-list-all"),
        pytest.param(None, None, id="null-all"),
    ],
)
def test_rank_forms(tmp_path, rank, expected):
    cfg = TrainerMonitorV2({"output_dir": str(tmp_path), "rank": rank}).config
    assert (tuple(cfg.ranks) if cfg.ranks is not None else None) == expected


def test_schedule_fields_read(tmp_path):
    cfg = TrainerMonitorV2({
        "output_dir": str(tmp_path), "start_step": 2, "stop_step": 40, "step_interval": 3,
        "step_count_per_record": 4, "collect_times": 5, "patch_optimizer_step": False, "async_write": True,
    }).config
    assert cfg.schedule == StepSchedule(start_step=2, stop_step=40, step_interval=3, step_count_per_record=4,
                                        collect_times=5)
    assert cfg.patch_optimizer_step is False
    assert cfg.async_write is True


@pytest.mark.parametrize(
    "entry, enabled",
    [
        pytest.param(("module", {}), True, id="module-absent-true"),
        pytest.param(("module", {"enabled": False}), False, id="module-false"),
        pytest.param(("weight_grad", {}), False, id="weight_grad-absent-false"),
        pytest.param(("weight_grad", {"enabled": True}), True, id="weight_grad-true"),
        pytest.param(("optimizer", {"ops": ["norm"]}), False, id="optimizer-absent-false"),
        pytest.param(("param", {}), False, id="param-absent-false"),
        pytest.param(("cc", {}), False, id="cc-absent-false"),
        pytest.param(("cc", {"enabled": True}), True, id="cc-true"),
    ],
)
def test_enabled_defaults(tmp_path, entry, enabled):
    name, fields = entry
    cfg = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {name: fields}}).config
    assert cfg.monitors[name].enabled is enabled
    assert [m.name for m in cfg.enabled_monitors] == ([name] if enabled else [])


def test_absent_monitor_is_not_enabled(tmp_path):
    cfg = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"param": {"enabled": True}}}).config
    assert [m.name for m in cfg.enabled_monitors] == ["param"]


def test_unknown_ops_dropped_with_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    cfg = TrainerMonitorV2({
        "output_dir": str(tmp_path),
        "monitors": {"param": {"enabled": True, "ops": ["norm", "std", "max", "median"]}},
    }).config
    assert cfg.monitors["param"].ops == ("max", "norm")
    warns = _warnings(caplog)
    assert len(warns) == 1
    msg = warns[0].getMessage()
    assert "std" in msg and "median" in msg
    assert "monitors.param.ops" in msg


def test_all_unknown_ops_means_all_five(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    cfg = TrainerMonitorV2({
        "output_dir": str(tmp_path), "monitors": {"weight_grad": {"enabled": True, "ops": ["std", "var"]}},
    }).config
    assert cfg.monitors["weight_grad"].ops == ALL_OPS
    msgs = " ".join(r.getMessage() for r in _warnings(caplog))
    assert "std" in msgs and "var" in msgs


def test_empty_ops_means_all_five(tmp_path):
    cfg = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"param": {"ops": []}}}).config
    assert cfg.monitors["param"].ops == ALL_OPS


def test_known_ops_give_no_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"param": {"enabled": True, "ops": ["nans", "min"]}}})
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    "ops, expected",
    [
        pytest.param(["nans", "norm", "mean", "max", "min"], ALL_OPS, id="reversed"),
        pytest.param(["norm", "min"], ("min", "norm"), id="norm-min"),
        pytest.param(["nans", "mean"], ("mean", "nans"), id="nans-mean"),
        pytest.param(["max", "max", "min"], ("min", "max"), id="duplicates"),
        pytest.param(["norm"], ("norm",), id="single"),
    ],
)
def test_ops_canonical_order(tmp_path, ops, expected):
    cfg = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"optimizer": {"ops": ops}}}).config
    assert cfg.monitors["optimizer"].ops == expected


def test_eps_is_read(tmp_path):
    cfg = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"param": {"eps": 1e-6}, "module": {}}}).config
    assert cfg.monitors["param"].eps == pytest.approx(1e-6)
    assert cfg.monitors["module"].eps == pytest.approx(1e-8)


def test_fields_starting_with_underscore_are_kept_and_ignored(tmp_path, caplog):
    """The documented way to keep a field this tool does not read (a comment, a setting
    of another tool) in a monitor entry: no error, no warning, nothing changed."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    cfg = TrainerMonitorV2({
        "output_dir": str(tmp_path),
        "monitors": {"weight_grad": {"enabled": True, "_comment": "local grads only", "_wg_distribution": True,
                                     "ops": ["norm"]},
                     "module": {"_targets": ["fc1"]}},
    }).config
    assert cfg.monitors["weight_grad"].enabled is True and cfg.monitors["weight_grad"].ops == ("norm",)
    assert "_comment" not in cfg.monitors["weight_grad"].options
    assert cfg.monitors["module"].get("targets") == ()  # "_targets" is not "targets"
    assert _warnings(caplog) == []


def test_cc_fields_nested_in_cc_distribution(tmp_path):
    cfg = TrainerMonitorV2({
        "output_dir": str(tmp_path),
        "monitors": {"cc": {"cc_distribution": {
            "enable": True, "cc_pre_hook": True, "cc_log_only": True,
            "cc_codeline": ["train.py[23]", "pkg/model.py[7]"], "module_ranks": [0, 2],
        }}},
    }).config
    cc = cfg.monitors["cc"]
    assert cc.enabled is True
    assert cc.get("cc_pre_hook") is True
    assert cc.get("cc_log_only") is True
    assert [tuple(c) for c in cc.get("cc_codeline")] == [("train.py", 23), ("pkg/model.py", 7)]
    assert tuple(cc.get("module_ranks")) == (0, 2)


def test_cc_distribution_enable_false(tmp_path):
    cfg = TrainerMonitorV2({
        "output_dir": str(tmp_path), "monitors": {"cc": {"cc_distribution": {"enable": False, "cc_pre_hook": True}}},
    }).config
    assert cfg.monitors["cc"].enabled is False
    assert cfg.monitors["cc"].get("cc_pre_hook") is True


def test_cc_direct_fields(tmp_path):
    cfg = TrainerMonitorV2({
        "output_dir": str(tmp_path),
        "monitors": {"cc": {"enabled": True, "cc_codeline": [" train.py[23] "], "module_ranks": 1}},
    }).config
    cc = cfg.monitors["cc"]
    assert [tuple(c) for c in cc.get("cc_codeline")] == [("train.py", 23)]
    assert tuple(cc.get("module_ranks")) == (1,)


def test_module_targets(tmp_path):
    cfg = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"module": {"targets": ["fc1", "act"]}}}).config
    assert tuple(cfg.monitors["module"].get("targets")) == ("fc1", "act")


# ------------------------------------------------------------ resolve_micro_batches
@pytest.mark.parametrize(
    "wg_fields, context, expected",
    [
        pytest.param({"micro_batch_number": 4, "grad_acc_steps": 2}, {"micro_batch_number": 8, "grad_acc_steps": 16},
                     4, id="config-mbn-wins-all"),
        pytest.param({"grad_acc_steps": 2}, {"micro_batch_number": 8, "grad_acc_steps": 16}, 2,
                     id="config-gas-beats-context"),
        pytest.param({"micro_batch_number": 3}, {"grad_acc_steps": 16}, 3, id="config-mbn-beats-context-gas"),
        pytest.param({}, {"micro_batch_number": 8, "grad_acc_steps": 16}, 8, id="context-mbn-beats-context-gas"),
        pytest.param({}, {"grad_acc_steps": 16}, 16, id="context-gas"),
        pytest.param({}, {"micro_batch_number": 5}, 5, id="context-mbn"),
        pytest.param({"grad_acc_steps": None}, {"grad_acc_steps": None, "micro_batch_number": None}, 1,
                     id="all-null-is-1"),
        pytest.param({}, {}, 1, id="nothing-is-1"),
        pytest.param({}, {"other_key": 7}, 1, id="unrelated-context-is-1"),
    ],
)
def test_resolve_micro_batches_precedence(tmp_path, wg_fields, context, expected):
    cfg = TrainerMonitorV2({
        "output_dir": str(tmp_path), "monitors": {"weight_grad": dict(enabled=True, **wg_fields)},
    }).config
    assert resolve_micro_batches(cfg.monitors["weight_grad"], context) == expected


@pytest.mark.parametrize(
    "key, value",
    [
        pytest.param("grad_acc_steps", "4", id="gas-string"),
        pytest.param("grad_acc_steps", 0, id="gas-zero"),
        pytest.param("grad_acc_steps", 2.0, id="gas-float"),
        pytest.param("micro_batch_number", True, id="mbn-bool"),
        pytest.param("micro_batch_number", -1, id="mbn-negative"),
    ],
)
def test_resolve_micro_batches_bad_context(tmp_path, key, value):
    cfg = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"weight_grad": {"enabled": True}}}).config
    with pytest.raises(ConfigError) as info:
        resolve_micro_batches(cfg.monitors["weight_grad"], {key: value})
    assert key in info.value.field
    assert key in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize(
    "key, value",
    [
        pytest.param("grad_acc_steps", "4", id="gas-string"),
        pytest.param("micro_batch_number", 0, id="mbn-zero"),
    ],
)
def test_start_with_bad_context_raises_and_leaves_model_clean(tmp_path, key, value):
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"weight_grad": {"enabled": True}}})
    with pytest.raises(ConfigError) as info:
        mon.start(model=model, optimizer=opt, **{key: value})
    assert key in info.value.field
    assert key in str(info.value) and repr(value) in str(info.value)
    # nothing installed is left behind
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)
        assert not p._backward_hooks
    mon.stop()


def test_config_micro_batch_number_beats_start_context(tmp_path):
    """micro_batch_number in the config beats grad_acc_steps passed to start(): micro_step = 2."""
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({
        "output_dir": str(tmp_path),
        "monitors": {"weight_grad": {"enabled": True, "micro_batch_number": 2}},
    })
    mon.start(model=model, optimizer=opt, grad_acc_steps=4)
    for x, y in make_batches(2):
        loss_fn(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    mon.stop()
    rows = [r for r in (tmp_path / "rank_0" / "weight_grad_step0-0.csv").read_text().splitlines()[1:]]
    assert rows
    assert {r.split(",")[4] for r in rows} == {"2"}
