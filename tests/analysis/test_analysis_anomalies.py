"""``msprobe-monitor anomalies`` and ``summary`` on real 2-rank DDP output.

The worker (workers/train_runs.py) trains with gradient accumulation (2 micro-batches,
``monitor_mbs_grad`` true) and the module, weight_grad, optimizer and param monitors.
In the ``nan`` run, rank 1 alone multiplies ``fc2``'s output by NaN in micro-batch 2 of
step NAN_STEP; the NaN reaches rank 0 only through the gradient all-reduce.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis_helpers import DESYNC_STEP, NAN_STEP, PARAMS, SPIKE_STEP, STEPS, cli, training_runs
from support.extras import needs_polars, require_command

pytestmark = needs_polars  # every test runs msprobe-monitor on its default engine


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return training_runs(tmp_path_factory)


def test_first_nan_is_the_injected_layer_output_on_rank_1(runs):
    res = cli("anomalies", runs / "nan", "--json")
    assert res.code == 1
    data = res.json()
    first = data["nonfinite"]["first"]
    assert (first["rank"], first["step"], first["monitor"], first["scope"], first["tensor"], first["kind"]) == \
        (1, NAN_STEP, "module", "forward", "fc2.output.0", "nan")
    assert first["values"]["nans"] > 0
    assert first["file"].endswith(os.path.join("rank_1", f"module_step{NAN_STEP}-{NAN_STEP}.csv"))
    # the modules before fc2 saw finite values, and nothing was non-finite before that step
    rows = (runs / "nan" / "rank_1" / f"module_step{NAN_STEP}-{NAN_STEP}.csv").read_text().splitlines()
    assert rows[first["line"] - 1].split(",")[2] == "fc2.output.0"
    assert all(",nan," not in r for r in rows[1:first["line"] - 1])
    per_rank = {d["rank"]: d for d in data["nonfinite"]["first_per_rank"]}
    # rank 1: micro-batch 1's local gradient of that step is finite, so the forward row comes first
    assert per_rank[1]["tensor"] == "fc2.output.0"
    # rank 0 computed nothing wrong: the NaN arrives with the all-reduced gradient
    assert (per_rank[0]["step"], per_rank[0]["monitor"], per_rank[0]["scope"]) == (NAN_STEP, "weight_grad", "reduced")
    assert per_rank[0]["micro_step"] == 2
    # NaN everywhere afterwards; replicas still agree (NaN equals NaN)
    assert data["nonfinite"]["count"] > 0
    assert data["rank_check"]["ranks_differing"] == 0


def test_first_nan_text_output(runs):
    res = cli("anomalies", runs / "nan")
    assert res.code == 1
    head = res.out.split("FIRST NON-FINITE VALUE OF EACH RANK")[0]
    assert f"rank 1, step {NAN_STEP}, forward: fc2.output.0 (module, scope forward) is nan" in head
    assert f"rank_1/module_step{NAN_STEP}-{NAN_STEP}.csv:" in head
    assert "Result: anomalies found (exit 1)" in res.out


def test_clean_run_has_no_anomaly(runs):
    res = cli("anomalies", runs / "clean", "--json")
    assert res.code == 0, res.out
    data = res.json()
    assert data["nonfinite"]["count"] == 0 and data["nonfinite"]["first"] is None
    assert data["spikes"]["count"] == 0
    assert data["rank_check"]["enabled"] and data["rank_check"]["ranks_differing"] == 0
    assert data["problems"]["count"] == 0
    text = cli("anomalies", runs / "clean")
    assert text.code == 0 and "Result: no anomaly (exit 0)" in text.out


def test_spike_found_at_the_spiked_step_only(runs):
    res = cli("anomalies", runs / "spike", "--json", "--limit", "0")
    assert res.code == 1
    spikes = res.json()["spikes"]
    assert spikes["count"] > 0
    assert {s["step"] for s in spikes["items"]} == {SPIKE_STEP}
    assert spikes["per_step"] == {str(SPIKE_STEP): spikes["count"]}
    first = spikes["items"][0]
    assert (first["monitor"], first["scope"], first["tensor"]) == ("module", "forward", "Net.input.0")
    assert first["ratio"] > 100 and "norm" in first["stats"]
    flagged = {(s["monitor"], s["scope"], s["tensor"]) for s in spikes["items"]}
    assert ("weight_grad", "reduced", "fc1.weight") in flagged
    assert {s["rank"] for s in spikes["items"]} == {0, 1}
    # the thresholds are flags
    assert cli("anomalies", runs / "spike", "--no-spikes").code == 0
    assert cli("anomalies", runs / "spike", "--spike-ratio", "1e9").code == 0
    # values without enough history are never judged (here: at most 2 * SPIKE_STEP values before the spike)
    assert cli("anomalies", runs / "spike", "--spike-window", "30", "--spike-min-history", "30").code == 0


def test_ranks_that_disagree(runs):
    res = cli("anomalies", runs / "desync", "--json")
    assert res.code == 1
    rc = res.json()["rank_check"]
    assert rc["ranks_differing"] == 1
    (item,) = rc["items"]
    # rank 1 changed fc1.weight after the update of DESYNC_STEP: the next step starts apart
    assert (item["rank"], item["step"], item["monitor"], item["scope"], item["tensor"]) == \
        (1, DESYNC_STEP + 1, "param", "param_origin", "fc1.weight")
    assert item["consensus_ranks"] == [0]
    # parameters differ from then on (origin and updated); gradients are all-reduced, so they agree
    assert item["rows_differing"] == 2 * (STEPS - DESYNC_STEP - 1)
    assert res.json()["nonfinite"]["count"] == 0
    # off for sharded runs, or compare only replicas
    assert cli("anomalies", runs / "desync", "--no-rank-check").code == 0
    assert cli("anomalies", runs / "desync", "--rank-groups", "0;1").code == 0
    assert cli("anomalies", runs / "desync", "--rank-atol", "0.01").code == 0


def test_selection_flags(runs):
    only0 = cli("anomalies", runs / "nan", "--ranks", "0", "--json").json()
    assert only0["ranks"] == [0] and only0["nonfinite"]["first"]["rank"] == 0
    before = cli("anomalies", runs / "nan", "--steps", f":{NAN_STEP - 1}")
    assert before.code == 0
    fwd = cli("anomalies", runs / "nan", "--monitors", "weight_grad", "--json").json()
    first = fwd["nonfinite"]["first"]
    assert (first["rank"], first["step"], first["scope"], first["micro_step"]) == (1, NAN_STEP, "unreduced", 2)
    assert first["tensor"] == PARAMS[0]  # within a phase: file order (parameter order for weight_grad)


def test_summary(runs):
    res = cli("summary", runs / "nan")
    assert res.code == 0
    out = res.out
    assert "2 rank(s) (0,1)" in out
    for monitor in ("module", "weight_grad", "optimizer", "param"):
        assert f"\n  {monitor} " in out
    assert f"0-{STEPS - 1} ({STEPS} steps)" in out
    assert f"first NaN/Inf:     rank 1, step {NAN_STEP}, forward: fc2.output.0" in out
    data = cli("summary", runs / "nan", "--json").json()
    wg = data["monitors"]["weight_grad"]
    assert wg["tensors"] == 2 * len(PARAMS) and wg["micro_steps"] == [1, 2] and wg["ranks"] == [0, 1]
    assert wg["steps"] == STEPS and wg["files"] == 2 * STEPS
    assert data["monitors"]["module"]["ops"] == ["min", "max", "mean", "norm", "nans"]
    assert data["per_rank"]["1"]["files"] == 4 * STEPS
    clean = cli("summary", runs / "clean")
    assert "first NaN/Inf:     none" in clean.out and "spikes:            none" in clean.out


def test_input_errors_exit_2(runs, tmp_path):
    res = cli("anomalies", tmp_path / "missing")
    assert res.code == 2 and "no such directory" in res.err
    res = cli("summary", tmp_path)
    assert res.code == 2 and "no rank_<r> directories" in res.err
    res = cli("anomalies", runs / "nan", "--monitors", "weights")
    assert res.code == 2 and "unknown monitor weights" in res.err
    res = cli("anomalies", runs / "nan", "--steps", "x")
    assert res.code == 2 and "--steps" in res.err
    assert cli("anomalies", runs / "nan", "--spike-window", "0").code == 2
    assert cli("frobnicate").code == 2


def test_installed_console_script(runs):
    require_command("msprobe-monitor", "this test runs the installed console script", os.path.dirname(sys.executable))
    script = Path(sys.executable).with_name("msprobe-monitor")
    assert script.exists(), f"{script} missing: run `pip install -e .` (pyproject.toml [project.scripts])"
    proc = subprocess.run([str(script), "anomalies", str(runs / "nan"), "--json"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["nonfinite"]["first"]["tensor"] == "fc2.output.0"
    proc = subprocess.run([sys.executable, "-m", "msprobe.core.monitor_v2.analysis", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "anomalies" in proc.stdout


def test_progress_only_on_request_or_terminal(runs):
    quiet = cli("summary", runs / "clean")
    assert "files" not in quiet.err  # stderr is not a terminal here
    loud = cli("summary", runs / "clean", "--progress")
    total = 4 * STEPS * 2 + 3 * STEPS * 2  # every file, then the rank-checked ones again
    assert f"reading: {total}/{total} files (100%)" in loud.err
    diff = cli("diff", runs / "clean", runs / "clean", "--progress")
    assert f"comparing: {2 * 4 * STEPS * 2}/{2 * 4 * STEPS * 2} files (100%)" in diff.err
