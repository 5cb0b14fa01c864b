"""``merge``'s mixture-of-experts part: the routers' token counts summed over the ranks
that route different tokens.

The ``moe`` monitor's ``"per_expert": true`` writes each router's raw token counts per
expert and step to ``rank_<r>/moe_counts_step<a>-<b>.csv`` (header
``vpp_stage,step,module_name,counts``; ``module_name`` is ``<router>.tokens_per_expert``,
``counts`` ``c_0;c_1;...`` over all E experts, global indices). A rank counts its own
tokens only; the model's load is the sum over the groups in which ranks see different
tokens, which ``layout.json`` names per router (``moe.<router>.tokens.split``: data and
context parallel, and tensor parallel with sequence parallelism). Ranks that differ only
in the other groups route the same tokens: replicas, which must agree.

:func:`merge_token_counts` writes ``DEST/moe_counts.csv`` (``step,module_name,counts``:
the global vectors) and ``DEST/moe.csv`` (``step,module_name,scope,min,max,mean,norm,
nans,zeros``, scope ``routing``: the statistics of each global vector, as the monitor's
``tokens_per_expert`` rows hold them for one rank; the merged view's ``moe`` file, which
``summary``/``anomalies``/``plot`` read with the routers' E and top-k from ``merge.json``'s
``moe``), router names under the layout's ``rename`` rules. A router whose ranks do not
cover its groups, or that a rank's layout does not describe, is left out and said in the
report's notes; replicas that disagree are counted there (the lowest rank's vector is
used). Standard library only.
"""

import csv
import io
import math
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import layout as lay
from ..errors import UnsafePathError
from ..safe_fs import SafeDir, read_regular_file

SIDECAR_RE = re.compile(r"^moe_counts_step(\d+)-(\d+)(?:\.run(\d+))?\.csv$")
COUNTS_FILE = "moe_counts.csv"
# the global rows are the merged view's moe monitor file (summary/anomalies/plot read it)
TOKENS_FILE = "moe.csv"
TOKENS_SUFFIX = ".tokens_per_expert"
ROUTING = "routing"
TOKENS_HEADER = ("step", "module_name", "scope", "min", "max", "mean", "norm", "nans", "zeros")


def _sidecars(rank_dir: str) -> List[str]:
    """The rank's sidecar files in the order they were written (windows by first step; a
    window's ``.run<k>`` after its plain file)."""
    try:
        names = os.listdir(rank_dir)
    except OSError:
        return []
    found = []
    for name in names:
        m = SIDECAR_RE.match(name)
        if m is not None:
            found.append(((int(m.group(1)), int(m.group(3) or 1)), name))
    return [os.path.join(rank_dir, name) for _, name in sorted(found)]


def read_sidecar(path: str) -> List[Tuple[int, int, str, List[int]]]:
    """``(vpp_stage, step, module_name, counts)`` of each well-formed row of a sidecar file."""
    text = read_regular_file(path, 1 << 30, "moe counts file").decode("utf-8", errors="replace")
    out = []
    for row in csv.DictReader(io.StringIO(text)):
        try:
            counts = [int(c) for c in (row.get("counts") or "").split(";") if c != ""]
            out.append((int(row["vpp_stage"]), int(row["step"]), str(row["module_name"]), counts))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def vector_stats(counts: Sequence[int]) -> Tuple[float, float, float, float, int, int]:
    """``(min, max, mean, norm, nans, zeros)`` of a count vector."""
    if not counts:
        return (math.nan, math.nan, math.nan, 0.0, 0, 0)
    return (float(min(counts)), float(max(counts)), sum(counts) / len(counts),
            math.sqrt(sum(c * c for c in counts)), 0, sum(1 for c in counts if c == 0))


def _router_split(doc: Dict[str, Any], router: str) -> Optional[List[List[Any]]]:
    entry = (doc.get("moe") or {}).get(router)
    tokens = entry.get("tokens") if isinstance(entry, dict) else None
    split = tokens.get("split") if isinstance(tokens, dict) else None
    if not isinstance(split, list):
        return None
    try:
        return [[str(g), int(i), int(n)] for g, i, n in split]
    except (TypeError, ValueError):
        return None


