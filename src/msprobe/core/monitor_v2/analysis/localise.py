"""What the first non-finite value of each rank can and cannot say, and the evidence the
trainer kept: shared by both engines, so that their reports agree.

After an engine's pass, for each rank with a non-finite value, in its first bad step S:

- **Phases that went non-finite at once.** The rows of step S are counted per phase
  (monitor and scope, :mod:`.order`). A phase whose every row is non-finite (and that
  holds at least two tensors) cannot say which layer started it: a NaN in one layer's
  forward pass makes the loss NaN, hence every gradient. The *earliest evidence* is then
  the first non-finite row, in execution order, of an earlier phase (the parameters at
  step start, the forward pass): there, some tensors are still finite, so it points at a
  place. Without one, the output holds no localising evidence.
- **The bracket.** The last step written on the rank before S is clean (S is the first
  bad one); when steps are sampled (``step_interval``), the problem began after it, in
  ``last clean + 1 .. S``.
- **The online alert.** ``rank_<r>/anomalies.jsonl`` (written by the trainer on the first
  anomaly, see docs/output-format.md) names the first anomalous row of a step in the
  trainer's order; when it names another tensor than this report, the difference is
  explained (the same layer or not, which comes first in execution order). Each run
  appends its own block (its lines name the run: ``run``, ``run_started``; a file of an
  older version, without them, has one block per ``first`` line): the latest run's block
  is the alert, the earlier runs' blocks are listed as theirs.
- **Dumps.** ``rank_<r>/dump_step<S>/manifest.json`` (and ``dump_step<S>.<n>``, a later
  run's dump of a step that already had one): the tensors kept to replay a step.

Rows that a later run wrote again (see :class:`.report.WindowRuns`: in the same file, or
beside it in a ``.run<k>`` file) are an earlier run's: the first bad step is read from the
latest rows only.

Only the windows holding step S (and the latest one before it) are read again, so the cost
grows with the ranks that went bad, not with the length of the run.
"""

import io
import json
import os
from typing import Any, Dict, List, Optional, Tuple

from .. import rows
from ..errors import UnsafePathError
from ..evidence import DUMP_DIR_RE
from ..safe_fs import open_regular
from .order import OrderKey, order_key, phase, where
from .reader import MONITORS, Layout, Problems, Row, StepRange, window_groups
from .report import Report, finding, latest_rows, nonfinite_kind

ALERT_FILE = "anomalies.jsonl"
MANIFEST = "manifest.json"
DUMP_RE = DUMP_DIR_RE  # dump_step<S>, and dump_step<S>.<n> for a later run's dump of the same step
# the trainer writes at most 101 lines a run, and each run resumed into the directory
# appends its own block: the file is bounded by its size alone (a hundred full blocks)
MAX_JSON_BYTES = 4 << 20
INCIDENT_PAGE = "docs/incident.md"
GRADIENTS_PHASE = phase(rows.WEIGHT_GRAD, rows.REDUCED)

# what a phase's tensors are called in a sentence
_NOUNS = {rows.WEIGHT_GRAD: "gradients", rows.PARAM: "parameters", rows.OPTIMIZER: "optimizer states",
          rows.CC: "communication tensors"}
_MODULE_KINDS = (rows.INPUT, rows.OUTPUT, rows.GRAD_INPUT, rows.GRAD_OUTPUT)


def localise(report: Report, steps: Optional[StepRange] = None) -> None:
    """Fill ``report.localisation``, ``report.alerts`` and ``report.dumps`` (see the
    module's docstring). Malformed evidence files are reported to ``report.problems``;
    the CSV files read again here were reported by the engine's pass already."""
    layout = report.layout
    quiet = Problems(strict=False, stream=io.StringIO())
    for rank in sorted(report.first_nonfinite):
        key, first = report.first_nonfinite[rank]
        report.localisation[rank] = _rank_localisation(layout, rank, key[0], first, quiet, steps)
    for rank in layout.ranks:
        rank_dir = os.path.join(layout.root, f"rank_{rank}")
        alert = read_alerts(os.path.join(rank_dir, ALERT_FILE), report.problems)
        if alert is not None:
            found = report.first_nonfinite.get(rank)
            alert["explanation"] = explain_alert(alert["first"], found[1] if found else None,
                                                 report.localisation.get(rank))
            report.alerts[rank] = alert
        report.dumps += read_dumps(rank_dir, rank, report.problems)


