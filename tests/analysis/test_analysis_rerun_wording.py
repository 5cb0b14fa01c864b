"""Two things a first-time user tripped over (issue 14, items 7 and 9).

- A script re-run with the same output_dir appends to the files of the earlier run
  (the writer warns, and writes no second header): ``summary`` and ``anomalies`` say
  which files hold several runs and which steps were written more than once.
- A gradient row's ``micro_step`` is the micro-batch's index when the run wrote one row
  per micro-batch, but the number of micro-batches accumulated when it wrote one row per
  step: the text says which ("of micro-batch 2" / "accumulated over 2 micro-batches").
"""

from pathlib import Path

import pytest

from analysis_helpers import LR_STEP, STEPS, cli, copy_run, training_runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return training_runs(tmp_path_factory)


def _rerun(root: Path, monitor: str = "weight_grad") -> int:
    """Append each file's rows to itself, as a second identical run would; returns the
    number of rows of one file (so the line where the second run starts is rows + 2)."""
    n = 0
    for f in sorted((root / "rank_0").glob(f"{monitor}_step*.csv")):
        lines = f.read_text().splitlines(keepends=True)
        f.write_text("".join(lines + lines[1:]))
        n = len(lines) - 1
    return n


@pytest.mark.parametrize("engine", ["columnar", "reference"])
def test_rerun_into_the_same_output_dir_is_flagged(runs, tmp_path, engine):
    root = copy_run(runs / "clean", tmp_path / "rerun")
    rows = _rerun(root)
    res = cli("anomalies", root, "--json", "--limit", "0", "--engine", engine)
    items = res.json()["appended"]["items"]
    assert len(items) == STEPS  # one file per step on rank 0
    for item in items:
        assert (item["rank"], item["monitor"], item["runs"], item["restart_lines"]) == (0, "weight_grad", 2, [rows + 2])
        step = int(Path(item["file"]).name.split("_step")[1].split("-")[0])
        assert item["steps_repeated"] == [step]
    text = cli("summary", root, "--engine", engine).out
    assert f"steps written more than once: {STEPS} file(s) hold several runs" in text
    assert f"2 runs (run 2 starts at line {rows + 2})" in text
    assert "STEPS WRITTEN MORE THAN ONCE" in cli("anomalies", root, "--engine", engine).out
    # the untouched run says nothing of the kind
    assert "written more than once" not in cli("summary", runs / "clean", "--engine", engine).out


def _accumulated(src: Path, dst: Path) -> Path:
    """The run as monitor_mbs_grad=false would write it: one unreduced row per step,
    micro_step = 2 (here: the rows of micro-batch 1 left out)."""
    root = copy_run(src, dst)
    for f in root.glob("rank_*/weight_grad_step*.csv"):
        lines = f.read_text().splitlines(keepends=True)
        f.write_text("".join(l for l in lines if ",unreduced,1," not in l))
    return root


def test_diff_says_which_micro_batch_or_how_many_were_accumulated(runs, tmp_path):
    res = cli("diff", runs / "clean", runs / "lr", "--monitors", "weight_grad", "--json")
    first = res.json()["first"]
    assert (first["step"], first["scope"], first["micro_step"]) == (LR_STEP + 1, "unreduced", 1)
    assert first["where"] == "local gradient of micro-batch 1"
    a = _accumulated(runs / "clean", tmp_path / "a")
    b = _accumulated(runs / "lr", tmp_path / "b")
    res = cli("diff", a, b, "--monitors", "weight_grad")
    assert f"step {LR_STEP + 1}, local gradient, accumulated over 2 micro-batches:" in res.out
    assert "micro_step 2" not in res.out
    data = cli("anomalies", a, "--json", "--limit", "0").json()
    assert data["monitors"]["weight_grad"]["micro_steps"] == [2]
