"""Config input that used to escape ``ConfigError`` (issue 12): files in other encodings,
huge integers, very deep nesting, a NUL in ``output_dir``, non-string keys, ``RANK=abc``;
and a property: any JSON-like config either constructs or raises ``ConfigError``, and
``validate`` agrees with the constructor."""

import json
import os
import sys

import pytest
import torch

from support.extras import require

require("hypothesis", "the hostile-config tests generate their configs with it")
from hypothesis import HealthCheck, event, given, settings, strategies as st  # noqa: E402

from msprobe.core.monitor_v2.analysis.validate import validate
from msprobe.core.monitor_v2.checks import MAX_INT
from msprobe.core.monitor_v2.config import load_config
from msprobe.core.monitor_v2.errors import ConfigError
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2


def _error(source):
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2(source)
    return info.value


# ------------------------------------------------------------------------ encodings
@pytest.mark.parametrize("encoding, named", [
    ("latin-1", "Latin-1"),
    ("utf-16", "UTF-16"),       # with a byte-order mark
    ("utf-16-le", "UTF-16"),    # without one
    ("utf-32", "UTF-32"),
])
def test_config_file_not_utf8(tmp_path, encoding, named):
    path = tmp_path / "cfg.json"
    path.write_bytes(json.dumps({"output_dir": str(tmp_path / "café")}, ensure_ascii=False).encode(encoding))
    msg = str(_error(str(path)))
    assert str(path) in msg and named in msg and "save it again as UTF-8" in msg
    res = validate(str(path))
    assert not res.ok and res.message == msg


def test_utf8_with_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"output_dir": str(tmp_path / "out")}).encode())
    assert TrainerMonitorV2(str(path)).config.output_dir == str(tmp_path / "out")


# ------------------------------------------------------------- sizes and nesting
def test_huge_integer_literal_in_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text('{"start_step": 1' + "0" * 5000 + "}")
    msg = str(_error(str(path)))
    assert "thousands of digits" in msg
    assert not validate(str(path)).ok


@pytest.mark.parametrize("value", [10**5000, -(10**400), MAX_INT + 1, 10**19],
                         ids=["5001-digits", "minus-401-digits", "int64-max-plus-1", "1e19"])
def test_huge_integer_values(tmp_path, value):
    err = _error({"output_dir": str(tmp_path), "start_step": value})
    assert err.field == "start_step" and "at most 9223372036854775807" in str(err)
    assert len(str(err)) < 300


def test_huge_integer_where_a_float_is_expected(tmp_path):
    err = _error({"output_dir": str(tmp_path), "monitors": {"weight_grad": {"eps": 10**400}}})
    assert err.field == "monitors.weight_grad.eps" and "finite number" in str(err)


def test_largest_integer_accepted(tmp_path):
    cfg = TrainerMonitorV2({"output_dir": str(tmp_path), "stop_step": MAX_INT}).config
    assert cfg.schedule.stop_step == MAX_INT


def test_deep_nesting_in_file(tmp_path):
    depth = sys.getrecursionlimit() * 2
    path = tmp_path / "cfg.json"
    path.write_text('{"monitors": ' + "[" * depth + "]" * depth + "}")
    assert "too deeply" in str(_error(str(path)))
    assert not validate(str(path)).ok


def test_deep_nesting_in_dict(tmp_path):
    deep = "x"
    for _ in range(sys.getrecursionlimit() * 2):
        deep = [deep]
    err = _error({"output_dir": str(tmp_path), "monitors": {"module": {"targets": deep}}})
    assert err.field == "monitors.module.targets[0]" and len(str(err)) < 300


# -------------------------------------------------------------------- output_dir
def test_nul_in_output_dir(tmp_path):
    err = _error({"output_dir": str(tmp_path / "a\0b")})
    assert err.field == "output_dir" and "NUL" in str(err)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"output_dir": "a\0b"}))
    res = validate(str(path))
    assert not res.ok and res.field == "output_dir" and "NUL" in res.message


def test_unencodable_output_dir(tmp_path):
    err = _error({"output_dir": str(tmp_path / "x\ud800")})
    assert err.field == "output_dir" and "surrogate" in str(err)


# ------------------------------------------------------------------------- keys
@pytest.mark.parametrize("cfg, field", [
    ({5: 1}, None),
    ({("a", "b"): 1}, None),
    ({"monitors": {0: {}}}, "monitors"),
    ({"monitors": {"module": {None: True}}}, "monitors.module"),
    ({"monitors": {"cc": {"cc_distribution": {1.5: True}}}}, "monitors.cc.cc_distribution"),
    ({"alert": {b"spike_factor": 3}}, "alert"),
])
def test_non_string_keys(tmp_path, cfg, field):
    cfg = dict(cfg)
    cfg.setdefault("output_dir", str(tmp_path))
    err = _error(cfg)
    assert err.field == field and "keys must be strings" in str(err)


