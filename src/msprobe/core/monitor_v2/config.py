"""Loading and validating ``monitor_v2_config.json``.

Everything is checked here, at construction of ``TrainerMonitorV2``: a bad config never
reaches the training loop. Errors are ``ConfigError`` naming the field (dotted path),
the value and what is allowed. An unknown top-level field, monitor name or field inside
a monitor is an error with the closest known name; inside a monitor, a field whose name
starts with ``_`` is ignored (the way to keep comments or other tools' settings).

A JSON ``null`` is read as "use the default" for every optional field.

A config file is read as the CSV readers read theirs (``read_config_bytes``), and a file
that is not a config is never quoted: its errors name the path and the reason only (the
line and column of a JSON error, the offset of a byte that is not UTF-8); a JSON object
none of whose top-level fields is a config field or resembles one is refused without
naming them. A config's own mistakes (a misspelt field, a bad value) are named.
"""

import codecs
import difflib
import importlib.util
import json
import logging
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from . import rows
from .cc_base import CONFIG_FIELDS as CC_FIELDS
from .checks import (Checker, Fields, at_least, check_bool, check_int, check_keys, check_positive_number,
                     check_rank_list, check_str_list, describe, fail)
from .errors import ConfigError, UnsafePathError
from .monitor import DEFAULT_EPS, MODULE_CONFIG_FIELDS, WEIGHT_GRAD_CONFIG_FIELDS, MonitorSettings
from .optimizer import CONFIG_FIELDS as OPTIMIZER_FIELDS
from .param import CONFIG_FIELDS as PARAM_FIELDS
from .safe_fs import dir_mode, file_mode, make_dirs, missing_dirs, private_dir_problem, read_regular_file
from .schedule import StepSchedule

logger = logging.getLogger("msprobe.monitor_v2")

FRAMEWORK_ALIASES: Dict[str, str] = {
    "pytorch": "pytorch",
    "pt": "pytorch",
    "torch": "pytorch",
    "mindspore": "mindspore",
    "ms": "mindspore",
}
# A config is a few hundred bytes; anything above this is not one (and a device such as
# /dev/zero, refused before, would otherwise fill the memory).
MAX_CONFIG_BYTES = 1 << 20


def normalize_framework(value: Any, path: str = "framework") -> str:
    if not isinstance(value, str) or value.strip().lower() not in FRAMEWORK_ALIASES:
        raise fail(path, value, "allowed: " + ", ".join(sorted(FRAMEWORK_ALIASES)))
    return FRAMEWORK_ALIASES[value.strip().lower()]


def _unknown_field(path: str, name: str, known, kind: str = "field") -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "."
    return f"monitor_v2 config: unknown {kind} '{path}'{hint} Known {kind}s: {', '.join(known)}"


