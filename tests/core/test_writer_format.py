"""The writer joins a row's cells by hand (one ``str.format`` per row for the statistics,
the csv module only for each distinct name): every byte must be what the csv module and
``format_value`` write cell by cell, for hostile names (commas, quotes, line breaks,
formula starts, empty) and awkward values (NaN, infinities, -0.0, empty rows)."""

import csv
import io
import math
import random

import pytest

from support.extras import require

from msprobe.core.monitor_v2.rows import ALL_OPS, DEFAULT_OPS
from msprobe.core.monitor_v2.schedule import StepSchedule
from msprobe.core.monitor_v2.stats import Row, Stat, format_value
from msprobe.core.monitor_v2.writer import CsvWriter, MonitorOutput, csv_cell

HOSTILE_NAMES = [
    "layers.0.weight", "a,b", 'say "hi"', '"', ",", '",', "", " lead and trail ", "=SUM(A1)", "+1", "-x",
    "@at", "'quoted", "new\nline", "cr\rhere", "tab\there", "uni\u2028sep", "汉字,名字", "x" * 300,
]
VALUES = [0.0, -0.0, 1.0, -1.5, 1e-45, 3.4028234663852886e38, 0.1, 123456789.0, 1.23456789e-7,
          math.nan, -math.nan, math.inf, -math.inf]


def _rows(seed: int, n: int):
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        numel = rnd.choice([0, 1, 7, 1 << 20])
        stat = Stat(numel, rnd.choice(VALUES), rnd.choice(VALUES), rnd.choice(VALUES),
                    rnd.choice([0.0, 1e-90, 2.25, 2.5e10, math.nan, math.inf]), rnd.choice([0, 3]), rnd.choice([0, 11]))
        rows.append(Row(rnd.choice([0, 1]), 12, rnd.choice(HOSTILE_NAMES), rnd.choice(HOSTILE_NAMES + ["param"]),
                        rnd.choice([None, 0, 4]), stat))
    return rows


def cell_by_cell(out: MonitorOutput, rows, with_header: bool) -> bytes:
    """The rows as the csv module and ``format_value`` write them, one cell at a time."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    if with_header:
        writer.writerow(out.header)
    for row in rows:
        cells = [row.vpp_stage, row.step, csv_cell(row.name), csv_cell(row.scope)]
        if out.with_micro_step:
            cells.append(row.micro_step)
        cells.extend(format_value(op, row.stat.value(op)) for op in out.ops)
        writer.writerow(cells)
    return buf.getvalue().encode("utf-8", errors="backslashreplace")


@pytest.mark.parametrize("ops", [DEFAULT_OPS, ALL_OPS, ("norm",), ("zeros", "mean"), ("nans", "max", "min")])
@pytest.mark.parametrize("with_micro_step", [False, True])
def test_joined_rows_are_the_csv_modules_bytes(tmp_path, ops, with_micro_step):
    out = MonitorOutput("weight_grad" if with_micro_step else "param", ops, with_micro_step)
    writer = CsvWriter(str(tmp_path / "rank_0"), StepSchedule(), [out])
    for seed in range(5):
        rows = _rows(seed, 200)
        for with_header in (True, False):
            assert writer._format(out.name, 12, [r.fields() for r in rows], with_header) == \
                cell_by_cell(out, rows, with_header)
    writer.close()


def test_hostile_names_read_back_as_one_cell_each(tmp_path):
    out = MonitorOutput("param", DEFAULT_OPS, False)
    writer = CsvWriter(str(tmp_path / "rank_0"), StepSchedule(), [out])
    rows = [Row(0, 1, name, "param", None, Stat(1, 1.0, 1.0, 1.0, 1.0, 0)) for name in HOSTILE_NAMES]
    text = writer._format("param", 1, [r.fields() for r in rows], True).decode("utf-8")
    parsed = list(csv.reader(io.StringIO(text)))
    assert len(parsed) == len(rows) + 1  # every row on one line
    assert all(len(cells) == 4 + len(DEFAULT_OPS) for cells in parsed)
    assert parsed[1 + HOSTILE_NAMES.index("a,b")][2] == "a,b"
    assert parsed[1 + HOSTILE_NAMES.index('say "hi"')][2] == 'say "hi"'
    assert '"a,b"' in text and '"say ""hi"""' in text
    writer.close()


def _csv_module_cell(text: str) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([csv_cell(text), ""])
    return buf.getvalue()[:-2]


def test_a_name_cell_is_what_the_csv_module_writes_for_any_text():
    """``_row_cell`` writes a name without a comma, quote or line break as it is and leaves
    the others to the csv module: the same text for every string (hypothesis draws any
    unicode, with the characters that matter made likely), and for the hostile names."""
    require("hypothesis", "the cell property test draws its names with it")
    from hypothesis import given, settings, strategies as st

    from msprobe.core.monitor_v2.writer import _row_cell

    for name in HOSTILE_NAMES:
        assert _row_cell(name) == _csv_module_cell(name), name
    alphabet = st.one_of(st.sampled_from(list(',"\r\n\t\'=+-@ \x00\u2028\udcff')), st.characters())

    @settings(max_examples=3000, deadline=None)
    @given(st.text(alphabet=alphabet, max_size=12))
    def check(text):
        assert _row_cell.__wrapped__(text) == _csv_module_cell(text)

    check()
