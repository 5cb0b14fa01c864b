"""``validate CONFIG``: the library's own validation, without its side effects.

``load_config`` creates ``output_dir`` (with its parents) and writes a probe file in it.
``validate`` leaves nothing behind, so it runs ``load_config`` on a copy of the parsed
config whose ``output_dir`` is a fresh temporary directory (removed afterwards): every
other field gets exactly the library's checks and messages. ``output_dir`` itself then
gets the library's own check (``config.check_output_dir``: create it, write and remove a
probe file) with ``keep=False``, which removes the directories the check created: a path
the library would refuse (``/proc/x``, below a file, read-only) is refused here too, with
the same message. With ``create_output_dir`` the real ``load_config(path)`` runs
instead, creating ``output_dir`` as training would.

A relative ``output_dir`` is resolved against the current directory, as the training
process would resolve it against its own.

The file is read as the constructor reads it (``config.read_config_file``): another
user's symbolic link on the way is refused, a FIFO never blocks, and what the result
says of a file that is not a config is its path and the reason only.
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


def validate(path: str, fr: Optional[str] = None, create_output_dir: bool = False) -> ValidateResult:
    from ..config import check_output_dir, load_config, read_config_file  # the library's own checks
    from ..errors import ConfigError

    handler = _Capture()
    log = logging.getLogger("msprobe.monitor_v2")
    log.addHandler(handler)
    old_propagate = log.propagate
    log.propagate = False  # warnings are returned (and printed by the CLI), not logged twice
    tmp = None
    try:
        raw: Any = None
        existed = False
        try:
            raw = read_config_file(path)  # every unreadable file is a ConfigError, as in training
            if create_output_dir:
                cfg = load_config(path, fr=fr)
            else:
                copy = dict(raw)
                tmp = tempfile.mkdtemp(prefix="msprobe_validate_")
                copy["output_dir"] = tmp
                cfg = load_config(copy, fr=fr)
                out_dir = "./" if raw.get("output_dir") is None else raw["output_dir"]
                existed = isinstance(out_dir, str) and os.path.isdir(out_dir)
                check_output_dir(out_dir, keep=False)
        except ConfigError as exc:
            return ValidateResult(False, path, str(exc), exc.field, handler.messages)
        out_dir = cfg.output_dir if create_output_dir else raw.get("output_dir")
        out_dir = "./" if out_dir is None else out_dir
        details = {
            "framework": cfg.framework,
            "output_dir": os.path.abspath(out_dir),
            "output_dir_exists": existed if not create_output_dir and isinstance(raw, dict) else True,
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