# ------------------------------------------------------------------ the first bad step
class _Phase:
    __slots__ = ("monitor", "scope", "rows", "bad", "tensors", "first")

    def __init__(self, monitor: str, scope: str) -> None:
        self.monitor = monitor
        self.scope = scope
        self.rows = 0
        self.bad = 0
        self.tensors: set = set()
        self.first: Optional[Tuple[OrderKey, Row, str]] = None


def _within(lo: Optional[int], hi: Optional[int], steps: Optional[StepRange]) -> StepRange:
    if steps is None:
        return lo, hi
    a = steps[0] if lo is None else (lo if steps[0] is None else max(lo, steps[0]))
    b = steps[1] if hi is None else (hi if steps[1] is None else min(hi, steps[1]))
    return a, b


def _rank_localisation(layout: Layout, rank: int, step: int, first: Dict[str, Any], problems: Problems,
                       steps: Optional[StepRange]) -> Dict[str, Any]:
    phases: Dict[Tuple[str, str], _Phase] = {}
    previous: Optional[int] = None
    for monitor in MONITORS:
        windows = [g for g in window_groups(layout.files_of(rank, monitor)) if g[0].first <= step]
        holding = [g for g in windows if max(f.last for f in g) >= step]
        before = [g for g in windows if max(f.last for f in g) < step][-1:]
        for group in before + holding:
            for f, row in latest_rows(group, problems, _within(None, step, steps)):
                if row.step < step:
                    previous = row.step if previous is None else max(previous, row.step)
                elif row.step == step:
                    _count(phases, rank, monitor, row, f.path)
    full = sorted((p for p in phases.values() if p.bad == p.rows and len(p.tensors) >= 2),
                  key=lambda p: phase(p.monitor, p.scope))
    # the optimizer state and the updated parameters follow from the gradients: named
    # only when nothing up to the gradients went non-finite at once
    full = [p for p in full if phase(p.monitor, p.scope) <= GRADIENTS_PHASE] or full
    origin = phases.get((rows.PARAM, rows.PARAM_ORIGIN))
    clean_start = origin is not None and origin.rows > 0 and origin.bad == 0
    evidence = None
    if full:
        limit = phase(full[0].monitor, full[0].scope)
        earlier = [(p.first, p.monitor) for p in phases.values()
                   if p.first is not None and phase(p.monitor, p.scope) < limit]
        if earlier:
            (_order, row, path), monitor = min(earlier, key=lambda t: t[0][0])
            evidence = finding(rank, monitor, row, path, kind=nonfinite_kind(row.vals), values=dict(row.vals))
            # where the row is depends on the input's form (CSV or an exported dataset), what it is does not
            del evidence["file"], evidence["line"]
    groups = _groups(full)
    loc = {
        "rank": rank, "step": step, "tensor": first["tensor"], "monitor": first["monitor"], "scope": first["scope"],
        "all_nonfinite": groups, "localised": not groups, "evidence": evidence,
        "last_clean_step": previous, "first_bad_step": step, "clean_start": clean_start,
        "began_in": [step if clean_start else None if previous is None else previous + 1, step],
        "phases": [{"monitor": p.monitor, "scope": p.scope, "where": where(p.monitor, p.scope, None),
                    "rows": p.rows, "nonfinite": p.bad, "tensors": len(p.tensors)}
                   for p in sorted(phases.values(), key=lambda p: phase(p.monitor, p.scope))],
    }
    loc["message"] = localisation_text(loc)
    loc["bracket"] = bracket_text(loc)
    return loc


