"""``msprobe-monitor compare REF CAND``: do two runs (GPU and NPU, bf16 and fp32, before
and after a change) agree within the precision they computed in, and where do they part?

``diff`` answers "where is the first bit that differs", which across hardware is the very
first row. ``compare`` scores every row both runs have with errors that mean something
across hardware and judges them against a tolerance of the run's precision:

- alignment: rows are matched on (rank, monitor, step, name, scope, micro_step, dp_rank);
  ``reduced`` rows ignore ``micro_step`` (it counts the micro-batches accumulated, which
  may differ: 1 under DP=2, 2 under gradient accumulation 2); per-micro-batch scopes
  (``unreduced``, ``backward``) are *not comparable* when the sides' micro-batches or
  data-parallel sizes differ, and counted as such. Runs of different parallel layouts are
  merged (:mod:`.merge`) and compared under global names; ``collapse_dp`` pools the rows
  kept per data-parallel rank (norm from summed squares, min of mins, max of maxes, counts
  summed, means averaged). Rows only one side has are counted per monitor and scope.
- errors per statistic: signed ``cand - ref``, absolute, relative ``|d| / max(|ref|,
  floor)`` and scaled ``|d| / max(|ref|, |cand|, floor)``; a row whose two values are both
  within ``floor`` of zero is *near zero* (counted apart, never ranked); a NaN/Inf on one
  side only, or different NaN counts, is a *non-finite mismatch* (always an error).
- levels, on the judged statistics (``norm`` by default): without a baseline run, pass
  when the scaled error is within the tolerance of the comparison's dtype, warning up to
  10 x that, error beyond; with ``baseline`` (a second reference run, REF2), the scaled
  error divided by the run-to-run noise ``max(scaled(REF, REF2), minimum error of the
  dtype)``: warning above 2, error above 10 (the ratio limits of msProbe's benchmark
  method, whose L2/L0 levels use 2 and 10).
- where they part: the earliest (step, phase) in execution order (param_origin ->
  forward -> backward -> unreduced -> comm -> reduced -> optimizer -> param_updated) with
  a row beyond tolerance; there the worst layers (largest row, p95 beside it), msProbe's
  input/output rule for module rows (output error > 10 x input error: warning; input <
  0.1 and output > 0.5: error), which names the module where an error is born, and the
  gradients whose error grows after the reduce.
- loss and global grad norm (``scalars`` rows, or ``--loss-log``): the migration standard
  (first loss within 0.005 absolute or 0.5 %, every loss within 0.01 or 1 %, mean signed
  relative grad-norm error within 5 %).

Pure Python (standard library only); :mod:`.compare_columnar` does the same per-row work
with Polars where it is installed (the rows per second the scale needs).
"""

import csv
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .. import layout as lay
from .. import rows
from .blocks import latest_blocks
from .order import PHASE_LABELS
from .reader import InputError, Layout, Problems, StepRange, scan, window_groups

