"""Host side of the statistics engine, shared by every monitor and framework.

On the device, each observed tensor becomes one small vector ``[min, max, sum, norm]``
(see ``FIELDS``) computed in at least fp32, plus an integer NaN count when one is needed. ``step()`` moves all vectors of a
step to the host in one transfer per device, then this module merges the vectors that
share a row key (several calls of one module, several collectives from one call site)
exactly: min of mins, max of maxes, mean weighted by element count, norm from summed
squares, NaN counts summed.

The optional ``zeros`` statistic (elements exactly equal to zero) travels beside the
vector like the NaN count: an integer, a 0-d integer device tensor, or ``None`` when
the monitor's ``ops`` do not ask for it; counts are summed when rows merge.
"""

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

from . import native
from .rows import COUNT_OPS

# Index of each statistic in the device vector.
FIELDS: Tuple[str, ...] = ("min", "max", "sum", "norm")
MIN, MAX, SUM, NORM = range(len(FIELDS))


def _nan_min(a: float, b: float) -> float:
    # Python's min() silently drops a NaN depending on argument order.
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return a if a <= b else b


def _nan_max(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return a if a >= b else b


class Stat:
    """Exact, mergeable summary of one or more tensors.

    A plain class with ``__slots__`` (``dataclass(slots=True)`` needs Python 3.10): every
    row of a step lives until the step is written, and each object it brings is one more
    for the garbage collector's full collections to walk."""

    __slots__ = ("numel", "min", "max", "total", "sumsq", "nans", "zeros")

    def __init__(self, numel: int, min: float, max: float, total: float, sumsq: float, nans: int,
                 zeros: int = 0) -> None:
        self.numel = numel
        self.min = min
        self.max = max
        self.total = total
        self.sumsq = sumsq
        self.nans = nans
        self.zeros = zeros

    def _fields(self) -> Tuple[Any, ...]:
        return tuple(getattr(self, name) for name in Stat.__slots__)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._fields() == other._fields()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it was

    def __repr__(self) -> str:
        return "Stat(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in Stat.__slots__) + ")"

    @classmethod
    def from_vector(cls, vector: Sequence[float], nans: int, numel: int, zeros: int = 0) -> "Stat":
        norm = vector[NORM]
        mn, mx = vector[MIN], vector[MAX]
        if nans:  # some kernels (MindSpore's CPU min/max) skip NaN; the spec never hides it
            mn = mx = math.nan
        return cls(numel=numel, min=mn, max=mx, total=vector[SUM], sumsq=norm * norm, nans=int(nans),
                   zeros=int(zeros))

    def merge(self, other: "Stat") -> None:
        self._merge(other.numel, other.min, other.max, other.total, other.sumsq, other.nans, other.zeros)

    def _merge(self, numel: int, mn: float, mx: float, total: float, sumsq: float, nans: int, zeros: int) -> None:
        if numel == 0:
            return
        if self.numel == 0:
            self.min, self.max = mn, mx
        else:
            self.min = _nan_min(self.min, mn)
            self.max = _nan_max(self.max, mx)
        self.numel += numel
        self.total += total
        self.sumsq += sumsq
        self.nans += nans
        self.zeros += zeros

    def value(self, op: str) -> float:
        if op == "nans":
            return self.nans
        if op == "zeros":
            return self.zeros
        if op == "norm":
            return math.sqrt(self.sumsq) if not math.isnan(self.sumsq) else math.nan
        if self.numel == 0:
            return math.nan
        if op == "min":
            return self.min
        if op == "max":
            return self.max
        if op == "mean":
            return self.total / self.numel
        raise KeyError(op)


@dataclass(frozen=True)
class StatPlan:
    """Which reductions a monitor's ``ops`` need (shared by the framework engines)."""

    minmax: bool
    total: bool
    norm: bool
    nans: bool
    zeros: bool = False  # the optional count of elements equal to zero
    # the fields as a tuple: a cache key that hashes in C (a dataclass's hash is a Python
    # call, and the same-tensor cache hashes its keys several times per module tensor)
    key: Tuple[bool, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.minmax, self.total, self.norm, self.nans, self.zeros))

    @classmethod
    def from_ops(cls, ops: Sequence[str]) -> "StatPlan":
        return cls(
            minmax="min" in ops or "max" in ops,
            total="mean" in ops,
            norm="norm" in ops,
            nans="nans" in ops,
            zeros="zeros" in ops,
        )



def record_type() -> type:
    """The class the engines make records of: the extension's ``Record`` (the same
    interface, but outside the garbage collector: see native/python_ext.c) where it is
    built, else ``Record``."""
    ext = native.extension()
    return Record if ext is None else ext.Record