def _unknown_monitor_field(path: str, key: str, known: Tuple[str, ...]) -> ConfigError:
    """A field a known monitor does not have: an error, not a warning, because a misspelt
    field silently changes what is recorded ("target" records every module, "enable"
    leaves the monitor off). A name starting with '_' is the documented way to keep a
    field this tool does not read (a comment, another tool's setting)."""
    close = difflib.get_close_matches(key.lower(), list(known), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "."
    return ConfigError(
        f"monitor_v2 config: unknown field '{path}.{key}'{hint} Known fields: {', '.join(known)} "
        "(a field whose name starts with '_' is ignored: the way to keep a comment or another tool's setting)",
        field=f"{path}.{key}")


# ----------------------------------------------------------------- per-monitor fields
# Each monitor declares its own fields beside its code: name -> (checker, default).
MONITOR_FIELDS: Dict[str, Fields] = {
    rows.MODULE: MODULE_CONFIG_FIELDS,
    rows.WEIGHT_GRAD: WEIGHT_GRAD_CONFIG_FIELDS,
    rows.OPTIMIZER: OPTIMIZER_FIELDS,
    rows.PARAM: PARAM_FIELDS,
    rows.CC: CC_FIELDS,
    rows.MOE: {},  # filled below, beside its checkers (_check_patterns is defined further down)
}
_COMMON_FIELDS = ("enabled", "ops", "eps")
# listed after each monitor's own fields (messages name the long-standing ones first)
_LATE_COMMON_FIELDS = ("steps",)


@dataclass(frozen=True)
class AlertSettings:
    """``alert``: log anomalies the step they are written (see ``alert.py``)."""

    nonfinite: bool = True
    spike_factor: Optional[float] = 10.0  # None: no spike alerts
    spike_window: int = 20
    spike_warmup: int = 10
    # A norm at or below this is never a spike: a tensor that converged to 0 and then reads
    # 1e-8 is rounding noise, not "inf x the median".
    spike_floor: float = 1e-6
    # Incident evidence (evidence.py): the byte budget of the pre-update dump (None: no
    # dump), and whether a non-finite gradient stops the job before the update.
    dump_max_bytes: Optional[int] = None
    stop_on_nonfinite: bool = False
    on_anomaly: Optional["OnAnomaly"] = None  # None: an anomaly turns nothing on

    @property
    def checks_gradients(self) -> bool:
        """Whether the optimizer pre-step hook checks the gradients (one host sync a step)."""
        return self.dump_max_bytes is not None or self.stop_on_nonfinite


DEFAULT_DUMP_BYTES = 256 << 20
_ALERT_FIELDS = ("enabled", "nonfinite", "spike_factor", "spike_window", "spike_warmup", "spike_floor",
                 "dump", "stop_on_nonfinite", "on_anomaly")


@dataclass(frozen=True)
class OnAnomaly:
    """``alert.on_anomaly``: monitors turned on for ``steps`` steps after the first anomaly
    (see ``dynamic.py``). ``auto_targets``: ``module`` narrowed to the offending tensor's
    module subtree (``"targets": "auto"``)."""

    steps: int
    monitors: Mapping[str, MonitorSettings]
    auto_targets: bool = False


_ON_ANOMALY_FIELDS = ("steps", "monitors")


def _parse_on_anomaly(raw: Any) -> Optional[OnAnomaly]:
    path = "alert.on_anomaly"
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise fail(path, raw, "must be an object such as {\"steps\": 20, \"monitors\": "
                              "{\"module\": {\"targets\": \"auto\"}}}")
    check_keys(path, raw)
    for key in raw:
        if key not in _ON_ANOMALY_FIELDS:
            raise ConfigError(_unknown_field(f"{path}.{key}", key, _ON_ANOMALY_FIELDS), field=f"{path}.{key}")
    if raw.get("steps") is None:
        raise fail(f"{path}.steps", None, "is required: how many steps the monitors stay on (an integer >= 1)")
    steps = check_int(f"{path}.steps", raw["steps"], 1)
    monitors, auto = _parse_monitors(raw.get("monitors"), f"{path}.monitors", allow_auto=True)
    if not any(m.enabled for m in monitors.values()):
        raise fail(f"{path}.monitors", raw.get("monitors"),
                   "must turn on at least one monitor, e.g. {\"module\": {\"targets\": \"auto\"}}")
    return OnAnomaly(steps=steps, monitors=monitors, auto_targets=auto)


# ------------------------------------------------------------------------- sinks
# Live dashboards (see sinks.py). Each entry: the module imported, the pip package, and
# the sink's own fields (checker, default); the fields every sink has come first.
def _check_str(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise fail(path, value, "must be a non-empty string")
    return value


def _check_dir(path: str, value: Any) -> str:
    # resolved here, as output_dir is: a relative directory means the one of the constructor's cwd
    problem = output_dir_text_problem(value)
    if problem is not None:
        raise fail(path, value, problem)
    return os.path.abspath(value)


def _check_choice(*allowed: str) -> Checker:
    def check(path: str, value: Any) -> str:
        if not isinstance(value, str) or value not in allowed:
            raise fail(path, value, "allowed: " + ", ".join(allowed))
        return value
    return check


_SINK_COMMON: Fields = {
    "enabled": (check_bool, True),
    "run_name": (_check_str, "rank_{rank}"),
}
SINK_BACKENDS: Dict[str, Tuple[str, str, Fields]] = {
    "tensorboard": ("tensorboard", "tensorboard", {"log_dir": (_check_dir, None)}),
    "wandb": ("wandb", "wandb", {
        "project": (_check_str, "msprobe-monitor"),
        "entity": (_check_str, None),
        "group": (_check_str, None),
        "mode": (_check_choice("online", "offline", "disabled"), None),
        "dir": (_check_dir, None),
    }),
    "mlflow": ("mlflow", "mlflow", {
        "tracking_uri": (_check_str, None),
        "experiment": (_check_str, "msprobe-monitor"),
    }),
    "swanlab": ("swanlab", "swanlab", {
        "project": (_check_str, "msprobe-monitor"),
        "workspace": (_check_str, None),
        "mode": (_check_choice("online", "local", "offline", "disabled"), None),
        "log_dir": (_check_dir, None),
    }),
}
_SINK_FIELDS = ("ranks", "max_keys", "top_k", "tensors")
MAX_SINK_KEYS = 10000


@dataclass(frozen=True)
class SinksSettings:
    """``sinks``: what goes to the live dashboards at each written step (``sinks.py``)."""

    backends: Mapping[str, Mapping[str, Any]]  # sink name -> its validated fields
    ranks: Optional[Tuple[int, ...]] = (0,)  # None: every monitored rank
    max_keys: int = 1000
    top_k: int = 5
    tensors: Tuple[str, ...] = ()  # regular expressions (re.search) over tensor names


def _check_patterns(path: str, value: Any) -> Tuple[str, ...]:
    patterns = check_str_list(path, value)
    for i, pattern in enumerate(patterns):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise fail(f"{path}[{i}]", pattern, f"must be a regular expression ({exc})") from None
    return patterns


# ----------------------------------------------------------------------------- moe
# ``routers``: regular expressions (re.search) on module names: the modules whose calls are
# a router's (they win over the transformers declaration and the name rule); ``top_k``: the
# experts a token goes to where a router's output does not say it (a Linear gate that
# returns only logits); ``score``: the score function where the router does not say it.
MOE_SCORES = ("softmax", "sigmoid")
MONITOR_FIELDS[rows.MOE].update({
    "routers": (_check_patterns, ()),
    "per_expert": (check_bool, False),
    "eval_routing": (check_bool, False),
    "top_k": (at_least(1), None),
    "score": (_check_choice(*MOE_SCORES), None),
})


def _parse_sink(name: str, raw: Any) -> Optional[Dict[str, Any]]:
    path = f"sinks.{name}"
    module, package, own = SINK_BACKENDS[name]
    if raw is None or raw is False:
        return None
    if raw is True:
        raw = {}
    if not isinstance(raw, Mapping):
        raise fail(path, raw, "must be true/false or an object of the sink's fields "
                               f"({', '.join(list(_SINK_COMMON) + list(own))})")
    check_keys(path, raw)
    fields = {**_SINK_COMMON, **own}
    for key in raw:
        if key not in fields:
            raise ConfigError(_unknown_field(f"{path}.{key}", key, tuple(fields)), field=f"{path}.{key}")
    parsed = {key: default if raw.get(key) is None else checker(f"{path}.{key}", raw[key])
              for key, (checker, default) in fields.items()}
    if not parsed.pop("enabled"):
        return None
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"monitor_v2 config: field '{path}' turns on the {name} sink, but the library '{module}' is not "
            f"installed in this Python ({sys.executable}): pip install {package}  (or remove '{path}')",
            field=path)
    return parsed


def _parse_sinks(raw: Any) -> Optional[SinksSettings]:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise fail("sinks", raw, "must be an object such as {\"tensorboard\": true} (sinks: "
                                  + ", ".join(SINK_BACKENDS) + ")")
    check_keys("sinks", raw)
    known = tuple(SINK_BACKENDS) + _SINK_FIELDS
    for key in raw:
        if key not in known:
            raise ConfigError(_unknown_field(f"sinks.{key}", key, known), field=f"sinks.{key}")
    backends = {}
    for name in SINK_BACKENDS:
        parsed = _parse_sink(name, raw.get(name))
        if parsed is not None:
            backends[name] = parsed
    ranks_raw = raw.get("ranks")
    if ranks_raw is None:
        ranks: Optional[Tuple[int, ...]] = (0,)
    elif ranks_raw == "all":
        ranks = None
    elif isinstance(ranks_raw, str):
        raise fail("sinks.ranks", ranks_raw, "must be \"all\", a rank (integer >= 0) or a list of ranks")
    else:
        ranks = check_rank_list("sinks.ranks", ranks_raw)
        if not ranks:
            raise fail("sinks.ranks", ranks_raw, "must name at least one rank, or be \"all\"")
    max_keys = 1000 if raw.get("max_keys") is None else check_int("sinks.max_keys", raw["max_keys"], 1)
    if max_keys > MAX_SINK_KEYS:
        raise fail("sinks.max_keys", max_keys, f"must be at most {MAX_SINK_KEYS} (dashboards slow down or refuse "
                                                f"steps with more keys)")
    if not backends:
        logger.warning("monitor_v2 config: 'sinks' turns on no sink (sinks: %s), so nothing is sent to a dashboard",
                       ", ".join(SINK_BACKENDS))
        return None
    return SinksSettings(
        backends=backends,
        ranks=ranks,
        max_keys=max_keys,
        top_k=5 if raw.get("top_k") is None else check_int("sinks.top_k", raw["top_k"], 0),
        tensors=() if raw.get("tensors") is None else _check_patterns("sinks.tensors", raw["tensors"]),
    )


def _parse_alert(raw: Any) -> Optional[AlertSettings]:
    if raw is None or raw is False:
        return None
    if raw is True:
        return AlertSettings()
    if not isinstance(raw, Mapping):
        raise fail("alert", raw, "must be true/false or an object such as {\"spike_factor\": 10}")
    check_keys("alert", raw)
    for key in raw:
        if key not in _ALERT_FIELDS:
            raise ConfigError(_unknown_field(f"alert.{key}", key, _ALERT_FIELDS), field=f"alert.{key}")
    if raw.get("enabled") is not None and not check_bool("alert.enabled", raw["enabled"]):
        return None
    factor = raw.get("spike_factor", 10.0)
    if factor is not None:
        factor = check_positive_number("alert.spike_factor", factor)
        if factor <= 1:
            raise fail("alert.spike_factor", raw["spike_factor"], "must be a number > 1, or null for no spike alerts")
    return AlertSettings(
        nonfinite=True if raw.get("nonfinite") is None else check_bool("alert.nonfinite", raw["nonfinite"]),
        spike_factor=factor,
        spike_window=20 if raw.get("spike_window") is None else check_int("alert.spike_window", raw["spike_window"], 3),
        spike_warmup=10 if raw.get("spike_warmup") is None else check_int("alert.spike_warmup", raw["spike_warmup"], 1),
        spike_floor=1e-6 if raw.get("spike_floor") is None else _nonneg_floor(raw["spike_floor"]),
        dump_max_bytes=_parse_dump(raw.get("dump")),
        stop_on_nonfinite=(False if raw.get("stop_on_nonfinite") is None
                           else check_bool("alert.stop_on_nonfinite", raw["stop_on_nonfinite"])),
        on_anomaly=_parse_on_anomaly(raw.get("on_anomaly")),
    )


def _parse_dump(raw: Any) -> Optional[int]:
    """``alert.dump``: true (the default budget), false/absent, or {"max_bytes": N}."""
    if raw is None or raw is False:
        return None
    if raw is True:
        return DEFAULT_DUMP_BYTES
    if not isinstance(raw, Mapping):
        raise fail("alert.dump", raw, 'must be true/false or an object such as {"max_bytes": 268435456}')
    check_keys("alert.dump", raw)
    for key in raw:
        if key != "max_bytes":
            raise ConfigError(_unknown_field(f"alert.dump.{key}", key, ("max_bytes",)), field=f"alert.dump.{key}")
    if raw.get("max_bytes") is None:
        return DEFAULT_DUMP_BYTES
    return check_int("alert.dump.max_bytes", raw["max_bytes"], 1)


def _nonneg_floor(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise fail("alert.spike_floor", value, "must be a finite number >= 0 (0: no floor)")
    return float(value)


@dataclass(frozen=True)
class MonitorConfig:
    """The whole validated configuration."""

    framework: str = "pytorch"
    output_dir: str = "./"
    format: str = "csv"
    async_write: Optional[bool] = None  # None: the writer thread, waited for up to 1 s a step (writer.py)
    ranks: Optional[Tuple[int, ...]] = None  # None: every rank monitors
    schedule: StepSchedule = StepSchedule()
    patch_optimizer_step: Optional[bool] = None  # None: patch iff an optimizer is given
    monitors: Mapping[str, MonitorSettings] = field(default_factory=dict)
    alert: Optional["AlertSettings"] = None  # None: no online alerts
    structure: bool = False  # start() writes rank_<r>/structure.txt (module and parameter names)
    sinks: Optional["SinksSettings"] = None  # None: no live dashboard
    dynamic: bool = False  # edits of the config file apply while training (dynamic.py)

    @property
    def enabled_monitors(self) -> List[MonitorSettings]:
        """Enabled monitors in the canonical order of the spec."""
        return [self.monitors[n] for n in rows.MONITORS if n in self.monitors and self.monitors[n].enabled]


def _parse_ops(path: str, value: Any) -> Tuple[str, ...]:
    if value is None:
        return rows.DEFAULT_OPS
    names = check_str_list(path, value)
    unknown = [n for n in names if n not in rows.ALL_OPS]
    if unknown:
        logger.warning(
            "monitor_v2 config: '%s' has unknown ops %s, dropped (allowed: %s)",
            path, unknown, ", ".join(rows.ALL_OPS),
        )
    # Columns always come in the order of ALL_OPS, whatever the order of the list.
    chosen = tuple(op for op in rows.ALL_OPS if op in names)
    return chosen or rows.DEFAULT_OPS


def _parse_monitor(name: str, raw: Any, base: str = "monitors") -> MonitorSettings:
    path = f"{base}.{name}"
    if not isinstance(raw, Mapping):
        raise fail(path, raw, "must be an object such as {\"enabled\": true}")
    check_keys(path, raw)
    raw = dict(raw)
    if name == rows.CC and "cc_distribution" in raw:
        # Older configs nest the cc fields in cc_distribution (with "enable"); direct
        # fields win over nested ones.
        nested = raw.pop("cc_distribution")
        if nested is not None:
            if not isinstance(nested, Mapping):
                raise fail(f"{path}.cc_distribution", nested, "must be an object")
            check_keys(f"{path}.cc_distribution", nested)
            nested = dict(nested)
            enable = nested.pop("enable", None)
            if enable is not None and "enabled" not in raw:
                raw["enabled"] = enable
            raw = {**nested, **raw}

    specific = MONITOR_FIELDS[name]
    known = _COMMON_FIELDS + tuple(specific) + _LATE_COMMON_FIELDS
    for key in raw:
        if key not in known and not key.startswith("_"):
            raise _unknown_monitor_field(path, key, known)

    enabled_raw = raw.get("enabled")
    enabled = (name == rows.MODULE) if enabled_raw is None else check_bool(f"{path}.enabled", enabled_raw)
    ops = _parse_ops(f"{path}.ops", raw.get("ops"))
    if name in rows.ZEROS_MONITORS and "zeros" not in ops:  # a dead expert is a count of zero
        ops = tuple(op for op in rows.ALL_OPS if op in ops or op == "zeros")
    eps_raw = raw.get("eps")
    eps = DEFAULT_EPS if eps_raw is None else check_positive_number(f"{path}.eps", eps_raw)
    steps = None if raw.get("steps") is None else check_int(f"{path}.steps", raw["steps"], 1)
    if name == rows.MODULE and raw.get("targets") == AUTO_TARGETS:
        raise fail(f"{path}.targets", AUTO_TARGETS, "\"auto\" is allowed only in alert.on_anomaly.monitors.module; "
                                                    "here: a list of module-name substrings ([] = every module)")
    options = {}
    for key, (checker, default) in specific.items():
        value = raw.get(key)
        options[key] = default if value is None else checker(f"{path}.{key}", value)
    return MonitorSettings(name=name, enabled=enabled, ops=ops, eps=eps, options=options, steps=steps)


AUTO_TARGETS = "auto"


def _parse_monitors(raw_monitors: Any, path: str = "monitors",
                    allow_auto: bool = False) -> Tuple[Dict[str, MonitorSettings], bool]:
    """The ``monitors`` object (top level, or ``alert.on_anomaly.monitors``), and whether
    its ``module`` entry asks for ``"targets": "auto"`` (allowed only there)."""
    raw_monitors = {} if raw_monitors is None else raw_monitors
    if not isinstance(raw_monitors, Mapping):
        raise fail(path, raw_monitors, "must be an object {name: {...}} with names " + ", ".join(rows.MONITORS))
    check_keys(path, raw_monitors)
    monitors = {}
    auto = False
    for name, entry in raw_monitors.items():
        if name not in rows.MONITORS:
            raise ConfigError(
                _unknown_field(f"{path}.{name}", str(name), rows.MONITORS, kind="monitor"),
                field=f"{path}.{name}",
            )
        if allow_auto and name == rows.MODULE and isinstance(entry, Mapping) and entry.get("targets") == AUTO_TARGETS:
            entry = {k: v for k, v in entry.items() if k != "targets"}
            auto = True
        monitors[name] = _parse_monitor(name, entry, path)
    return monitors, auto


_TOP_LEVEL = (
    "framework", "output_dir", "format", "async_write", "rank", "start_step", "stop_step",
    "step_interval", "step_count_per_record", "collect_times", "patch_optimizer_step", "monitors", "alert",
    "structure",
    "sinks",
    "dynamic",
)


_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
         (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def _decode(path: str, data: bytes) -> str:
    """The text of a config file, which must be UTF-8 (a UTF-8 byte-order mark is allowed)."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise ConfigError(
                f"monitor_v2 config: '{path}' is encoded as {name} (it starts with a {name} byte-order mark); "
                f"config files must be UTF-8: save it again as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        guess = "UTF-16 without a byte-order mark" if b"\0" in data[:64] else "Latin-1 or another 8-bit encoding"
        # the offset, never the byte: nothing of a file that is not a config is quoted
        raise ConfigError(
            f"monitor_v2 config: '{path}' is not UTF-8 (the byte at offset {exc.start} is not valid UTF-8; "
            f"the file looks like {guess}); config files must be UTF-8: save it again as UTF-8") from None


# What the JSON parser says is wrong, without the text it read: the C parser's messages
# quote nothing, the pure-Python one's quote the offending character ("Invalid \escape:
# 'q'"); only the leading words of a known message are kept.
_JSON_REASONS = ("Expecting value", "Expecting ',' delimiter", "Expecting ':' delimiter",
                 "Expecting property name enclosed in double quotes", "Unterminated string starting at",
                 "Invalid control character", "Invalid \\uXXXX escape", "Invalid \\escape", "Extra data",
                 "Illegal trailing comma before end of object", "Illegal trailing comma before end of array")


def _json_reason(msg: str) -> str:
    for reason in _JSON_REASONS:
        if msg.startswith(reason):
            return reason
    return "syntax error"


def _looks_like_a_config(parsed: Mapping[str, Any]) -> bool:
    """Whether a JSON object read from a file is meant as a config: empty, or one of its
    top-level fields is a config field or close to one (a misspelt field is named in the
    error that follows). A file none of whose fields is (a credentials file, another
    tool's settings) is not quoted: its field names may be its secrets."""
    if not parsed:
        return True
    for key in parsed:
        if key in _TOP_LEVEL or difflib.get_close_matches(str(key), _TOP_LEVEL, n=1, cutoff=0.6):
            return True
    return False


def read_config_file(path: str) -> Dict[str, Any]:
    """The JSON object in the file ``path``; every way it can be unreadable is a ``ConfigError``."""
    return parse_config_bytes(path, read_config_bytes(path))


def read_config_bytes(path: str) -> bytes:
    """The bytes of the config file ``path``; every way it can be unreadable is a ``ConfigError``.

    Read by the rules of the CSV readers (``safe_fs.read_regular_file``): no symbolic link
    of another user on the way (as root, a link planted in a shared directory would put a
    file of root's in the log), a regular file only (a FIFO never blocks), 1 MiB at most.
    Every message names the path and the reason, never the file's content."""
    try:
        return read_regular_file(path, MAX_CONFIG_BYTES, "config")
    except UnsafePathError as exc:  # a FIFO, a device, a directory, or too large: never read
        raise ConfigError(f"monitor_v2 config: cannot read '{path}': {exc.why}") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"monitor_v2 config: cannot read '{path}': {reason}") from None


def parse_config_bytes(path: str, data: bytes) -> Dict[str, Any]:
    """The JSON object in ``data``, read from ``path`` (named in the errors)."""
    text = _decode(path, data)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"monitor_v2 config: '{path}' is not valid JSON: {_json_reason(exc.msg)} at line {exc.lineno}, "
            f"column {exc.colno}"
        ) from None
    except RecursionError:
        raise ConfigError(f"monitor_v2 config: '{path}' nests arrays or objects too deeply to be a config") from None
    except ValueError:  # an integer literal with more digits than Python converts (4300)
        raise ConfigError(f"monitor_v2 config: '{path}' holds an integer literal with thousands of digits; "
                          f"no config value is that large") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"monitor_v2 config: '{path}' must hold a JSON object, got {type(parsed).__name__}")
    if not _looks_like_a_config(parsed):
        raise ConfigError(
            f"monitor_v2 config: '{path}' is not a monitor_v2 config: none of its {len(parsed)} top-level "
            f"field(s) is a config field or resembles one (known: {', '.join(_TOP_LEVEL)}); they are not "
            f"named here, since a file that is not a config is never quoted")
    return parsed


def _read_source(source: Union[str, os.PathLike, Mapping]) -> Dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            f"monitor_v2 config: expected a path to a JSON file or a dict, got {describe(source)}"
        )
    return read_config_file(os.fspath(source))


