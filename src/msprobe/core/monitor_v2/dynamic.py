"""Incident mode on the training side: a config edited while the job runs (``"dynamic":
true``), monitors on for a number of steps (``steps``), and monitors turned on by the
first anomaly (``alert.on_anomaly``). Framework-neutral: the trainer drives it at each
step boundary and the back end's session supplies the one small collective.

At a step boundary the trainer asks ``ConfigWatch.changed()`` (one ``os.stat``; the file
is read only when its modification time, size or inode moved) and whether its alerter
has seen an anomaly, and agrees with the other ranks on both with one small collective
over two integers (``Session.agree_max``: an all-reduce MAX in PyTorch; in MindSpore an
all-gather and the maximum taken on each rank, its CPU back end having no MAX
all-reduce): every rank then reads the file, or escalates, at
the same boundary, so that the change starts at the same step everywhere. A step where
neither ``dynamic`` nor ``on_anomaly`` is configured does none of this.

``MonitorPlan`` says which monitors run at a step: the running config's entries, each
from the step it took effect (for ``steps`` steps when given), and an escalation's
entries, which only turn on monitors the running config has off. A monitor whose entry
has ``steps`` is written on every step of its window, whatever the schedule fields say.
"""

import hashlib
import json
import logging
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from . import rows
from .config import MonitorConfig, load_config, parse_config_bytes, read_config_bytes
from .errors import ConfigError
from .monitor import MonitorSettings

logger = logging.getLogger("msprobe.monitor_v2")

# Fields an edit applies while training; any other change needs a restart (said once per edit).
LIVE_FIELDS = ("monitors", "schedule", "alert", "dynamic")
_RESTART_FIELDS = ("framework", "output_dir", "format", "async_write", "ranks", "patch_optimizer_step",
                   "structure", "sinks")
_SCHEDULE_NAMES = ("start_step", "stop_step", "step_interval", "step_count_per_record", "collect_times")


# ------------------------------------------------------------------ the config file
class ConfigWatch:
    """The config file named by the user, watched at step boundaries.

    ``changed()`` costs one ``os.stat``. ``read()`` reads, parses and validates the file
    as ``load_config`` does; a refused edit is logged once at WARNING (the same content
    is not warned about again) and the caller keeps its running config. The file is read
    by ``config.read_config_bytes``'s rules: a path replaced by another user's symbolic
    link or by a FIFO is refused (without blocking the step boundary), and the warning
    names the path and the reason, never what a file that is not a config holds."""

    def __init__(self, path: str, fr: Optional[str] = None) -> None:
        self.path = path
        self.fr = fr
        self._seen = self._signature()
        self._accepted: Optional[bytes] = None
        self._refused: Optional[bytes] = None
        self.raw: Dict[str, Any] = {}
        try:
            data = read_config_bytes(path)
            self._accepted = hashlib.sha256(data).digest()
            self.raw = parse_config_bytes(path, data)
        except ConfigError:  # the constructor has just read it: a race with an edit, read at the next check
            self._seen = None

    def _signature(self) -> Optional[Tuple[int, int, int]]:
        try:
            info = os.stat(self.path)
        except OSError:  # an editor between unlink and rename: looked at again next step
            return None
        return info.st_mtime_ns, info.st_size, info.st_ino

    def changed(self) -> bool:
        signature = self._signature()
        return signature is not None and signature != self._seen

    def read(self, check: Callable[[MonitorConfig], None]) -> Optional[MonitorConfig]:
        """The edited config, validated (``check`` adds the trainer's own checks), or None
        when the content is what runs already or the edit is refused."""
        self._seen = self._signature()
        digest: Optional[bytes] = None
        try:
            data = read_config_bytes(self.path)
            digest = hashlib.sha256(data).digest()
            if digest == self._accepted:
                return None  # touched, or written back unchanged
            if digest == self._refused:
                return None
            raw = parse_config_bytes(self.path, data)
            config = load_config(raw, self.fr)
            check(config)
        except ConfigError as exc:
            key = digest if digest is not None else hashlib.sha256(str(exc).encode("utf-8", "replace")).digest()
            if key != self._refused:
                self._refused = key
                logger.warning("monitor_v2: the edit of %s is refused, the running configuration stays: %s",
                               self.path, exc)
            return None
        self._accepted, self._refused, self.raw = digest, None, raw
        return config


def restart_fields(old: MonitorConfig, new: MonitorConfig) -> List[str]:
    """The changed fields that only a restart applies."""
    changed = [name for name in _RESTART_FIELDS if getattr(old, name) != getattr(new, name)]
    if (old.alert is None) != (new.alert is None):
        changed.append("alert (turned on or off)")
    return changed


def entry_key(settings: MonitorSettings, raw_monitors: Any) -> str:
    """What decides whether an entry was edited: its settings and its raw text (a field
    such as ``_armed``, which ``control`` writes, re-arms an entry whose settings are the
    same as before)."""
    raw = raw_monitors.get(settings.name) if isinstance(raw_monitors, Mapping) else None
    return json.dumps([repr(settings), raw], sort_keys=True, default=str)