# Empty tensors never reach the device: their statistics are known.
EMPTY_VECTOR: Tuple[float, ...] = (math.nan, math.nan, 0.0, 0.0)

# The engines' grouped reads (``read_grouped``): a tensor of at most GROUP_MAX_NUMEL
# elements joins the others of its group, stacked GROUP_ELEMENTS elements at a time (a
# bounded temporary: 16 MiB of fp32 and its fp64 cast). A larger tensor is read alone:
# its reductions' fixed cost is small beside its data.
GROUP_MAX_NUMEL = 1 << 16
GROUP_ELEMENTS = 1 << 22


def read_grouped(count: int, group_of: Callable[[int], Optional[Tuple[Hashable, int]]],
                 read_group: Callable[[List[int]], Optional[List[Any]]],
                 read_one: Callable[[int], Any]) -> List[Any]:
    """The records of ``count`` tensors, in their order, read in groups where they can be:
    the engines' ``record_many`` for tensors their one-pass reads do not take.

    ``group_of(i)`` is ``(key, element count)`` of tensor ``i`` (one key: one device, dtype
    and shape), or None for a tensor read alone (``read_one(i)``), as is one of more than
    ``GROUP_MAX_NUMEL`` elements or none. The members of a key are handed to
    ``read_group`` (their indices) ``GROUP_ELEMENTS`` elements at a time; a part of one
    tensor gains nothing from a stack and is read alone, and so is a part ``read_group``
    could not read (it returns None: the per-tensor path then finds and says why)."""
    records: List[Any] = [None] * count
    groups: Dict[Tuple[Hashable, int], List[int]] = {}
    for i in range(count):
        group = group_of(i)
        if group is None or not 0 < group[1] <= GROUP_MAX_NUMEL:
            records[i] = read_one(i)
        else:
            groups.setdefault(group, []).append(i)
    for (_, numel), members in groups.items():
        per_part = max(1, GROUP_ELEMENTS // numel)
        for start in range(0, len(members), per_part):
            part = members[start:start + per_part]
            read = read_group(part) if len(part) > 1 else None
            for i, rec in zip(part, read if read is not None else map(read_one, part)):
                records[i] = rec
    return records


class Record:
    """One observation of one tensor, before it reaches the host.

    ``vector`` is a framework tensor on the device (or, for empty tensors, a host
    tuple) and ``nans`` a 0-d integer tensor, ``None`` when the engine proved there is
    no NaN (or none was asked for), or an int; ``to_host`` replaces both by host values.
    ``vector`` None: the tensor gave no statistics (a meta tensor, an unsupported layout;
    the engine said so once); the record is left out of its row.

    A host vector handed over as a list is kept as a tuple and reads back as a list: a
    record lives from its hook to the end of the step, and the garbage collector stops
    tracking a tuple of floats (a list it walks in every full collection).
    """

    __slots__ = ("vpp_stage", "name", "scope", "micro_step", "_vector", "_listed", "nans", "numel", "zeros")

    def __init__(self, vpp_stage: int, name: str, scope: str, micro_step: Optional[int], vector: Any, nans: Any,
                 numel: int, zeros: Any = None) -> None:  # zeros like ``nans``: None when not asked for
        self.vpp_stage = vpp_stage
        self.name = name
        self.scope = scope
        self.micro_step = micro_step
        if type(vector) is list:
            self._vector, self._listed = tuple(vector), True
        else:
            self._vector, self._listed = vector, False
        self.nans = nans
        self.numel = numel
        self.zeros = zeros

    @classmethod
    def host(cls, key: Tuple[int, str, str, Optional[int]], vector: Tuple[float, ...], nans: Any, numel: int,
             zeros: Any) -> "Record":
        """A record of host statistics under the row key ``key``, its vector already a
        tuple (read back as a list, as one handed over as a list)."""
        rec = cls.__new__(cls)
        rec.vpp_stage, rec.name, rec.scope, rec.micro_step = key
        rec._vector, rec._listed, rec.nans, rec.numel, rec.zeros = vector, True, nans, numel, zeros
        return rec

    @property
    def vector(self) -> Any:
        vector = self._vector
        return list(vector) if self._listed else vector

    @vector.setter
    def vector(self, value: Any) -> None:
        if type(value) is list:
            self._vector, self._listed = tuple(value), True
        else:
            self._vector, self._listed = value, False

    def relabelled(self, vpp_stage: int, name: str, scope: str, micro_step: Optional[int]) -> "Record":
        """This record's statistics under another row key (a tensor observed twice)."""
        rec = Record.__new__(Record)
        rec.vpp_stage, rec.name, rec.scope, rec.micro_step = vpp_stage, name, scope, micro_step
        rec._vector, rec._listed, rec.nans, rec.numel, rec.zeros = (
            self._vector, self._listed, self.nans, self.numel, self.zeros)
        return rec

    @property
    def key(self) -> Tuple[int, str, str, Optional[int]]:
        return (self.vpp_stage, self.name, self.scope, self.micro_step)

    def __repr__(self) -> str:
        fields = ("vpp_stage", "name", "scope", "micro_step", "vector", "nans", "numel", "zeros")
        return "Record(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in fields) + ")"