def output_dir_text_problem(path: Any) -> Optional[str]:
    """Why ``path`` cannot name a directory at all (None if it can): the text checks of
    ``check_output_dir``, before it touches the file system."""
    if not isinstance(path, str) or not path.strip():
        return "must be a non-empty path string"
    if "\0" in path:
        return "must not contain a NUL character (\\0)"
    try:
        os.fsencode(path)
    except UnicodeError:
        return "holds characters that the file system encoding cannot represent (a lone surrogate?)"
    return None


def check_output_dir(path: Any, keep: bool = True) -> str:
    """Create ``path`` (with parents, mode 0750 whatever the umask), check that it is safe
    to write into, prove that a file can be written in it, and return it as an absolute
    path: the one check of ``output_dir``, shared by the library and ``msprobe-monitor
    validate``. A relative ``output_dir`` is resolved once, here, against the working
    directory of the constructor, whatever the working directory at ``start()``.

    Safe means: no component is a symbolic link another user owns, and the directory
    itself is owned by this user and writable by nobody else (see ``safe_fs``).

    ``keep=False`` (validate) removes the directories this check created, so the file
    system is left as it was; the probe file is always removed."""
    problem = output_dir_text_problem(path)
    if problem is not None:
        raise fail("output_dir", path, problem)
    dir_mode()  # a bad MSPROBE_MONITOR_*_MODE fails here, before training
    file_mode()
    path = os.path.abspath(path)
    created, probe = missing_dirs(path)  # directories that did not exist, deepest first
    if os.path.exists(probe) and not os.path.isdir(probe):
        raise fail("output_dir", path, f"must be a writable directory ({probe!r} exists and is not a directory)")
    try:
        make_dirs(path)
        unsafe = private_dir_problem(path)
        if unsafe is not None:
            raise fail("output_dir", path, f"must be a directory that only you can write ({path!r}: {unsafe})")
        fd, probe_file = tempfile.mkstemp(prefix=".msprobe_write_check_", dir=path)
        os.close(fd)
        os.remove(probe_file)
    except ConfigError:
        raise
    except UnsafePathError as exc:
        raise fail("output_dir", path, f"must not lead through a link another user controls ({exc.why})") from None
    except (OSError, ValueError) as exc:
        what = "cannot be created: " if created else ""
        if isinstance(exc, PermissionError):
            why = f"{probe!r} is not writable"
        else:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise fail("output_dir", path, f"must be a writable directory ({what}{why})") from None
    finally:
        if not keep:
            for directory in created:
                try:
                    os.rmdir(directory)
                except OSError:
                    pass  # not created after all (the error above), or no longer empty
    return path


