"""``merge`` of a mixture of experts (issue 49 item 4).

1. Grouped experts under expert parallelism (torch DTensor ``Shard(0)`` over a mesh
   dimension named ``ep``, TorchTitan's way; 2 gloo ranks, ``workers/expert_parallel.py``):
   the ranks' ``experts.w`` rows, its ``.expert_norms`` rows and its ``.expert.<e>`` rows
   (local index ``e`` of ep rank ``r`` merged as global ``2r + e``) combined into the whole
   model's, against NumPy over the full tensors the worker gathered (``full_tensor()``); the
   expert that gets no token is one ``zeros`` of the gradient's and ``exp_avg``'s merged
   ``expert_norms``; both merge engines.
2. The routers' token counts: sidecar files in the ``moe`` monitor's format
   (``rank_<r>/moe_counts_step<a>-<b>.csv``, written here: the monitor that writes them is
   another part of the issue) summed over the groups each rank's ``layout.json`` names
   (``moe.<router>.tokens.split``), replicas (tensor parallel without sequence parallel)
   taken once and checked, a router whose ranks miss a group left out; against NumPy.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from msprobe.core.monitor_v2 import layout as lay
from msprobe.core.monitor_v2.analysis.merge import merge_run, polars_available
from support import assert_row_matches, numpy_stats, read_csv, run_torchrun

WORKER = Path(__file__).parent / "workers" / "expert_parallel.py"
ENGINES = ["python"] + (["polars"] if polars_available() else [])


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_parallel")
    run_torchrun(WORKER, out, nproc=2, timeout=300)
    return out, torch.load(out / "ref.pt")


def with_zeros(t):
    want = numpy_stats(t)
    want["zeros"] = int((t.numpy() == 0).sum())
    return want


def norms_stats(t):
    a = t.to(torch.float64).numpy().copy().reshape(t.shape[0], -1)
    n = np.sqrt((a * a).sum(axis=1))
    return {"min": float(n.min()), "max": float(n.max()), "mean": float(n.mean()),
            "norm": float(np.sqrt((n * n).sum())), "nans": 0, "zeros": int((n == 0).sum())}


def one(rows, **match):
    found = [r for r in rows if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, len(found))
    return found[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_grouped_experts_merged_over_ep(ep_run, tmp_path, engine):
    out, ref = ep_run
    report = merge_run(str(out / "run"), str(tmp_path / "merged"), engine=engine)
    assert report.disagreements == 0
    wg = read_csv(tmp_path / "merged" / "weight_grad.csv")
    pr = read_csv(tmp_path / "merged" / "param.csv")
    opt = read_csv(tmp_path / "merged" / "optimizer.csv")
    for step, r in enumerate(ref):
        s = str(step)
        cases = [(wg, "experts.w", "reduced", r["grad"]), (pr, "experts.w", "param_origin", r["before"]),
                 (pr, "experts.w", "param_updated", r["after"]), (opt, "experts.w.exp_avg", "exp_avg", r["exp_avg"])]
        for rows, name, scope, full in cases:
            assert_row_matches(one(rows, step=s, module_name=name, scope=scope), with_zeros(full), 1e-5, 1e-9)
            row = one(rows, step=s, module_name=name + ".expert_norms", scope=scope)
            assert_row_matches(row, norms_stats(full), 1e-5, 1e-9)
            for e in range(full.shape[0]):
                assert_row_matches(one(rows, step=s, module_name=f"{name}.expert.{e}", scope=scope),
                                   with_zeros(full[e]), 1e-5, 1e-9)
        # global expert 3 got no token: no gradient, no first moment
        assert int(one(wg, step=s, module_name="experts.w.expert_norms", scope="reduced")["zeros"]) == 1
        assert float(r["grad"][3].abs().max()) == 0.0
        assert int(one(opt, step=s, module_name="experts.w.exp_avg.expert_norms", scope="exp_avg")["zeros"]) == 1
    # nothing left out or guessed
    assert report.left_out["unknown"] == 0 and report.left_out["incomplete"] == 0, report.to_json()


def _rank(root, rank, groups, router, split, rows):
    """A rank directory with a layout saying ``groups`` and the router's token split, and a
    sidecar of ``rows`` (step, counts)."""
    d = root / f"rank_{rank}"
    d.mkdir(parents=True)
    doc = lay.new_document("pytorch", "test", rank, 4)
    doc["groups"] = {g: lay.group(i, n) for g, (i, n) in groups.items()}
    lay.moe_entry(doc, router).update({"num_experts": 4, "top_k": 2, "tokens": {"split": split, "partial": True}})
    lay.write_layout(str(d), doc)
    # a monitor file, so that the directory is an output the readers accept
    (d / "param_step0-1.csv").write_text("vpp_stage,step,module_name,scope,min,max,mean,norm,nans\n"
                                         "0,0,w,param_origin,1,1,1,1,0\n0,1,w,param_origin,1,1,1,1,0\n")
    lines = ["vpp_stage,step,module_name,counts"]
    lines += [f"0,{s},{router}.tokens_per_expert,{';'.join(map(str, c))}" for s, c in rows]
    (d / "moe_counts_step0-1.csv").write_text("\n".join(lines) + "\n")


def test_token_counts_summed_over_the_groups_that_see_different_tokens(tmp_path):
    """dp=2 x tp=2 without sequence parallelism: the two tp ranks of a dp rank route the
    same tokens (replicas), the dp ranks different ones."""
    g = np.random.default_rng(0)
    router = "decoder.layers.0.mlp.router"
    per_dp = {dp: [g.integers(0, 9, 4) for _ in range(2)] for dp in range(2)}
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        _rank(tmp_path / "run", rank, {"dp": (dp, 2), "tp": (tp, 2)}, router, [["dp", dp, 2]],
              [(s, per_dp[dp][s]) for s in range(2)])
    report = merge_run(str(tmp_path / "run"), str(tmp_path / "merged"), engine="python")
    assert "moe.csv" in report.files and "moe_counts.csv" in report.files
    counts = read_csv(tmp_path / "merged" / "moe_counts.csv")
    tokens = read_csv(tmp_path / "merged" / "moe.csv")
    for s in range(2):
        total = per_dp[0][s] + per_dp[1][s]
        row = one(counts, step=str(s), module_name=f"{router}.tokens_per_expert")
        assert [int(c) for c in row["counts"].split(";")] == total.tolist()
        got = one(tokens, step=str(s), module_name=f"{router}.tokens_per_expert", scope="routing")
        want = {"min": float(total.min()), "max": float(total.max()), "mean": float(total.mean()),
                "norm": float(np.sqrt((total.astype(float) ** 2).sum())), "nans": 0}
        assert_row_matches(got, want)
        assert int(got["zeros"]) == int((total == 0).sum())
    assert not any("left out" in n or "different counts" in n for n in report.notes), report.notes


def test_token_counts_of_an_incomplete_or_disagreeing_run(tmp_path):
    """A dp rank missing (its directory gone): the sum would be a part, so it is left out
    and said; tp replicas that differ are said and the lowest rank's counts used."""
    router = "decoder.layers.0.mlp.router"
    for rank in range(2):  # dp=2, tp=1: only dp rank 0 here
        _rank(tmp_path / "a", rank, {"dp": (0, 2), "tp": (rank, 2)}, router, [["dp", 0, 2]],
              [(0, [1, 2, 3, 4 + rank])])
    report = merge_run(str(tmp_path / "a"), str(tmp_path / "ma"), engine="python")
    assert any("do not cover" in n for n in report.notes), report.notes
    assert any("different counts" in n for n in report.notes), report.notes
    assert read_csv(tmp_path / "ma" / "moe.csv") == []
