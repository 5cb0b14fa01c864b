"""The kernel built as a CPython extension (``native/python_ext.c``): its statistics are
the ctypes binding's to the bit, and its CSV rows are the Python writer's to the byte, on
random bit patterns (NaN of both signs, infinities, subnormals, -0.0) and hostile names.
"""

import ctypes
import math
import os
import struct

import numpy as np
import pytest

from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.schedule import StepSchedule
from msprobe.core.monitor_v2.writer import CsvWriter, MonitorOutput


@pytest.fixture(scope="module")
def extension():
    k = native.load()
    assert k is not None and k.ext is not None, (
        "the kernel was not built as an extension: are Python's headers (Python.h) installed?")
    return k


@pytest.fixture(scope="module")
def ctypes_binding():
    """The same kernel through ctypes, as on a machine without Python's headers."""
    errors = []
    k = native._load_built(native._compiler(), native._BASE_FLAGS, native._SOURCE, "stats_kernel-ctypes-test.so",
                           lambda path: native.NativeStats(ctypes.CDLL(path), path), errors)
    assert k is not None and k.ext is None, errors
    return k


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _same(a, b) -> bool:
    """Equal to the bit (NaN included), element by element, through nested sequences."""
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return isinstance(b, float) and (_bits(a) == _bits(b) or (math.isnan(a) and math.isnan(b)))
    return a == b


def _buffers():
    rng = np.random.default_rng(7)
    f32 = [rng.standard_normal(n).astype(np.float32) * 3 for n in (1, 15, 17, 256, 4097, 70_000)]
    f32.append(np.array([0.0, -0.0, 1.0, 0.0], dtype=np.float32))
    with_nan = rng.standard_normal(300).astype(np.float32)
    with_nan[5] = np.nan
    f32.append(with_nan)
    f32.append(np.array([np.inf, -np.inf, 2.0], dtype=np.float32))
    f16 = [(rng.standard_normal(n) * 40).astype(np.float16) for n in (3, 4100)]
    bf16 = [(rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16) for n in (5, 5000)]
    return ([(a, native.F32) for a in f32] + [(a, native.F16) for a in f16] + [(a, native.BF16) for a in bf16])


def test_statistics_are_the_ctypes_bindings_to_the_bit(extension, ctypes_binding):
    buffers = _buffers()
    for arr, code in buffers:
        for threads in (1, 2):
            args = (arr.ctypes.data, arr.size, code, threads)
            assert _same(extension.stats(*args), ctypes_binding.stats(*args)), (arr[:4], code)
            assert _same(extension.stats_zeros(*args), ctypes_binding.stats_zeros(*args)), (arr[:4], code)
    pointers = [a.ctypes.data for a, _ in buffers]
    counts = [a.size for a, _ in buffers]
    codes = [c for _, c in buffers]
    for zeros in (False, True):
        got = extension.stats_many(pointers, counts, codes, 1, zeros)
        want = ctypes_binding.stats_many(pointers, counts, codes, 1, zeros)
        assert _same(list(got), list(want))


def test_statistics_match_numpy(extension):
    rng = np.random.default_rng(3)
    arr = rng.standard_normal(10_001).astype(np.float32)
    arr[::9] = 0.0
    (mn, mx, total, norm), nans, zeros = extension.stats_zeros(arr.ctypes.data, arr.size, native.F32)
    v = arr.astype(np.float64)
    assert (mn, mx, nans, zeros) == (v.min(), v.max(), 0, int((arr == 0).sum()))
    want_norm = math.sqrt((v * v).sum())
    assert norm == pytest.approx(want_norm, rel=1e-6)
    assert total == pytest.approx(v.sum(), abs=1e-6 * want_norm)  # fp32 block sums: error relative to the norm


def test_bad_arguments_raise_instead_of_reading_memory(extension):
    with pytest.raises(ValueError):
        extension.stats(0, 4, native.F32)  # a null pointer
    with pytest.raises(ValueError):
        extension.stats(12345, 0, native.F32)  # nothing to read
    arr = np.ones(4, dtype=np.float32)
    with pytest.raises(ValueError):
        extension.stats(arr.ctypes.data, 4, 9)  # no such dtype code
    with pytest.raises(ValueError):
        extension.stats_many([arr.ctypes.data], [4, 4], [native.F32], 1, False)


