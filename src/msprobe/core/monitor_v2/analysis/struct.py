"""``msprobe-monitor struct``: the model's module and parameter names from
``rank_<r>/structure.txt`` (written by ``start()`` with ``"structure": true``), and what
a ``targets`` list selects, counted with the module monitor's own matching."""

import os
import re
from typing import Any, Dict, List, Optional, Sequence, TextIO

from ..model_structure import FILE_NAME, Structure, read_structure
from ..monitor import target_hits
from .reader import InputError
from .text import dump_json, table

_RANK_DIR = re.compile(r"^rank_(?P<rank>\d+)$")
EXIT_OK, EXIT_FOUND = 0, 1


def find_structure(path: str, rank: Optional[int]) -> str:
    """The structure file of ``path``: the file itself, a rank directory holding it, or an
    output directory (its ``rank_<rank>``, by default the lowest rank that has one)."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise InputError(f"{path}: no such file or directory")
    here = os.path.join(path, FILE_NAME)
    if rank is None and os.path.isfile(here):
        return here
    ranks = []
    for name in os.listdir(path):
        match = _RANK_DIR.match(name)
        if match and os.path.isfile(os.path.join(path, name, FILE_NAME)):
            ranks.append(int(match.group("rank")))
    ranks.sort()
    if rank is not None:
        if rank not in ranks:
            raise InputError(f"{os.path.join(path, f'rank_{rank}', FILE_NAME)}: not found"
                             + (f" (ranks with a structure file: {', '.join(map(str, ranks))})" if ranks else
                                _HOW))
        return os.path.join(path, f"rank_{rank}", FILE_NAME)
    if not ranks:
        raise InputError(f"{path}: no rank_<r>/{FILE_NAME} here{_HOW}")
    return os.path.join(path, f"rank_{ranks[0]}", FILE_NAME)


_HOW = ("; start the monitor once with \"structure\": true in its config to write it "
        "(start() writes it before the first step)")


def selection(structure: Structure, targets: Sequence[str]) -> Dict[str, Any]:
    per_target = {t: [m.name for m in structure.modules if target_hits(m.name, [t])] for t in targets}
    chosen = structure.select(targets)
    return {
        "per_target": per_target,
        "selected": [m.name for m in chosen],
        "selected_with_rows": [m.name for m in chosen if not m.container],
        "containers": [m.name for m in chosen if m.container],
        "unmatched": [t for t, names in per_target.items() if not names],
    }


def run_struct(path: str, rank: Optional[int], targets: Optional[Sequence[str]], as_json: bool, out: TextIO) -> int:
    file = find_structure(path, rank)
    try:
        s = read_structure(file)
    except (OSError, ValueError) as exc:
        raise InputError(str(exc) if isinstance(exc, ValueError) else f"{file}: cannot read: {exc.strerror or exc}")
    sel = selection(s, targets) if targets else None
    code = EXIT_FOUND if sel and sel["unmatched"] else EXIT_OK
    if as_json:
        data: Dict[str, Any] = {
            "command": "struct", "file": os.path.abspath(file), "rank": s.rank, "framework": s.framework,
            "modules": [{"name": m.name, "type": m.cls, "container": m.container, "depth": m.depth,
                         **({"router": m.router} if m.router else {})} for m in s.modules],
            "parameters": [{"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "trainable": p.trainable}
                           for p in s.params],
        }
        if sel is not None:
            data["targets"] = list(targets or ())
            data.update({k: v for k, v in sel.items() if k != "per_target"})
            data["per_target"] = {t: len(v) for t, v in sel["per_target"].items()}
        data["exit_code"] = code
        dump_json(data, out)
        return code
    trainable = sum(p.trainable for p in s.params)
    lines = [f"msprobe-monitor struct {file}: rank {s.rank}, {s.framework or 'unknown framework'}, "
             f"{len(s.modules)} modules, {len(s.params)} parameters ({trainable} trainable)"]
    if sel is None:
        lines += ["", "MODULES (names exactly as monitors.module.targets matches them: a target selects every "
                      "module whose name contains it)"]
        for m in s.modules:
            note = f"{m.cls}; container: no rows of its own" if m.container else m.cls
            lines.append(f"  {'  ' * m.depth}{m.name}  ({note})")
        routers = [m for m in s.modules if m.router]
        if routers:
            lines += ["", "MOE ROUTERS (observed by the moe monitor: rows <router>.tokens_per_expert, ...)"]
            lines += [f"  {m.name}  ({m.cls}; {m.router})" for m in routers]
        lines += ["", "PARAMETERS (the module_name of weight_grad, param and optimizer rows)"]
        lines.append(table(["name", "dtype", "shape", ""],
                           [[p.name, p.dtype, "x".join(map(str, p.shape)) or "scalar",
                             "trainable" if p.trainable else "frozen: no rows"] for p in s.params]))
        lines += ["", "Count what a targets list selects: msprobe-monitor struct "
                      f"{path} --targets NAME [NAME ...]"]
    else:
        rows: List[List[Any]] = []
        for t, names in sel["per_target"].items():
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            rows.append([repr(t), len(names), shown or "(no module name contains it)"])
        lines += ["", "TARGETS", table(["target", "modules", "selects"], rows)]
        lines += ["", f"SELECTED: {len(sel['selected'])} of {len(s.modules)} modules, "
                      f"{len(sel['selected_with_rows'])} with rows of their own"
                  + (f" ({len(sel['containers'])} container(s) without: {', '.join(sel['containers'])})"
                     if sel["containers"] else "")]
        lines += [f"  {name}" for name in sel["selected"]]
        if sel["unmatched"]:
            lines += ["", f"Targets that select nothing (exit 1): {', '.join(map(repr, sel['unmatched']))}"]
    print("\n".join(lines), file=out)
    return code
