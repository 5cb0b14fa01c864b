"""Megatron-Core 0.16 MoE under expert parallelism on 4 gloo ranks: EP=2 x TP=1 (DP=4 for
the dense parameters, expert data parallel 2 for the experts) and EP=2 x PP=2 (1F1B, DP=2,
one layer a stage); ``SequentialMLP`` experts, the ``allgather`` dispatcher;
``workers/megatron_ep.py`` through benchmarks/megatron_cpu_shim.py, one launch.

What is checked, against the worker's own references (each parameter's reduced
``main_grad``, value and Adam ``exp_avg``, and each router's routing map summed):
- each rank's ``layout.json`` describes the expert parameters (nothing "unknown" but what
  pipeline parallelism always leaves), renames local expert ``i`` of expert-parallel rank
  ``r`` to the model's ``2r + i`` (under pipeline parallelism together with the layer's
  global number), and names each router with its experts, ``local_experts`` and the groups
  its tokens differ over;
- ``merge_run``: every expert's merged ``reduced`` gradient, ``param_origin`` and
  ``exp_avg`` rows under the global name equal NumPy on the worker's tensors; nothing left
  out, no replica disagrees;
- the ``moe`` monitor (``"per_expert": true``) on every rank: its ``tokens_per_expert``
  rows and its sidecar equal the rank's routing maps summed; each router's ``layout.json``
  entry carries the monitor's fields (``num_experts``, ``top_k``, ``score``) beside the
  stack's (``local_experts``, ``tokens``, ``expert_params``);
- ``merge`` sums the sidecars over the data-parallel group into global ``tokens_per_expert``
  rows (``DEST/moe.csv``) equal to the sum of the ranks' routing maps, leaves the per-rank
  ``moe`` rows out (counted), and ``summary``/``anomalies`` on the merged view judge the
  global counts (MaxVio, CV and dead experts of the summed vector).
"""

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from support import assert_row_matches, numpy_stats, read_csv, run_torchrun
from support.extras import require

require("megatron.core", "the expert-parallel test trains Megatron-Core's MoE GPT on 4 gloo ranks")

from msprobe.core.monitor_v2.analysis.cli import main  # noqa: E402
from msprobe.core.monitor_v2.analysis.merge import merge_run  # noqa: E402
from msprobe.core.monitor_v2.analysis.moe import IMBALANCE, MoeSettings, moe_findings  # noqa: E402
from msprobe.core.monitor_v2.analysis.reader import Problems, scan  # noqa: E402
from msprobe.core.monitor_v2.layout import load_layout, rename  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "megatron_ep.py"
WORLD, STEPS, EXPERTS, EP, LAYERS = 4, 2, 4, 2, 2
CONFIGS = ("ep", "pp-ep")
STAGED = ("module rows of the modules above the transformer layers under pipeline parallelism "
          "(each stage's own tensors under one name)")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_ep")
    started = time.time()
    run_torchrun(WORKER, out, nproc=WORLD, timeout=600)
    print(f"megatron_ep launch: {time.time() - started:.1f} s")
    return out


@pytest.fixture(params=CONFIGS)
def run(launched, request):
    out = launched / request.param
    saved = [torch.load(out / f"full_rank{r}.pt") for r in range(WORLD)]
    report = merge_run(str(out / "run"), str(out / "merged"), engine="python")
    return out, saved, report


