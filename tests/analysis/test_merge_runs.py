"""``msprobe-monitor merge`` on real runs: 2 gloo ranks of plain DDP under torchrun (the
runs of ``workers/train_runs.py``, shared with the other analysis tests).

Under DDP every parameter is replicated: the merged ``reduced``, ``param`` and
``optimizer`` rows are any rank's rows (checked against each rank's own file), the
``unreduced`` and ``module`` rows stay one per data-parallel rank, equal to that rank's.
In the ``desync`` run rank 1 alone adds 1e-3 to ``fc1.weight`` in place after the
optimizer step of step DESYNC_STEP (after DDP construction, so the replicas truly
diverge): merge reports the ``param`` rows of ``fc1.weight`` from the next step on,
names rank 1 against rank 0, and exits 1."""

import csv
import json
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from analysis_helpers import DESYNC_STEP, PARAMS, STEPS, cli, training_runs
from support.extras import POLARS_ENGINE, require

from msprobe.core.monitor_v2.analysis.merge import merge_run
from msprobe.core.monitor_v2.layout import load_layout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return training_runs(tmp_path_factory)


Key = Tuple[str, str, str, str]  # step, module_name, scope, micro_step


def rank_rows(run: Path, rank: int, monitor: str) -> List[Dict[str, str]]:
    out: List[Dict[str, str]] = []
    for path in sorted((run / f"rank_{rank}").glob(f"{monitor}_step*.csv"),
                       key=lambda p: int(p.name.split("step")[1].split("-")[0])):
        with open(path, newline="") as fh:
            out += list(csv.DictReader(fh))
    return out