def _count(phases: Dict[Tuple[str, str], _Phase], rank: int, monitor: str, row: Row, path: str) -> None:
    p = phases.get((monitor, row.scope))
    if p is None:
        p = phases[(monitor, row.scope)] = _Phase(monitor, row.scope)
    p.rows += 1
    p.tensors.add(row.name)
    if nonfinite_kind(row.vals) is None:
        return
    p.bad += 1
    key = order_key(row.step, monitor, row.scope, row.micro, row.line, rank)
    if p.first is None or key < p.first[0]:
        p.first = (key, row, path)


def _groups(full: List[_Phase]) -> List[Dict[str, Any]]:
    """The fully non-finite phases, one item per monitor (module: per scope, since its
    forward and backward rows are different tensors)."""
    out: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for p in full:
        gk = (p.monitor, p.scope if p.monitor == rows.MODULE else "")
        g = out.setdefault(gk, {"monitor": p.monitor, "scopes": [], "rows": 0, "tensors": set()})
        g["scopes"].append(p.scope)
        g["rows"] += p.rows
        g["tensors"] |= p.tensors
    return [{"monitor": g["monitor"], "scopes": g["scopes"], "rows": g["rows"], "tensors": len(g["tensors"]),
             "noun": _noun(g["monitor"], g["scopes"][0])} for g in out.values()]


def _noun(monitor: str, scope: str) -> str:
    if monitor == rows.MODULE:
        return "module gradients" if scope == rows.BACKWARD else "module tensors"
    return _NOUNS.get(monitor, f"{monitor} tensors")


def evidence_text(ev: Optional[Dict[str, Any]]) -> str:
    if ev is None:
        return f"none in this output: turn on `module` (see {INCIDENT_PAGE})"
    text = f"{ev['tensor']} ({ev['monitor']}, {ev['where']}: {ev['kind']})"
    if ev["monitor"] == rows.PARAM and ev["scope"] == rows.PARAM_ORIGIN:
        text += f": it was already non-finite before step {ev['step']}"
    return text


def localisation_text(loc: Dict[str, Any]) -> str:
    """The "cannot localise" sentence of a rank (empty when the first value localises)."""
    groups = loc["all_nonfinite"]
    if not groups:
        return ""
    parts = [f"all {g['tensors']} {g['noun']} ({g['monitor']} {', '.join(g['scopes'])}: {g['rows']} rows)"
             for g in groups]
    who = f"the {groups[0]['noun']}" if len(groups) == 1 else "they"
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return (f"{listed} went non-finite in step {loc['step']}: {who} cannot localise this; "
            f"the earliest evidence is {evidence_text(loc['evidence'])}")


def bracket_text(loc: Dict[str, Any]) -> str:
    """Where the problem began, when the written steps leave a gap before the first bad
    one (empty when the step before it was written)."""
    last, bad = loc["last_clean_step"], loc["first_bad_step"]
    if loc["clean_start"] and (last is None or last + 1 < bad):
        seen = "" if last is None else f"last clean written step {last}, first bad written step {bad}; "
        return (f"{seen}the parameters step {bad} started from are finite (param param_origin): it began in step "
                f"{bad}")
    if last is None:
        if bad == 0:
            return ""
        return f"no step before step {bad} is in this output for rank {loc['rank']}: it began in step {bad} or earlier"
    if last + 1 == bad:
        return ""
    return f"last clean written step {last}, first bad written step {bad}: it began in {last + 1}..{bad}"


# ------------------------------------------------------------------ evidence files
def _read_json_text(path: str, problems: Problems) -> Optional[str]:
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except UnsafePathError as exc:
        problems.report(path, None, f"not read: {exc.why}", "file")
        return None
    except OSError as exc:
        problems.report(path, None, f"cannot read the file: {exc.strerror or exc}", "file")
        return None
    with open(fd, encoding="utf-8", errors="replace") as fh:
        text = fh.read(MAX_JSON_BYTES + 1)
    if len(text) > MAX_JSON_BYTES:
        problems.report(path, None, f"larger than {MAX_JSON_BYTES} bytes: not a file the trainer writes", "file")
        return None
    return text


