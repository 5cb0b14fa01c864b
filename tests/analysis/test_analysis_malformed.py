"""Malformed, truncated and mixed-version CSV files: a clear message naming the file and
the line, never a traceback. Default: the bad line (or, for a header that cannot be
read, the file) is skipped with a warning on stderr and the analysis goes on;
``--strict`` stops at the first problem with exit code 2.

The files start as real monitor output (the clean run of workers/train_runs.py, rank 0,
steps 0-2) and are then damaged by hand.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from analysis_helpers import cli, training_runs
from support.extras import needs_polars

pytestmark = needs_polars  # every test runs msprobe-monitor on its default engine

HEADER_WG = "vpp_stage,step,module_name,scope,micro_step,min,max,mean,norm,nans"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return training_runs(tmp_path_factory)


@pytest.fixture
def out(runs, tmp_path) -> Path:
    dst = tmp_path / "out" / "rank_0"
    dst.mkdir(parents=True)
    for step in range(3):
        for p in (runs / "clean" / "rank_0").glob(f"*_step{step}-{step}.csv"):
            shutil.copy(p, dst / p.name)
    return tmp_path / "out"


def lines_of(path: Path):
    return path.read_text().splitlines(keepends=True)


def write(path: Path, lines) -> None:
    path.write_text("".join(lines))


# each case: (file to damage, damage(path) -> line number of the problem or None, message fragment)
def wrong_header(p):
    ls = lines_of(p)
    ls[0] = ls[0].replace("module_name", "name")
    write(p, ls)
    return 1


def old_weight_grad_header(p):  # a weight_grad file without micro_step (another version)
    ls = [",".join(c for i, c in enumerate(line.rstrip("\n").split(",")) if i != 4) + "\n" for line in lines_of(p)]
    write(p, ls)
    return 1


def unknown_op(p):
    ls = lines_of(p)
    ls = [ls[0].rstrip("\n") + ",std\n"] + [line.rstrip("\n") + ",0.5\n" for line in ls[1:]]
    write(p, ls)
    return 1


def missing_field(p):
    ls = lines_of(p)
    ls[2] = ls[2].rstrip("\n").rsplit(",", 1)[0] + "\n"
    write(p, ls)
    return 3


def appended_other_ops(p):  # a resumed run with "ops": ["min", "max"] appended to the file
    ls = lines_of(p)
    step = ls[1].split(",")[1]
    ls.append(f"0,{step},fc1.weight,unreduced,1,-0.5,0.5\n")
    write(p, ls)
    return len(ls)


def second_header(p):
    ls = lines_of(p)
    ls.append(HEADER_WG + "\n")
    write(p, ls)
    return len(ls)


def non_numeric(p):
    ls = lines_of(p)
    cells = ls[3].rstrip("\n").split(",")
    cells[6] = "abc"  # the max column
    ls[3] = ",".join(cells) + "\n"
    write(p, ls)
    return 4


def non_integer_step(p):
    ls = lines_of(p)
    cells = ls[1].split(",")
    cells[1] = "one"
    ls[1] = ",".join(cells)
    write(p, ls)
    return 2


def truncated(p):  # the job died in the middle of a write
    text = p.read_text()
    cut = text.rstrip("\n")
    cut = cut[: cut.rfind(",") + 3]
    p.write_text(cut)
    return cut.count("\n") + 1


def truncated_header(p):
    p.write_text(HEADER_WG[:20])
    return 1


def empty_file(p):
    p.write_text("")
    return None


def step_outside_window(p):
    ls = lines_of(p)
    cells = ls[1].split(",")
    cells[1] = "9"
    ls[1] = ",".join(cells)
    write(p, ls)
    return 2


CASES = {
    "wrong_header": ("module_step1-1.csv", wrong_header, "unrecognised header", "file"),
    "old_version_header": ("weight_grad_step1-1.csv", old_weight_grad_header, "no micro_step column", "file"),
    "unknown_statistic": ("param_step1-1.csv", unknown_op, "unknown column(s) std", "file"),
    "wrong_column_count": ("optimizer_step1-1.csv", missing_field, "8 fields where the header", "line"),
    "mixed_version_append": ("weight_grad_step2-2.csv", appended_other_ops, "7 fields where the header", "line"),
    "second_header": ("weight_grad_step2-2.csv", second_header, "a second header line", "line"),
    "non_numeric_value": ("weight_grad_step1-1.csv", non_numeric, "column 'max' = 'abc' is not a number", "line"),
    "non_integer_step": ("module_step0-0.csv", non_integer_step, "column 'step' = 'one' is not an integer", "line"),
    "truncated_last_line": ("weight_grad_step2-2.csv", truncated, "ends in the middle of this line", "line"),
    "truncated_header": ("param_step2-2.csv", truncated_header, "ends in the middle of its header line", "file"),
    "empty_file": ("optimizer_step2-2.csv", empty_file, "empty file", "file"),
    "step_outside_window": ("param_step0-0.csv", step_outside_window, "step 9 is outside this file's steps 0-0",
                            "line"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_file_is_reported_with_file_and_line(out, case):
    name, damage, fragment, skipped = CASES[case]
    path = out / "rank_0" / name
    line = damage(path)
    where = f"{path}:{line}: " if line is not None else f"{path}: "
    for command in ("anomalies", "summary"):
        res = cli(command, out)
        assert res.code == 0, (case, command, res.out, res.err)  # the rest of the data is clean
        assert f"msprobe-monitor: warning: {where}" in res.err, (case, res.err)
        assert fragment in res.err and f"; {skipped} skipped" in res.err, (case, res.err)
        assert res.err.count("warning:") == 1, res.err
    data = cli("anomalies", out, "--json").json()
    assert data["problems"]["count"] == 1
    (problem,) = data["problems"]["items"]
    assert problem["file"] == str(path) and problem["line"] == line and fragment in problem["message"]
    strict = cli("anomalies", out, "--strict")
    assert strict.code == 2, strict.out
    assert f"error: {where}" in strict.err and fragment in strict.err and "--strict" in strict.err


def test_malformed_input_in_diff_and_plot(out, runs, tmp_path):
    path = out / "rank_0" / "weight_grad_step1-1.csv"
    line = non_numeric(path)
    res = cli("diff", runs / "clean", out, "--ranks", "0", "--steps", "0:2")
    assert f"{path}:{line}: column 'max' = 'abc' is not a number; line skipped" in res.err
    assert res.code == 1  # that row is missing from B
    assert cli("diff", runs / "clean", out, "--ranks", "0", "--steps", "0:2", "--strict").code == 2
    res = cli("plot", out, "--out", tmp_path / "plots", "--max-plots", "1")
    assert res.code == 0 and f"{path}:{line}:" in res.err
    assert "Malformed input (1 skipped)" in (tmp_path / "plots" / "report.html").read_text()


def test_many_problems_are_counted_not_all_printed(out):
    path = out / "rank_0" / "weight_grad_step1-1.csv"
    ls = lines_of(path)
    write(path, [ls[0]] + ["garbage\n"] * 50)
    res = cli("anomalies", out, "--json")
    assert res.json()["problems"]["count"] == 50
    assert res.err.count(f"{path}:") == 20 and "only the first 20 problems are shown" in res.err


def test_no_traceback_from_the_process(out):
    path = out / "rank_0" / "module_step0-0.csv"
    path.write_bytes(b"\x00\xff\xfe garbage \x00\n\x01,2,3\n")
    proc = subprocess.run([sys.executable, "-m", "msprobe.core.monitor_v2.analysis", "anomalies", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr and proc.returncode == 0, proc.stderr
    assert f"{path}:1: unrecognised header" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "msprobe.core.monitor_v2.analysis", "anomalies", str(out),
                           "--strict"], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr and proc.returncode == 2 and f"{path}:1:" in proc.stderr
