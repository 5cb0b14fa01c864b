"""Incident evidence: ``rank_<r>/anomalies.jsonl`` and the pre-update dump.

- ``anomalies.jsonl``: written by the alerter (inside the writer's step flush, so on the
  writer's thread with ``async_write``) for the first anomalous written step of the run:
  one JSON object per anomalous row of that step, in execution order (``rows.execution_order``),
  at most ``MAX_ANOMALY_LINES`` of them, then ``{"truncated": n}``.
- ``dump_step<S>/``: the parameters, their gradients and the root module's inputs of the
  step whose gradients went non-finite, as they were before ``optimizer.step()`` applied
  them (taken by the framework's ``GradientGuard`` in the optimizer pre-step hook):
  ``manifest.json`` plus one tensor file (``tensors.pt``, ``torch.save`` of a dict, for
  PyTorch; ``tensors.npz`` for MindSpore). ``load_dump`` reads one back.

Every file goes through ``safe_fs`` (never through a link, 0640; directories 0750).
Framework-neutral: torch/numpy are imported by ``load_dump`` only, when it reads a file.
"""

import json
import math
import os
from typing import Any, Callable, Dict, IO, List, Mapping, Optional, Sequence, Tuple

from . import rows
from .safe_fs import SafeDir, open_append
from .stats import Row

ANOMALIES_FILE = "anomalies.jsonl"
MANIFEST = "manifest.json"
MAX_ANOMALY_LINES = 100
PARAM, GRAD, INPUT = "param", "grad", "input"


def dump_dir_name(step: int) -> str:
    return f"dump_step{step}"


def json_float(value: float) -> Any:
    """A statistic as JSON: non-finite floats as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def anomaly_lines(rank: int, step: int, rows_by_monitor: Sequence[Tuple[str, Sequence[Row]]],
                  kinds: Mapping[int, str], nonfinite: Callable[[Row], bool]) -> List[Dict[str, Any]]:
    """The JSON objects of one step: one per row whose ``id`` is in ``kinds`` (its kind,
    "nonfinite" or "spike"), sorted by execution order. ``order`` is the row's
    ``rows.execution_order`` key, ``line`` being the row's place among its monitor's rows
    of that step (its order in the file within the step)."""
    lines = []
    for monitor, monitor_rows in rows_by_monitor:
        bad = sum(1 for r in monitor_rows if nonfinite(r))
        for line, row in enumerate(monitor_rows):
            kind = kinds.get(id(row))
            if kind is None:
                continue
            stat = row.stat
            lines.append({
                "rank": rank,
                "step": step,
                "micro_step": row.micro_step,
                "monitor": monitor,
                "module_name": row.name,
                "scope": row.scope,
                "vpp_stage": row.vpp_stage,
                "kind": kind,
                "stats": {**{op: json_float(stat.value(op)) for op in rows.VALUE_OPS}, "nans": stat.nans},
                "order": list(rows.execution_order(step, monitor, row.scope, row.micro_step, line, rank)),
                "rows_nonfinite": bad,
                "rows_total": len(monitor_rows),
                "first": False,
            })
    lines.sort(key=lambda d: d["order"])
    if lines:
        lines[0]["first"] = True
    if len(lines) > MAX_ANOMALY_LINES:
        lines = lines[:MAX_ANOMALY_LINES] + [{"truncated": len(lines) - MAX_ANOMALY_LINES}]
    return lines


def append_anomalies(rank_dir: str, lines: Sequence[Mapping[str, Any]]) -> str:
    """Append ``lines`` to ``rank_dir/anomalies.jsonl`` in one write; returns the path."""
    path = os.path.join(rank_dir, ANOMALIES_FILE)
    data = "".join(json.dumps(line, allow_nan=False) + "\n" for line in lines).encode()
    fd, _ = open_append(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return path


def write_dump(rank_dir: str, step: int, manifest: Dict[str, Any], payload: Any, file_name: str,
               save: Callable[[Any, IO[bytes]], None]) -> str:
    """Write ``payload`` (the tensors, by ``<kind>:<name>``) with ``save`` into
    ``rank_dir/dump_step<S>/file_name``, then ``manifest.json``: a manifest that exists
    names a complete tensor file. Returns the directory."""
    with SafeDir(rank_dir) as top:
        sub = top.subdir(dump_dir_name(step))
        try:
            with sub.replace(file_name) as fh:
                save(payload, fh)
            sub.write_bytes(MANIFEST, (json.dumps(manifest, indent=1, allow_nan=False) + "\n").encode())
        finally:
            sub.close()
    return os.path.join(rank_dir, dump_dir_name(step))


def payload_key(kind: str, name: str) -> str:
    return f"{kind}:{name}"


def load_dump(path: str) -> Dict[str, Any]:
    """Read a dump directory (``rank_<r>/dump_step<S>``) back.

    Returns ``{"manifest": dict, "params": {name: tensor}, "grads": {name: tensor},
    "inputs": {name: tensor}, "calls": [{"args": [...], "kwargs": {...}}]}``: ``calls`` are
    the root module's forward calls of the step, in order, with the tensors that were
    still alive (a missing one is ``None``; non-tensor arguments were not kept). PyTorch
    dumps give ``torch.Tensor``s (loaded with ``weights_only=True``), MindSpore dumps
    numpy arrays. The replay recipe is in docs/output-format.md."""
    with SafeDir(path, create=False) as d:
        manifest = json.loads(d.read_bytes(MANIFEST))
        files = sorted({t["file"] for t in manifest.get("tensors", ())})
        data: Dict[str, Any] = {}
        for name in files:
            raw = d.read_bytes(name)
            data.update(_load_tensor_file(name, raw))
    out: Dict[str, Any] = {"manifest": manifest, "params": {}, "grads": {}, "inputs": {}, "calls": []}
    group = {PARAM: "params", GRAD: "grads", INPUT: "inputs"}
    for entry in manifest.get("tensors", ()):
        out[group[entry["kind"]]][entry["name"]] = data[payload_key(entry["kind"], entry["name"])]
    calls: Dict[Tuple[int, int], Dict[str, Any]] = {}
    for entry in list(manifest.get("tensors", ())) + list(manifest.get("skipped", ())):
        where = entry.get("call")
        if entry["kind"] != INPUT or where is None:
            continue
        call = calls.setdefault((where["vpp_stage"], where["call"]), {"args": {}, "kwargs": {}})
        value = out["inputs"].get(entry["name"])
        if "arg" in where:
            call["args"][where["arg"]] = value
        else:
            call["kwargs"][where["kwarg"]] = value
    for key in sorted(calls):
        args = calls[key]["args"]
        out["calls"].append({"vpp_stage": key[0], "args": [args.get(i) for i in range(max(args, default=-1) + 1)],
                             "kwargs": calls[key]["kwargs"]})
    return out


def _load_tensor_file(name: str, raw: bytes) -> Dict[str, Any]:
    import io

    if name.endswith(".npz"):
        import numpy

        with numpy.load(io.BytesIO(raw), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    import torch

    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