class _Block:
    """The lines of ``anomalies.jsonl`` that one run wrote."""

    __slots__ = ("run", "started", "records", "truncated")

    def __init__(self, run: Optional[str], started: Optional[str]) -> None:
        self.run = run
        self.started = started
        self.records: List[Dict[str, Any]] = []
        self.truncated = 0

    def to_json(self, path: str) -> Dict[str, Any]:
        first = next((r for r in self.records if r.get("first") is True), self.records[0])
        return {"file": path, "run": self.run, "run_started": self.started, "first": first,
                "records": len(self.records), "truncated": self.truncated}


def _run_of(rec: Dict[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    run, started = rec.get("run"), rec.get("run_started")
    return (run if isinstance(run, str) else None), (started if isinstance(started, str) else None)


def _blocks(path: str, text: str, problems: Problems) -> List[_Block]:
    """The runs' blocks of an ``anomalies.jsonl``, in the order they were appended. A line
    starts a new block when it names another run than the block before, or, in a file of
    a version that did not name runs, when it is a ``first`` line (each run wrote one
    block, its first line marked ``first``)."""
    blocks: List[_Block] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            problems.report(path, n, f"not a JSON object: {exc}")
            continue
        if not isinstance(rec, dict):
            problems.report(path, n, "not a JSON object")
            continue
        run, started = _run_of(rec)
        marker = "truncated" in rec and "step" not in rec
        if not marker and not all(k in rec for k in ("step", "monitor", "module_name")):
            problems.report(path, n, "an anomaly record needs step, monitor and module_name")
            continue
        current = blocks[-1] if blocks else None
        new_run = current is None or (run is not None and run != current.run) or (
            run is None and not marker and rec.get("first") is True and current.records)
        if new_run:
            current = _Block(run, started)
            blocks.append(current)
        if marker:
            current.truncated = int(rec["truncated"]) if isinstance(rec["truncated"], int) else 0
        else:
            rec["line"] = n
            current.records.append(rec)
    return [b for b in blocks if b.records]


def read_alerts(path: str, problems: Problems) -> Optional[Dict[str, Any]]:
    """The latest run's block of ``rank_<r>/anomalies.jsonl`` (None when the file is absent
    or holds no record): its first anomaly (the line marked ``first``, else its first
    record), ``run`` and ``run_started`` (None in a file of an older version), the number
    of its records and its ``truncated`` count; ``earlier_runs``: the blocks of the runs
    before it (a run that died, then resumed into the same directory), the latest first,
    each as the same keys."""
    text = _read_json_text(path, problems)
    if text is None:
        return None
    blocks = _blocks(path, text, problems)
    if not blocks:
        return None
    latest = blocks[-1].to_json(path)
    latest["earlier_runs"] = [b.to_json(path) for b in reversed(blocks[:-1])]
    return latest


def read_dumps(rank_dir: str, rank: int, problems: Problems) -> List[Dict[str, Any]]:
    """The dumps of one rank (``dump_step<S>/manifest.json``, and ``dump_step<S>.<n>/``
    for the n-th dump of the same step, by a later run), in step order, then in the order
    they were written; each names its run (``run``, ``run_started``: None in a dump of an
    older version)."""
    try:
        names = sorted(os.listdir(rank_dir))
    except OSError:
        return []
    out = []
    for name in names:
        m = DUMP_RE.match(name)
        if not m:
            continue
        path = os.path.join(rank_dir, name, MANIFEST)
        text = _read_json_text(path, problems)
        if text is None:
            continue
        try:
            man = json.loads(text)
        except ValueError as exc:
            problems.report(path, None, f"not JSON: {exc}", "file")
            continue
        if not isinstance(man, dict) or not isinstance(man.get("tensors"), list):
            problems.report(path, None, "a dump manifest needs a list of tensors", "file")
            continue
        tensors = [t for t in man["tensors"] if isinstance(t, dict)]
        skipped = man.get("skipped") if isinstance(man.get("skipped"), list) else []
        run, started = _run_of(man)
        out.append({
            "rank": rank, "step": man.get("step", int(m.group("step"))), "dir": os.path.join(rank_dir, name),
            "dump": int(m.group("n") or 1), "run": run, "run_started": started,
            "manifest": path, "reason": man.get("reason"), "tensors": len(tensors),
            "bytes": man.get("bytes", sum(t.get("bytes", 0) for t in tensors if isinstance(t.get("bytes"), int))),
            "max_bytes": man.get("max_bytes"), "skipped": len(skipped),
            "kinds": {k: sum(1 for t in tensors if t.get("kind") == k) for k in ("param", "grad", "input")},
            "skipped_items": [s for s in skipped if isinstance(s, dict)][:20],
        })
    out.sort(key=lambda d: (d["step"] if isinstance(d["step"], int) else -1, d["dump"]))
    return out


# ------------------------------------------------------------------ the alert and the report
def layer_of(monitor: str, name: str) -> Optional[str]:
    """The module a row's tensor belongs to: ``blocks.2.fc`` for ``blocks.2.fc.output.0``
    (module) and for ``blocks.2.fc.weight`` (a parameter); None for communication rows."""
    parts = name.split(".")
    if monitor == rows.MODULE:
        for i in range(len(parts) - 1, -1, -1):
            if parts[i] in _MODULE_KINDS:
                return ".".join(parts[:i])
        return name
    if monitor in (rows.WEIGHT_GRAD, rows.PARAM):
        return ".".join(parts[:-1])
    if monitor == rows.OPTIMIZER:
        return ".".join(parts[:-2])
    return None


def _alert_where(rec: Dict[str, Any]) -> str:
    return where(str(rec.get("monitor")), str(rec.get("scope")), rec.get("micro_step")
                 if isinstance(rec.get("micro_step"), int) else None)


def _key(step: int, monitor: str, scope: str, micro: Optional[int]) -> Tuple[int, int, int]:
    return order_key(step, monitor, scope, micro, 0, 0)[:3]


def explain_alert(rec: Dict[str, Any], first: Optional[Dict[str, Any]], loc: Optional[Dict[str, Any]]) -> str:
    """Why the alert's first anomaly and this report's first non-finite value of the same
    rank name different tensors (or that they agree)."""
    a_name, a_mon, a_scope = str(rec.get("module_name")), str(rec.get("monitor")), str(rec.get("scope"))
    a_step = rec.get("step")
    alert = f"{a_name} ({a_mon}, {_alert_where(rec)})"
    if rec.get("kind") == "spike":
        return f"the alert's first anomaly is a spike of {alert} in step {a_step}"
    if first is None:
        return (f"the alert named {alert} in step {a_step}; this report finds no non-finite value on this rank "
                f"(was the run's output filtered with --steps, --monitors or --ranks?)")
    this = f"{first['tensor']} ({first['monitor']}, {first['where']})"
    if a_name == first["tensor"] and a_mon == first["monitor"] and a_step == first["step"]:
        return f"the alert and this report name the same tensor, {this}, in step {a_step}"
    text = f"the alert named {alert}"
    if a_step != first["step"]:
        text += f" in step {a_step}"
    text += f" and this report names {this}"
    if a_step != first["step"]:
        text += f" in step {first['step']}"
    if not isinstance(a_step, int):
        return text
    a_key = _key(a_step, a_mon, a_scope, rec.get("micro_step") if isinstance(rec.get("micro_step"), int) else None)
    r_key = _key(first["step"], first["monitor"], first["scope"], first["micro_step"])
    la, lr = layer_of(a_mon, a_name), layer_of(first["monitor"], first["tensor"])
    if la is not None and la == lr:
        text += f": the same layer {la or '(the root module)'}"
    else:
        text += (": both name the first non-finite row in execution order, the alert over every monitor its "
                 "rank wrote in that step, this report over the monitors, steps and ranks it reads")
    if a_key < r_key:
        text += f"; {a_name} ({_alert_where(rec)}) comes first in execution order"
    elif r_key < a_key:
        text += f"; {first['tensor']} ({first['where']}) comes first in execution order"
    else:
        text += f"; both are in the same phase ({first['where']})"
    if loc is not None and not loc["localised"] and loc["evidence"] is None and a_key <= r_key:
        text += (f"; this report's rows of step {first['step']} cannot localise it (see above): start from the "
                 f"alert's tensor")
    return text