def load_config(source: Union[str, os.PathLike, Mapping], fr: Optional[str] = None) -> MonitorConfig:
    """Read and validate a config (path or parsed dict); ``fr`` overrides ``framework``."""
    raw = _read_source(source)
    check_keys("", raw)
    for key in raw:
        if key not in _TOP_LEVEL:
            raise ConfigError(_unknown_field(key, key, _TOP_LEVEL), field=key)

    def get(key: str) -> Any:
        return raw.get(key)

    if fr is not None:
        framework = normalize_framework(fr, "fr")
    elif get("framework") is not None:
        framework = normalize_framework(get("framework"))
    else:
        framework = "pytorch"

    fmt = get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt.lower() != "csv"):
        raise fail("format", fmt, "only 'csv' is supported")

    async_write = None if get("async_write") is None else check_bool("async_write", get("async_write"))
    ranks = None
    if get("rank") is not None:
        ranks = check_rank_list("rank", get("rank")) or None  # [] means every rank

    start_step = 0 if get("start_step") is None else check_int("start_step", get("start_step"), 0)
    stop_step = None if get("stop_step") is None else check_int("stop_step", get("stop_step"), 0)
    if stop_step is not None and stop_step <= start_step:
        raise fail("stop_step", stop_step, f"must be greater than start_step ({start_step})")
    schedule = StepSchedule(
        start_step=start_step,
        stop_step=stop_step,
        step_interval=1 if get("step_interval") is None else check_int("step_interval", get("step_interval"), 1),
        step_count_per_record=(
            1 if get("step_count_per_record") is None
            else check_int("step_count_per_record", get("step_count_per_record"), 1)
        ),
        collect_times=None if get("collect_times") is None else check_int("collect_times", get("collect_times"), 1),
    )
    alert = _parse_alert(get("alert"))
    sinks = _parse_sinks(get("sinks"))
    if sinks is not None and ranks is not None and sinks.ranks is not None and not set(sinks.ranks) & set(ranks):
        logger.warning("monitor_v2 config: 'sinks.ranks' %s names no rank that monitors ('rank' %s), so nothing is "
                       "sent to a dashboard; add one of %s to 'sinks.ranks', or write \"ranks\": \"all\"",
                       list(sinks.ranks), list(ranks), list(ranks))
    patch = get("patch_optimizer_step")
    patch = None if patch is None else check_bool("patch_optimizer_step", patch)
    structure = False if get("structure") is None else check_bool("structure", get("structure"))

    monitors, _ = _parse_monitors(get("monitors"))
    dynamic = False if get("dynamic") is None else check_bool("dynamic", get("dynamic"))

    if not any(m.enabled for m in monitors.values()) and not structure:  # a structure listing is output too
        logger.warning(
            "monitor_v2 config: no monitor is enabled (monitors: %s), so nothing will be written. "
            "Turn one on, e.g. \"monitors\": {\"weight_grad\": {\"enabled\": true}}",
            ", ".join(f"{n} off" for n in monitors) or "none listed")

    output_dir = "./" if get("output_dir") is None else get("output_dir")
    output_dir = check_output_dir(output_dir)
    return MonitorConfig(
        framework=framework,
        output_dir=output_dir,
        format="csv",
        async_write=async_write,
        ranks=ranks,
        schedule=schedule,
        patch_optimizer_step=patch,
        monitors=monitors,
        alert=alert,
        structure=structure,
        sinks=sinks,
        dynamic=dynamic,
    )


def resolve_micro_batches(settings: MonitorSettings, context: Mapping[str, Any]) -> int:
    """Micro-batches per step: ``micro_batch_number`` beats ``grad_acc_steps``; the config
    beats the ``start()`` context; neither given means 1."""
    for key in ("micro_batch_number", "grad_acc_steps"):
        if settings.options.get(key) is not None:
            return settings.options[key]
    for key in ("micro_batch_number", "grad_acc_steps"):
        if context.get(key) is not None:
            return check_int(f"start({key}=...)", context[key], 1)
    return 1