def merge_token_counts(rank_dirs: Dict[int, str], docs: Dict[int, Dict[str, Any]], out: SafeDir,
                       notes: List[str], routers: Optional[Dict[str, Dict[str, Any]]] = None) -> Optional[int]:
    """Write the global token counts (see the module doc); returns the rows written to
    ``TOKENS_FILE`` (None, and no file, where no rank wrote a sidecar). ``routers`` gets each
    written router's ``num_experts``/``top_k``/``score`` under its global name (the
    lowest rank's layout entry)."""
    described: Dict[str, Dict[str, Any]] = {}
    # (step, global name) -> piece identity -> [(rank, counts)]
    groups: Dict[Tuple[int, str], Dict[Tuple[Tuple[str, int], ...], List[Tuple[int, List[int]]]]] = {}
    wholes: Dict[Tuple[int, str], int] = {}
    undescribed: Dict[str, List[int]] = {}
    found = False
    for rank in sorted(rank_dirs):
        doc = docs.get(rank)
        latest: Dict[Tuple[int, str], Tuple[int, List[int]]] = {}
        for path in _sidecars(rank_dirs[rank]):
            found = True
            try:
                rows = read_sidecar(path)
            except (OSError, UnsafePathError) as exc:
                notes.append(f"{path}: not read ({exc})")
                continue
            for vpp, step, name, counts in rows:
                latest[(step, name)] = (vpp, counts)  # a later run's row of the same step wins
        if doc is None:
            continue
        rules = [tuple(r) for r in (doc.get("rename") or []) if isinstance(r, (list, tuple)) and len(r) == 2]
        for (step, name), (_, counts) in latest.items():
            router = name[: -len(TOKENS_SUFFIX)] if name.endswith(TOKENS_SUFFIX) else name
            split = _router_split(doc, router)
            if split is None:
                undescribed.setdefault(router, []).append(rank)
                continue
            gname = lay.rename(name, rules)
            ident = tuple(sorted((g, i) for g, i, _ in split))
            whole = 1
            for _, _, n in split:
                whole *= max(1, n)
            groups.setdefault((step, gname), {}).setdefault(ident, []).append((rank, counts))
            wholes[(step, gname)] = whole
            entry = (doc.get("moe") or {}).get(router) or {}
            described.setdefault(lay.rename(router, rules), {
                k: entry[k] for k in ("num_experts", "top_k", "score") if k in entry})
    if not found:
        return None
    for router, ranks in sorted(undescribed.items()):
        notes.append(f"moe counts of {router} (ranks {','.join(map(str, sorted(set(ranks))))}) left out: "
                     f"the rank's {lay.FILE_NAME} does not say over which groups its tokens differ (moe.<router>.tokens)")
    count_lines = ["step,module_name,counts\n"]
    token_lines = [",".join(TOKENS_HEADER) + "\n"]
    incomplete: List[str] = []
    disagree = 0
    for (step, gname), pieces in sorted(groups.items()):
        vectors = []
        for reps in pieces.values():
            first = reps[0][1]
            if any(counts != first for _, counts in reps[1:]):
                disagree += 1
            vectors.append(first)
        if len(pieces) != wholes[(step, gname)] or len({len(v) for v in vectors}) != 1:
            incomplete.append(f"{gname} step {step}")
            continue
        total = [sum(col) for col in zip(*vectors)]
        count_lines.append(f"{step},{gname},{';'.join(map(str, total))}\n")
        router = gname[: -len(TOKENS_SUFFIX)] if gname.endswith(TOKENS_SUFFIX) else gname
        if routers is not None and router in described:
            routers.setdefault(router, described[router])
        mn, mx, mean, norm, nans, zeros = vector_stats(total)
        token_lines.append(f"{step},{gname},{ROUTING},{mn:.9g},{mx:.9g},{mean:.9g},{norm:.9g},{nans},{zeros}\n")
    if incomplete:
        notes.append(f"moe counts left out where the ranks do not cover every group the tokens differ over: "
                     f"{', '.join(incomplete[:5])}{' ...' if len(incomplete) > 5 else ''} ({len(incomplete)})")
    if disagree:
        notes.append(f"moe counts: {disagree} router step(s) whose replicas (ranks routing the same tokens) "
                     "wrote different counts; the lowest rank's were used")
    out.write_bytes(COUNTS_FILE, "".join(count_lines).encode("utf-8", errors="backslashreplace"))
    out.write_bytes(TOKENS_FILE, "".join(token_lines).encode("utf-8", errors="backslashreplace"))
    return len(token_lines) - 1
