"""MoE findings of ``summary``/``anomalies`` (and the heat maps of ``plot``): read from the
``moe`` rows (``rows.MOE_KINDS``), the routers' ``layout.json`` entries (E, top-k) and the
``<param>.expert_norms`` rows of gradient scopes where a run has them.

Per rank and router, over the written steps in order (each step's latest rows):

- **dead experts**: ``tokens_per_expert`` with ``zeros`` > 0 on ``dead_steps`` consecutive
  written steps (or an ``expert_norms`` gradient row with ``zeros`` > 0 as long);
- **load imbalance**: MaxVio = max/mean - 1 above ``maxvio``, or CV =
  sqrt(max(norm^2/E - mean^2, 0))/mean above ``cv``, on ``dead_steps`` consecutive steps;
- **routing collapse**: the mean token entropy below ``entropy_fraction`` x log(k) on as many
  consecutive steps (k from ``layout.json``; k = 1 is never flagged: log 1 = 0);
- **logit growth**: the largest |logit| of the latest step at least ``logit_growth`` times
  the first written step's and above ``logit_floor``;
- **near-duplicate experts**: the largest pairwise cosine of the router weight's rows at or
  above ``cosine`` on the latest step.

Per-expert rows (:func:`expert_spread`, shown by ``summary``/``anomalies``): the rows of
one parameter of every expert of a layer (``...experts.<i>.<param>`` of a list of expert
modules, ``<param>.expert.<e>`` of a grouped tensor) grouped by expert index, with the
quietest and loudest expert's gradient norm at the latest step.

On a merged view (``merge``'s DEST) the ``moe`` rows are the global ``tokens_per_expert``
rows summed from the ranks' sidecars, and E and top-k come from ``merge.json``'s ``moe``:
a dead expert is one that no rank sent a token to.

Standard library only, as the rest of the reading tools' core.
"""

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .. import rows
from .reader import Layout, Problems, StepRange, iter_rows

EXPERT_NORMS = "expert_norms"
_GRADIENT_SCOPES = (rows.UNREDUCED, rows.REDUCED)

DEAD = "dead experts"
DEAD_GRAD = "experts without gradient"
IMBALANCE = "load imbalance"
COLLAPSE = "routing collapse"
LOGIT_GROWTH = "logit growth"
DUPLICATE = "near-duplicate experts"


@dataclass(frozen=True)
class MoeSettings:
    dead_steps: int = 3
    maxvio: float = 1.0
    cv: float = 1.0
    entropy_fraction: float = 0.5
    logit_growth: float = 10.0
    logit_floor: float = 10.0
    cosine: float = 0.99

    def describe(self) -> str:
        return (f"dead: zero tokens (or zero gradient) on {self.dead_steps} consecutive written steps; imbalance: "
                f"MaxVio > {self.maxvio:g} or CV > {self.cv:g} as long; collapse: mean entropy < "
                f"{self.entropy_fraction:g} x log(top_k) as long; logit growth: max |logit| >= "
                f"{self.logit_growth:g} x the first step's and > {self.logit_floor:g}; duplicates: max weight cosine "
                f">= {self.cosine:g}")


def maxvio(vals: Dict[str, float]) -> float:
    """max/mean - 1 of a ``tokens_per_expert`` row (NaN without tokens)."""
    mean = vals.get("mean", math.nan)
    return vals.get("max", math.nan) / mean - 1.0 if mean and mean > 0 else math.nan


def cv(vals: Dict[str, float], experts: Optional[int]) -> float:
    """sqrt(max(norm^2/E - mean^2, 0))/mean (population), E from layout.json."""
    mean = vals.get("mean", math.nan)
    norm = vals.get("norm", math.nan)
    if not experts or not mean or mean <= 0:
        return math.nan
    return math.sqrt(max(norm * norm / experts - mean * mean, 0.0)) / mean


def _layout_doc(root: str, rank: int) -> Dict[str, Any]:
    path = os.path.join(root, f"rank_{rank}", "layout.json")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def router_layout(root: str, rank: int) -> Dict[str, Dict[str, Any]]:
    """``layout.json``'s ``moe`` of a rank ({} where absent or unreadable)."""
    moe = _layout_doc(root, rank).get("moe")
    return moe if isinstance(moe, dict) else {}


