"""``msprobe-monitor control CONFIG ...``: edit the config of a running job safely.

The edit is applied to the parsed file, validated with the library's own ``load_config``
(on a copy whose ``output_dir`` is a temporary directory, as ``validate`` does: nothing
is created), and only then written: a temporary file (0640) next to CONFIG, flushed to
disk, renamed over CONFIG in one step. A monitor running with ``"dynamic": true`` sees
the new file at its next step boundary (``dynamic.py``) and never reads half a file. A
symbolic link at CONFIG is refused: the rename would replace the link, not the file the
job reads.

``--steps N`` also writes ``"_armed"`` (the time of the edit) into the monitor's entry:
the same command run again later turns the monitor on again for N steps, although its
settings are the same as before.
"""

import datetime
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import ConfigError

ARMED = "_armed"


@dataclass
class ControlEdit:
    enable: Optional[str] = None
    disable: List[str] = field(default_factory=list)
    targets: Optional[List[str]] = None
    ops: Optional[List[str]] = None
    steps: Optional[int] = None
    sets: List[Tuple[str, Any]] = field(default_factory=list)  # top-level field -> JSON value


def parse_set(text: str) -> Tuple[str, Any]:
    """``FIELD=JSON`` (a value that is not JSON is taken as a string)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"--set {text!r}: expected FIELD=VALUE, e.g. step_interval=5")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return name.strip(), parsed


def apply_edit(raw: Dict[str, Any], edit: ControlEdit) -> Tuple[Dict[str, Any], List[str]]:
    """The edited config and one line per change."""
    if edit.enable is None and (edit.targets is not None or edit.ops is not None or edit.steps is not None):
        raise ConfigError("--targets, --ops and --steps apply to the monitor of --enable: add --enable MONITOR")
    out = json.loads(json.dumps(raw))  # a deep copy of plain JSON
    changes: List[str] = []
    monitors = out.get("monitors")
    if monitors is None:
        monitors = out["monitors"] = {}
    if not isinstance(monitors, dict):
        raise ConfigError("monitor_v2 config: field 'monitors' must be an object")
    for name in edit.disable:
        entry = monitors.get(name)
        entry = dict(entry) if isinstance(entry, dict) else {}
        entry["enabled"] = False
        monitors[name] = entry
        changes.append(f"monitors.{name}.enabled = false")
    if edit.enable is not None:
        name = edit.enable
        entry = monitors.get(name)
        entry = dict(entry) if isinstance(entry, dict) else {}
        entry["enabled"] = True
        changes.append(f"monitors.{name}.enabled = true")
        if edit.targets is not None:
            entry["targets"] = list(edit.targets)
            changes.append(f"monitors.{name}.targets = {json.dumps(entry['targets'])}")
        if edit.ops is not None:
            entry["ops"] = list(edit.ops)
            changes.append(f"monitors.{name}.ops = {json.dumps(entry['ops'])}")
        if edit.steps is not None:
            entry["steps"] = edit.steps
            entry[ARMED] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")
            changes.append(f"monitors.{name}.steps = {edit.steps} (from the step the job reads this edit)")
        monitors[name] = entry
    for key, value in edit.sets:
        out[key] = value
        changes.append(f"{key} = {json.dumps(value)}")
    return out, changes


def validate_edited(raw: Dict[str, Any], fr: Optional[str]) -> None:
    """``load_config``'s checks on ``raw`` without creating ``output_dir`` (a ConfigError)."""
    from ..config import load_config, output_dir_text_problem

    out_dir = raw.get("output_dir")
    if out_dir is not None:
        problem = output_dir_text_problem(out_dir)
        if problem is not None:
            raise ConfigError(f"monitor_v2 config: field 'output_dir' = {out_dir!r} {problem}", field="output_dir")
    tmp = tempfile.mkdtemp(prefix="msprobe_control_")
    try:
        load_config({**raw, "output_dir": tmp}, fr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_config(path: str, raw: Dict[str, Any]) -> None:
    """Replace ``path`` atomically by ``raw`` (a temporary 0640 file beside it, fsync, rename)."""
    from .. import safe_fs

    _refuse_link(path)
    data = (json.dumps(raw, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    with safe_fs.replace_file(path, 0o640) as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _refuse_link(path: str) -> None:
    if os.path.islink(path):
        raise ConfigError(f"monitor_v2 control: {path!r} is a symbolic link; the atomic replace would replace the "
                          f"link, not the file it points to: edit {os.path.realpath(path)!r} instead")


def control(path: str, edit: ControlEdit, fr: Optional[str] = None) -> List[str]:
    """Load ``path``, apply ``edit``, validate, replace the file; the changes made."""
    from ..config import read_config_file

    _refuse_link(path)
    raw = read_config_file(path)
    edited, changes = apply_edit(raw, edit)
    validate_edited(edited, fr)
    if edited != raw:
        write_config(path, edited)
    return changes


def run_control(path: str, enable: Optional[str], disable: Sequence[str], targets: Optional[Sequence[str]],
                ops: Optional[Sequence[str]], steps: Optional[int], sets: Sequence[str],
                fr: Optional[str], out: Any) -> int:
    edit = ControlEdit(enable=enable, disable=list(disable or ()), targets=None if targets is None else list(targets),
                       ops=None if ops is None else list(ops), steps=steps,
                       sets=[parse_set(s) for s in sets or ()])
    changes = control(path, edit, fr)
    if not changes:
        print(f"{path}: nothing to change (give --enable, --disable or --set)", file=out)
        return 0
    print(f"{path} replaced; a job running with \"dynamic\": true applies it from its next step boundary:", file=out)
    for line in changes:
        print(f"  {line}", file=out)
    return 0