def merged_rows(dest: Path, monitor: str) -> List[Dict[str, str]]:
    with open(dest / f"{monitor}.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def stats_of(row: Dict[str, str]) -> Dict[str, str]:
    return {op: row[op] for op in ("min", "max", "mean", "norm", "nans")}


def test_ddp_layout_is_written_and_says_every_parameter_is_whole(runs):
    for rank in (0, 1):
        doc = load_layout(str(runs / "clean" / f"rank_{rank}" / "layout.json"))
        assert doc["world_size"] == 2 and doc["groups"]["dp"] == {"rank": rank, "size": 2}
        assert sorted(doc["params"]) == sorted(PARAMS)
        for entry in doc["params"].values():
            n = 1
            for d in entry["shape"]:
                n *= d
            assert all(p == {"numel": n, "split": []} for p in entry["pieces"].values())


def test_ddp_merge_keeps_replicated_rows_once_and_per_rank_rows_per_dp_rank(runs, tmp_path):
    run, dest = runs / "clean", tmp_path / "merged"
    res = cli("merge", run, dest, "--json")
    assert res.code == 0, res.out + res.err
    rep = res.json()
    assert rep["disagreements"] == 0 and rep["exit_code"] == 0
    assert rep["left_out"] == {"unknown": 0, "partial": 0, "incomplete": 0, "cc": 0, "no_layout": 0, "moe": 0}
    assert rep["ranks"] == [0, 1] and rep["world_size"] == 2 and rep["groups"] == {"dp": 2}
    per_rank = {m: [rank_rows(run, r, m) for r in (0, 1)] for m in ("module", "weight_grad", "optimizer", "param")}
    assert rep["rows_read"] == sum(len(rows) for both in per_rank.values() for rows in both)

    wg = merged_rows(dest, "weight_grad")
    for rank in (0, 1):
        # in execution order: micro-batch 1's gradients before micro-batch 2's (the file has them per parameter)
        want = sorted(((r["step"], r["module_name"], r["micro_step"], stats_of(r))
                       for r in per_rank["weight_grad"][rank] if r["scope"] == "unreduced"),
                      key=lambda t: (int(t[0]), int(t[2])))
        got = [(r["step"], r["module_name"], r["micro_step"], stats_of(r))
               for r in wg if r["scope"] == "unreduced" and r["dp_rank"] == str(rank)]
        assert got == want and len(got) == STEPS * 2 * len(PARAMS)  # 2 micro-batches a step
    reduced = [r for r in wg if r["scope"] == "reduced"]
    assert {r["dp_rank"] for r in reduced} == {""}
    for rank in (0, 1):  # the replicas agree, and the merged row is each rank's row
        assert [(r["step"], r["module_name"], stats_of(r)) for r in reduced] == [
            (r["step"], r["module_name"], stats_of(r)) for r in per_rank["weight_grad"][rank]
            if r["scope"] == "reduced"]
    for monitor in ("optimizer", "param"):
        merged = merged_rows(dest, monitor)
        assert "dp_rank" not in merged[0] and "micro_step" not in merged[0]
        for rank in (0, 1):
            assert [(r["step"], r["module_name"], r["scope"], stats_of(r)) for r in merged] == [
                (r["step"], r["module_name"], r["scope"], stats_of(r)) for r in per_rank[monitor][rank]]
    module = merged_rows(dest, "module")
    for rank in (0, 1):
        assert [(r["step"], r["module_name"], r["scope"], stats_of(r)) for r in module if r["dp_rank"] == str(rank)] \
            == [(r["step"], r["module_name"], r["scope"], stats_of(r)) for r in per_rank["module"][rank]]
    assert rep["rows_written"] == len(wg) + len(module) + sum(len(merged_rows(dest, m)) for m in ("optimizer", "param"))
    # execution order inside a step: forward before backward, unreduced before reduced
    step0 = [r["scope"] for r in module if r["step"] == "0"]
    assert step0.index("backward") > max(i for i, s in enumerate(step0) if s == "forward")
    scopes = [r["scope"] for r in wg if r["step"] == "0"]
    assert scopes == ["unreduced"] * (4 * len(PARAMS)) + ["reduced"] * len(PARAMS)
    assert json.loads((dest / "merge.json").read_text())["format"] == "msprobe-monitor-merged"
    # the pure-Python merge (used without Polars) writes the same files
    merge_run(str(run), str(tmp_path / "python"), engine="python")
    for name in ("module.csv", "weight_grad.csv", "optimizer.csv", "param.csv", "disagreements.csv", "merge.json"):
        assert (tmp_path / "python" / name).read_text() == (dest / name).read_text(), name


def test_polars_batches_of_one_step_merge_the_same_as_one_batch(runs, tmp_path, monkeypatch):
    require("polars", POLARS_ENGINE)
    from msprobe.core.monitor_v2.analysis import columnar

    run = runs / "desync"
    merge_run(str(run), str(tmp_path / "one"), engine="polars")
    monkeypatch.setattr(columnar, "BATCH_ROWS", 1)  # a batch per file window: one step each here
    merge_run(str(run), str(tmp_path / "many"), engine="polars")
    for name in ("module.csv", "weight_grad.csv", "optimizer.csv", "param.csv", "disagreements.csv", "merge.json"):
        assert (tmp_path / "many" / name).read_text() == (tmp_path / "one" / name).read_text(), name


def test_diverged_ddp_replicas_are_reported_by_merge_with_exit_1(runs, tmp_path):
    run, dest = runs / "desync", tmp_path / "merged"
    res = cli("merge", run, dest)
    assert res.code == 1, res.out + res.err
    assert "replicas disagree (exit 1)" in res.out
    with open(dest / "disagreements.csv", newline="") as fh:
        dis = list(csv.DictReader(fh))
    assert dis, res.out
    assert {(d["monitor"], d["module_name"]) for d in dis} == {("param", "fc1.weight")}
    assert {d["ranks"] for d in dis} == {"0;1"}
    assert min(int(d["step"]) for d in dis) == DESYNC_STEP + 1
    assert {int(d["step"]) for d in dis if d["scope"] == "param_origin"} == set(range(DESYNC_STEP + 1, STEPS))
    # the values are the two ranks' own rows, in rank order
    mine = {(r["step"], r["scope"]): r for r in rank_rows(run, 1, "param") if r["module_name"] == "fc1.weight"}
    ref = {(r["step"], r["scope"]): r for r in rank_rows(run, 0, "param") if r["module_name"] == "fc1.weight"}
    for d in dis:
        key = (d["step"], d["scope"])
        assert d["values"] == f"{ref[key][d['stat']]};{mine[key][d['stat']]}"
    # the merged row holds the lowest rank's values, not an average
    merged = {(r["step"], r["scope"]): r for r in merged_rows(dest, "param") if r["module_name"] == "fc1.weight"}
    assert all(stats_of(merged[k]) == stats_of(ref[k]) for k in ref)
    assert "fc1.weight" in res.out and "param_origin" in res.out
    rep = json.loads((dest / "merge.json").read_text())
    assert rep["disagreements"] == len(dis) and rep["disagreeing_rows"] >= STEPS - DESYNC_STEP - 1


def test_a_rank_without_layout_has_its_rows_left_out_and_said(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "clean", run)
    (run / "rank_1" / "layout.json").unlink()
    rep = merge_run(str(run), str(tmp_path / "merged"))
    n1 = sum(len(rank_rows(run, 1, m)) for m in ("module", "weight_grad", "optimizer", "param"))
    assert rep.left_out["no_layout"] == n1 and rep.no_layout_ranks == [1]
    assert rep.disagreements == 0
    res = cli("merge", run, tmp_path / "merged")
    assert res.code == 0 and "no_layout" in res.out and "rank(s) 1 have no readable layout.json" in res.out