def has_grouped_experts(root: str, rank: int) -> bool:
    """Whether a rank's ``layout.json`` names routers or a parameter of three or more
    dimensions (grouped experts, whose gradient rows may have ``expert_norms``): only then
    are its ``weight_grad`` files read again for them (they can be large)."""
    doc = _layout_doc(root, rank)
    if doc.get("moe"):
        return True
    params = doc.get("params")
    return isinstance(params, dict) and any(
        isinstance(p, dict) and isinstance(p.get("shape"), list) and len(p["shape"]) >= 3 for p in params.values())


def _latest_rows(layout: Layout, rank: int, monitor: str, problems: Problems,
                 steps: Optional[StepRange]) -> Dict[Tuple[str, str], Dict[int, Dict[str, float]]]:
    """(name, scope) -> step -> values: each step's latest row (the files in the order their
    runs wrote them: by window, run series and time)."""
    out: Dict[Tuple[str, str], Dict[int, Dict[str, float]]] = {}
    # CSV files only: an exported dataset's Parquet partitions are not read here (no MoE
    # findings on an exported dataset)
    files = sorted((f for f in layout.files_of(rank, monitor) if f.path.endswith(".csv")),
                   key=lambda f: (f.first, f.run, f.mtime_ns))
    for f in files:
        for row in iter_rows(f, problems, steps):
            if monitor == rows.WEIGHT_GRAD and not row.name.endswith("." + EXPERT_NORMS):
                continue
            if monitor == rows.WEIGHT_GRAD and row.micro not in (None, 0) and row.scope == rows.UNREDUCED:
                # per-micro-batch rows: an expert idle in one micro-batch is not dead
                continue
            out.setdefault((row.name, row.scope), {})[row.step] = row.vals
    return out


def _streak(series: List[Tuple[int, bool]], need: int) -> Optional[Tuple[int, int]]:
    """The first run of at least ``need`` consecutive True values: (its first step, its length)."""
    start, length = 0, 0
    for step, hit in series:
        if hit:
            start = step if length == 0 else start
            length += 1
        elif length >= need:
            return start, length
        else:
            length = 0
    return (start, length) if length >= need else None


def moe_findings(layout: Layout, problems: Problems, settings: MoeSettings,
                 steps: Optional[StepRange] = None) -> Optional[List[Dict[str, Any]]]:
    """The MoE findings over every rank, or None where the output has no moe rows nor
    expert_norms rows (nothing to say)."""
    found: List[Dict[str, Any]] = []
    any_rows = False
    for rank in layout.ranks:
        # a merged view: the global routers merge described (its moe.csv holds the global counts)
        routers = (layout.merged.get("moe") or {}) if layout.merged is not None else router_layout(layout.root, rank)
        moe_rows = _latest_rows(layout, rank, rows.MOE, problems, steps) if layout.files_of(rank, rows.MOE) else {}
        grad_rows = (_latest_rows(layout, rank, rows.WEIGHT_GRAD, problems, steps)
                     if layout.files_of(rank, rows.WEIGHT_GRAD)
                     and (layout.merged is not None or has_grouped_experts(layout.root, rank)) else {})
        any_rows = any_rows or bool(moe_rows) or bool(grad_rows)
        for (name, scope), by_step in sorted(moe_rows.items()):
            parsed = rows.moe_router_of(name)
            if parsed is None or scope == rows.EVAL_ROUTING:
                continue
            router, kind = parsed
            info = routers.get(router, {})
            series = sorted(by_step.items())
            found += _router_findings(rank, router, kind, series, info, settings)
        for (name, scope), by_step in sorted(grad_rows.items()):
            if scope not in _GRADIENT_SCOPES:
                continue
            series = sorted(by_step.items())
            hit = _streak([(s, (v.get("zeros") or 0) > 0) for s, v in series], settings.dead_steps)
            if hit is not None:
                worst = max(int(v.get("zeros") or 0) for s, v in series if s >= hit[0])
                found.append(_item(DEAD_GRAD, rank, name[:-len(EXPERT_NORMS) - 1], hit[0], hit[1], worst,
                                   f"{worst} expert(s) got no gradient ({scope}) on {hit[1]} consecutive written "
                                   f"steps from step {hit[0]}"))
    if not any_rows:
        return None
    return found


def _item(kind: str, rank: int, where: str, step: int, steps: int, value: float, detail: str) -> Dict[str, Any]:
    return {"kind": kind, "rank": rank, "router": where, "step": step, "steps": steps, "value": value,
            "detail": detail}


