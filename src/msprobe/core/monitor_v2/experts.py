"""Per-expert statistics of grouped experts (framework-neutral part).

A mixture-of-experts model keeps the weights of its experts either as one module per
expert (transformers 4.x, Megatron-Core's ``SequentialMLP``, DeepSpeed: their rows are
per expert already) or as one tensor whose first dimension is the (local) expert count:
transformers 5.x ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``,
TorchTitan's ``experts.w1/w2/w3``. One row for such a tensor hides a dead expert in the
norm of the live ones, so ``weight_grad``, ``param`` and ``optimizer`` add, beside the
tensor's own row (which stays):

- ``<row>.expert_norms``: the statistics of the vector of the E per-expert L2 norms
  (min/max = the quietest/loudest expert, ``norm`` = the tensor's norm, ``zeros`` = the
  experts whose slice is all zeros: in the gradient scopes, the experts that got no
  gradient; ``nans`` = the experts with a NaN);
- ``<row>.expert.<e>`` (only with ``"per_expert": true``): the full statistics of
  expert ``e``'s slice (``e`` the local index; ``merge`` renames it to the global one).

``<row>`` is the tensor's own row name (``<param>.exp_avg`` for an optimizer state).

Which parameters are grouped experts: the monitor's ``expert_params`` (regular
expressions searched in the parameter's name), or by default every 3-D parameter
directly under a module whose name contains ``experts`` (``DEFAULT_RULE``); the first
dimension is the expert count. ``"expert_params": []`` turns the rows off.

One read of the data. In host memory the E slices (views, no copy) are read with the
step's other tensors in one ``record_many``; the tensor's own row is the merge of the E
records (min of mins, max of maxes, summed sums, squares and counts, as every row
merges), and ``expert_norms`` is built from the E norms, on the host where the engine's
records are host values already (the CPU kernel), else from the records' device norms
(``Session.expert_norm_vector``). On an accelerator the E records come from reductions
along the expert dimension (``Session.expert_device_records``: a handful of launches per
tensor, not four or five per expert), with the ``[E]`` norms for ``expert_norms``;
``to_host`` moves them with the step's other values. A session without
``expert_norm_vector`` (MindSpore) writes no per-expert rows, said once.
"""

import logging
import math
import re
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .checks import Fields, check_bool, fail
from .logonce import LogOnce
from .stats import Record, record_type

logger = logging.getLogger("msprobe.monitor_v2")

NORMS_SUFFIX = ".expert_norms"
EXPERT_INFIX = ".expert."
# the default rule: a 3-D parameter whose module path has a component containing "experts"
DEFAULT_RULE = r"(^|[.:])[^.:]*experts[^.:]*\.[^.]+$"
_DEFAULT_RE = re.compile(DEFAULT_RULE)


def norms_name(row_name: str) -> str:
    """The ``expert_norms`` row of the tensor row ``row_name``."""
    return row_name + NORMS_SUFFIX


def expert_name(row_name: str, index: int) -> str:
    """The per-expert row of expert ``index`` of the tensor row ``row_name``."""
    return f"{row_name}{EXPERT_INFIX}{index}"


_EXPERT_ROW_RE = re.compile(r"^(.*)\.expert\.(\d+)$")


def split_row_name(name: str) -> Tuple[str, str, Optional[int]]:
    """``(tensor row, kind, local expert)`` of a row name: kind ``"norms"`` for an
    ``expert_norms`` row, ``"expert"`` for a per-expert row, ``""`` for any other (then the
    tensor row is ``name`` itself)."""
    if name.endswith(NORMS_SUFFIX):
        return name[: -len(NORMS_SUFFIX)], "norms", None
    m = _EXPERT_ROW_RE.match(name)
    if m is not None:
        return m.group(1), "expert", int(m.group(2))
    return name, "", None


def check_regex_list(path: str, value: Any) -> Tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise fail(path, value, "must be a list of regular expressions (searched in parameter names), "
                                "or null for the default rule (3-D parameters under a module named *experts*)")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise fail(f"{path}[{i}]", item, "must be a string (a regular expression)")
        try:
            re.compile(item)
        except re.error as exc:
            raise fail(f"{path}[{i}]", item, f"must be a regular expression ({exc})") from None
    return tuple(value)


# the fields weight_grad, param and optimizer each declare (config.py collects them)
CONFIG_FIELDS: Fields = {
    "expert_params": (check_regex_list, None),
    "per_expert": (check_bool, False),
}


