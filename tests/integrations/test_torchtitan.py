"""TorchTitan 0.3.0's real ``Trainer`` with the monitor, 2 gloo ranks on the CPU: the llama3
debug model on FSDP2 and the DeepSeek-V3 debug MoE model on FSDP2 with expert parallel 2,
TorchTitan's defaults kept (selective activation checkpointing, ``ChunkedLossWrapper``,
fused AdamW, clipping), the monitor started as a TorchTitan user would
(``mon.start(model=trainer.model_parts, optimizer=trainer.optimizers,
grad_acc_steps=...)``, ``"patch_optimizer_step": false``, ``mon.step()`` after each
``train_step`` in TorchTitan's own ``train()``), every monitor on; llama3 with
``weight_grad``'s default, DeepSeek-V3 with ``monitor_mbs_grad``. The shims that let it run
on the CPU are in torchtitan_shims.py, the runs and the references in
torchtitan_worker.py: NumPy statistics of ``full_tensor()`` reads of TorchTitan's own
gradients, parameters and AdamW moments, and of the lm_head logits and gradients computed
again in float64. One launch trains both models; the checks share it.

Rows describe each rank's piece of a sharded tensor (FSDP2's ``Shard(0)``, expert
parallel's experts): the pieces' statistics make up the whole tensor's (norm from the
summed squares, min of the minima, max of the maxima, the mean of equal halves)."""

import functools
import math
from pathlib import Path
from typing import Dict, List

import pytest

from support import rows_of, run_torchrun
from support.extras import require

for _package, _why in (("torchtitan", "the TorchTitan test trains with TorchTitan's own Trainer"),
                       ("triton", "TorchTitan 0.3.0 imports triton unconditionally")):
    require(_package, _why, load=False)  # imported by the worker only

import torch  # noqa: E402

WORKER = Path(__file__).with_name("torchtitan_worker.py")
MODELS = ("llama3", "deepseek_v3")
STEPS, GRAD_ACC, RANKS, EXPERT_PARALLEL = 2, 2, 2, {"llama3": 1, "deepseek_v3": 2}
LOCAL_TOKENS = 2 * 32  # a rank's tokens a micro-batch (the worker's LOCAL_BATCH x SEQ_LEN)
Stats = Dict[str, float]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("torchtitan")
    run_torchrun(WORKER, out, *MODELS, timeout=600)
    return out


@pytest.fixture(params=MODELS)
def model(request) -> str:
    return request.param


def _refs(out: Path, model: str) -> List[dict]:
    paths = [out / model / f"ref_rank{r}.pt" for r in range(RANKS)]
    if not all(p.exists() for p in paths):
        pytest.fail(f"no results for {model}: a monitored run before it raised (see that model's tests)")
    return [torch.load(p, weights_only=False) for p in paths]


def _trained(out: Path, model: str) -> List[dict]:
    """The references, where the monitored run trained to its end (else its traceback)."""
    refs = _refs(out, model)
    for ref in refs:
        assert ref["error"] is None, f"the monitored {model} run raised on rank {ref['rank']}:\n{ref['error']}"
    return refs


@functools.lru_cache(maxsize=None)
def _all_rows(out: Path, model: str, monitor: str, rank: int) -> List[dict]:
    return rows_of(out / model / "mon", monitor, rank)


def _rows(out: Path, model: str, monitor: str, rank: int, **match) -> List[dict]:
    return [x for x in _all_rows(out, model, monitor, rank) if all(x[k] == str(v) for k, v in match.items())]


def _combined(parts: List[Stats]) -> Stats:
    """The statistics of several equal-sized tensors taken together (calls of a module in one
    step, micro-batches), as the module monitor combines its calls."""
    return {"min": min(p["min"] for p in parts), "max": max(p["max"] for p in parts),
            "mean": sum(p["mean"] for p in parts) / len(parts),
            "norm": math.sqrt(sum(p["norm"] ** 2 for p in parts))}


def _assert_stats(got: Stats, want: Stats, rtol: float, what) -> None:
    """min, max and norm within ``rtol``; the mean within ``rtol`` or 1e-6 of the norm (a mean
    near zero is a difference of large sums)."""
    for op in ("min", "max", "norm"):
        assert math.isclose(got[op], want[op], rel_tol=rtol, abs_tol=1e-12), (what, op, got[op], want[op])
    assert math.isclose(got["mean"], want["mean"], rel_tol=rtol, abs_tol=1e-6 * want["norm"]), \
        (what, "mean", got["mean"], want["mean"])


