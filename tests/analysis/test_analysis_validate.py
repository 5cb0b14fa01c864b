"""``msprobe-monitor validate CONFIG``: the library's validation (``load_config``) without
its side effects: OK and exit 0, or the ConfigError message and exit 2; ``output_dir`` is
checked (writable, or creatable) but never created."""

import json
import os
import sys
from pathlib import Path

import pytest

from msprobe.core.monitor_v2.config import load_config
from msprobe.core.monitor_v2.errors import ConfigError

from analysis_helpers import cli

README_CONFIG = {
    "framework": "pytorch", "output_dir": "./monitor_v2_out", "rank": [0], "start_step": 0, "step_interval": 1,
    "step_count_per_record": 1, "collect_times": 100, "format": "csv",
    "monitors": {"weight_grad": {"enabled": True, "ops": ["min", "max", "mean", "norm", "nans"], "eps": 1e-8,
                                 "monitor_mbs_grad": False}},
}


def write(tmp_path: Path, cfg, name="cfg.json") -> Path:
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return path


def test_good_config_is_ok_and_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, README_CONFIG)
    before = sorted(os.listdir(tmp_path))
    res = cli("validate", path)
    assert res.code == 0, res.err
    assert res.out.startswith(f"OK: {path}: monitors weight_grad; output_dir {tmp_path / 'monitor_v2_out'} "
                              "(will be created)")
    assert sorted(os.listdir(tmp_path)) == before  # output_dir not created
    data = cli("validate", path, "--json").json()
    assert data["ok"] and data["exit_code"] == 0 and data["details"]["monitors"] == ["weight_grad"]
    assert data["details"]["ranks"] == [0] and data["details"]["stop_step"] == 100
    # the training-side behaviour, on request
    assert cli("validate", path, "--create-output-dir").code == 0
    assert (tmp_path / "monitor_v2_out").is_dir()


def test_unknown_monitor_field_is_an_error_and_underscore_fields_are_kept(tmp_path):
    cfg = {"output_dir": str(tmp_path / "o"), "monitors": {"module": {"target": ["fc1"]}}}
    path = write(tmp_path, cfg)
    res = cli("validate", path)
    assert res.code == 2 and res.out == ""
    assert res.err.startswith(f"INVALID: {path}: monitor_v2 config: unknown field 'monitors.module.target'; "
                              "did you mean 'targets'?"), res.err
    assert cli("validate", path, "--json").json()["field"] == "monitors.module.target"
    cfg["monitors"]["module"] = {"targets": ["fc1"], "_target": "kept for another tool", "_comment": "x"}
    res = cli("validate", write(tmp_path, cfg))
    assert res.code == 0 and res.out.startswith("OK: ") and res.err == ""


