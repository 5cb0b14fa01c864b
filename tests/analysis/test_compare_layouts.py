"""``msprobe-monitor compare`` across parallel layouts: the same Megatron-Core GPT (CPU
shim, benchmarks/megatron_cpu_shim.py) trained on the same two batches a step as TP=1 x
DP=2 (one micro-batch a rank) and as TP=2 x DP=1 (both batches as two micro-batches),
workers/compare_megatron.py, 2 gloo ranks. Both runs are merged and compared under global
names; checked independently: the whole-tensor norms rebuilt from each rank's rows (read
with the csv module, combined by the pieces its layout.json names) with NumPy, and the
loss and gradient norm each run logged with ``log_scalars`` (compare's migration-standard
verdict on them, read from the runs the merged views came from).

What TP changes: the column- and row-parallel matmuls sum their partial products in
another order (and across ranks, by the all-reduce), and the tp shards' norms are combined
from per-rank sums of squares. Measured on this model over 3 steps (scaled norm error
|cand - ref| / max(|ref|, |cand|)): reduced gradients median 2.5e-6, largest 5.3e-5 (a
LayerNorm weight at step 2: replicated over tp, but computed from its output's gradient,
which tp all-reduces from partial sums, and summed over tokens of both signs, so the
rounding is large beside its small norm); moments up to 3.9e-5 (Adam carries it on);
parameters up to 7e-6; the logged loss 2.3e-7 and gradient norm 2.7e-6. Above fp32's
rounding (1.2e-7), inside compare's fp32 tolerance (1e-4), which is what the test asserts,
with the medians well below it. The per-micro-batch scopes (``unreduced``, module
``backward``) differ by construction (one micro-batch of one batch against two of half
weight each) and must be reported as not comparable, not as errors.
"""

import csv
import json
import math
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import pytest

from analysis_helpers import cli
from support import run_torchrun
from support.extras import require

require("megatron.core", "the layout comparison trains Megatron-Core's GPT under TP=2 and under DP=2 (CPU, gloo)")