def _values(row: dict) -> Stats:
    return {op: float(row[op]) for op in ("min", "max", "mean", "norm")}


def _pieces(per_rank: List[List[dict]], what) -> Stats:
    """One row a rank, each of an equal piece of one tensor: the whole tensor's statistics."""
    assert all(len(rows) == 1 for rows in per_rank), (what, per_rank)
    return _combined([_values(rows[0]) for rows in per_rank])


# ------------------------------------------------------------------ training itself
def test_trains_bit_identical_to_an_unmonitored_run(launched, model):
    for ref in _trained(launched, model):
        assert ref["grad_acc"] == GRAD_ACC
        assert len(ref["losses"]) == STEPS * GRAD_ACC
        assert ref["losses"] == ref["plain_losses"], "the monitor changed a loss"
        assert ref["identical"] is True, "the monitor changed a parameter"


def test_stop_leaves_nothing_behind(launched, model):
    for ref in _trained(launched, model):
        assert ref["left_after_stop"] == {}, "(unmonitored Trainer, monitored one after stop())"


def test_warnings_are_said_once_and_no_monitor_error(launched, model):
    for ref in _trained(launched, model):
        lines = ref["warnings"]
        assert len(set(lines)) == len(lines), lines
        assert not [line for line in lines if "contained" in line], lines


# ------------------------------------------------------------------ names and steps
def test_every_monitor_writes_every_step_under_the_models_names(launched, model):
    refs = _trained(launched, model)
    names = set(refs[0]["names"])
    assert all(n.startswith("0:") and "_checkpoint_wrapped_module" not in n for n in names)
    # grouped experts (3-D, under a module named *experts*) also get their per-expert norms
    grouped = {n for n in names if refs[0]["ndims"][n] == 3 and "experts" in n.rsplit(".", 1)[0].rsplit(".", 1)[-1]}
    assert bool(grouped) == (model == "deepseek_v3"), grouped
    norms = ".expert_norms"
    expected = {
        "weight_grad": {(n, "reduced") for n in names} | {(n + norms, "reduced") for n in grouped},
        "param": {(n + x, scope) for n in names for scope in ("param_origin", "param_updated")
                  for x in ("", norms) if not x or n in grouped},
        "optimizer": {(f"{n}.{key}{x}", key) for n in names for key in ("exp_avg", "exp_avg_sq")
                      for x in ("", norms) if not x or n in grouped},
    }
    for r in range(RANKS):
        for monitor in ("module", "weight_grad", "param", "optimizer", "cc"):
            steps = {x["step"] for x in _rows(launched, model, monitor, r)}
            assert steps == {str(s) for s in range(STEPS)}, (monitor, r, steps)
        for monitor, want in expected.items():
            for s in range(STEPS):
                got = {(x["module_name"], x["scope"]) for x in _rows(launched, model, monitor, r, step=s)
                       if x["scope"] != "unreduced"}
                assert got == want, (monitor, r, s, sorted(want - got)[:5], sorted(got - want)[:5])


def test_cc_rows_hold_fsdp2s_collectives(launched, model):
    _trained(launched, model)
    for r in range(RANKS):
        for s in range(STEPS):
            ops = {x["module_name"].split(".")[0] for x in _rows(launched, model, "cc", r, step=s)}
            assert {"all_gather_single", "reduce_scatter_single"} <= ops, (r, s, ops)


# ------------------------------------------------------------------ weight_grad
def test_reduced_is_torchtitans_gradient_after_clipping(launched, model):
    refs = _trained(launched, model)
    for s in range(STEPS):
        for name in refs[0]["read"]:
            per_rank = [_rows(launched, model, "weight_grad", r, step=s, module_name=name, scope="reduced")
                        for r in range(RANKS)]
            assert all(int(x["micro_step"]) == GRAD_ACC for rows in per_rank for x in rows), \
                ("micro_step counts the micro-batches declared to start()", s, name,
                 [x["micro_step"] for rows in per_rank for x in rows])
            _assert_stats(_pieces(per_rank, (s, name)), refs[0]["reduced"][s][name], 1e-5, (s, name))