class ExpertRule:
    """Which parameters are grouped experts: ``patterns`` None is the default rule."""

    def __init__(self, patterns: Optional[Sequence[str]]) -> None:
        self.patterns = None if patterns is None else [re.compile(p) for p in patterns]

    def matches(self, name: str, ndim: int) -> bool:
        if self.patterns is None:
            return ndim == 3 and _DEFAULT_RE.search(name) is not None
        return ndim >= 1 and any(p.search(name) for p in self.patterns)


def grouped_names(named: Sequence[Tuple[str, Any]], rule: ExpertRule) -> Dict[str, int]:
    """The grouped-expert parameters among ``(name, parameter)``: name -> its number of
    dimensions (a tensor read for it is split only when it has as many)."""
    out: Dict[str, int] = {}
    for name, p in named:
        ndim = len(getattr(p, "shape", ()))
        if rule.matches(name, ndim):
            out[name] = ndim
    return out


def _is_host(rec: Any) -> bool:
    vector = rec.vector
    return (isinstance(vector, (list, tuple)) and type(rec.nans) in _HOST_COUNTS
            and type(rec.zeros) in _HOST_COUNTS)


_HOST_COUNTS = (int, type(None))


def host_norms_record(key: Tuple[int, str, str, Optional[int]], norms: Sequence[float], nans: bool,
                      zeros: bool) -> Record:
    """The ``expert_norms`` record of host norms (NaN and zero counts where asked)."""
    finite = [n for n in norms if not math.isnan(n)]
    mn = min(finite) if len(finite) == len(norms) and finite else math.nan
    mx = max(finite) if len(finite) == len(norms) and finite else math.nan
    vector = (mn, mx, math.fsum(norms), math.sqrt(math.fsum(n * n for n in norms)))
    n_nan = sum(1 for n in norms if math.isnan(n))
    n_zero = sum(1 for n in norms if n == 0)
    return record_type().host(key, vector, n_nan if nans else None, len(norms), n_zero if zeros else None)


