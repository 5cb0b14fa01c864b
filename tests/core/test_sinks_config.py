"""The ``sinks`` config section: every bad entry is a ``ConfigError`` at construction naming
the field, the value and what is allowed; defaults as documented (docs/dashboards.md)."""

import logging

import pytest

from msprobe.core.monitor_v2.config import MAX_SINK_KEYS, load_config
from msprobe.core.monitor_v2.errors import ConfigError

from support.extras import needs

# the config refuses a sink whose library is missing (by design): a case that turns one on needs it
TB_WHY = "the config refuses a tensorboard sink where TensorBoard is missing, and this case turns one on"
needs_tensorboard = needs("tensorboard", TB_WHY)


def tb(*case):
    """A parametrized case that turns the tensorboard sink on."""
    return pytest.param(*case, marks=needs_tensorboard)


def cfg(tmp_path, sinks, **top):
    return dict({"output_dir": str(tmp_path), "monitors": {"weight_grad": {"enabled": True}}, "sinks": sinks}, **top)


@pytest.mark.parametrize("sinks, field, words", [
    ({"tensorbord": True}, "sinks.tensorbord", ["did you mean 'tensorboard'", "wandb", "mlflow", "swanlab"]),
    ([{"tensorboard": True}], "sinks", ["must be an object", "tensorboard, wandb, mlflow, swanlab"]),
    ({"wandb": 3}, "sinks.wandb", ["3 (int)", "true/false or an object", "project"]),
    ({"wandb": {"mode": "offlne"}}, "sinks.wandb.mode", ["'offlne'", "online, offline, disabled"]),
    ({"wandb": {"projct": "p"}}, "sinks.wandb.projct", ["did you mean 'project'"]),
    ({"swanlab": {"mode": "cloud"}}, "sinks.swanlab.mode", ["'cloud'", "online, local, offline, disabled"]),
    ({"mlflow": {"tracking_uri": ""}}, "sinks.mlflow.tracking_uri", ["non-empty string"]),
    ({"tensorboard": {"enabled": "yes"}}, "sinks.tensorboard.enabled", ["'yes'", "true or false"]),
    tb({"tensorboard": True, "max_keys": 0}, "sinks.max_keys", ["0 (int)", ">= 1"]),
    tb({"tensorboard": True, "max_keys": MAX_SINK_KEYS + 1}, "sinks.max_keys", [f"at most {MAX_SINK_KEYS}"]),
    tb({"tensorboard": True, "top_k": -1}, "sinks.top_k", [">= 0"]),
    tb({"tensorboard": True, "tensors": ["fc1(["]}, "sinks.tensors[0]", ["regular expression"]),
    tb({"tensorboard": True, "tensors": "fc1"}, "sinks.tensors", ["list of strings"]),
    tb({"tensorboard": True, "ranks": "some"}, "sinks.ranks", ["'some'", "\"all\""]),
    tb({"tensorboard": True, "ranks": []}, "sinks.ranks", ["at least one rank"]),
    tb({"tensorboard": True, "ranks": [-1]}, "sinks.ranks[0]", ["-1", ">= 0"]),
])
def test_bad_sinks_name_field_value_and_what_is_allowed(tmp_path, sinks, field, words):
    with pytest.raises(ConfigError) as err:
        load_config(cfg(tmp_path, sinks))
    assert err.value.field == field
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@needs_tensorboard
def test_defaults_and_switches(tmp_path):
    c = load_config(cfg(tmp_path, {"tensorboard": True, "wandb": {"enabled": False}, "mlflow": None}))
    s = c.sinks
    assert list(s.backends) == ["tensorboard"]
    assert s.backends["tensorboard"] == {"run_name": "rank_{rank}", "log_dir": None}
    assert (s.ranks, s.max_keys, s.top_k, s.tensors) == ((0,), 1000, 5, ())
    assert load_config(cfg(tmp_path, {"tensorboard": True, "ranks": "all"})).sinks.ranks is None
    assert load_config(cfg(tmp_path, {"tensorboard": True, "ranks": 3})).sinks.ranks == (3,)
    assert load_config({"output_dir": str(tmp_path)}).sinks is None


@needs_tensorboard
def test_no_sink_turned_on_and_ranks_that_never_send_are_said(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        assert load_config(cfg(tmp_path, {"tensorboard": False})).sinks is None
        load_config(cfg(tmp_path, {"tensorboard": True}, rank=[1, 2]))
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "turns on no sink" in text
    assert "names no rank that monitors" in text and "[0]" in text and "[1, 2]" in text


def test_a_missing_library_names_the_pip_command(tmp_path, monkeypatch):
    import sys

    for name in ("wandb", "mlflow", "tensorboard", "swanlab"):
        monkeypatch.setitem(sys.modules, name, None)  # import NAME -> ImportError, find_spec -> None
        with pytest.raises(ConfigError) as err:
            load_config(cfg(tmp_path, {name: True}))
        assert err.value.field == f"sinks.{name}" and f"pip install {name}" in str(err.value)


@needs_tensorboard
@needs("wandb", "the config refuses a wandb sink where W&B is missing, and this test turns one on")
def test_relative_sink_directories_are_resolved_at_construction(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = load_config(cfg(tmp_path, {"tensorboard": {"log_dir": "tb"}, "wandb": {"dir": "wb"}})).sinks
    assert s.backends["tensorboard"]["log_dir"] == str(tmp_path / "tb")
    assert s.backends["wandb"]["dir"] == str(tmp_path / "wb")
    with pytest.raises(ConfigError) as err:
        load_config(cfg(tmp_path, {"tensorboard": {"log_dir": "a\0b"}}))
    assert err.value.field == "sinks.tensorboard.log_dir" and "NUL" in str(err.value)