def test_unreduced_rows_count_micro_batches_not_backward_passes(launched, model):
    """``ChunkedLossWrapper`` runs 8 backward passes through lm_head per micro-batch: the
    rows' ``micro_step`` still counts the micro-batches (1..GRAD_ACC per micro-batch with
    ``monitor_mbs_grad``, GRAD_ACC for a step's accumulated row)."""
    refs = _trained(launched, model)
    allowed = set(range(1, GRAD_ACC + 1)) if refs[0]["monitor_mbs_grad"] else {GRAD_ACC}
    for r in range(RANKS):
        for s in range(STEPS):
            steps = {int(x["micro_step"]) for x in _rows(launched, model, "weight_grad", r, step=s,
                                                         scope="unreduced")}
            assert steps <= allowed, (r, s, sorted(steps))


@pytest.mark.parametrize("model", ["deepseek_v3"])  # the run with monitor_mbs_grad
def test_unreduced_lm_head_holds_the_micro_batchs_whole_local_gradient(launched, model):
    """lm_head's local gradient of each micro-batch, computed again in float64 from the
    chunks' inputs (the whole micro-batch), not one chunk's."""
    refs = _trained(launched, model)
    assert refs[0]["monitor_mbs_grad"]
    for r, ref in enumerate(refs):
        for s in range(STEPS):
            rows = _rows(launched, model, "weight_grad", r, step=s, module_name="0:lm_head.weight",
                         scope="unreduced")
            assert sorted(int(x["micro_step"]) for x in rows) == list(range(1, GRAD_ACC + 1)), (r, s, rows)
            for x in rows:
                m = int(x["micro_step"])
                _assert_stats(_values(x), ref["lm_head_grad"][s][m - 1], 1e-4, (r, s, m))


@pytest.mark.parametrize("model", ["llama3"])  # the run with weight_grad's default
def test_without_monitor_mbs_grad_no_unreduced_rows_and_one_warning_why(launched, model):
    """FSDP2 reduce-scatters at every micro-batch (lm_head at the last of its chunks): the
    step's accumulated local gradient never exists, so no accumulated row is written, for
    lm_head either, and one WARNING says why and what gives the rows."""
    refs = _trained(launched, model)
    assert not refs[0]["monitor_mbs_grad"]
    for r, ref in enumerate(refs):
        rows = _rows(launched, model, "weight_grad", r, scope="unreduced")
        assert rows == [], (r, [(x["step"], x["module_name"], x["micro_step"]) for x in rows][:5])
        why = [line for line in ref["warnings"] if "FSDP2" in line and "monitor_mbs_grad" in line]
        assert len(why) == 1, ref["warnings"]


@pytest.mark.parametrize("model", ["deepseek_v3"])  # the run with monitor_mbs_grad
def test_unreduced_per_micro_batch_adds_up_to_what_fsdp2_reduced(launched, model):
    """With ``monitor_mbs_grad``: one row a rank, parameter and micro-batch. FSDP2 sums the
    ranks' local gradients (TorchTitan's divide factor is 1): the means of the ranks' rows
    add up to the mean of what the micro-batch added to ``.grad``; an expert-parallel
    tensor's rows are each rank's own experts, halves of it."""
    refs = _trained(launched, model)
    assert refs[0]["monitor_mbs_grad"]
    for s in range(STEPS):
        for m in range(1, GRAD_ACC + 1):
            for name, want in refs[0]["mb_grad"][s][m - 1].items():
                per_rank = [_rows(launched, model, "weight_grad", r, step=s, module_name=name, scope="unreduced",
                                  micro_step=m) for r in range(RANKS)]
                assert all(len(rows) == 1 for rows in per_rank), (s, m, name, per_rank)
                share = 1 / EXPERT_PARALLEL[model] if ".routed_experts." in name else 1.0
                mean = share * sum(float(rows[0]["mean"]) for rows in per_rank)
                assert math.isclose(mean, want["mean"], rel_tol=1e-3, abs_tol=1e-6 * want["norm"]), \
                    (s, m, name, mean, want["mean"])