class Row(Stat):
    """One CSV row: its key and step, and its merged statistics (the row is its own
    ``stat``: one object per row instead of two)."""

    __slots__ = ("vpp_stage", "step", "name", "scope", "micro_step")

    def __init__(self, vpp_stage: int, step: int, name: str, scope: str, micro_step: Optional[int],
                 stat: Stat) -> None:
        super().__init__(stat.numel, stat.min, stat.max, stat.total, stat.sumsq, stat.nans, stat.zeros)
        self.vpp_stage = vpp_stage
        self.step = step
        self.name = name
        self.scope = scope
        self.micro_step = micro_step

    @property
    def stat(self) -> "Row":
        return self

    def _fields(self) -> Tuple[Any, ...]:
        return tuple(getattr(self, name) for name in Row.__slots__) + Stat._fields(self)

    def __repr__(self) -> str:
        key = ", ".join(f"{n}={getattr(self, n)!r}" for n in Row.__slots__)
        return f"Row({key}, stat={Stat.__repr__(self)})"


    @classmethod
    def from_fields(cls, step: int, fields: "RowFields") -> "Row":
        row = cls.__new__(cls)
        (row.vpp_stage, row.name, row.scope, row.micro_step,
         row.numel, row.min, row.max, row.total, row.sumsq, row.nans, row.zeros) = fields
        row.step = step
        return row

    def fields(self) -> "RowFields":
        return (self.vpp_stage, self.name, self.scope, self.micro_step,
                self.numel, self.min, self.max, self.total, self.sumsq, self.nans, self.zeros)


# A merged row as a plain tuple: (vpp_stage, name, scope, micro_step, numel, min, max,
# total, sumsq, nans, zeros). The garbage collector stops tracking a tuple of strings and
# numbers at its first collection; the writer formats these, and builds ``Row`` objects
# only for the alerter and the sinks.
RowFields = Tuple[int, str, str, Optional[int], int, float, float, float, float, int, int]


def merge_fields(records: Iterable[Record]) -> List[RowFields]:
    """``merge_records`` without the step, each row a ``RowFields`` tuple (merged in C
    where the kernel's extension is built: the same tuples, see ``_merge_fields``)."""
    ext = native.extension()
    if ext is not None:
        listed = records if type(records) is list else list(records)
        try:
            return ext.merge_fields(listed)
        except TypeError:  # a device vector, or values of other types: merged in Python
            records = listed
    return _merge_fields(records)


def _merge_fields(records: Iterable[Record]) -> List[RowFields]:
    """``merge_fields`` in Python."""
    rows: Dict[Tuple[int, str, str, Optional[int]], RowFields] = {}
    nan = math.nan
    for rec in records:
        vector = rec._vector  # as stored: no list built per record
        if vector is None:
            continue
        nans = int(rec.nans or 0)
        zeros = int(rec.zeros or 0)
        norm = vector[NORM]
        if nans:  # some kernels (MindSpore's CPU min/max) skip NaN; the spec never hides it
            mn = mx = nan
        else:
            mn, mx = vector[MIN], vector[MAX]
        numel = rec.numel
        key = (rec.vpp_stage, rec.name, rec.scope, rec.micro_step)
        row = rows.get(key)
        if row is None:
            rows[key] = key + (numel, mn, mx, vector[SUM], norm * norm, nans, zeros)
        elif numel:  # Stat.merge, on the tuple
            if row[4] == 0:
                merged_min, merged_max = mn, mx
            else:
                merged_min, merged_max = _nan_min(row[5], mn), _nan_max(row[6], mx)
            rows[key] = key + (row[4] + numel, merged_min, merged_max, row[7] + vector[SUM],
                               row[8] + norm * norm, row[9] + nans, row[10] + zeros)
    return list(rows.values())


def merge_records(step: int, records: Iterable[Record]) -> List[Row]:
    """Merge host records sharing a row key; rows keep the order of first appearance.
    Unobserved records (``vector`` None) are left out: a row of only those is not written."""
    return [Row.from_fields(step, fields) for fields in merge_fields(records)]


def format_value(op: str, value: float) -> str:
    """Nine significant digits reproduce any fp32 value exactly; NaN/Inf as ``nan``/``inf``."""
    if op in COUNT_OPS:
        return str(int(value))
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return format(value, ".9g")
