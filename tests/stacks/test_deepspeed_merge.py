"""DeepSpeed ZeRO-0/1/2/3 (and ``BF16_Optimizer``): ``layout.json`` says what each rank's
rows cover, and ``msprobe-monitor merge`` (``merge_run``) combines the ranks' shards into
the statistics of every whole parameter. The merged ``reduced`` gradient, ``param_origin``,
``param_updated`` and Adam moments are compared with NumPy on the whole tensors that
DeepSpeed's public API assembles (``safe_get_full_grad``, ``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``: collectives every rank calls; see
workers/deepspeed_train.py) within 1e-5 relative.

No launch of its own: the runs are those of test_deepspeed.py (one torchrun job per ZeRO
stage, shared through its ``launched`` fixture and the launch cache it keeps per session).
"""

import json
import math
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from support import numpy_stats, read_csv
from test_deepspeed import STEPS, Run, launched  # noqa: F401 - launched is the shared fixture

SHAPES = {"fc1.weight": [10, 6], "fc1.bias": [10], "fc2.weight": [3, 10], "fc2.bias": [3]}
MOMENTS = ("exp_avg", "exp_avg_sq")
# Every configuration test_deepspeed.py launches whose moments and masters DeepSpeed's
# public API (or, ZeRO-0 fp32, the torch optimizer itself) gives whole.
CONFIGS = ["z0-fp32-gas2", "z1-fp32-gas2", "z1-bf16-gas2", "z2-fp32-gas2", "z2-bf16-gas2",
           "z3-fp32-gas2", "z3-bf16-gas2", "z3-fp32-gas1"]
RTOL = 1e-5


class Merged:
    def __init__(self, out: Path, dest: Path, config: str) -> None:
        from msprobe.core.monitor_v2.analysis.merge import merge_run

        self.run = Run(out, config)
        self.report = merge_run(str(out / "acc"), str(dest))
        self.info = json.loads((dest / "merge.json").read_text())
        self.rows = {m: read_csv(dest / f"{m}.csv") for m in ("weight_grad", "param", "optimizer")}
        self.layouts = [json.loads((out / "acc" / f"rank_{r}" / "layout.json").read_text()) for r in range(2)]
        self.sharded = self.run.stage >= 1

    def one(self, monitor: str, **match) -> Dict[str, str]:
        found = [x for x in self.rows[monitor] if all(x[k] == str(v) for k, v in match.items())]
        assert len(found) == 1, f"{monitor} {match}: expected one merged row, found {len(found)}: {found}"
        return found[0]


@pytest.fixture(params=CONFIGS)
def merged(request, launched, tmp_path) -> Merged:  # noqa: F811 - the shared fixture
    return Merged(launched(request.param), tmp_path / "merged", request.param)


def assert_stats(row: Dict[str, str], full: torch.Tensor, what) -> None:
    """``row`` is the statistics of the whole tensor ``full`` (NumPy, fp64) within 1e-5
    relative. The mean of a tensor whose elements nearly cancel is compared with an
    absolute bound of 1e-8 of its largest element: the merge combines the shards' means,
    each written with 9 significant digits."""
    ref = numpy_stats(full)
    scale = max(abs(ref["min"]), abs(ref["max"]))
    for op in ("min", "max", "norm"):
        assert math.isclose(float(row[op]), ref[op], rel_tol=RTOL, abs_tol=1e-12), (what, op, row[op], ref[op])
    assert math.isclose(float(row["mean"]), ref["mean"], rel_tol=RTOL, abs_tol=1e-8 * scale), \
        (what, "mean", row["mean"], ref["mean"])
    assert int(row["nans"]) == ref["nans"] == 0, (what, row["nans"])


