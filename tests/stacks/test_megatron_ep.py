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
- the routers' token counts (the ``moe`` monitor's sidecar format, written by the worker)
  summed over the data-parallel group into global ``tokens_per_expert`` rows equal the sum
  of the ranks' routing maps.
"""

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from support import assert_row_matches, numpy_stats, read_csv, run_torchrun
from support.extras import require

require("megatron.core", "the expert-parallel test trains Megatron-Core's MoE GPT on 4 gloo ranks")

from msprobe.core.monitor_v2.analysis.merge import merge_run  # noqa: E402
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


def test_merge_combines_experts_under_global_names(run):
    out, saved, report = run
    assert report.disagreements == 0 and not any(report.left_out.values()), report.to_json()
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
    tokens = read_csv(out / "merged" / "moe_tokens.csv")
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