# ---------------------------------------------------------------- CSV rows

def _random_doubles(n: int, seed: int):
    """Doubles from random bit patterns (every exponent, NaN payloads of both signs,
    subnormals), and from fp32 values widened, as the kernel's min and max are."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 2 ** 63, size=n, dtype=np.int64).view(np.float64)
    signs = np.where(rng.integers(0, 2, size=n) == 1, -1.0, 1.0)
    widened = (rng.standard_normal(n) * 10.0 ** rng.integers(-40, 38, size=n)).astype(np.float32).astype(np.float64)
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 5e-324, 1e-5, 1e-4, 123456789.0,
               999999999.5, 1e9, 0.1, 2.5, 1e16, 1.5e-10]
    with np.errstate(invalid="ignore"):  # NaN bit patterns times a sign
        raw = raw * signs
    return [float(x) for x in raw] + [float(x) for x in widened] + special


NAMES = ["blocks.0.linear.weight", "a,b", 'quote"d', "=SUM(A1)", "-neg", "tab\there", "line\nbreak",
         "\u2028sep", "ünïcode.名字", "", "'", "x" * 300]


def _rows(n: int, seed: int):
    values = _random_doubles(4 * n, seed)
    rng = np.random.default_rng(seed + 1)
    rows = []
    for i in range(n):
        mn, mx, total, sumsq = values[4 * i:4 * i + 4]
        sumsq = abs(sumsq)  # a sum of squares: never negative (NaN of either sign stays)
        numel = int(rng.integers(0, 3)) * int(rng.integers(1, 10 ** 6))  # some empty rows
        micro = None if i % 3 == 0 else int(rng.integers(1, 9))
        rows.append((int(i % 4), NAMES[i % len(NAMES)], ["forward", "unreduced", "a,b"][i % 3], micro, numel,
                     mn, mx, total, sumsq, int(rng.integers(0, 5)), int(rng.integers(0, 10 ** 9))))
    return rows


@pytest.mark.parametrize("ops", [("min", "max", "mean", "norm"), ("norm", "nans", "zeros", "min", "mean", "max"),
                                 ("zeros",), ("mean", "nans")])
@pytest.mark.parametrize("with_micro_step", [False, True])
def test_rows_are_the_python_writers_to_the_byte(tmp_path, extension, ops, with_micro_step):
    out = MonitorOutput("weight_grad", ops, with_micro_step)
    writer = CsvWriter(str(tmp_path / "rank_0"), StepSchedule(), [out])
    assert writer._format_rows is not None
    rows = _rows(6000, seed=len(ops) + with_micro_step)
    fast = writer._format("weight_grad", 12, rows, with_header=True)
    python = b"".join(l.encode() for l in [",".join(out.header) + "\n"]) + CsvWriter._format_python(out, 12, rows)
    assert fast == python
    assert fast.count(b"\n") == len(rows) + 1


def test_a_row_of_other_types_is_written_by_python_with_the_same_bytes(tmp_path, extension):
    out = MonitorOutput("param", ("min", "max", "mean", "norm", "nans"), False)
    writer = CsvWriter(str(tmp_path / "rank_0"), StepSchedule(), [out])
    rows = [(0, "w", "param_origin", None, 4, 1, 2.0, 3.0, 4.0, 0, 0),  # an int minimum
            (0, "b", "param_origin", None, 4, np.float64(0.5), 2.0, 3.0, 4.0, 0, 0)]
    body = writer._format("param", 3, rows, with_header=False)
    assert body == CsvWriter._format_python(out, 3, rows)
    assert body.splitlines()[0] == b"0,3,w,param_origin,1,2,0.75,2,0"


# ------------------------------------------------------- records and merging

def test_compiled_records_behave_as_the_python_class_and_stay_out_of_the_collector(extension):
    import gc

    from msprobe.core.monitor_v2 import stats

    C, P = extension.ext.Record, stats.Record
    assert stats.record_type() is C
    for cls in (C, P):
        listed = cls(0, "w", "unreduced", None, [1.0, 2.0, 3.0, 4.0], 0, 4)
        kept = cls(1, "b", "reduced", 2, (5.0, 6.0, 7.0, 8.0), None, 8, zeros=3)
        assert listed.vector == [1.0, 2.0, 3.0, 4.0] and listed._vector == (1.0, 2.0, 3.0, 4.0)
        assert kept.vector == (5.0, 6.0, 7.0, 8.0) and kept.zeros == 3 and kept.key == (1, "b", "reduced", 2)
        moved = kept.relabelled(0, "b2", "forward", None)
        assert (moved.key, moved.vector, moved.numel, moved.zeros) == ((0, "b2", "forward", None), kept.vector, 8, 3)
        host = cls.host((0, "h", "param_origin", None), (1.0, 1.0, 1.0, 1.0), 0, 1, None)
        assert host.vector == [1.0, 1.0, 1.0, 1.0] and host.name == "h"
        listed.vector, listed.nans = [9.0, 9.0, 9.0, 9.0], 1
        assert listed.vector == [9.0, 9.0, 9.0, 9.0] and listed.nans == 1
    assert repr(C(0, "w", "s", None, [1.0, 2.0, 3.0, 4.0], 0, 4)) == repr(P(0, "w", "s", None, [1.0, 2.0, 3.0, 4.0], 0, 4))
    assert not gc.is_tracked(C(0, "w", "s", None, [1.0, 2.0, 3.0, 4.0], 0, 4))
    assert gc.is_tracked(P(0, "w", "s", None, [1.0, 2.0, 3.0, 4.0], 0, 4))


def _random_records(cls, n: int, seed: int):
    rng = np.random.default_rng(seed)
    values = _random_doubles(4 * n, seed)
    records = []
    for i in range(n):
        mn, mx, total, norm = values[4 * i:4 * i + 4]
        vector = None if i % 17 == 0 else ([mn, mx, total, abs(norm)] if i % 2 else (mn, mx, total, abs(norm)))
        nans = [None, 0, int(rng.integers(0, 3))][i % 3]
        zeros = [None, int(rng.integers(0, 9))][i % 2]
        numel = 0 if i % 11 == 0 else int(rng.integers(1, 10 ** 6))
        key = (int(rng.integers(0, 2)), f"layer.{int(rng.integers(0, n // 4))}", ["forward", "backward"][i % 2],
               None if i % 5 else 1)
        records.append(cls(*key, vector, nans, numel, zeros))
    return records


def test_merging_in_c_gives_the_python_merges_tuples_to_the_bit(extension):
    from msprobe.core.monitor_v2 import stats

    for seed in range(4):
        compiled = _random_records(extension.ext.Record, 3000, seed)
        mixed = compiled[:1500] + _random_records(stats.Record, 3000, seed)[1500:]
        for records in (compiled, mixed):
            got = extension.ext.merge_fields(records)
            want = stats._merge_fields(records)
            assert len(want) < len(records) - 100, "the keys repeat: rows are merged"
            assert _same(got, want)
            assert _same(stats.merge_fields(records), want)


@pytest.mark.parametrize("with_micro_step", [False, True])
def test_records_merged_and_formatted_in_one_call_are_the_python_writers_bytes(tmp_path, extension, with_micro_step):
    """``format_records`` (the writer's path when no alert or dashboard needs row objects)
    writes exactly what Python's merge and formatter write for the same records: repeated
    keys merged, unobserved and empty records, NaN counts that hide min and max."""
    from msprobe.core.monitor_v2 import stats

    out = MonitorOutput("weight_grad", ("min", "max", "mean", "norm", "nans", "zeros"), with_micro_step)
    writer = CsvWriter(str(tmp_path / "rank_0"), StepSchedule(), [out])
    for seed in range(3):
        for records in (_random_records(extension.ext.Record, 3000, seed),
                        _random_records(extension.ext.Record, 1500, seed) + _random_records(stats.Record, 1500, seed)):
            want_rows = stats._merge_fields(records)
            formatted, n = writer._formatted_records("weight_grad", 7, records)
            assert n == len(want_rows) < len(records) - 100
            assert formatted(False) == CsvWriter._format_python(out, 7, want_rows)
            assert formatted(True).startswith((",".join(out.header) + "\n").encode())
    writer.close()


def test_a_record_the_c_merge_does_not_take_is_merged_in_python(extension):
    from msprobe.core.monitor_v2 import stats

    # a vector still on its device (a framework tensor; a NumPy array stands in for one here)
    device_vector = extension.ext.Record(0, "w", "forward", None, np.array([1.0, 2.0, 3.0, 4.0]), 0, 4)
    with pytest.raises(TypeError):
        extension.ext.merge_fields([device_vector])
    with pytest.raises(TypeError):
        extension.ext.format_records([device_vector], "1", b"\x00", False, {}, str)
    ints = extension.ext.Record(0, "w", "forward", None, (1, 2, 3, 4), 0, 4)  # ints, not floats
    assert stats.merge_fields([ints]) == stats._merge_fields([ints]) == [(0, "w", "forward", None, 4, 1, 2, 3, 16, 0, 0)]


def test_each_float_cell_is_pythons_format_9g(extension):
    """The compiled formatter's fast path (nine digits in double, proven rounding)
    and its fallback together give ``format(x, ".9g")`` for every double: random bit
    patterns, fp32 values of every magnitude, powers of two and ten, halves, and decimal
    numbers with ten digits whose tenth is 5 (ties of the rounding)."""
    cell = extension.ext._format_float
    rng = np.random.default_rng(11)
    n = 60_000
    with np.errstate(over="ignore", invalid="ignore"):
        values = list(rng.integers(0, 2 ** 64, size=n, dtype=np.uint64).view(np.float64))
        values += list((rng.standard_normal(n) * 10.0 ** rng.integers(-45, 39, size=n)).astype(np.float32))
    values += list(rng.standard_normal(n) * 10.0 ** rng.integers(-12, 12, size=n))
    values += [float(f"{rng.integers(10 ** 8, 10 ** 9)}5e{rng.integers(-30, 30)}") for _ in range(20_000)]
    values += [float(f"{rng.integers(10 ** 9, 10 ** 10)}e{rng.integers(-30, 30)}") for _ in range(20_000)]
    values += [i * 0.5 for i in range(-3000, 3000)] + [2.0 ** i for i in range(-1074, 1024)]
    values += [10.0 ** i for i in range(-323, 309)] + [5e-324, -0.0, 0.0, 1e-5, 1e-4, 99999999.95, 999999999.5]
    wrong = [(v, cell(float(v)), format(float(v), ".9g")) for v in values if cell(float(v)) != format(float(v), ".9g")]
    assert wrong == [], wrong[:5]


def test_not_on_host_finds_the_records_to_host_must_move(extension):
    from msprobe.core.monitor_v2 import stats

    C = extension.ext.Record
    host = [C(0, "a", "s", None, (1.0, 2.0, 3.0, 4.0), 0, 4), C(0, "b", "s", None, [1.0, 2.0, 3.0, 4.0], None, 4, 2)]
    device = np.array([1.0, 2.0, 3.0, 4.0])  # stands in for a framework tensor
    moved = [C(0, "c", "s", None, device, 0, 4), C(0, "d", "s", None, (1.0, 2.0, 3.0, 4.0), device[0:1], 4),
             C(0, "e", "s", None, (1.0, 2.0, 3.0, 4.0), 0, 4, zeros=device[0:1]),
             stats.Record(0, "f", "s", None, (1.0, 2.0, 3.0, 4.0), 0, 4)]  # another class: looked at by to_host
    got = extension.ext.not_on_host(host[:1] + moved[:2] + host[1:] + moved[2:])
    assert [r.name for r in got] == ["c", "d", "e", "f"]


def test_records_many_builds_what_stats_many_and_record_host_build(extension):
    from msprobe.core.monitor_v2 import stats

    buffers = _buffers()
    keys = [(0, f"t{i}", "param", None if i % 2 else 3) for i in range(len(buffers))]
    args = ([a.ctypes.data for a, _ in buffers], [a.size for a, _ in buffers], [c for _, c in buffers], 1)
    for nans, zeros in ((True, False), (False, True), (True, True)):
        got = extension.ext.records_many(keys, *args, nans, zeros)
        vectors, nan_counts, zero_counts = extension.stats_many(*args, zeros)
        for rec, key, vector, n, count, z in zip(got, keys, vectors, nan_counts, args[1], zero_counts or [None] * 99):
            want = stats.Record.host(key, vector, n if nans else None, count, z)
            assert type(rec) is extension.ext.Record
            assert _same([rec.key, rec.vector, rec.nans, rec.numel, rec.zeros],
                         [want.key, want.vector, want.nans, want.numel, want.zeros])
    with pytest.raises(TypeError):
        extension.ext.records_many([("not", "a key")] * len(buffers), *args, True, False)


def _read_records(extension, nans: bool, zeros: bool):
    """``record_read``'s records of every test buffer, and the same statistics as records
    built from ``stats``/``stats_zeros``'s list (the engine's path without the call)."""
    ext = extension.ext
    inline, listed = [], []
    for i, (a, code) in enumerate(_buffers()):
        key = (i % 2, f"t{i % 5}", "forward", None if i % 3 else 2)
        inline.append(ext.record_read(a.ctypes.data, a.size, code, 1, nans, zeros, *key))
        if zeros:
            vector, n, z = extension.stats_zeros(a.ctypes.data, a.size, code, 1)
        else:
            (vector, n), z = extension.stats(a.ctypes.data, a.size, code, 1), None
        listed.append(ext.Record(*key, vector, n if nans else None, a.size, z))
    return inline, listed


@pytest.mark.parametrize("nans, zeros", [(True, False), (False, True), (True, True)])
def test_record_read_is_stats_and_a_record_in_one_call_with_its_vector_inline(tmp_path, extension, nans, zeros):
    """``record_read`` (the engine's read of one tensor) keeps the kernel's four statistics
    in the record itself: the same values, counts, merge and CSV bytes as a record of
    ``stats``'s list, and no tuple or float objects until a vector is asked for."""
    import gc

    from msprobe.core.monitor_v2 import stats

    inline, listed = _read_records(extension, nans, zeros)
    for got, want in zip(inline, listed):
        assert _same([got.key, got.vector, got._vector, got.nans, got.numel, got.zeros, got._listed],
                     [want.key, want.vector, want._vector, want.nans, want.numel, want.zeros, True])
        moved = got.relabelled(1, "other", "backward", None)
        assert _same([moved.key, moved.vector, moved.nans, moved.zeros],
                     [(1, "other", "backward", None), want.vector, want.nans, want.zeros])
        assert repr(got) == repr(want) and not gc.is_tracked(got)
    assert sum(math.isnan(r.vector[0]) and math.isnan(r.vector[1]) for r in inline) == 1, "a NaN hides min and max"
    assert _same(extension.ext.merge_fields(inline), stats._merge_fields(listed))
    assert extension.ext.not_on_host(inline) == [], "an inline vector is on the host"
    out = MonitorOutput("module", ("min", "max", "mean", "norm", "nans", "zeros"), False)
    writer = CsvWriter(str(tmp_path / "rank_0"), StepSchedule(), [out])
    formatted, n = writer._formatted_records("module", 3, inline)
    assert formatted(False) == CsvWriter._format_python(out, 3, stats._merge_fields(listed))
    writer.close()
    inline[0].vector = [1.0, 2.0, 3.0, 4.0]  # set by to_host's way: no longer inline
    assert inline[0].vector == [1.0, 2.0, 3.0, 4.0] and inline[0]._vector == (1.0, 2.0, 3.0, 4.0)


def test_a_cache_entry_is_outside_the_collector_and_lets_its_tensor_go(extension):
    import gc

    class Tensor:  # any object with weak references stands in for a framework tensor
        pass

    t = Tensor()
    rec = extension.ext.record_read(np.ones(4, np.float32).ctypes.data, 4, native.F32, 1, True, False, 0, "a", "f",
                                    None)
    entry = extension.ext.cache_entry(t, 3, rec)
    assert entry[0]() is t and entry[1:] == (3, rec)
    assert not gc.is_tracked(entry) and not gc.is_tracked(entry[0])
    del t
    assert entry[0]() is None, "the entry holds the tensor weakly"
    with pytest.raises(TypeError):
        extension.ext.cache_entry(7, 0, rec)  # an object without weak references: the caller caches nothing


def test_a_grad_note_that_cannot_read_its_monitor_hands_over_to_the_python_hook(extension):
    """``GradNote`` reads its monitor's ``active`` first; where that raises (or the note is
    not armed), the one Python hook gets ``(source, *args)`` with no error left pending, and
    the pass is not counted in C."""
    class Broken:
        @property
        def active(self):
            raise RuntimeError("no such state")

    for armed in (7, -1):  # armed for the running task, and not armed
        calls = []
        state = extension.ext.NoteState(lambda: 7)
        state.task = armed
        note = extension.ext.GradNote(Broken(), "source", 3, state, lambda *args: calls.append(args))
        assert note("tensor") is None
        assert calls == [("source", "tensor")] and state.passes == {} and state.pending == []


def _order_case(seed: int):
    """Unreduced records under shuffled, sorted or reversed (index, micro step[, row]) keys,
    reduced records, and pass counts: what weight_grad collects at a step's end."""
    import random

    rng = random.Random(seed)
    width = rng.choice([2, 3])
    keys = sorted({tuple(rng.randint(-2, 40) for _ in range(width)) for _ in range(rng.randint(0, 60))})
    arrangement = rng.choice(["shuffled", "sorted", "reversed"])
    if arrangement == "shuffled":
        rng.shuffle(keys)
    elif arrangement == "reversed":
        keys.reverse()
    passes = {i: rng.randint(0, 4) for i in range(rng.randint(0, 8))}
    announced = rng.randint(1, 3)
    n_reduced = rng.randint(0, 6)

    def build():
        record = native.extension().Record.host
        unreduced = {k: record((0, f"p{k}", "unreduced", None if k[1] == 0 else k[1]), (1.0, 2.0, 3.0, 4.0), None, 4,
                               None) for k in keys}
        reduced = [record((0, f"r{i}", "reduced", None), (1.0, 2.0, 3.0, 4.0), None, 4, None)
                   for i in range(n_reduced)]
        return unreduced, reduced

    return build, passes, announced


@pytest.mark.parametrize("seed", range(40))
def test_weight_grads_file_order_in_c_is_the_python_order(extension, seed):
    """``file_order`` (what ``weight_grad_rows`` calls) gives the records in the Python
    path's order, with the same micro steps: the key order of tuples (a run already in
    order, a reversed one, or any other), and the step's micro-batches (the most passes,
    or the announced number where none ran) on accumulated and reduced rows."""
    from msprobe.core.monitor_v2.monitor import _weight_grad_rows, weight_grad_rows

    build, passes, announced = _order_case(seed)
    in_c, in_python = weight_grad_rows(*build(), passes, announced), _weight_grad_rows(*build(), passes, announced)
    assert [r.key for r in in_c] == [r.key for r in in_python]
    assert extension.ext.file_order(*build(), passes, announced) is not None, "the C path took the case"


def test_file_order_leaves_what_it_does_not_read_to_python(extension):
    """A key that is not a tuple of ints, or a record of the Python class, gives None and
    changes nothing: the Python code then orders them."""
    from msprobe.core.monitor_v2.monitor import weight_grad_rows
    from msprobe.core.monitor_v2.stats import Record

    ext = extension.ext
    rec = ext.Record.host((0, "a", "unreduced", None), (1.0, 2.0, 3.0, 4.0), None, 4, None)
    python_rec = Record(0, "b", "unreduced", None, [1.0, 2.0, 3.0, 4.0], None, 4)
    for unreduced, reduced in [({(0, "x"): rec}, []), ({(0, 0): rec}, [python_rec]), ({(0, 0): python_rec}, []),
                               ({(2 ** 70, 0): rec}, []), ({0: rec}, [])]:
        assert ext.file_order(unreduced, reduced, {0: 2}, 1) is None
        assert rec.micro_step is None and python_rec.micro_step is None, "nothing changed"
    assert [r.name for r in weight_grad_rows({(1, 0): python_rec, (0, 0): rec}, [], {0: 2}, 1)] == ["a", "b"]
    assert rec.micro_step == 2 and python_rec.micro_step == 2