def _router_findings(rank: int, router: str, kind: str, series: List[Tuple[int, Dict[str, float]]],
                     info: Dict[str, Any], settings: MoeSettings) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    need = settings.dead_steps
    experts = info.get("num_experts")
    top_k = info.get("top_k")
    if kind == rows.TOKENS_PER_EXPERT:
        hit = _streak([(s, (v.get("zeros") or 0) > 0) for s, v in series], need)
        if hit is not None:
            worst = max(int(v.get("zeros") or 0) for s, v in series if s >= hit[0])
            of = f" of {experts}" if experts else ""
            out.append(_item(DEAD, rank, router, hit[0], hit[1], worst,
                             f"{worst} expert(s){of} got no token on {hit[1]} consecutive written steps from step "
                             f"{hit[0]}"))
        flags = [(s, maxvio(v) > settings.maxvio or cv(v, experts) > settings.cv) for s, v in series]
        hit = _streak(flags, need)
        if hit is not None:
            at = dict(series)[hit[0]]
            out.append(_item(IMBALANCE, rank, router, hit[0], hit[1], round(maxvio(at), 6),
                             f"MaxVio {maxvio(at):.3g}, CV {cv(at, experts):.3g} at step {hit[0]} (the most loaded "
                             f"expert has {at.get('max', math.nan):g} tokens, the mean {at.get('mean', math.nan):g}); "
                             f"{hit[1]} consecutive written steps"))
    elif kind == rows.TOKEN_ENTROPY and isinstance(top_k, int) and top_k > 1:
        floor = settings.entropy_fraction * math.log(top_k)
        hit = _streak([(s, v.get("mean", math.nan) < floor) for s, v in series], need)
        if hit is not None:
            at = dict(series)[hit[0]]
            out.append(_item(COLLAPSE, rank, router, hit[0], hit[1], at.get("mean"),
                             f"mean token entropy {at.get('mean', math.nan):.3g} < {settings.entropy_fraction:g} x "
                             f"log({top_k}) = {floor:.3g} at step {hit[0]}: tokens are routed to fewer than top_k "
                             f"experts' worth of probability; {hit[1]} consecutive written steps"))
    elif kind == rows.LOGITS and len(series) >= 2:
        def peak(v: Dict[str, float]) -> float:
            return max(abs(v.get("min", math.nan)), abs(v.get("max", math.nan)))
        first, last = peak(series[0][1]), peak(series[-1][1])
        if last > settings.logit_floor and first > 0 and last >= settings.logit_growth * first:
            out.append(_item(LOGIT_GROWTH, rank, router, series[-1][0], len(series), last,
                             f"max |logit| {last:.3g} at step {series[-1][0]}, {last / first:.3g} x step "
                             f"{series[0][0]}'s {first:.3g}: the softmax saturates"))
    elif kind == rows.WEIGHT_COSINE and series:
        step, v = series[-1]
        top = v.get("max", math.nan)
        if top >= settings.cosine:
            out.append(_item(DUPLICATE, rank, router, step, 1, top,
                             f"two experts' router rows have cosine {top:.6g} at step {step}: they receive the same "
                             f"tokens"))
    return out


def moe_table(findings: List[Dict[str, Any]]) -> Tuple[List[str], List[List[Any]]]:
    headers = ["rank", "finding", "router / parameter", "from step", "steps", "value", "detail"]
    return headers, [[f["rank"], f["kind"], f["router"], f["step"], f["steps"], f["value"], f["detail"]]
                     for f in findings]


# ----------------------------------------------------------------------- heat maps
def heat_maps(layout: Layout, rank: int, problems: Problems,
              steps: Optional[StepRange] = None) -> Tuple[List[str], List[int], List[List[float]], List[List[float]]]:
    """``(routers, steps, maxvio[router][step], dead[router][step])`` of one rank (NaN where
    a router has no row at a step): the layer x step heat maps of ``plot``."""
    data = _latest_rows(layout, rank, rows.MOE, problems, steps) if layout.files_of(rank, rows.MOE) else {}
    per: Dict[str, Dict[int, Dict[str, float]]] = {}
    for (name, scope), by_step in data.items():
        parsed = rows.moe_router_of(name)
        if parsed is not None and parsed[1] == rows.TOKENS_PER_EXPERT and scope == rows.ROUTING:
            per[parsed[0]] = by_step
    routers = list(per)
    all_steps = sorted({s for by in per.values() for s in by})
    vio = [[maxvio(per[r][s]) if s in per[r] else math.nan for s in all_steps] for r in routers]
    dead = [[float(per[r][s].get("zeros") or 0) if s in per[r] else math.nan for s in all_steps] for r in routers]
    return routers, all_steps, vio, dead