def test_layout_files_say_what_each_rank_holds(merged: Merged):
    run = merged.run
    for r, doc in enumerate(merged.layouts):
        assert (doc["format"], doc["stack"], doc["rank"], doc["world_size"]) == \
            ("msprobe-monitor-layout", "deepspeed", r, 2)
        # no mpu: data parallelism only, the group gradients are reduced over is the world
        assert doc["groups"] == {"dp": {"rank": r, "size": 2}}
        assert doc["unknown"] == []
        assert set(doc["params"]) == set(SHAPES)
        for name, entry in doc["params"].items():
            # the full shape, also under ZeRO-3 where the parameter is empty outside forward
            assert entry["shape"] == SHAPES[name], (name, entry)
            numel = math.prod(SHAPES[name])
            pieces = entry["pieces"]
            assert pieces["unreduced"] == {"numel": numel, "split": []}  # the whole local gradient
            for cls in ("reduced", "param", "optimizer"):
                if not merged.sharded:
                    assert pieces[cls] == {"numel": numel, "split": []}, (name, cls)
                    continue
                assert pieces[cls]["split"] == [["dp", r, 2]], (name, cls)
                if run.stage == 3:  # ds_tensor: ceil(numel / 2) each, the last without its padding
                    part = -(-numel // 2)
                    assert pieces[cls]["numel"] == min(part, numel - r * part), (name, cls, pieces[cls])
    if merged.sharded:
        for name in SHAPES:
            for cls in ("reduced", "param", "optimizer"):
                held = [doc["params"][name]["pieces"][cls]["numel"] for doc in merged.layouts]
                assert sum(held) == math.prod(SHAPES[name]), (name, cls, held)
                # a rank that holds none of a parameter writes no row of it, one that holds some does
                for r, n in enumerate(held):
                    monitor, scope = {"reduced": ("weight_grad", "reduced"), "param": ("param", "param_origin"),
                                      "optimizer": ("optimizer", "exp_avg")}[cls]
                    row_name = name if cls != "optimizer" else f"{name}.exp_avg"
                    rows = run.rows(r, monitor, module_name=row_name, scope=scope)
                    assert len(rows) == (STEPS if n else 0), (name, cls, r, n, len(rows))
    if run.stage in (1, 2):
        # ZeRO-1/2 cut the flat group (103 elements, padded to 104) in two: rank 0 holds
        # the first 52 elements of fc1.weight, rank 1 the rest of the model
        assert [d["params"]["fc1.weight"]["pieces"]["reduced"]["numel"] for d in merged.layouts] == [52, 8]
        assert [d["params"]["fc2.weight"]["pieces"]["param"]["numel"] for d in merged.layouts] == [0, 30]


def test_merge_report(merged: Merged):
    info, run = merged.info, merged.run
    assert info["format"] == "msprobe-monitor-merged"
    assert (info["world_size"], info["ranks"], info["groups"]) == (2, [0, 1], {"dp": 2})
    assert info["disagreements"] == 0, info
    assert all(n == 0 for n in info["left_out"].values()), info["left_out"]
    n_unreduced = 0 if (run.stage >= 2 and run.gas > 1) else STEPS * len(SHAPES) * 2
    wg = merged.rows["weight_grad"]
    assert len(wg) == STEPS * len(SHAPES) + n_unreduced
    assert len(merged.rows["param"]) == STEPS * len(SHAPES) * 2
    assert len(merged.rows["optimizer"]) == STEPS * len(SHAPES) * len(MOMENTS)
    assert list(wg[0]) == ["step", "module_name", "scope", "micro_step", "dp_rank",
                           "min", "max", "mean", "norm", "nans"]
    assert all(x["dp_rank"] == "" for x in wg if x["scope"] == "reduced")


def test_merged_reduced_gradients_are_the_whole(merged: Merged):
    refs = merged.run.refs[0]
    for s in range(STEPS):
        for name in SHAPES:
            row = merged.one("weight_grad", step=s, module_name=name, scope="reduced")
            assert row["micro_step"] == str(merged.run.gas)
            assert_stats(row, refs["full_grad"][s][name], ("reduced", s, name))


def test_merged_unreduced_keep_one_row_per_dp_rank(merged: Merged):
    run = merged.run
    if run.stage >= 2 and run.gas > 1:
        assert not [x for x in merged.rows["weight_grad"] if x["scope"] == "unreduced"]
        return
    for s in range(STEPS):
        for name in SHAPES:
            for r in range(2):
                row = merged.one("weight_grad", step=s, module_name=name, scope="unreduced", dp_rank=r)
                assert_stats(row, run.refs[r]["acc"][s][name], ("unreduced", s, name, r))


def masters_and_moments(run: Run, s: int) -> Dict[str, torch.Tensor]:
    """The fp32 masters and moments after step ``s``, whole: DeepSpeed's public API
    (ZeRO-1/2/3), the torch optimizer and the parameters themselves (ZeRO-0 fp32)."""
    refs = run.refs[0]
    if run.stage >= 1:
        return refs["ds"][s]
    out = dict(refs["torch_state"][s])
    if s + 1 < STEPS:
        out.update(refs["params_before"][s + 1])
    return out


def test_merged_params_and_moments_are_the_whole(merged: Merged):
    run = merged.run
    refs = run.refs[0]
    for s in range(STEPS):
        after = masters_and_moments(run, s)
        # before step s: the masters after step s-1; before step 0 the initial masters,
        # read with safe_get_full_fp32_param (ZeRO-0: the parameters) before training
        before = masters_and_moments(run, s - 1) if s else refs["masters_before"][0]
        for name in SHAPES:
            assert_stats(merged.one("param", step=s, module_name=name, scope="param_origin"), before[name],
                         ("param_origin", s, name))
            if name in after:
                assert_stats(merged.one("param", step=s, module_name=name, scope="param_updated"), after[name],
                             ("param_updated", s, name))
            for key in MOMENTS:
                assert_stats(merged.one("optimizer", step=s, module_name=f"{name}.{key}", scope=key),
                             after[f"{name}.{key}"], (key, s, name))


def test_replicas_that_disagree_are_reported(launched, tmp_path):  # noqa: F811 - the shared fixture
    """ZeRO-0 all-reduces whole gradients: both ranks' ``reduced`` rows are replicas. One
    made to differ by 0.1 % (a copy of the real output, rank 1's norm of fc1.weight at
    step 1) is reported, and the lowest rank's value is the one written."""
    import csv
    import shutil

    from msprobe.core.monitor_v2.analysis.merge import merge_run

    src = tmp_path / "acc"
    shutil.copytree(launched("z0-fp32-gas2") / "acc", src)
    path = src / "rank_1" / "weight_grad_step1-1.csv"
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = rows[0]
    hit = [x for x in rows[1:] if x[head.index("module_name")] == "fc1.weight" and x[head.index("scope")] == "reduced"]
    assert len(hit) == 1
    rank0 = [x for x in read_csv(src / "rank_0" / "weight_grad_step1-1.csv")
             if x["module_name"] == "fc1.weight" and x["scope"] == "reduced"][0]
    assert hit[0][head.index("norm")] == rank0["norm"]  # the real replicas agree
    hit[0][head.index("norm")] = repr(float(rank0["norm"]) * 1.001)
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    merge_run(str(src), str(tmp_path / "merged"))
    info = json.loads((tmp_path / "merged" / "merge.json").read_text())
    assert (info["disagreements"], info["disagreeing_rows"]) == (1, 1), info
    [said] = read_csv(tmp_path / "merged" / "disagreements.csv")
    assert (said["step"], said["monitor"], said["module_name"], said["scope"], said["stat"]) == \
        ("1", "weight_grad", "fc1.weight", "reduced", "norm")
    row = [x for x in read_csv(tmp_path / "merged" / "weight_grad.csv")
           if x["step"] == "1" and x["module_name"] == "fc1.weight" and x["scope"] == "reduced"]
    assert [x["norm"] for x in row] == [rank0["norm"]]
