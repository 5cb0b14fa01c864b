"""Validation of the incident-mode fields: ``dynamic``, per-monitor ``steps`` and
``alert.on_anomaly`` (a ``ConfigError`` naming the field, the value and what is allowed)."""

import pytest

from msprobe.core.monitor_v2.config import load_config
from msprobe.core.monitor_v2.errors import ConfigError
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2


def cfg(tmp_path, **fields):
    return {"output_dir": str(tmp_path), "monitors": {"weight_grad": {"enabled": True}}, **fields}


@pytest.mark.parametrize("fields, field, words", [
    ({"dynamic": "yes"}, "dynamic", ["'yes'"]),
    ({"monitors": {"module": {"steps": 0}}}, "monitors.module.steps", ["0", ">= 1"]),
    ({"monitors": {"module": {"steps": 2.5}}}, "monitors.module.steps", ["2.5"]),
    ({"monitors": {"module": {"targets": "auto"}}}, "monitors.module.targets",
     ["auto", "alert.on_anomaly.monitors.module"]),
    ({"alert": {"on_anomaly": {"monitors": {"module": {}}}}}, "alert.on_anomaly.steps", ["required"]),
    ({"alert": {"on_anomaly": {"steps": 0, "monitors": {"module": {}}}}}, "alert.on_anomaly.steps", ["0"]),
    ({"alert": {"on_anomaly": {"steps": 5, "monitors": {}}}}, "alert.on_anomaly.monitors", ["at least one"]),
    ({"alert": {"on_anomaly": {"steps": 5, "monitors": {"modul": {}}}}}, "alert.on_anomaly.monitors.modul",
     ["did you mean 'module'"]),
    ({"alert": {"on_anomaly": {"steps": 5, "monitor": {}}}}, "alert.on_anomaly.monitor", ["did you mean 'monitors'"]),
    ({"alert": {"on_anomaly": {"steps": 5, "monitors": {"weight_grad": {"targets": "auto"}}}}},
     "alert.on_anomaly.monitors.weight_grad.targets", ["unknown field"]),
    ({"alert": {"on_anomaly": 3}}, "alert.on_anomaly", ["must be an object"]),
])
def test_bad_incident_fields(tmp_path, fields, field, words):
    with pytest.raises(ConfigError) as info:
        load_config(cfg(tmp_path, **fields))
    assert info.value.field == field
    for w in words:
        assert w in str(info.value)


def test_good_incident_fields(tmp_path):
    c = load_config(cfg(tmp_path, dynamic=True, monitors={"module": {"steps": 20, "targets": ["blocks.3"]}},
                        alert={"on_anomaly": {"steps": 7, "monitors": {"module": {"targets": "auto"},
                                                                       "weight_grad": {"enabled": True}}}}))
    assert c.dynamic and c.monitors["module"].steps == 20
    on = c.alert.on_anomaly
    assert on.steps == 7 and on.auto_targets and on.monitors["module"].get("targets") == ()
    assert not load_config(cfg(tmp_path)).dynamic


def test_dynamic_needs_a_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2(cfg(tmp_path, dynamic=True))
    assert info.value.field == "dynamic" and "path" in str(info.value)
