"""The ``moe`` monitor on Megatron-Core 0.16.1's MoE layer (``TopKRouter`` returning
``(probs, routing_map)``), 2 gloo ranks on the CPU under the project's shim: the routers
found by their name, each rank's ``tokens_per_expert`` equal to NumPy over the routing maps
the worker captured, the logits said once as not observable (Megatron computes them with a
function inside the router), a weight_cosine row per router and step, training
bit-identical."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from support import rows_of, run_torchrun
from support.extras import require

require("megatron.core", "the moe monitor is tested on Megatron-Core's MoE layer on 2 gloo ranks")

WORKER = Path(__file__).parent / "workers" / "megatron_moe.py"
ROUTERS = ["decoder.layers.0.mlp.router", "decoder.layers.1.mlp.router"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_moe")
    run_torchrun(WORKER, out, timeout=600)
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_megatron_router_counts_per_rank(run, rank):
    ref = torch.load(run / f"ref_rank{rank}.pt")
    assert ref["errors"] == 0
    assert all(torch.equal(a, b) for a, b in zip(ref["losses"], ref["losses_off"]))
    assert all(torch.equal(a, b) for a, b in zip(ref["params"], ref["params_off"]))
    rows = rows_of(run, "moe", rank=rank)
    assert {r["module_name"].rpartition(".")[0] for r in rows} == set(ROUTERS)
    for router in ROUTERS:
        for step, routing_map in enumerate(ref["maps"][router]):
            counts = routing_map.numpy().sum(0).astype(np.float64)
            row = next(r for r in rows if r["step"] == str(step) and r["module_name"] == f"{router}.tokens_per_expert")
            want = {"min": counts.min(), "max": counts.max(), "mean": counts.mean(),
                    "norm": math.sqrt((counts ** 2).sum())}
            for op, value in want.items():
                assert math.isclose(float(row[op]), value, rel_tol=1e-6), (router, step, op)
            assert int(row["zeros"]) == int((counts == 0).sum())
            assert counts.sum() == 2 * 16  # top-2 of this rank's 16 tokens
    kinds = {r["module_name"].rpartition(".")[2] for r in rows}
    assert kinds == {"tokens_per_expert", "weight_cosine"}
    said = [m for level, m in ref["logs"] if "not observable" in m]
    assert len(said) == len(ROUTERS) and all(level == "WARNING" for level, m in ref["logs"] if "not observable" in m)