@pytest.mark.parametrize("model", ["deepseek_v3"])
def test_merged_expert_norms_are_those_of_every_expert(launched, model, tmp_path):
    """Expert parallel 2: each rank's routed experts' ``.expert_norms`` rows are of its own
    experts; ``merge`` combines them into the rows of the vector of every expert's gradient
    norm, against NumPy over the norms of TorchTitan's gradients (``full_tensor()``)."""
    from msprobe.core.monitor_v2.analysis.merge import merge_run

    refs = _trained(launched, model)
    merge_run(str(launched / model / "mon"), str(tmp_path / "merged"), engine="python")
    rows = _merged_rows(tmp_path / "merged" / "weight_grad.csv")
    checked = 0
    for s in range(STEPS):
        for name, norms in refs[0]["expert_norms"][s].items():
            gname = name  # TorchTitan's layout keeps the chunk prefix
            got = [x for x in rows if x["step"] == str(s) and x["module_name"] == gname + ".expert_norms"
                   and x["scope"] == "reduced"]
            assert len(got) == 1, (s, gname, len(got))
            n = torch.tensor(norms, dtype=torch.float64)
            want = {"min": float(n.min()), "max": float(n.max()), "mean": float(n.mean()), "norm": float(n.norm())}
            _assert_stats(_values(got[0]), want, 1e-4, (s, gname))
            checked += 1
    assert checked >= 2 * STEPS


def _merged_rows(path: Path) -> List[dict]:
    import csv

    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


# ------------------------------------------------------------------ param, optimizer
def test_params_and_adamw_moments_are_torchtitans(launched, model):
    """``param`` rows against the parameters around ``optimizers.step()``; ``optimizer`` rows
    against the moments in ``trainer.optimizers.optimizers[i].state``."""
    refs = _trained(launched, model)
    for s in range(STEPS):
        for name in refs[0]["read"]:
            for scope, key in (("param_origin", "origin"), ("param_updated", "updated")):
                per_rank = [_rows(launched, model, "param", r, step=s, module_name=name, scope=scope)
                            for r in range(RANKS)]
                _assert_stats(_pieces(per_rank, (s, name, scope)), refs[0][key][s][name], 1e-5, (s, name, scope))
            for key in ("exp_avg", "exp_avg_sq"):
                per_rank = [_rows(launched, model, "optimizer", r, step=s, module_name=f"{name}.{key}", scope=key)
                            for r in range(RANKS)]
                _assert_stats(_pieces(per_rank, (s, name, key)), refs[0]["moments"][s][name][key], 1e-5,
                              (s, name, key))


# ------------------------------------------------------------------ module
def test_module_rows_of_the_final_norm_and_the_lm_head_calls_inside_the_loss(launched, model):
    """The final norm's output and its gradient as ``ChunkedLossWrapper`` receives and
    returns them; lm_head, called by the loss on 8 chunks a micro-batch: its input (the
    same elements), its output and its gradient (the logits, computed again in float64)."""
    refs = _trained(launched, model)
    for r, ref in enumerate(refs):
        for s in range(STEPS):
            want = {
                ("0:norm.output.0", "forward"): (ref["pred"][s], 1e-5),
                ("0:lm_head.input.0", "forward"): (ref["pred"][s], 1e-5),
                ("0:lm_head.output.0", "forward"): (ref["logits"][s], 1e-4),
                ("0:lm_head.grad_output.0", "backward"): (ref["logits_grad"][s], 1e-4),
                ("0:norm.grad_output.0", "backward"): (ref["pred_grad"][s], 1e-5),
            }
            for (name, scope), (parts, rtol) in want.items():
                assert len(parts) == GRAD_ACC, (r, s, name, parts)
                rows = _rows(launched, model, "module", r, step=s, module_name=name, scope=scope)
                assert len(rows) == 1, (r, s, name, rows)
                _assert_stats(_values(rows[0]), _combined(parts), rtol, (r, s, name))


def test_module_rows_of_every_checkpointed_layer(launched, model):
    """Every decoder layer (each under selective activation checkpointing) has its forward
    and backward rows at every step, named without the checkpoint wrapper."""
    refs = _trained(launched, model)
    layers = sorted({n.split(".")[1] for n in refs[0]["names"] if n.startswith("0:layers.")}, key=int)
    assert len(layers) == 6
    for r in range(RANKS):
        for s in range(STEPS):
            names = {(x["module_name"], x["scope"]) for x in _rows(launched, model, "module", r, step=s)}
            for i in layers:
                for name, scope in ((f"0:layers.{i}.input.0", "forward"), (f"0:layers.{i}.output.0", "forward"),
                                    (f"0:layers.{i}.grad_output.0", "backward")):
                    assert (name, scope) in names, (r, s, name)
            assert not [n for n, _ in names if "_checkpoint_wrapped_module" in n]


