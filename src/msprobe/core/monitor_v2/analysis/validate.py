"""``validate CONFIG``: the library's own validation, without its side effects.

``load_config`` creates ``output_dir`` (with its parents) and writes a probe file in it.
``validate`` must not, so it runs ``load_config`` on a copy of the parsed config whose
``output_dir`` is a fresh temporary directory (removed afterwards): every other field
gets exactly the library's checks and messages. ``output_dir`` itself is then checked
without touching the file system: it must be a non-empty string, and either an existing
writable directory or a path whose nearest existing ancestor is a writable directory
(so that the library could create it). With ``create_output_dir`` the real
``load_config(path)`` runs instead, creating ``output_dir`` as training would.

A relative ``output_dir`` is resolved against the current directory, as the training
process would resolve it against its own.
"""

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field as dc_field
from typing import Any, Dict, List, Optional


@dataclass
class ValidateResult:
    ok: bool
    path: str
    message: str = ""
    field: Optional[str] = None
    warnings: List[str] = dc_field(default_factory=list)
    details: Dict[str, Any] = dc_field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        return {"ok": self.ok, "config": self.path, "error": self.message or None, "field": self.field,
                "warnings": self.warnings, "details": self.details}


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _output_dir_problem(value: Any) -> Optional[str]:
    """Why the library would reject ``output_dir`` (None if it would accept it)."""
    from ..config import _describe, output_dir_text_problem  # the constructor's wording

    if value is None:
        value = "./"
    prefix = f"monitor_v2 config: field 'output_dir' = {_describe(value)}: "
    problem = output_dir_text_problem(value)
    if problem is not None:
        return prefix + problem
    path = os.path.abspath(value)
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if probe != path and os.path.isdir(probe):
        # the directories load_config would create: each name must fit the file system
        limit = os.pathconf(probe, "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
        for name in os.path.relpath(path, probe).split(os.sep):
            if len(os.fsencode(name)) > limit:
                return prefix + f"must be a writable directory (File name too long: {name[:40]!r}...)"
    if not os.path.isdir(probe):
        return prefix + f"must be a writable directory ({probe!r} exists and is not a directory)"
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == path else f"cannot be created: {probe!r} is not writable"
        return prefix + f"must be a writable directory ({what})"
    return None


def validate(path: str, fr: Optional[str] = None, create_output_dir: bool = False) -> ValidateResult:
    from ..config import load_config, read_config_file  # the library's validation, the same code as training
    from ..errors import ConfigError

    handler = _Capture()
    log = logging.getLogger("msprobe.monitor_v2")
    log.addHandler(handler)
    old_propagate = log.propagate
    log.propagate = False  # warnings are returned (and printed by the CLI), not logged twice
    tmp = None
    try:
        raw: Any = None
        try:
            raw = read_config_file(path)  # every unreadable file is a ConfigError, as in training
            if create_output_dir:
                cfg = load_config(path, fr=fr)
            else:
                copy = dict(raw)
                tmp = tempfile.mkdtemp(prefix="msprobe_validate_")
                copy["output_dir"] = tmp
                cfg = load_config(copy, fr=fr)
                problem = _output_dir_problem(raw.get("output_dir"))
                if problem is not None:
                    return ValidateResult(False, path, problem, "output_dir", handler.messages)
        except ConfigError as exc:
            return ValidateResult(False, path, str(exc), exc.field, handler.messages)
        out_dir = cfg.output_dir if create_output_dir else raw.get("output_dir")
        out_dir = "./" if out_dir is None else out_dir
        details = {
            "framework": cfg.framework,
            "output_dir": os.path.abspath(out_dir),
            "output_dir_exists": os.path.isdir(out_dir),
            "monitors": [m.name for m in cfg.enabled_monitors],
            "ranks": list(cfg.ranks) if cfg.ranks else "all",
            "start_step": cfg.schedule.start_step,
            "stop_step": cfg.schedule.effective_stop_step,
            "step_interval": cfg.schedule.step_interval,
            "step_count_per_record": cfg.schedule.step_count_per_record,
        }
        return ValidateResult(True, path, "", None, handler.messages, details)
    finally:
        log.removeHandler(handler)
        log.propagate = old_propagate
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
