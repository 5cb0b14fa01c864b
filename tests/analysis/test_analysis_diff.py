"""``msprobe-monitor diff`` on two real runs: same seed and data, the second one's learning
rate is 10x larger from step LR_STEP on (workers/train_runs.py, runs ``clean`` and ``lr``).

With AdamW the learning rate only enters the parameter update: at step LR_STEP the
gradients and the optimizer state are still identical, so the first difference is the
``param_updated`` row of the first parameter; every monitor differs from the next step on.
"""

import shutil
from pathlib import Path

import pytest

from analysis_helpers import DESYNC_STEP, LR_STEP, PARAMS, STEPS, cli, training_runs
from support.extras import needs_polars

pytestmark = needs_polars  # every test runs msprobe-monitor on its default engine


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return training_runs(tmp_path_factory)


def test_first_divergence_is_the_update_of_the_changed_step(runs):
    res = cli("diff", runs / "clean", runs / "lr", "--json")
    assert res.code == 1
    data = res.json()
    first = data["first"]
    assert (first["rank"], first["step"], first["monitor"], first["scope"], first["tensor"]) == \
        (0, LR_STEP, "param", "param_updated", PARAMS[0])
    assert first["a"] != first["b"] and first["rel_diff"] > 1e-5
    per = data["per_monitor"]
    assert per["param"]["first_step"] == LR_STEP
    for monitor in ("module", "weight_grad", "optimizer"):
        assert per[monitor]["first_step"] == LR_STEP + 1, monitor
    assert data["rows_only_in_a"] == data["rows_only_in_b"] == 0
    assert data["compared_rows"] == sum(p["compared_rows"] for p in per.values()) > 0
    largest = data["largest"]
    assert 0 < len(largest) <= 20
    rel = [x["rel_diff"] for x in largest]
    assert rel == sorted(rel, reverse=True)
    assert all(x["step"] >= LR_STEP for x in largest)


def test_diff_text_output(runs):
    res = cli("diff", runs / "clean", runs / "lr", "--limit", "5")
    assert res.code == 1
    assert f"rank 0, step {LR_STEP}, updated parameters: {PARAMS[0]} (param, scope param_updated)" in res.out
    assert "LARGEST DIFFERENCES" in res.out and "Result: the runs differ (exit 1)" in res.out
    table = res.out.split("LARGEST DIFFERENCES")[1].split("Result:")[0].strip().splitlines()
    assert len(table) == 1 + 2 + 5  # title, header, rule, 5 rows (--limit)


def test_identical_runs_and_tolerances(runs, tmp_path):
    same = cli("diff", runs / "clean", runs / "clean")
    assert same.code == 0 and "no difference (exit 0)" in same.out
    # the worker is deterministic: the desync run is the clean run until rank 1 alone
    # changes fc1.weight after the update of DESYNC_STEP
    assert cli("diff", runs / "clean", runs / "desync", "--steps", f"0:{DESYNC_STEP}").code == 0
    first = cli("diff", runs / "clean", runs / "desync", "--json").json()["first"]
    assert (first["rank"], first["step"], first["scope"], first["tensor"]) == \
        (1, DESYNC_STEP + 1, "param_origin", "fc1.weight")
    # tolerances: |a-b| <= atol + rtol * max(|a|,|b|)
    assert cli("diff", runs / "clean", runs / "lr", "--rtol", "2").code == 0
    assert cli("diff", runs / "clean", runs / "lr", "--atol", "1e9").code == 0
    assert cli("diff", runs / "clean", runs / "lr", "--stats", "nans").code == 0
    only_norm = cli("diff", runs / "clean", runs / "lr", "--stats", "norm", "--json").json()
    assert only_norm["first"]["stat"] == "norm" and only_norm["first"]["step"] == LR_STEP
    # the divergence appears where the data changes when earlier steps are left out
    late = cli("diff", runs / "clean", runs / "lr", "--steps", f"{LR_STEP + 2}:", "--json").json()
    assert late["first"]["step"] == LR_STEP + 2


def test_rows_present_in_one_run_only(runs, tmp_path):
    short = tmp_path / "short"
    shutil.copytree(runs / "clean", short)
    last = STEPS - 1
    for p in (short / "rank_1").glob(f"*_step{last}-{last}.csv"):
        p.unlink()
    res = cli("diff", runs / "clean", short, "--json")
    assert res.code == 1
    data = res.json()
    assert data["differing_rows"] == 0 and data["rows_only_in_a"] > 0 and data["rows_only_in_b"] == 0
    only = data["first_only_in_one_run"]
    assert (only["rank"], only["step"], only["only_in"]) == (1, last, "A")
    missing_rank = tmp_path / "one_rank"
    shutil.copytree(runs / "clean", missing_rank)
    shutil.rmtree(missing_rank / "rank_1")
    res = cli("diff", runs / "clean", missing_rank, "--json")
    assert res.code == 1 and res.json()["not_compared"] == ["rank 1 only in A"]
    assert res.json()["differing_rows"] == 0