# ------------------------------------------------------------------ moe: the model's token counts
def _csv_rows(path: Path) -> List[dict]:
    import csv

    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _sidecar_counts(rank_dir: Path) -> Dict[tuple, List[int]]:
    """``(step, router) -> counts`` of a rank's ``moe_counts_step*.csv`` files (csv module)."""
    out: Dict[tuple, List[int]] = {}
    for path in sorted(rank_dir.glob("moe_counts_step*.csv")):
        for row in _csv_rows(path):
            router = row["module_name"].rpartition(".tokens_per_expert")[0]
            out[(int(row["step"]), router)] = [int(c) for c in row["counts"].split(";")]
    return out


@pytest.mark.parametrize("model", ["deepseek_v3"])
def test_merged_token_counts_are_the_models_over_both_ranks(launched, model, tmp_path):
    """FSDP2 + expert parallel 2: each rank routes its own tokens to all 8 experts and writes
    its counts (``per_expert``); TorchTitan's layout says the counts are parts of a sum over
    ``dp`` and which experts the rank holds, and ``merge`` writes the model's counts: the
    NumPy sums of the ranks' sidecar vectors (read with csv) and of the expert ids a hook of
    the test's own saw each router choose."""
    import json

    import numpy as np

    from msprobe.core.monitor_v2.analysis.merge import merge_run

    refs = _trained(launched, model)
    mon = launched / model / "mon"
    routers = sorted(refs[0]["router_counts"][0])
    assert len(routers) >= 2, routers  # the debug model's MoE layers
    for r, ref in enumerate(refs):
        assert all(calls == [GRAD_ACC] * STEPS for calls in ref["router_calls"].values()), ref["router_calls"]
        layout = json.loads((mon / f"rank_{r}" / "layout.json").read_text())
        for router in routers:
            entry = layout["moe"][router]
            assert entry["tokens"] == {"split": [["dp", r, RANKS]], "partial": True}, entry
            assert entry["local_experts"] == [4 * r, 4] and entry["num_experts"] == 8, entry
        sidecar = _sidecar_counts(mon / f"rank_{r}")
        assert set(sidecar) == {(s, t) for s in range(STEPS) for t in routers}, sorted(sidecar)
        for s in range(STEPS):
            for router in routers:
                assert sidecar[(s, router)] == ref["router_counts"][s][router], (r, s, router)
    report = merge_run(str(mon), str(tmp_path / "merged"), engine="python")
    merged = {(int(x["step"]), x["module_name"]): [int(c) for c in x["counts"].split(";")]
              for x in _csv_rows(tmp_path / "merged" / "moe_counts.csv")}
    stats = {(int(x["step"]), x["module_name"]): x for x in _csv_rows(tmp_path / "merged" / "moe.csv")}
    per_rank = [_sidecar_counts(mon / f"rank_{r}") for r in range(RANKS)]
    top_k = {t: e["top_k"] for t, e in json.loads((mon / "rank_0" / "layout.json").read_text())["moe"].items()}
    for s in range(STEPS):
        for router in routers:
            name = router + ".tokens_per_expert"
            from_sidecars = np.sum([side[(s, router)] for side in per_rank], axis=0)
            from_ids = np.sum([ref["router_counts"][s][router] for ref in refs], axis=0)
            assert merged[(s, name)] == from_sidecars.tolist() == from_ids.tolist(), (s, router)
            # every token of every rank, top-k experts each
            assert from_ids.sum() == RANKS * GRAD_ACC * LOCAL_TOKENS * top_k[router], from_ids
            row = stats[(s, name)]
            assert row["scope"] == "routing"
            want = {"min": from_ids.min(), "max": from_ids.max(), "mean": from_ids.mean(),
                    "norm": float(np.sqrt((from_ids.astype(np.float64) ** 2).sum()))}
            for op, value in want.items():
                assert math.isclose(float(row[op]), float(value), rel_tol=1e-8), (s, router, op)  # %.9g
            assert int(row["zeros"]) == int((from_ids == 0).sum())
    assert not [n for n in report.notes if "moe counts" in n], report.notes
    assert set(report.moe) == set(routers), report.moe
