"""Two things a first-time user tripped over (issue 14, items 7 and 9).

- A script re-run with the same output_dir appends to the files of the earlier run
  (the writer warns, and writes no second header): ``summary`` and ``anomalies`` say
  which files hold several runs and which steps were written more than once, and count
  each step's latest rows, the earlier run's apart (issue 47).
- A gradient row's ``micro_step`` is the micro-batch's index when the run wrote one row
  per micro-batch, but the number of micro-batches accumulated when it wrote one row per
  step: the text says which ("of micro-batch 2" / "accumulated over 2 micro-batches").
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis_helpers import LR_STEP, SPIKE_STEP, STEPS, cli, copy_run, training_runs
from support.extras import needs_polars


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


@pytest.mark.parametrize("engine", [pytest.param("columnar", marks=needs_polars), "reference"])
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
    data = res.json()
    # the second run's rows are each step's latest; the first run's, which it wrote again, apart
    assert data["monitors"]["weight_grad"]["earlier_rows"] == STEPS * rows
    assert data["runs"]["earlier_rows"] == STEPS * rows and data["runs"]["steps_repeated"] == STEPS
    assert data["per_rank"]["0"]["rows"] == cli("anomalies", runs / "clean", "--json", "--engine",
                                                 engine).json()["per_rank"]["0"]["rows"]
    text = cli("summary", root, "--engine", engine).out
    assert (f"several runs:      {STEPS} file(s) with runs appended to them (a re-run into the same files); "
            f"{STEPS} step(s) written more than once, {STEPS * rows} row(s) of earlier runs set aside (each step's "
            "latest rows are the report's); first: ") in text
    assert text.count("written more than once") == 1  # the file's own steps are "repeated step(s): 0"
    assert "; repeated step(s): 0" in text
    assert f"2 runs (run 2 starts at line {rows + 2})" in text
    assert "STEPS WRITTEN MORE THAN ONCE" in cli("anomalies", root, "--engine", engine).out
    # the untouched run says nothing of the kind
    assert "appended re-runs" not in cli("summary", runs / "clean", "--engine", engine).out


def _accumulated(src: Path, dst: Path) -> Path:
    """The run as monitor_mbs_grad=false would write it: one unreduced row per step,
    micro_step = 2 (here: the rows of micro-batch 1 left out)."""
    root = copy_run(src, dst)
    for f in root.glob("rank_*/weight_grad_step*.csv"):
        lines = f.read_text().splitlines(keepends=True)
        f.write_text("".join(l for l in lines if ",unreduced,1," not in l))
    return root


@needs_polars
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


# The README's quick start, 30 steps: run four times with the same output_dir, the old
# analysis compared each run with the end of the one before it (and the repeated values
# shrank the MAD), finding spikes in identical runs that a single run does not have. Each
# run has its own history; the last run's are the spikes of the latest rows, the three
# earlier runs' are counted apart.
QUICK_START = """
import sys
import torch
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2
for run in range(int(sys.argv[1])):  # each run as a fresh script would do it, into the same output_dir
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMonitorV2({"output_dir": "out", "monitors": {"weight_grad": {"enabled": True}}})
    mon.start(model=model, optimizer=optimizer, grad_acc_steps=2)
    for step in range(30):
        for micro_batch in range(2):
            (model(torch.randn(8, 16)).pow(2).mean() / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mon.stop()
"""


@pytest.fixture(scope="module")
def quick_start_runs(tmp_path_factory) -> Path:
    """``single``: one run; ``four``: the same training run four times into one output_dir
    (one process, four monitors one after the other: one torch import, not four)."""
    root = tmp_path_factory.mktemp("quick_start_runs")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, times in (("single", 1), ("four", 4)):
        (root / name).mkdir()
        proc = subprocess.run([sys.executable, "-c", QUICK_START, str(times)], cwd=root / name, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.count("stopped after 30 steps") == times, proc.stderr
    return root


@pytest.mark.parametrize("engine", [pytest.param("columnar", marks=needs_polars), "reference"])
def test_re_runs_appended_to_the_output_find_no_spikes_a_single_run_does_not(quick_start_runs, engine):
    single = cli("anomalies", quick_start_runs / "single" / "out", "--json", "--limit", "0", "--engine", engine).json()
    four = cli("anomalies", quick_start_runs / "four" / "out", "--json", "--limit", "0", "--engine", engine).json()
    assert four["appended"]["files"] == 30 and {i["runs"] for i in four["appended"]["items"]} == {4}
    # four identical runs: the last run's spikes as the latest, the three others' as earlier runs' (here: none)
    assert four["spikes"]["count"] == single["spikes"]["count"], four["spikes"]["items"][:3]
    assert four["spikes"]["earlier_runs"]["count"] == 3 * single["spikes"]["count"]
    assert four["spikes"]["count"] == 0


@needs_polars
def test_both_engines_agree_on_re_runs(quick_start_runs, runs, tmp_path):
    """The same findings from the reference and the columnar engine on appended runs,
    spikes included (a run with a real spike, appended to itself, has it once in its
    latest rows and once among the earlier run's)."""
    root = copy_run(runs / "spike", tmp_path / "spike_twice")
    for f in sorted(root.glob("rank_*/*.csv")):
        lines = f.read_text().splitlines(keepends=True)
        f.write_text("".join(lines + lines[1:]))
    once = cli("anomalies", runs / "spike", "--json", "--limit", "0", "--engine", "reference").json()
    for out in (root, quick_start_runs / "four" / "out"):
        ref = cli("anomalies", out, "--json", "--limit", "0", "--engine", "reference").json()
        col = cli("anomalies", out, "--json", "--limit", "0", "--engine", "columnar").json()
        for key in ("spikes", "appended", "runs", "nonfinite", "rank_check", "monitors"):
            assert ref[key] == col[key], key
    twice = cli("anomalies", root, "--json", "--limit", "0", "--engine", "reference").json()
    assert once["spikes"]["count"] > 0 and SPIKE_STEP in {i["step"] for i in once["spikes"]["items"]}
    assert twice["spikes"]["count"] == once["spikes"]["count"]
    assert twice["spikes"]["per_step"] == once["spikes"]["per_step"]
    assert twice["spikes"]["earlier_runs"]["per_step"] == once["spikes"]["per_step"]