# ------------------------------------------------------------------------- RANK
@pytest.mark.parametrize("value", ["abc", "-1", "1.0", "٣", "9" * 40])
def test_rank_variable_not_a_rank(tmp_path, monkeypatch, value):
    monkeypatch.setenv("RANK", value)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path)})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError) as info:
        mon.start(model=model)
    assert info.value.field == "RANK" and "RANK=" in str(info.value) and "integer >= 0" in str(info.value)
    assert not model._forward_hooks and not os.listdir(tmp_path)
    monkeypatch.setenv("RANK", " 3 ")  # the user fixes it: start() works on the same monitor
    mon.start(model=model)
    mon.stop()
    assert os.listdir(tmp_path) == ["rank_3"]


# --------------------------------------------------------------------- property
_KEYS = ("framework", "output_dir", "format", "async_write", "rank", "start_step", "stop_step",
         "step_interval", "step_count_per_record", "collect_times", "patch_optimizer_step", "monitors",
         "alert", "module", "weight_grad", "optimizer", "param", "cc", "enabled", "ops", "eps", "targets",
         "monitor_mbs_grad", "micro_batch_number", "grad_acc_steps", "mv_distribution", "param_distribution",
         "cc_codeline", "cc_log_only", "cc_pre_hook", "module_ranks", "cc_distribution", "enable", "nonfinite",
         "spike_factor", "spike_window", "spike_warmup")

_scalars = (st.none() | st.booleans()
            | st.integers(min_value=-3, max_value=12)
            | st.sampled_from([0, MAX_INT, MAX_INT + 1, -(2**70), 10**400])
            | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e-8, 0.5, 3.0, 11.0])
            | st.text(max_size=12)
            | st.sampled_from(["pt", "MindSpore", "csv", "min", "norm", "nans", "a.py[3]", "x\0y", "x\ud800",
                               "a" * 300]))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=8), inner, max_size=5),
                     max_leaves=25)
_MONITOR_FIELDS = ("enabled", "ops", "eps", "targets", "monitor_mbs_grad", "micro_batch_number", "grad_acc_steps",
                   "mv_distribution", "param_distribution", "cc_codeline", "cc_log_only", "cc_pre_hook",
                   "module_ranks", "cc_distribution")
_TOP = ("framework", "output_dir", "format", "async_write", "rank", "start_step", "stop_step", "step_interval",
        "step_count_per_record", "collect_times", "patch_optimizer_step", "alert")
# mostly well-formed shapes (known fields, plausible values) so that many examples construct,
# with anything JSON can hold mixed in at every level
_monitor_entry = st.fixed_dictionaries({}, optional={k: _json for k in _MONITOR_FIELDS}) | _json
_monitors = st.dictionaries(st.sampled_from(("module", "weight_grad", "optimizer", "param", "cc")) | st.text(max_size=6),
                            _monitor_entry, max_size=3) | _json
_configs = (st.fixed_dictionaries({}, optional={**{k: _json for k in _TOP}, "monitors": _monitors})
            | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=6), _json, max_size=6))
# dict configs may also hold keys no JSON file can
_dict_configs = st.dictionaries(st.sampled_from(_KEYS) | st.integers() | st.none(), _json, max_size=4) | _configs
def _inside(tmp_path, cfg):
    """Keep every output_dir the generator invents under ``tmp_path``."""
    cfg = dict(cfg)
    if isinstance(cfg.get("output_dir"), str):
        cfg["output_dir"] = f"{tmp_path}/{cfg['output_dir']}"
    return cfg


def _outcome(source):
    try:
        load_config(source, None)
    except ConfigError as exc:
        return False, str(exc)
    return True, ""


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=_configs)
def test_any_json_config_constructs_or_raises_config_error_and_validate_agrees(tmp_path, cfg):
    cfg = _inside(tmp_path, cfg)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    # validate first: it must not create output_dir (and then the constructor sees the same file system)
    res = validate(str(path))
    ok, message = _outcome(str(path))  # anything but ConfigError fails the test here
    event("constructs" if ok else "ConfigError")
    assert res.ok == ok, (res.message, message)
    if not ok:
        assert res.message == message


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=_dict_configs)
def test_any_dict_config_constructs_or_raises_config_error(tmp_path, cfg):
    _outcome(_inside(tmp_path, cfg))