class ExpertReads:
    """``record_many`` with the grouped experts' tensors read per expert (see the module doc).

    ``names`` maps the row names of grouped tensors (as the monitor keys them) to their
    number of dimensions; the per-expert rows are written when ``per_expert``."""

    def __init__(self, session: Any, settings: Any, monitor: str) -> None:
        options = settings.options
        self.rule = ExpertRule(options.get("expert_params"))
        self.per_expert = bool(options.get("per_expert", False))
        self.monitor = monitor
        self.session = session
        self.norm_vector: Optional[Callable[..., Any]] = getattr(session, "expert_norm_vector", None)
        self.device_read: Optional[Callable[..., Any]] = getattr(session, "expert_device_records", None)
        # the E views, made by the framework's side (for PyTorch: outside the training's modes)
        self.slices: Optional[Callable[[Any], List[Any]]] = getattr(session, "expert_slices", None)
        self._once = LogOnce()
        self.params: Dict[str, int] = {}
        self.refresh()

    def refresh(self) -> None:
        """The grouped parameters of the session's table (again after parameters were added)."""
        table = getattr(self.session, "table", None)
        infos = list(table.params) if table is not None else []
        self.params = grouped_names([(i.name, i.param) for i in infos], self.rule)
        if self.params and self.norm_vector is None:
            self._once.warning("unsupported", "monitor_v2 %s: grouped-expert parameters (e.g. %s) get no per-expert "
                               "rows ('.expert_norms') on this framework: per-expert statistics are read on PyTorch "
                               "only in this version. Logged once.", self.monitor, next(iter(self.params)))
            self.params = {}

    def record_many(self, engine: Any, tensors: Sequence[Any], plan: Any, keys: Sequence[Tuple],
                    names: Optional[Dict[str, int]] = None) -> List[Record]:
        """``engine.record_many(tensors, plan, keys)`` with each tensor whose row name is in
        ``names`` (default: the grouped parameters) read per expert, and its extra rows."""
        names = self.params if names is None else names
        if not names:
            return engine.record_many(tensors, plan, keys)
        if any(key[1] in names and callable(getattr(t, "to_local", None)) for t, key in zip(tensors, keys)):
            # a DTensor (expert parallel): the rows are of the local tensor, its slices this rank's experts
            tensors = [t.to_local() if key[1] in names and callable(getattr(t, "to_local", None)) else t
                       for t, key in zip(tensors, keys)]
        grouped = [i for i, key in enumerate(keys)
                   if key[1] in names and len(getattr(tensors[i], "shape", ())) == names[key[1]]
                   and tensors[i].shape[0] > 0]
        if len(grouped) < sum(1 for key in keys if key[1] in names):
            self._say_not_split(tensors, keys, names, set(grouped))
        if not grouped:
            return engine.record_many(tensors, plan, keys)
        split = set(grouped)
        along: Dict[int, Tuple[List[Record], Any]] = {}  # read along the expert dimension (accelerators)
        if self.device_read is not None:
            for i in grouped:
                got = self.device_read(tensors[i], plan, self._expert_keys(keys[i], int(tensors[i].shape[0])))
                if got is not None:
                    along[i] = got
        flat: List[Any] = []
        flat_keys: List[Tuple] = []
        spans: List[Tuple[int, int, int]] = []  # (index in the input, first flat place, experts)
        for i, (t, key) in enumerate(zip(tensors, keys)):
            if i not in split:
                flat.append(t)
                flat_keys.append(key)
                continue
            count = int(t.shape[0])
            spans.append((i, len(flat), count))
            if i in along:
                continue
            flat.extend(self.slices(t) if self.slices is not None else [t[e] for e in range(count)])
            flat_keys.extend(self._expert_keys(key, count))
        # the slices' norms make the expert_norms row: read even where the ops leave norm out
        read = engine.record_many(flat, plan if plan.norm else replace(plan, norm=True), flat_keys)
        out: List[Record] = []
        extra: List[Record] = []
        at = 0
        for i, first, count in spans:
            out.extend(read[at:first])
            key = keys[i]
            norms_key = (key[0], norms_name(key[1]), key[2], key[3])
            if i in along:
                experts, norms = along[i]
                at = first
                norms_record: Optional[Record] = engine.record(norms, plan, *norms_key)
            else:
                experts = read[first:first + count]
                at = first + count
                norms_record = self.norms_record(tensors[i], experts, plan, norms_key)
            if self.per_expert:  # the tensor's own row: the experts' records under its key
                out.extend(r.relabelled(*key) for r in experts)
                extra.extend(experts)
            else:
                out.extend(experts)
            if norms_record is not None:
                extra.append(norms_record)
        out.extend(read[at:])
        return out + extra

    def _say_not_split(self, tensors: Sequence[Any], keys: Sequence[Tuple], names: Dict[str, int],
                       grouped: set) -> None:
        """A grouped tensor read in another shape than its parameter's (a flat shard of
        FSDP1, a rank holding none of it): no per-expert rows for it, said once."""
        for i, key in enumerate(keys):
            if key[1] in names and i not in grouped:
                shape = tuple(getattr(tensors[i], "shape", ()))
                if 0 in shape:
                    continue  # an empty piece: nothing to read, nothing to say
                self._once.warning("not-split", "monitor_v2 %s: '%s' is a grouped-expert parameter but its %s "
                                   "tensor has shape %s here (a flat shard, not [experts, ...]): no per-expert "
                                   "rows for it (and others like it). Logged once.", self.monitor, key[1],
                                   key[2], list(shape))
                return

    def _expert_keys(self, key: Tuple, count: int) -> List[Tuple]:
        """The row keys of a grouped tensor's E slices: ``.expert.<e>`` rows where asked,
        else the tensor's own key (the slices' records merge into its row)."""
        if not self.per_expert:
            return [key] * count
        vpp, name, scope, micro = key
        return [(vpp, expert_name(name, e), scope, micro) for e in range(count)]

    def norms_record(self, tensor: Any, experts: Sequence[Record], plan: Any,
                     key: Tuple[int, str, str, Optional[int]]) -> Optional[Record]:
        """The ``expert_norms`` record from the E per-expert records (None where some expert
        gave no statistics: said once)."""
        if any(r.vector is None for r in experts):
            self._once.warning("unobserved", "monitor_v2 %s: no '%s' row: some expert slices of the tensor gave no "
                               "statistics. Logged once.", self.monitor, key[1])
            return None
        if all(_is_host(r) for r in experts):
            return host_norms_record(key, [float(r.vector[3]) for r in experts], plan.nans, plan.zeros)
        assert self.norm_vector is not None
        return self.norm_vector(tensor, experts, plan, key)