def same_monitor(a: MonitorSettings, b: MonitorSettings) -> bool:
    """The same hooks and columns (only ``steps`` may differ): no restart needed."""
    return replace(a, steps=None) == replace(b, steps=None)


# ------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class PlannedMonitor:
    settings: MonitorSettings
    since: int  # the step it takes effect
    until: Optional[int]  # the first step it is off again; None: no end
    key: str = ""
    escalated: bool = False

    def live(self, step: int) -> bool:
        return self.since <= step and (self.until is None or step < self.until)


def _planned(settings: MonitorSettings, step: int, key: str, steps: Optional[int] = None,
             escalated: bool = False) -> PlannedMonitor:
    n = settings.steps if settings.steps is not None else steps
    return PlannedMonitor(settings, step, None if n is None else step + n, key, escalated)


class MonitorPlan:
    """Which monitors run at which step."""

    def __init__(self, monitors: Iterable[MonitorSettings], step: int, raw_monitors: Any = None) -> None:
        self.base: Dict[str, PlannedMonitor] = {
            s.name: _planned(s, step, entry_key(s, raw_monitors)) for s in monitors}
        self.escalation: Dict[str, PlannedMonitor] = {}

    def replace_base(self, monitors: Iterable[MonitorSettings], step: int, raw_monitors: Any) -> None:
        """A new running config from ``step``: an entry edited (or new) takes effect
        there; one left as it was keeps its window."""
        new = {}
        for s in monitors:
            key = entry_key(s, raw_monitors)
            old = self.base.get(s.name)
            new[s.name] = old if old is not None and old.key == key else _planned(s, step, key)
        self.base = new

    def escalate(self, monitors: Iterable[MonitorSettings], step: int, steps: int) -> None:
        self.escalation = {s.name: _planned(s, step, "", steps, True) for s in monitors}

    def wanted(self, step: int) -> Dict[str, PlannedMonitor]:
        """The monitors on at ``step``, in file order; the running config's entry wins
        over an escalation's (an escalation never narrows a monitor already on)."""
        out = {}
        for name in rows.MONITORS:
            for source in (self.base, self.escalation):
                planned = source.get(name)
                if planned is not None and planned.live(step):
                    out[name] = planned
                    break
        return out

    def next_change(self, step: int) -> Optional[int]:
        """The first step after ``step`` where ``wanted`` may differ (None: never)."""
        bounds = [b for p in list(self.base.values()) + list(self.escalation.values())
                  for b in (p.since, p.until) if b is not None and b > step]
        return min(bounds) if bounds else None


def timed_names(wanted: Mapping[str, PlannedMonitor]) -> Set[str]:
    """Monitors written on every step of their window (an entry with ``steps``, an escalation)."""
    return {name for name, p in wanted.items() if p.until is not None}


# ---------------------------------------------------------------- escalation
def auto_target(monitor: str, name: str, root_tags: Sequence[str]) -> Optional[str]:
    """The module whose subtree ``"targets": "auto"`` selects for an anomalous row:
    the module of a parameter (``a.b.c.weight`` -> ``a.b.c``; an optimizer state
    ``a.b.c.weight.exp_avg`` -> ``a.b.c``), the module of a module row
    (``a.b.c.output.0`` -> ``a.b.c``). None (every module) for a ``cc`` row, a
    parameter of the root, or the root itself. A chunk prefix ``N:`` is kept, so the
    target stays inside that chunk (``N:`` alone: the whole chunk)."""
    prefix, sep, rest = name.partition(rows.CHUNK_SEP)
    if not sep or not prefix.isdigit():
        prefix, rest = "", name
    else:
        prefix += sep
    if monitor == rows.MODULE:
        cut = max(rest.rfind(f".{kind}.") for kind in rows.MODULE_KINDS)
        module = rest[:cut] if cut > 0 else ""
        if prefix + module in root_tags:
            module = ""
    elif monitor in (rows.WEIGHT_GRAD, rows.PARAM):
        module = rest.rpartition(".")[0]
    elif monitor == rows.OPTIMIZER:
        module = rest.rpartition(".")[0].rpartition(".")[0]
    else:
        return None
    if not module:
        return prefix or None
    return prefix + module


def describe_planned(planned: Mapping[str, PlannedMonitor]) -> str:
    parts = []
    for name, p in planned.items():
        targets = p.settings.options.get("targets") if name == rows.MODULE else None
        what = name + (f" (targets {list(targets)})" if targets else "")
        if p.settings.ops != rows.DEFAULT_OPS:
            what += f" (ops {','.join(p.settings.ops)})"
        when = f"steps {p.since}..{p.until - 1}" if p.until is not None else f"from step {p.since}"
        parts.append(f"{what} {when}")
    return ", ".join(parts) or "no monitor"


def schedule_text(config: MonitorConfig) -> str:
    s = config.schedule
    return ", ".join(f"{n} {getattr(s, n)}" for n in _SCHEDULE_NAMES)