BAD = {
    "unknown_field": ({"start_stpe": 1}, "start_stpe", "unknown field 'start_stpe'; did you mean 'start_step'?"),
    "string_for_int": ({"step_interval": "2"}, "step_interval", "field 'step_interval' = '2' (str): must be an integer >= 1"),
    "bool_for_int": ({"collect_times": True}, "collect_times", "must be an integer >= 1"),
    "stop_before_start": ({"start_step": 5, "stop_step": 5}, "stop_step", "must be greater than start_step (5)"),
    "unknown_monitor": ({"monitors": {"weight_grads": {}}}, "monitors.weight_grads", "did you mean 'weight_grad'?"),
    "bad_ops": ({"monitors": {"param": {"ops": "norm"}}}, "monitors.param.ops", "must be a list of strings"),
    "bad_format": ({"format": "json"}, "format", "only 'csv' is supported"),
    "bad_framework": ({"framework": "jax"}, "framework", "allowed:"),
    "negative_rank": ({"rank": [0, -1]}, "rank[1]", "must be an integer >= 0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_gives_the_library_message(tmp_path, case):
    cfg, field, fragment = BAD[case]
    path = write(tmp_path, dict(cfg, output_dir=str(tmp_path / "never")))
    res = cli("validate", path)
    assert res.code == 2 and res.out == ""
    assert fragment in res.err
    with pytest.raises(ConfigError) as exc:  # the very message of the library
        load_config(dict(cfg, output_dir=str(tmp_path / "lib")))
    assert res.err.strip() == f"INVALID: {path}: {exc.value}"  # the file, then the library's message
    data = cli("validate", path, "--json").json()
    assert data["ok"] is False and data["exit_code"] == 2 and data["field"] == field
    assert not (tmp_path / "never").exists()


def test_unreadable_or_invalid_json(tmp_path):
    res = cli("validate", tmp_path / "missing.json")
    assert res.code == 2 and "cannot read" in res.err and "missing.json" in res.err
    res = cli("validate", write(tmp_path, '{"step_interval": 2,\n "x": }'))
    assert res.code == 2 and "is not valid JSON" in res.err and "line 2" in res.err
    res = cli("validate", write(tmp_path, "[1, 2]"))
    assert res.code == 2 and "must hold a JSON object" in res.err


def test_output_dir_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    res = cli("validate", write(tmp_path, {"output_dir": str(blocker / "sub")}))
    assert res.code == 2
    assert "field 'output_dir'" in res.err and "must be a writable directory" in res.err
    assert "exists and is not a directory" in res.err
    res = cli("validate", write(tmp_path, {"output_dir": ""}))
    assert res.code == 2 and "must be a non-empty path string" in res.err
    res = cli("validate", write(tmp_path, {"output_dir": 3}), "--json")
    assert res.code == 2 and res.json()["field"] == "output_dir"
    # an existing directory is fine and reported as such
    res = cli("validate", write(tmp_path, {"output_dir": str(tmp_path)}))
    assert res.code == 0 and "(exists)" in res.out
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            res = cli("validate", write(tmp_path, {"output_dir": str(ro / "x")}))
            assert res.code == 2 and "not writable" in res.err
        finally:
            ro.chmod(0o700)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_validate_refuses_what_the_library_refuses(tmp_path):
    """One check for both: /proc/x passes every permission test (as root) yet cannot be
    created; validate says what the library says, and leaves nothing behind."""
    cfg = {"output_dir": "/proc/x", "monitors": {"param": {"enabled": True}}}
    with pytest.raises(ConfigError) as lib:
        load_config(cfg)
    path = write(tmp_path, cfg)
    res = cli("validate", path)
    assert res.code == 2 and res.err.strip() == f"INVALID: {path}: {lib.value}"
    assert "cannot be created" in res.err
    # a creatable path is created by the check and removed again, parents included
    deep = tmp_path / "new" / "deeper"
    res = cli("validate", write(tmp_path, {"output_dir": str(deep), "monitors": {"param": {"enabled": True}}}))
    assert res.code == 0 and "(will be created)" in res.out
    assert not (tmp_path / "new").exists()


def test_no_monitor_enabled_is_not_a_plain_ok(tmp_path):
    cfg = {"output_dir": str(tmp_path), "monitors": {"weight_grad": {"enabled": False}}}
    res = cli("validate", write(tmp_path, cfg))
    assert res.code == 0
    assert res.out.startswith("VALID BUT WRITES NOTHING (no monitor is enabled)")
    assert "no monitor is enabled" in res.err
    cfg["monitors"]["weight_grad"] = {"enable": True}  # a misspelt "enabled" is refused outright
    res = cli("validate", write(tmp_path, cfg))
    assert res.code == 2 and "did you mean 'enabled'?" in res.err
    cfg["monitors"]["weight_grad"] = {"enabled": True, "ops": ["norm", "nrm"]}  # an unknown op stays a warning
    res = cli("validate", write(tmp_path, cfg))
    assert res.code == 0 and res.out.startswith("OK with 1 warning(s) (above): ") and "'nrm'" in res.err


# ------------------------------------------------------------- issue 12: hostile input
@pytest.mark.parametrize("content, expect", [
    pytest.param('{"output_dir": "caf\xe9"}'.encode("latin-1"), "not UTF-8", id="latin-1"),
    pytest.param('{"output_dir": "x"}'.encode("utf-16"), "UTF-16", id="utf-16"),
    pytest.param(b'{"start_step": 1' + b"0" * 5000 + b"}", "thousands of digits", id="huge-integer"),
    pytest.param(b'{"monitors": ' + b"[" * 100000 + b"]" * 100000 + b"}", "too deeply", id="deep-nesting"),
    pytest.param(b'{"output_dir": "a\\u0000b"}', "NUL", id="nul-in-output-dir"),
])
def test_hostile_config_is_a_config_error(tmp_path, content, expect):
    path = tmp_path / "cfg.json"
    path.write_bytes(content)
    res = cli("validate", path)
    assert res.code == 2 and res.out == "", (res.code, res.out, res.err)
    assert expect in res.err and "internal error" not in res.err
    data = cli("validate", path, "--json").json()
    assert data["ok"] is False and data["exit_code"] == 2 and expect in data["error"]