def test_layout_describes_expert_parallel_parameters(run):
    out, saved, _ = run
    for r in range(WORLD):
        doc = load_layout(str(out / "run" / f"rank_{r}" / "layout.json"))
        ep_rank, ep_size = saved[r]["meta"]["ep"]
        assert doc["groups"]["ep"] == {"rank": ep_rank, "size": ep_size} and ep_size == EP
        pp_rank, pp = saved[r]["meta"]["pp"]
        assert doc["unknown"] == ([] if pp == 1 else [STAGED])
        assert all(isinstance(e["shape"], list) for e in doc["params"].values())
        local = EXPERTS // EP
        for layer in range(LAYERS // pp):
            global_layer = pp_rank * (LAYERS // pp) + layer
            for i in range(local):
                name = f"decoder.layers.{layer}.mlp.experts.local_experts.{i}.linear_fc1.weight"
                want = f"decoder.layers.{global_layer}.mlp.experts.local_experts.{ep_rank * local + i}.linear_fc1.weight"
                assert rename(name, doc["rename"]) == want
        assert sorted(doc["moe"]) == saved[r]["meta"]["routers"]
        dp_rank, dp_size = saved[r]["meta"]["dp"]
        for router, entry in doc["moe"].items():
            assert entry["num_experts"] == EXPERTS and entry["top_k"] == 2 and entry["score"] == "softmax"
            assert entry["experts"] == router.rsplit(".", 1)[0] + ".experts"
            assert entry["local_experts"] == [ep_rank * local, local]
            assert entry["tokens"] == {"split": [["dp", dp_rank, dp_size]], "partial": True}
            assert len(entry["expert_params"]) == 4 * local
            # the moe monitor's own entry went in beside the stack's: the same router, its
            # experts as the monitor found them
            assert entry["experts"].endswith("mlp.experts")


def test_merge_combines_experts_under_global_names(run):
    out, saved, report = run
    moe_rows = sum(len(read_csv(f)) for f in (out / "run").glob("rank_*/moe_*.csv") if "counts" not in f.name)
    assert moe_rows > 0
    assert report.disagreements == 0 and report.left_out == {
        "unknown": 0, "partial": 0, "incomplete": 0, "cc": 0, "no_layout": 0, "moe": moe_rows}, report.to_json()
    wg = read_csv(out / "merged" / "weight_grad.csv")
    pr = read_csv(out / "merged" / "param.csv")
    opt = read_csv(out / "merged" / "optimizer.csv")

    def one(rows, **match):
        found = [x for x in rows if all(x[k] == v for k, v in match.items())]
        assert len(found) == 1, match
        return found[0]

    checked = set()
    for r in range(WORLD):
        full = saved[r]["full"]
        for step in range(STEPS):
            for name, grad in full["grad"][step].items():
                if ".local_experts." not in name:
                    continue
                checked.add(name)
                s = str(step)
                assert_row_matches(one(wg, step=s, module_name=name, scope="reduced"), numpy_stats(grad), 1e-5, 1e-9)
                assert_row_matches(one(pr, step=s, module_name=name, scope="param_origin"),
                                   numpy_stats(full["param"][step][name]), 1e-5, 1e-9)
                assert_row_matches(one(opt, step=s, module_name=name + ".exp_avg", scope="exp_avg"),
                                   numpy_stats(full["exp_avg"][step][name]), 1e-5, 1e-9)
    # every global expert of both layers, 4 parameters each
    assert len(checked) == LAYERS * EXPERTS * 4
    assert {n.split(".local_experts.")[1].split(".")[0] for n in checked} == {str(e) for e in range(EXPERTS)}


def test_merge_sums_token_counts_over_data_parallel(run):
    out, saved, report = run
    counts = read_csv(out / "merged" / "moe_counts.csv")
    tokens = read_csv(out / "merged" / "moe.csv")
    routers = sorted({n for r in range(WORLD) for n in saved[r]["meta"]["global_routers"]})
    assert len(routers) == LAYERS and len(counts) == len(tokens) == STEPS * LAYERS
    dp = saved[0]["meta"]["dp"][1]
    for step in range(STEPS):
        for router in routers:
            # the ranks that hold the router (its pipeline stage) route different tokens (dp)
            held = [r for r in range(WORLD) if router in saved[r]["full"]["tokens"][step]]
            assert len(held) == dp
            total = sum(saved[r]["full"]["tokens"][step][router].numpy() for r in held)
            name = f"{router}.tokens_per_expert"
            row = [x for x in counts if x["step"] == str(step) and x["module_name"] == name]
            assert [int(c) for c in row[0]["counts"].split(";")] == total.tolist()
            assert total.sum() == dp * 2 * 8 * 2 * 2  # dp ranks x micro-batches x tokens x top-k
            got = [x for x in tokens if x["step"] == str(step) and x["module_name"] == name][0]
            want = {"min": float(total.min()), "max": float(total.max()), "mean": float(total.mean()),
                    "norm": float(np.sqrt((total.astype(np.float64) ** 2).sum())), "nans": 0}
            assert_row_matches(got, want)


def test_moe_monitor_counts_each_rank_and_writes_its_sidecar(run):
    out, saved, _ = run
    for r in range(WORLD):
        rank_dir = out / "run" / f"rank_{r}"
        rows = [x for f in sorted(rank_dir.glob("moe_*.csv")) if "counts" not in f.name for x in read_csv(f)]
        sidecar = [x for f in sorted(rank_dir.glob("moe_counts_step*.csv")) for x in read_csv(f)]
        local = saved[r]["full"]["local"]
        assert len(sidecar) == STEPS * len(local[0]) and local[0]
        for step in range(STEPS):
            for router, counts in local[step].items():
                want = counts.numpy().astype(np.float64)
                name = f"{router}.tokens_per_expert"
                side = [x for x in sidecar if x["step"] == str(step) and x["module_name"] == name]
                assert len(side) == 1 and [int(c) for c in side[0]["counts"].split(";")] == want.astype(int).tolist()
                got = [x for x in rows if x["step"] == str(step) and x["module_name"] == name and x["scope"] == "routing"]
                assert len(got) == 1, (r, step, name)
                assert_row_matches(got[0], {"min": want.min(), "max": want.max(), "mean": want.mean(),
                                            "norm": float(np.sqrt((want ** 2).sum())), "nans": 0})
                assert int(got[0]["zeros"]) == int((want == 0).sum())


def test_merged_view_findings_use_the_global_counts(run):
    out, saved, report = run
    routers = sorted({n for r in range(WORLD) for n in saved[r]["meta"]["global_routers"]})
    assert report.to_json()["moe"] == {r: {"num_experts": EXPERTS, "top_k": 2, "score": "softmax"} for r in routers}
    # every written step flagged (MaxVio > 0, one step enough): each finding's value is the
    # MaxVio of the first step, which must be the global vector's, not a rank's
    settings = MoeSettings(dead_steps=1, maxvio=0.0, cv=float("inf"))
    merged = moe_findings(scan(str(out / "merged")), Problems(), settings)
    for router in routers:
        total = sum(saved[r]["full"]["tokens"][0][router].numpy() for r in range(WORLD)
                    if router in saved[r]["full"]["tokens"][0]).astype(np.float64)
        found = [f for f in merged if f["kind"] == IMBALANCE and f["router"] == router]
        assert len(found) == 1 and found[0]["rank"] == 0 and found[0]["step"] == 0
        assert found[0]["value"] == round(total.max() / total.mean() - 1, 6)
        cv = float(np.sqrt(max((total ** 2).sum() / EXPERTS - total.mean() ** 2, 0.0)) / total.mean())
        assert f"CV {cv:.3g}" in found[0]["detail"]
        dead = [f for f in merged if f["kind"] == "dead experts" and f["router"] == router]
        assert len(dead) == (1 if (total == 0).any() else 0)


def test_reading_tools_put_the_experts_side_by_side(run):
    """``summary``/``anomalies`` group the experts' gradient rows by expert index (each
    layer's parameter over its experts): the quietest and loudest expert of the last step,
    on the merged view (all 4 experts, global names) and on one rank (its 2 local experts,
    local names), equal to NumPy over the worker's reduced gradients."""
    out, saved, _ = run
    last = STEPS - 1
    grads = {}
    for r in range(WORLD):
        grads.update(saved[r]["full"]["grad"][last])
    per_group = {}
    for name, grad in grads.items():
        if ".local_experts." not in name:
            continue
        head, _, tail = name.partition(".local_experts.")
        e, _, param = tail.partition(".")
        per_group.setdefault(f"{head}.local_experts.<e>.{param}", {})[int(e)] = float(
            np.sqrt((grad.double().numpy() ** 2).sum()))
    assert len(per_group) == LAYERS * 4 and all(len(v) == EXPERTS for v in per_group.values())

    def check(items, want_groups, experts):
        assert {i["group"] for i in items} == set(want_groups)
        for item in items:
            norms = want_groups[item["group"]]
            assert item["scope"] == "reduced" and item["step"] == last and item["experts"] == experts
            assert item["quietest"] == min(norms, key=norms.get) and item["loudest"] == max(norms, key=norms.get)
            assert np.isclose(item["quietest_norm"], min(norms.values()), rtol=1e-5)
            assert np.isclose(item["loudest_norm"], max(norms.values()), rtol=1e-5)

    stdout = io.StringIO()
    main(["anomalies", str(out / "merged"), "--json", "--limit", "0"], out=stdout, err=io.StringIO())
    check(json.loads(stdout.getvalue())["experts"]["items"], per_group, EXPERTS)
    text = io.StringIO()
    main(["summary", str(out / "merged")], out=text, err=io.StringIO())
    assert "experts:" in text.getvalue() and "widest spread" in text.getvalue()
    # one rank: its own experts, local names (local index i is global ep_rank * 2 + i)
    rank = next(r for r in range(WORLD) if saved[r]["meta"]["pp"][0] == 0 and saved[r]["meta"]["ep"][0] == 1)
    local = EXPERTS // EP
    mine = {}
    for group, norms in per_group.items():
        layer = int(group.split("decoder.layers.")[1].split(".")[0])
        if layer < LAYERS // saved[rank]["meta"]["pp"][1]:
            mine[group] = {e - local: n for e, n in norms.items() if e >= local}
    stdout = io.StringIO()
    main(["anomalies", str(out / "run"), "--ranks", str(rank), "--json", "--limit", "0"], out=stdout,
         err=io.StringIO())
    check(json.loads(stdout.getvalue())["experts"]["items"], mine, local)