# ------------------------------------------------------------------ dtypes and tolerances
# The scaled error of a whole tensor's norm that a run computed in this precision shows
# against a float32 run (docs/compare.md, "Choosing tolerances", measures them): bfloat16
# from the tiny GPT trained under autocast against float32 (largest row 1.5e-2 over 6 steps,
# every monitor); float32 above its run-to-run noise (a different thread count: up to 3e-6)
# and the CSV's 9 significant digits; float16 between the two (PyTorch's rtol 1e-3).
TOLERANCE: Dict[str, float] = {"float64": 1e-7, "float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}
# Below it a value counts as zero: a row whose two values are both within it is near zero.
# Whole-tensor norms are legitimately small (Adam's exp_avg_sq of a small model: 3e-8 to 2e-6,
# which a per-element atol such as PyTorch's 1e-5 would hide), and bfloat16 has float32's
# exponent range: 1e-12 for all but float16, whose smallest subnormal is 6e-8.
FLOOR: Dict[str, float] = {"float64": 1e-12, "float32": 1e-12, "float16": 6e-8, "bfloat16": 1e-12}
# msProbe's "minimum error" of the benchmark method: the smallest noise a ratio is taken to.
MIN_NOISE: Dict[str, float] = {"float64": 2.0 ** -20, "float32": 2.0 ** -14, "float16": 2.0 ** -11,
                               "bfloat16": 2.0 ** -8}
DTYPES: Tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
                  "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
# lowest precision first: a run's tolerance follows the lowest precision it computed in
_PRECISION_ORDER = ("bfloat16", "float16", "float32", "float64")

PASS, WARNING, ERROR = "pass", "warning", "error"
LEVELS = (PASS, WARNING, ERROR)
WARNING_RATIO, ERROR_RATIO = 2.0, 10.0  # with a baseline (msProbe's benchmark limits)
ERROR_FACTOR = 10.0  # without one: error beyond 10 x the tolerance
MODULE_WARNING_FACTOR = 10.0  # msProbe: output error > 10 x input error
MODULE_ERROR_INPUT, MODULE_ERROR_OUTPUT = 0.1, 0.5  # msProbe: input < 0.1 and output > 0.5

# row classes
COMPARED, NEAR_ZERO, NONFINITE = "compared", "near_zero", "nonfinite_mismatch"

VALUE_OPS = rows.VALUE_OPS
SCALARS = "scalars"
# the scopes whose rows are per micro-batch (or per data-parallel rank's share of the batch)
PER_MICRO_SCOPES = {(rows.WEIGHT_GRAD, rows.UNREDUCED), (rows.MODULE, rows.BACKWARD)}
PHASE_NAMES = {0: "param_origin", 1: "forward", 2: "backward", 3: "unreduced", 4: "comm", 5: "reduced",
               6: "optimizer", 7: "param_updated", 8: "other"}

# the migration standard (torchtitan-test's standards.py, from the internal guidance)
FIRST_LOSS_ABS, FIRST_LOSS_REL = 0.005, 0.005
ALL_LOSS_ABS, ALL_LOSS_REL = 0.01, 0.01
GRAD_NORM_MEAN_REL = 0.05


def dtype_name(text: str) -> str:
    """``bf16``, ``torch.bfloat16``, ``BFloat16`` -> ``bfloat16``; an unknown name raises
    :class:`InputError`."""
    t = str(text).strip().lower()
    for prefix in ("torch.", "mindspore.", "ms."):
        if t.startswith(prefix):
            t = t[len(prefix):]
    t = _DTYPE_ALIASES.get(t, t)
    if t not in DTYPES:
        raise InputError(f"dtype {text!r}: choose among {', '.join(DTYPES)} (or bf16, fp16, fp32, fp64)")
    return t


def lowest_precision(names: Iterable[str]) -> Optional[str]:
    """The lowest floating precision among ``names`` (integer and unknown dtypes ignored)."""
    found = set()
    for n in names:
        try:
            found.add(dtype_name(n))
        except InputError:
            continue
    for d in _PRECISION_ORDER:
        if d in found:
            return d
    return None


# ------------------------------------------------------------------ settings
@dataclass
class CompareSettings:
    stats: Tuple[str, ...] = ("norm",)  # the statistics judged
    dtype: Optional[str] = None  # None: the lowest precision recorded in layout.json, else float32
    tolerance: Optional[float] = None  # overrides the dtype's
    floor: Optional[float] = None  # overrides the dtype's
    collapse_dp: Optional[bool] = None  # None: on when the data-parallel sizes differ
    step_offset: int = 0  # a candidate step s is the reference's step s + step_offset
    rename: List[Tuple[str, str]] = field(default_factory=list)  # (candidate prefix, reference prefix)
    fail_on: str = WARNING
    top: int = 10
    out_dir: str = "compare_out"


def read_map(path: str) -> List[Tuple[str, str]]:
    """``--map FILE``: one rename a line, ``CANDIDATE_PREFIX REFERENCE_PREFIX`` (blank lines
    and ``#`` comments ignored); a candidate row whose name is the prefix or starts with it
    and a ``.`` is renamed (the longest prefix wins)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise InputError(f"--map {path}: cannot read it: {exc.strerror or exc}") from None
    out = []
    for i, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        if len(parts) != 2:
            raise InputError(f"--map {path}:{i}: expected 'CANDIDATE_PREFIX REFERENCE_PREFIX', got {line.strip()!r}")
        out.append((parts[0], parts[1]))
    return sorted(out, key=lambda p: -len(p[0]))


def renamed(name: str, rename: Sequence[Tuple[str, str]]) -> str:
    for old, new in rename:
        if name == old or name.startswith(old + ".") or name.startswith(old + rows.CHUNK_SEP):
            return new + name[len(old):]
    return name


# ------------------------------------------------------------------ reading one side
Key = Tuple[int, str, int, str, str, Optional[int], Optional[int]]  # rank, monitor, step, name, scope, micro, dp


@dataclass
class Side:
    """One run as compare reads it: its rows by key, what it is."""

    label: str
    root: str
    layout: Layout
    rows: Dict[Key, Tuple[Dict[str, float], int]] = field(default_factory=dict)  # key -> (values, line)
    provenance: Dict[str, Any] = field(default_factory=dict)
    micro_batches: Set[int] = field(default_factory=set)
    dp_size: Optional[int] = None
    dtypes: Dict[str, str] = field(default_factory=dict)
    scalars: Dict[str, Dict[int, float]] = field(default_factory=dict)  # name -> step -> value
    merged_from: Optional[str] = None


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def rank_layouts(root: str) -> Dict[int, Dict[str, Any]]:
    """Each ``rank_<r>/layout.json`` under ``root`` that can be read."""
    out: Dict[int, Dict[str, Any]] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for n in names:
        m = re.match(r"^rank_(\d+)$", n)
        if m:
            doc = _read_json(os.path.join(root, n, lay.FILE_NAME))
            if doc is not None:
                out[int(m.group(1))] = doc
    return out


def layout_shape(layouts: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    """World size and group sizes of a run (from its lowest rank's layout.json)."""
    if not layouts:
        return {}
    doc = layouts[min(layouts)]
    groups = doc.get("groups") if isinstance(doc.get("groups"), dict) else {}
    sizes = {g: v.get("size") for g, v in sorted(groups.items()) if isinstance(v, dict)}
    return {"world_size": doc.get("world_size"), "groups": sizes, "stack": doc.get("stack"),
            "framework": doc.get("framework")}


def _dtypes_of(layouts: Dict[int, Dict[str, Any]]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for r in sorted(layouts):
        d = layouts[r].get("dtypes")
        if isinstance(d, dict):
            for k, v in d.items():
                if isinstance(v, str):
                    out.setdefault(str(k), v)
    return out


def _header_ops(path: str) -> List[str]:
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            header = next(csv.reader(fh), [])
    except OSError:
        return []
    return [c for c in header if c in rows.ALL_OPS]


def open_side(label: str, root: str, problems: Problems, steps: Optional[StepRange] = None) -> Side:
    if not os.path.isdir(root):
        raise InputError(f"{label} {root!r}: no such directory (give a monitor output_dir or a merged view)")
    layout = scan(root)
    side = Side(label=label, root=root, layout=layout)
    if layout.merged is not None:
        doc = layout.merged
        side.provenance = {"kind": "merged view", "world_size": doc.get("world_size"),
                           "groups": doc.get("groups") or {}}
        src = doc.get("source")
        layouts = rank_layouts(src) if isinstance(src, str) and os.path.isdir(src) else {}
    else:
        layouts = rank_layouts(root)
        side.provenance = {"kind": "output_dir", **layout_shape(layouts)}
        side.provenance["ranks"] = layout.ranks
    side.dtypes = _dtypes_of(layouts)
    groups = side.provenance.get("groups") or {}
    side.dp_size = groups.get("dp") if isinstance(groups.get("dp"), int) else None
    side.provenance["layout_json"] = bool(layouts)
    return side


def read_rows(side: Side, problems: Problems, settings: CompareSettings, steps: Optional[StepRange],
              rename: Sequence[Tuple[str, str]] = (), offset: int = 0) -> None:
    """Fill ``side.rows`` (each step's latest rows of every rank and monitor)."""
    ops: Dict[str, List[str]] = {}
    n_rows: Dict[str, int] = {}
    for r in side.layout.ranks:
        for m in side.layout.monitors:
            files = side.layout.files_of(r, m)
            if not files:
                continue
            ops.setdefault(m, _header_ops(files[0].path))
            for window in window_groups(files):
                for step, (_path, block) in latest_blocks(window, problems, None):
                    s = step + offset
                    if steps is not None and not ((steps[0] is None or s >= steps[0]) and
                                                  (steps[1] is None or s <= steps[1])):
                        continue
                    for (name, scope, micro, dp), row in block.items():
                        n_rows[m] = n_rows.get(m, 0) + 1
                        if m == rows.WEIGHT_GRAD and micro is not None:
                            side.micro_batches.add(micro)
                        if scope == rows.REDUCED:
                            micro = None  # the count of micro-batches accumulated: may differ
                        nm = renamed(name, rename) if rename else name
                        side.rows[(r, m, s, nm, scope, micro, dp)] = (row.vals, row.line)
    side.provenance["monitors"] = sorted(ops, key=rows.MONITORS.index)
    side.provenance["ops"] = ops
    side.provenance["rows"] = n_rows
    side.provenance["micro_batches"] = max(side.micro_batches) if side.micro_batches else None
    side.provenance["steps"] = _step_span({k[2] for k in side.rows})
    finish_side(side, offset, steps)


def finish_side(side: Side, offset: int, steps: Optional[StepRange]) -> None:
    """What both paths add to a side once its rows are read: the dtypes of its provenance
    (how many rows of each), and its scalars."""
    side.provenance["dtypes"] = dict(Counter(side.dtypes.values())) if side.dtypes else None
    read_scalars(side, offset, steps)


def _step_span(steps: Set[int]) -> Optional[List[int]]:
    return [min(steps), max(steps)] if steps else None


def collapse_dp(side: Side) -> int:
    """Pool the rows kept per data-parallel rank into one (dp None); returns how many rows
    were pooled."""
    groups: Dict[Key, List[Tuple[Dict[str, float], int]]] = {}
    pooled = 0
    for key in [k for k in side.rows if k[6] is not None]:
        vals, line = side.rows.pop(key)
        groups.setdefault(key[:6] + (None,), []).append((vals, line))
        pooled += 1
    for key, items in groups.items():
        side.rows[key] = (pool_values([v for v, _ in items]), min(line for _, line in items))
    return pooled


def pool_values(parts: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """Statistics of equal-sized pieces taken together."""
    out: Dict[str, float] = {}
    common = set(parts[0])
    for p in parts[1:]:
        common &= set(p)
    for op in common:
        vs = [float(p[op]) for p in parts]
        if op == "norm":
            out[op] = math.sqrt(sum(v * v for v in vs))
        elif op == "min":
            out[op] = math.nan if any(v != v for v in vs) else min(vs)
        elif op == "max":
            out[op] = math.nan if any(v != v for v in vs) else max(vs)
        elif op == "mean":
            out[op] = sum(vs) / len(vs)
        else:
            out[op] = sum(vs)
    return out


# ------------------------------------------------------------------ scalars (loss, grad norm)
_SCALARS_FILE = re.compile(r"^scalars_step(\d+)-(\d+)(?:\.run(\d+))?\.csv$")


def read_scalars(side: Side, offset: int = 0, steps: Optional[StepRange] = None) -> None:
    """``rank_<r>/scalars_step<a>-<b>.csv`` (``module_name`` = the scalar's name, value in
    ``mean``) of the lowest rank that has them; later files win for a step written twice.

    A merged view has no scalars files (the loss is not a tensor the merge puts under
    global names): they are read from the run it was merged from (``merged_from``, or the
    ``source`` its merge.json names), whose every rank logged the same values. They feed
    the loss and grad-norm verdict only, never ``compare.csv``'s rows. ``steps`` selects
    the (reference) steps after ``offset``, as for the rows."""
    root = side.root
    if side.layout.merged is not None:
        src = side.merged_from or side.layout.merged.get("source")
        if not isinstance(src, str) or not os.path.isdir(src):
            side.provenance["scalars"] = None
            return
        root = src
        ranks = sorted(int(m.group(1)) for m in (re.match(r"^rank_(\d+)$", n) for n in _listdir(root)) if m)
    else:
        ranks = side.layout.ranks or [0]
    for r in ranks:
        d = os.path.join(root, f"rank_{r}")
        names = [n for n in _listdir(d) if _SCALARS_FILE.match(n)]
        if not names:
            continue
        names.sort(key=lambda n: (int(_SCALARS_FILE.match(n).group(3) or 1), int(_SCALARS_FILE.match(n).group(1))))
        for n in names:
            with open(os.path.join(d, n), encoding="utf-8", newline="") as fh:
                reader = csv.DictReader(fh)
                for rec in reader:
                    try:
                        step = int(rec["step"]) + offset
                        value = float(rec.get("mean") or rec.get("max"))
                        name = rec["module_name"]
                    except (KeyError, TypeError, ValueError):
                        continue
                    if steps is not None and not ((steps[0] is None or step >= steps[0]) and
                                                  (steps[1] is None or step <= steps[1])):
                        continue
                    side.scalars.setdefault(name, {})[step] = value
        side.provenance["scalars"] = {"source": "scalars rows", "path": os.path.abspath(d),
                                      "names": sorted(side.scalars)}
        return
    side.provenance["scalars"] = None


def _listdir(path: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def read_loss_log(path: str, offset: int = 0) -> Dict[str, Dict[int, float]]:
    """``--loss-log``: one step a line, ``STEP LOSS [GRAD_NORM]``, separated by spaces,
    tabs or commas; blank lines, ``#`` comments and a header line (a first line whose first
    field is not an integer) are skipped."""
    out: Dict[str, Dict[int, float]] = {"loss": {}, "grad_norm": {}}
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise InputError(f"--loss-log {path}: cannot read it: {exc.strerror or exc}") from None
    for i, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = [p for p in re.split(r"[\s,]+", text) if p]
        try:
            step = int(parts[0])
        except ValueError:
            if not out["loss"]:
                continue  # a header
            raise InputError(f"--loss-log {path}:{i}: expected 'STEP LOSS [GRAD_NORM]', got {line.strip()!r}") from None
        try:
            vals = [float(p) for p in parts[1:3]]
        except ValueError:
            raise InputError(f"--loss-log {path}:{i}: not a number in {line.strip()!r}") from None
        if not vals:
            raise InputError(f"--loss-log {path}:{i}: no loss after the step in {line.strip()!r}")
        out["loss"][step + offset] = vals[0]
        if len(vals) > 1:
            out["grad_norm"][step + offset] = vals[1]
    if not out["loss"]:
        raise InputError(f"--loss-log {path}: no 'STEP LOSS' line in it")
    if not out["grad_norm"]:
        del out["grad_norm"]
    return out


def migration_verdict(ref: Dict[str, Dict[int, float]], cand: Dict[str, Dict[int, float]]) -> Optional[Dict[str, Any]]:
    """The migration standard on the loss and the global grad norm both sides have."""
    out: Dict[str, Any] = {}
    loss_r, loss_c = ref.get("loss") or {}, cand.get("loss") or {}
    steps = sorted(set(loss_r) & set(loss_c))
    if steps:
        diffs = [(s, loss_c[s] - loss_r[s], loss_r[s]) for s in steps]
        s0, d0, r0 = diffs[0]
        first_ok = _finite(d0) and (abs(d0) <= FIRST_LOSS_ABS or abs(d0) <= FIRST_LOSS_REL * abs(r0))
        bad = [s for s, d, r in diffs
               if not (_finite(d) and (abs(d) <= ALL_LOSS_ABS or abs(d) <= ALL_LOSS_REL * abs(r)))]
        worst = max(diffs, key=lambda t: abs(t[1]) if _finite(t[1]) else math.inf)
        out["loss"] = {
            "steps": len(steps), "first_step": s0, "first_abs": abs(d0), "first_rel": _rel(d0, r0),
            "first_ok": first_ok, "all_ok": not bad, "steps_beyond": bad[:20], "n_beyond": len(bad),
            "max_abs": abs(worst[1]), "max_abs_step": worst[0],
            "rule": f"first loss within {FIRST_LOSS_ABS} absolute or {FIRST_LOSS_REL:.1%}; every loss within "
                    f"{ALL_LOSS_ABS} or {ALL_LOSS_REL:.0%}",
        }
    g_r, g_c = ref.get("grad_norm") or {}, cand.get("grad_norm") or {}
    gsteps = sorted(s for s in set(g_r) & set(g_c) if g_r[s] != 0)
    if gsteps:
        rel = [(g_c[s] - g_r[s]) / abs(g_r[s]) for s in gsteps]
        mean = sum(rel) / len(rel)
        out["grad_norm"] = {"steps": len(gsteps), "mean_signed_rel": mean,
                            "ok": _finite(mean) and abs(mean) <= GRAD_NORM_MEAN_REL,
                            "rule": f"mean signed relative error within +-{GRAD_NORM_MEAN_REL:.0%}"}
    if not out:
        return None
    ok = all(v for k, v in (("first", out.get("loss", {}).get("first_ok", True)),
                            ("all", out.get("loss", {}).get("all_ok", True)),
                            ("gn", out.get("grad_norm", {}).get("ok", True))))
    out["level"] = PASS if ok else ERROR
    return out


def _finite(x: float) -> bool:
    return x == x and abs(x) != math.inf


def _rel(d: float, r: float) -> float:
    return abs(d) / abs(r) if r else math.inf


# ------------------------------------------------------------------ errors of one value pair
def value_errors(ref: float, cand: float, floor: float) -> Tuple[str, float, float, float, float]:
    """``(class, signed, absolute, relative, scaled)``; ``class`` is ``compared``,
    ``near_zero`` (both within ``floor`` of zero) or ``nonfinite_mismatch`` (a NaN or Inf
    the other side does not have: its errors are NaN)."""
    rf, cf = _finite(ref), _finite(cand)
    if not (rf and cf):
        same = (ref != ref and cand != cand) or (not rf and not cf and ref == cand)
        if same:
            return COMPARED, 0.0, 0.0, 0.0, 0.0
        return NONFINITE, math.nan, math.nan, math.nan, math.nan
    d = cand - ref
    a = abs(d)
    if max(abs(ref), abs(cand)) <= floor:
        return NEAR_ZERO, d, a, a / max(abs(ref), floor), a / floor
    return COMPARED, d, a, a / max(abs(ref), floor), a / max(abs(ref), abs(cand), floor)


# ------------------------------------------------------------------ the comparison
@dataclass
class RowResult:
    key: Key
    ref: Dict[str, float]
    cand: Dict[str, float]
    line: int
    errors: Dict[str, Tuple[str, float, float, float, float]]  # stat -> value_errors
    cls: str  # of the judged statistics: nonfinite_mismatch > compared > near_zero
    error: float  # the largest scaled error of the judged statistics (NaN for a non-finite mismatch)
    noise: Optional[float] = None  # scaled(REF, REF2) of the same statistic, with a baseline
    ratio: Optional[float] = None
    level: str = PASS

    @property
    def phase(self) -> int:
        return rows.execution_phase(self.key[1], self.key[4])


@dataclass
class CompareReport:
    ref: Side
    cand: Side
    settings: CompareSettings
    dtype: str = "float32"
    dtype_source: str = ""
    tolerance: float = 0.0
    floor: float = 0.0
    baseline: Optional[Side] = None
    collapse_dp: bool = False
    merged: List[str] = field(default_factory=list)
    results: List[RowResult] = field(default_factory=list)
    only: Dict[str, Dict[str, Dict[str, int]]] = field(default_factory=dict)  # monitor -> scope -> {ref, cand}
    not_comparable: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # "monitor/scope" -> {rows, why}
    counts: Dict[str, int] = field(default_factory=dict)
    verdict: str = PASS
    part: Optional[Dict[str, Any]] = None
    first_step: Dict[str, Optional[int]] = field(default_factory=dict)
    pooled: List[Dict[str, Any]] = field(default_factory=list)
    rank_steps: Dict[Tuple[str, int, int], float] = field(default_factory=dict)  # (monitor/scope, rank, step)
    layer_steps: Dict[Tuple[str, int], float] = field(default_factory=dict)  # (layer, step) -> max error
    worst: List[Dict[str, Any]] = field(default_factory=list)
    grows_after_reduce: List[Dict[str, Any]] = field(default_factory=list)
    module_rule: List[Dict[str, Any]] = field(default_factory=list)
    scalars: Optional[Dict[str, Any]] = None
    config_differences: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    files: Dict[str, str] = field(default_factory=dict)
    engine: str = "python"
    frame: Any = None  # the columnar path's aligned rows (compare_columnar)
    present_ops: List[str] = field(default_factory=list)

    @property
    def code_level(self) -> str:
        return self.verdict


def _layer_of(name: str) -> str:
    """``blocks.3.mlp.fc.output.0`` -> ``blocks.3``; a name without a numeric component ->
    its first component (``tok_emb``, ``head``)."""
    base = name.split(rows.CHUNK_SEP, 1)[-1]
    tk = _module_tag(base)
    if tk is not None:
        base = tk[0]  # a module row: its module
    parts = base.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _module_tag(name: str) -> Optional[Tuple[str, str]]:
    """``blocks.1.mlp.output.0`` -> (``blocks.1.mlp``, ``output``)."""
    for kind in rows.MODULE_KINDS:
        marker = f".{kind}."
        i = name.rfind(marker)
        if i > 0:
            return name[:i], kind
    return None


def _level_of(error: float, tolerance: float) -> str:
    if error != error:
        return ERROR
    if error > ERROR_FACTOR * tolerance:
        return ERROR
    if error > tolerance:
        return WARNING
    return PASS


def _ratio_level(ratio: float) -> str:
    if ratio != ratio or ratio > ERROR_RATIO:
        return ERROR
    if ratio > WARNING_RATIO:
        return WARNING
    return PASS


def _p95(values: List[float]) -> float:
    """The 95th percentile, nearest rank (index ceil(0.95 n) - 1 of the sorted values)."""
    vs = sorted(values)
    return vs[max(0, math.ceil(0.95 * len(vs)) - 1)] if vs else math.nan


def worse(a: str, b: str) -> str:
    return a if LEVELS.index(a) >= LEVELS.index(b) else b


def choose_dtype(settings: CompareSettings, ref: Side, cand: Side) -> Tuple[str, str]:
    if settings.dtype is not None:
        return settings.dtype, "--dtype"
    low = lowest_precision(list(ref.dtypes.values()) + list(cand.dtypes.values()))
    if low is not None:
        return low, "the lowest precision recorded in layout.json (dtypes)"
    return "float32", ("no dtypes recorded in either run's layout.json: float32, the strictest default "
                       "(give --dtype for runs computed in lower precision)")


def config_differences(ref: Side, cand: Side) -> List[str]:
    out = []
    for k in ("kind", "framework", "stack", "world_size", "groups", "micro_batches", "monitors", "steps"):
        a, b = ref.provenance.get(k), cand.provenance.get(k)
        if a != b:
            out.append(f"{k}: {json.dumps(a)} vs {json.dumps(b)}")
    oa, ob = ref.provenance.get("ops") or {}, cand.provenance.get("ops") or {}
    for m in sorted(set(oa) & set(ob)):
        if oa[m] != ob[m]:
            out.append(f"{m} ops: {','.join(oa[m])} vs {','.join(ob[m])}")
    da, db = ref.dtypes, cand.dtypes
    diff = sorted(n for n in set(da) & set(db) if dtype_or(da[n]) != dtype_or(db[n]))
    if diff:
        out.append(f"dtypes: {len(diff)} tensor(s) differ, e.g. {diff[0]}: {da[diff[0]]} vs {db[diff[0]]}")
    return out


def dtype_or(text: str) -> str:
    try:
        return dtype_name(text)
    except InputError:
        return text


def needs_merge(ref: Side, cand: Side) -> bool:
    if (ref.layout.merged is None) != (cand.layout.merged is None):
        return True
    if ref.layout.merged is not None:
        return False
    a, b = ref.provenance, cand.provenance
    return (a.get("world_size"), a.get("groups")) != (b.get("world_size"), b.get("groups"))


def merge_side(side: Side, dest: str, problems: Problems) -> Side:
    from .merge import merge_run

    if not side.provenance.get("layout_json"):
        raise InputError(f"{side.label} {side.root}: the two runs have different parallel layouts and this one has "
                         f"no rank_<r>/layout.json to merge its ranks by: compare needs both merged under global names")
    merge_run(side.root, dest, problems=problems)
    merged = open_side(side.label, dest, problems)
    merged.merged_from = side.root
    merged.dtypes = side.dtypes
    merged.provenance.update({k: side.provenance.get(k) for k in ("stack", "framework", "ranks")})
    merged.provenance["merged_from"] = os.path.abspath(side.root)
    return merged


def polars_available() -> bool:
    try:
        import polars  # noqa: F401
    except ImportError:
        return False
    return True


def score(report: CompareReport, not_comparable_why: Optional[str]) -> None:
    ref, cand, base = report.ref, report.cand, report.baseline
    stats = report.settings.stats
    tol, floor = report.tolerance, report.floor
    min_noise = MIN_NOISE[report.dtype]
    counts = {COMPARED: 0, NEAR_ZERO: 0, NONFINITE: 0, PASS: 0, WARNING: 0, ERROR: 0, "no_baseline": 0}
    for key in sorted(set(ref.rows) | set(cand.rows),
                      key=lambda k: (k[2], k[0], k[1], k[4], k[3], _none_last(k[5]), _none_last(k[6]))):
        monitor, scope = key[1], key[4]
        if not_comparable_why and (monitor, scope) in PER_MICRO_SCOPES:
            nc = report.not_comparable.setdefault(f"{monitor}/{scope}",
                                                  {"ref": 0, "cand": 0, "why": not_comparable_why})
            nc["ref"] += key in ref.rows
            nc["cand"] += key in cand.rows
            continue
        r, c = ref.rows.get(key), cand.rows.get(key)
        if r is None or c is None:
            o = report.only.setdefault(monitor, {}).setdefault(scope, {"ref": 0, "cand": 0})
            o["ref" if r is not None else "cand"] += 1
            continue
        rv, cv = r[0], c[0]
        errs = {}
        for op in VALUE_OPS + ("nans",):
            if op in rv and op in cv:
                errs[op] = value_errors(float(rv[op]), float(cv[op]), floor)
        judged = [errs[s] for s in stats if s in errs]
        nan_mismatch = "nans" in errs and (float(rv["nans"]) > 0) != (float(cv["nans"]) > 0)
        if not judged and not nan_mismatch:
            continue
        if nan_mismatch or any(e[0] == NONFINITE for e in judged):
            cls, error = NONFINITE, math.nan
        elif all(e[0] == NEAR_ZERO for e in judged):
            cls, error = NEAR_ZERO, 0.0
        else:
            cls = COMPARED
            error = max(e[4] for e in judged if e[0] == COMPARED)
        res = RowResult(key=key, ref=rv, cand=cv, line=r[1], errors=errs, cls=cls, error=error)
        if cls == NONFINITE:
            res.level = ERROR
        elif cls == NEAR_ZERO:
            res.level = PASS
        elif base is not None:
            b = base.rows.get(key)
            if b is None:
                counts["no_baseline"] += 1
                res.level = _level_of(error, tol)
            else:
                noise = 0.0
                for s in stats:
                    if s in rv and s in b[0]:
                        e = value_errors(float(rv[s]), float(b[0][s]), floor)
                        if e[0] == COMPARED:
                            noise = max(noise, e[4])
                        elif e[0] == NONFINITE:
                            noise = math.inf
                res.noise = noise
                res.ratio = error / max(noise, min_noise)
                res.level = _ratio_level(res.ratio)
        else:
            res.level = _level_of(error, tol)
        counts[cls] += 1
        counts[res.level] += 1
        report.results.append(res)
    report.counts = counts
    verdict = PASS
    for res in report.results:
        verdict = worse(verdict, res.level)
    report.verdict = verdict


def _none_last(v: Optional[int]) -> int:
    return -1 if v is None else v  # the columnar path's sentinel: the same row order


def _beyond(res: RowResult) -> bool:
    return res.level != PASS


def aggregate(report: CompareReport) -> None:
    results = report.results
    tol = report.tolerance
    # first step each level is crossed
    for lvl in (WARNING, ERROR):
        st = [r.key[2] for r in results if LEVELS.index(r.level) >= LEVELS.index(lvl)]
        report.first_step[lvl] = min(st) if st else None
    # heat maps and pooled curves
    pooled: Dict[Tuple[str, str, int], List[float]] = {}
    for r in results:
        rank, monitor, step, name, scope = r.key[:5]
        e = r.error if r.cls == COMPARED else (math.inf if r.cls == NONFINITE else 0.0)
        k = (f"{monitor}/{scope}", rank, step)
        report.rank_steps[k] = max(report.rank_steps.get(k, 0.0), e)
        lk = (_layer_of(name), step)
        report.layer_steps[lk] = max(report.layer_steps.get(lk, 0.0), e)
        rn, cn = r.ref.get("norm"), r.cand.get("norm")
        if rn is not None and cn is not None and _finite(float(rn)) and _finite(float(cn)):
            acc = pooled.setdefault((monitor, scope, step), [0.0, 0.0, 0])
            acc[0] += float(rn) ** 2
            acc[1] += float(cn) ** 2
            acc[2] += 1
    def pooled_order(t: Tuple[Tuple[str, str, int], List[float]]) -> Tuple[int, int, str, str]:
        (monitor, scope, step), _ = t
        return step, rows.execution_phase(monitor, scope), monitor, scope

    for (monitor, scope, step), (sr, sc, n) in sorted(pooled.items(), key=pooled_order):
        a, b = math.sqrt(sr), math.sqrt(sc)
        report.pooled.append({"monitor": monitor, "scope": scope, "step": step, "ref_norm": a, "cand_norm": b,
                              "scaled_error": abs(b - a) / max(a, b, report.floor), "rows": n})
    report.grows_after_reduce = _grows_after_reduce(report, tol)
    # where they part: the earliest (step, phase) with a row beyond tolerance
    beyond = [r for r in results if _beyond(r)]
    if not beyond:
        return
    first = min(beyond, key=lambda r: (r.key[2], r.phase))
    step, phase = first.key[2], first.phase
    at = [r for r in results if r.key[2] == step and r.phase == phase]
    unreduced = [r for r in results if r.key[2] == step and r.phase == 3]
    locate(report, at, step, phase, len(unreduced), any(_beyond(r) for r in unreduced))


def locate(report: CompareReport, at: List[RowResult], step: int, phase: int, unreduced_rows: int,
           unreduced_beyond: bool) -> None:
    """``report.part`` and ``report.worst`` from the rows ``at`` the earliest (step, phase)
    with a row beyond tolerance (``report.grows_after_reduce`` already filled)."""
    at_beyond = [r for r in at if _beyond(r)]
    first_row = min(at_beyond, key=lambda r: (r.line, r.key[0], r.key[1], r.key[3], _none_last(r.key[5]),
                                              _none_last(r.key[6])))
    part: Dict[str, Any] = {"step": step, "phase": PHASE_NAMES.get(phase, "other"), "phase_label": PHASE_LABELS[phase],
                            "rows": len(at), "rows_beyond": len(at_beyond), "first_row": _row_json(first_row)}
    # the worst layers of that (step, phase)
    layers: Dict[str, List[RowResult]] = {}
    for r in at:
        if r.cls != NEAR_ZERO:
            layers.setdefault(_layer_of(r.key[3]), []).append(r)
    ranked = []
    for layer, rs in layers.items():
        errs = [r.error for r in rs if r.cls == COMPARED]
        worst_row = min(rs, key=lambda r: (r.cls != NONFINITE, -(r.error if r.error == r.error else 0.0), r.line,
                                           r.key[0], r.key[3], _none_last(r.key[5]), _none_last(r.key[6])))
        ranked.append({"layer": layer, "max_error": math.inf if worst_row.cls == NONFINITE else worst_row.error,
                       "p95_error": _p95(errs), "rows": len(rs), "rows_beyond": sum(1 for r in rs if _beyond(r)),
                       "worst_row": _row_json(worst_row)})
    ranked.sort(key=lambda d: (-d["max_error"], d["layer"]))
    report.worst = ranked[: report.settings.top]
    # msProbe's input/output rule for module rows: where the error is born
    if phase in (1, 2):
        part["born_at"] = _module_rule(report, at)
    if phase == 5:
        in_step = [g for g in report.grows_after_reduce if g["step"] == step]
        part["reduced_not_unreduced"] = bool(in_step) and unreduced_rows > 0 and not unreduced_beyond
        part["unreduced_rows"] = unreduced_rows
    report.part = part


def _module_rule(report: CompareReport, at: List[RowResult]) -> Optional[Dict[str, Any]]:
    """The first module (in call order: its output row's line) whose output error exceeds
    10 x its input error and the tolerance (warning), or whose input error is below 0.1 and
    output error above 0.5 (error)."""
    per: Dict[Tuple[int, str, Optional[int]], Dict[str, Any]] = {}
    for r in at:
        if r.key[1] != rows.MODULE or r.cls == NEAR_ZERO:
            continue
        tk = _module_tag(r.key[3])
        if tk is None:
            continue
        tag, kind = tk
        backward = r.key[4] == rows.BACKWARD
        side = "out" if kind in ((rows.GRAD_INPUT,) if backward else (rows.OUTPUT,)) else \
            "in" if kind in ((rows.GRAD_OUTPUT,) if backward else (rows.INPUT,)) else None
        if side is None:
            continue
        e = math.inf if r.cls == NONFINITE else r.error
        d = per.setdefault((r.key[0], tag, r.key[6]), {"in": None, "out": None, "line": None, "rank": r.key[0]})
        d[side] = e if d[side] is None else max(d[side], e)
        if side == "out" and (d["line"] is None or r.line < d["line"]):
            d["line"] = r.line
    found = []
    for (rank, tag, dp), d in per.items():
        if d["in"] is None or d["out"] is None:
            continue
        i, o = d["in"], d["out"]
        level = None
        if i < MODULE_ERROR_INPUT and o > MODULE_ERROR_OUTPUT:
            level = ERROR
        elif o > report.tolerance and o > MODULE_WARNING_FACTOR * i:
            level = WARNING
        if level:
            found.append({"module": tag, "rank": rank, "dp_rank": dp, "input_error": i, "output_error": o,
                          "level": level, "line": d["line"]})
    found.sort(key=lambda f: (f["line"], f["rank"], f["module"]))
    report.module_rule = found
    return found[0] if found else None


def _grows_after_reduce(report: CompareReport, tol: float) -> List[Dict[str, Any]]:
    unreduced: Dict[Tuple[int, int, str, Optional[int]], float] = {}
    reduced: Dict[Tuple[int, int, str, Optional[int]], RowResult] = {}
    for r in report.results:
        rank, monitor, step, name, scope, micro, dp = r.key
        if monitor != rows.WEIGHT_GRAD or r.cls == NEAR_ZERO:
            continue
        e = math.inf if r.cls == NONFINITE else r.error
        if scope == rows.UNREDUCED:
            k = (rank, step, name, None)
            unreduced[k] = max(unreduced.get(k, 0.0), e)
        elif scope == rows.REDUCED:
            reduced[(rank, step, name, None)] = r
    out = []
    for k, r in reduced.items():
        u = unreduced.get(k)
        if u is None or not _beyond(r):
            continue
        if u <= tol:
            out.append({"rank": k[0], "step": k[1], "tensor": k[2], "unreduced_error": u,
                        "reduced_error": math.inf if r.cls == NONFINITE else r.error, "level": r.level})
    out.sort(key=lambda g: (g["step"], -g["reduced_error"], g["rank"], g["tensor"]))
    return out


def _row_json(r: RowResult) -> Dict[str, Any]:
    rank, monitor, step, name, scope, micro, dp = r.key
    d = {"rank": rank, "monitor": monitor, "step": step, "tensor": name, "scope": scope, "micro_step": micro,
         "class": r.cls, "error": r.error, "level": r.level}
    if dp is not None:
        d["dp_rank"] = dp
    for s in ("norm",):
        if s in r.ref and s in r.cand:
            d["ref_" + s], d["cand_" + s] = float(r.ref[s]), float(r.cand[s])
    if r.ratio is not None:
        d["noise"], d["ratio"] = r.noise, r.ratio
    return d


# ------------------------------------------------------------------ compare.csv
CSV_KEY_COLUMNS = ("rank", "monitor", "step", "module_name", "scope", "micro_step", "dp_rank")


def write_csv(report: CompareReport, path: str) -> int:
    """Every aligned row: both values of every statistic, the four errors of each value
    statistic, the row's class, judged error, level (and the baseline's noise and ratio)."""
    ops = [op for op in VALUE_OPS + ("nans",) if any(op in r.ref for r in report.results[:1])] or list(VALUE_OPS)
    cols = list(CSV_KEY_COLUMNS)
    for op in ops:
        cols += [f"ref_{op}", f"cand_{op}"]
    for op in ops:
        if op in VALUE_OPS:
            cols += [f"{op}_signed", f"{op}_abs", f"{op}_rel", f"{op}_scaled"]
    cols += ["class", "error", "level"]
    if report.baseline is not None:
        cols += ["noise", "ratio"]
    n = 0
    with open(path, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(cols)
        for r in report.results:
            rank, monitor, step, name, scope, micro, dp = r.key
            row: List[Any] = [rank, monitor, step, name, scope, "" if micro is None else micro,
                              "" if dp is None else dp]
            for op in ops:
                row += [_cell(r.ref.get(op)), _cell(r.cand.get(op))]
            for op in ops:
                if op in VALUE_OPS:
                    e = r.errors.get(op)
                    row += [_cell(x) for x in e[1:]] if e else ["", "", "", ""]
            row += [r.cls, _cell(r.error), r.level]
            if report.baseline is not None:
                row += [_cell(r.noise), _cell(r.ratio)]
            w.writerow(row)
            n += 1
    return n


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v) if v == v else "NaN"  # as Polars writes it (the columnar path)
    return str(v)