WORKER = Path(__file__).parent / "workers" / "compare_megatron.py"
STEPS = 3
FP32_TOL = 1e-4  # compare's documented fp32 tolerance (docs/compare.md)
TYPICAL = 1e-5  # the median error per scope that TP's other reduction order leaves here (see the module doc)
CLASSES = {("weight_grad", "reduced"): "reduced", ("param", "param_origin"): "param",
           ("param", "param_updated"): "param", ("optimizer", "exp_avg"): "optimizer",
           ("optimizer", "exp_avg_sq"): "optimizer"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("compare_megatron")
    run_torchrun(WORKER, root, nproc=2, timeout=300)
    return root


def _rows(path: Path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def whole_norms(run: Path) -> Dict[Tuple[str, int, str, str], float]:
    """``(monitor, step, name, scope) -> norm`` of every whole parameter-shaped tensor
    (reduced gradients, parameters, moments), rebuilt from the ranks' rows: the root of
    the summed squares of the ranks' pieces along ``tp``, one rank's row where the
    layout names no tp split (a replica)."""
    sumsq: Dict[Tuple[str, int, str, str], float] = {}
    for rank_dir in sorted(run.glob("rank_*")):
        layout = json.loads((rank_dir / "layout.json").read_text())
        tp = layout["groups"].get("tp", {"rank": 0})["rank"]
        dp = layout["groups"]["dp"]["rank"]
        for path in sorted(rank_dir.glob("*.csv")):
            monitor = path.name.split("_step")[0]
            for r in _rows(path):
                piece = CLASSES.get((monitor, r["scope"]))
                if piece is None:
                    continue
                param = r["module_name"][: -len(r["scope"]) - 1] if monitor == "optimizer" else r["module_name"]
                split = [g for g, _, _ in layout["params"][param]["pieces"][piece]["split"]]
                assert set(split) <= {"tp"}, (param, split)  # no distributed optimizer here
                if dp != 0 or (not split and tp != 0):
                    continue  # a replica of a row counted already
                key = (monitor, int(r["step"]), r["module_name"], r["scope"])
                sumsq[key] = sumsq.get(key, 0.0) + float(r["norm"]) ** 2
    return {k: math.sqrt(v) for k, v in sumsq.items()}


def scalars(run: Path, rank: int) -> Dict[Tuple[int, str], float]:
    out = {}
    for path in sorted((run / f"rank_{rank}").glob("scalars_step*.csv")):
        for r in _rows(path):
            assert r["min"] == r["max"] == r["mean"] and r["nans"] == "0"
            out[(int(r["step"]), r["module_name"])] = float(r["mean"])
    return out


def test_tp2_against_dp2_under_global_names(runs, tmp_path):
    out = tmp_path / "cmp"
    res = cli("compare", runs / "dp2", runs / "tp2", "--out", out, "--json")
    doc = res.json()
    assert res.code == 0 and doc["verdict"] == "pass", res.out
    assert doc["where_they_part"] is None
    assert doc["settings"]["collapse_dp"] is True  # DP 2 against 1: the per-dp rows pooled
    assert (out / "merged_ref" / "merge.json").is_file() and (out / "merged_cand" / "merge.json").is_file()
    # the scopes cut per micro-batch differ by construction: said so, never as errors
    assert set(doc["not_comparable"]) == {"weight_grad/unreduced", "module/backward"}
    assert doc["provenance"]["ref"]["micro_batches"] == 1 and doc["provenance"]["cand"]["micro_batches"] == 2
    assert doc["counts"]["warning"] == doc["counts"]["error"] == doc["counts"]["nonfinite_mismatch"] == 0
    with open(out / "compare.csv", newline="") as fh:
        got = {(r["monitor"], int(r["step"]), r["module_name"], r["scope"]): r for r in csv.DictReader(fh)}
    assert {k[3] for k in got} == {"forward", "reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq"}

    # independently: whole-tensor norms from each run's rank rows, with NumPy
    ref, cand = whole_norms(runs / "dp2"), whole_norms(runs / "tp2")
    assert set(ref) == set(cand) and len(ref) == 5 * STEPS * len({k[2] for k in ref if k[0] == "weight_grad"})
    keys = sorted(ref)
    r = np.array([ref[k] for k in keys])
    c = np.array([cand[k] for k in keys])
    scaled = np.abs(c - r) / np.maximum(np.maximum(np.abs(r), np.abs(c)), 1e-12)
    assert scaled.max() <= FP32_TOL, (keys[int(scaled.argmax())], scaled.max())
    assert scaled.max() > 0  # TP does change the reduction order: the runs are not bit-identical
    for scope in {k[3] for k in keys}:
        assert np.median([e for k, e in zip(keys, scaled) if k[3] == scope]) <= TYPICAL, scope
    for k, e in zip(keys, scaled):
        row = got[k]
        # the merge's whole-tensor norms are the ones rebuilt here (9 significant digits in the CSVs)
        assert float(row["ref_norm"]) == pytest.approx(ref[k], rel=1e-7), k
        assert float(row["cand_norm"]) == pytest.approx(cand[k], rel=1e-7), k
        if row["class"] == "compared":  # within the CSVs' rounding (9 significant digits a norm)
            assert float(row["error"]) == pytest.approx(e, rel=1e-3, abs=2e-8), k
        assert row["level"] == "pass"
    # forward activations: every module's rows compared (the dp ranks' pooled on one side)
    forward = [row for k, row in got.items() if k[3] == "forward"]
    assert len(forward) > 100 and max(float(row["error"]) for row in forward) <= FP32_TOL

    # the loss and gradient norm the two runs logged (the same on every rank of a run)
    a, b = scalars(runs / "dp2", 0), scalars(runs / "tp2", 0)
    assert a == scalars(runs / "dp2", 1) and b == scalars(runs / "tp2", 1)
    assert sorted(a) == sorted(b) == [(s, n) for s in range(STEPS) for n in ("grad_norm", "loss")]
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=TYPICAL), key
    # compare reads them from the runs the merged views came from (a merged view has no
    # scalars files) and judges them by the migration standard: within it, as NumPy says
    sc = doc["scalars"]
    assert sc is not None and sc["level"] == "pass", doc["notes"]
    assert sc["source"] == {"ref": "scalars rows", "cand": "scalars rows"}
    for side, run in (("ref", "dp2"), ("cand", "tp2")):
        assert doc["provenance"][side]["scalars"]["path"] == str((runs / run / "rank_0").resolve())
    la, lb = (np.array([s[(i, "loss")] for i in range(STEPS)]) for s in (a, b))
    ga, gb = (np.array([s[(i, "grad_norm")] for i in range(STEPS)]) for s in (a, b))
    assert sc["loss"]["steps"] == sc["grad_norm"]["steps"] == STEPS
    assert sc["loss"]["first_abs"] == pytest.approx(abs(lb[0] - la[0]), rel=1e-9, abs=1e-15)
    assert sc["loss"]["max_abs"] == pytest.approx(np.abs(lb - la).max(), rel=1e-9, abs=1e-15)
    assert sc["grad_norm"]["mean_signed_rel"] == pytest.approx(float(np.mean((gb - ga) / np.abs(ga))),
                                                               rel=1e-9, abs=1e-15)
    assert sc["loss"]["first_ok"] and sc["loss"]["all_ok"] and sc["grad_norm"]["ok"]