# ----------------------------------------------------------------------- per-expert rows
# a row of one expert: a module of a list of experts (transformers 4.x ``experts.<i>.``,
# Megatron-Core ``SequentialMLP``'s ``local_experts.<i>.``, DeepSpeed ``deepspeed_experts.<i>.``),
# or a grouped tensor's ``<param>.expert.<e>`` row (``"per_expert": true``)
_EXPERT_MODULE = re.compile(r"^(?P<head>.*(?:^|\.)[^.]*experts\.)(?P<e>\d+)(?P<tail>\..+)$")
_EXPERT_ROW = re.compile(r"^(?P<head>.+\.expert\.)(?P<e>\d+)(?P<tail>)$")
_SPREAD_SCOPES = (rows.REDUCED, rows.UNREDUCED)  # the first present, per group
SPREAD_HEADERS = ["rank", "experts of", "scope", "step", "experts", "quietest", "norm", "loudest", "norm",
                  "loudest / quietest"]


def expert_group(name: str) -> Optional[Tuple[str, int]]:
    """``(name with the expert index as <e>, e)`` of a per-expert row, None for another row."""
    m = _EXPERT_MODULE.match(name) or _EXPERT_ROW.match(name)
    if m is None:
        return None
    return f"{m.group('head')}<e>{m.group('tail')}", int(m.group("e"))


def expert_spread(layout: Layout, problems: Problems,
                  steps: Optional[StepRange] = None) -> Optional[List[Dict[str, Any]]]:
    """The quietest and loudest expert of each group of per-expert gradient rows (the same
    parameter of every expert of a layer), at the latest step of each rank: ``weight_grad``
    rows of scope ``reduced`` (``unreduced``, its last micro-step's row, where a run has no
    reduced rows). None where no rank has such rows. Read only where a rank's layout names routers
    or grouped experts (or on a merged view): a dense model's gradient files are not read
    again."""
    out: List[Dict[str, Any]] = []
    for rank in layout.ranks:
        if not layout.files_of(rank, rows.WEIGHT_GRAD):
            continue
        if layout.merged is None and not has_grouped_experts(layout.root, rank):
            continue
        # (group, scope) -> step -> expert -> norm
        groups: Dict[Tuple[str, str], Dict[int, Dict[int, float]]] = {}
        files = sorted((f for f in layout.files_of(rank, rows.WEIGHT_GRAD) if f.path.endswith(".csv")),
                       key=lambda f: (f.first, f.run, f.mtime_ns))
        for f in files:
            for row in iter_rows(f, problems, steps):
                # a merged view's unreduced rows: data-parallel rank 0's; rows of several
                # micro-steps of a step: the last one read (the gradient accumulated so far)
                if row.scope not in _SPREAD_SCOPES or row.dp not in (None, 0):
                    continue
                hit = expert_group(row.name)
                norm = row.vals.get("norm")
                if hit is None or norm is None or math.isnan(norm):
                    continue
                groups.setdefault((hit[0], row.scope), {}).setdefault(row.step, {})[hit[1]] = norm
        taken = set()
        for scope in _SPREAD_SCOPES:
            for (group, sc), by_step in sorted(groups.items()):
                if sc != scope or group in taken:
                    continue
                taken.add(group)
                step = max(by_step)
                norms = by_step[step]
                if len(norms) < 2:
                    continue
                quiet = min(norms, key=lambda e: (norms[e], e))
                loud = max(norms, key=lambda e: (norms[e], -e))
                # None: the quietest expert got no gradient (no finite ratio; strict JSON has no inf)
                ratio = norms[loud] / norms[quiet] if norms[quiet] > 0 else None
                out.append({"rank": rank, "group": group, "scope": scope, "step": step, "experts": len(norms),
                            "quietest": quiet, "quietest_norm": norms[quiet], "loudest": loud,
                            "loudest_norm": norms[loud], "ratio": ratio})
    return out or None


def spread_table(spread: List[Dict[str, Any]]) -> Tuple[List[str], List[List[Any]]]:
    return SPREAD_HEADERS, [[s["rank"], s["group"], s["scope"], s["step"], s["experts"], s["quietest"],
                             f"{s['quietest_norm']:.6g}", s["loudest"], f"{s['loudest_norm']:.6g}",
                             "inf" if s["ratio"] is None else f"{s['ratio']:.3g}"] for s in spread]
