"""Megatron-Core 0.16 (GPTModel, TP=PP=1, DP=2, gloo, CPU through benchmarks/megatron_cpu_shim.py):
``mon.start(model=ddp, optimizer=get_megatron_optimizer(...))`` with Megatron's own
``DistributedDataParallel``, in fp32 and bf16 (``Float16Module``), without and with the
distributed optimizer, grad_acc_steps 2, monitor_mbs_grad false and true; and fp32 with
``overlap_grad_reduce``.

One torchrun launch trains every configuration (see workers/megatron_train.py); the
references are the worker's own clones of ``main_grad`` (after each backward pass and
after ``finish_grad_sync()``), the grad norm ``optimizer.step()`` returns, and clones of
the fp32 masters and Adam moments. Statistics are recomputed with NumPy.
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from support import assert_row_matches, numpy_stats, rows_of, run_torchrun
from support.extras import require

require("megatron.core", "the Megatron-Core stack tests train its GPT model on 2 gloo ranks")

WORKER = Path(__file__).parent / "workers" / "megatron_train.py"
CONFIGS = ["fp32", "fp32-distopt", "bf16", "bf16-distopt"]
STEPS, ACC, RANKS = 3, 2, (0, 1)
RTOL, ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    run_torchrun(WORKER, out, timeout=600)
    return out


def ref(out, config, run, rank):
    return torch.load(out / f"{config}-{run}" / f"ref_rank{rank}.pt", weights_only=False)


def rows(out, config, run, monitor, rank):
    return rows_of(out / f"{config}-{run}", monitor, rank=rank)


def pick(rows, **match):
    found = [r for r in rows if all(r[k] == str(v) for k, v in match.items())]
    assert len(found) == 1, f"expected one row for {match}, found {len(found)}"
    return found[0]


def local_slice(t, ranges, name):
    """This rank's part of a parameter's gradient under the distributed optimizer."""
    if not ranges:
        return t
    start, end = ranges[name]
    return t.reshape(-1)[start:end]


@pytest.mark.parametrize("config", CONFIGS)
def test_optimizer_types_are_the_ones_named(out, config):
    types = ref(out, config, "acc", 0)["optimizer_types"]
    want = {"fp32": "FP32Optimizer", "bf16": "Float16OptimizerWithFloat16Params"}.get(config, "DistributedOptimizer")
    assert types == ["ChainedOptimizer", want]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("run", ["acc", "mbs"])
def test_names_are_the_models_own_and_the_log_is_clean(out, config, run):
    for rank in RANKS:
        r = ref(out, config, run, rank)
        names = set(r["names"])
        held = set(r["steps"][0]["ranges"]) or names  # distributed optimizer: this rank's shards
        wg = rows(out, config, run, "weight_grad", rank)
        assert {x["module_name"] for x in wg if x["scope"] == "unreduced"} == names
        assert {x["module_name"] for x in wg if x["scope"] == "reduced"} == held
        assert {x["module_name"] for x in rows(out, config, run, "param", rank)} == held
        opt = rows(out, config, run, "optimizer", rank)
        assert {x["module_name"] for x in opt} == {f"{n}.{k}" for n in held for k in ("exp_avg", "exp_avg_sq")}
        # steps are optimizer steps
        for monitor in ("weight_grad", "param", "optimizer"):
            assert {int(x["step"]) for x in rows(out, config, run, monitor, rank)} == set(range(STEPS))
        if run == "acc":  # the module monitor ran here: names below DDP and Float16Module
            modules = {x["module_name"].rsplit(".", 2)[0] for x in rows(out, config, run, "module", rank)}
            known = set(r["modules"]) | {"GPTModel"}
            assert modules and modules <= known, sorted(modules - known)[:5]
            assert "decoder.layers.0.self_attention.linear_proj" in modules
        bad = [m for level, m in r["logs"] if level in ("ERROR", "CRITICAL") or "leaf tensor" in m]
        assert not bad, bad


@pytest.mark.parametrize("config", CONFIGS)
def test_unreduced_accumulated_is_main_grad_before_the_sync(out, config):
    for rank in RANKS:
        r = ref(out, config, "acc", rank)
        wg = rows(out, config, "acc", "weight_grad", rank)
        for s, st in enumerate(r["steps"]):
            for name in r["names"]:
                row = pick(wg, step=s, module_name=name, scope="unreduced", micro_step=ACC)
                assert_row_matches(row, numpy_stats(st["acc"][-1][name]), rtol=RTOL, atol=ATOL)
        # read in one batch at the end of each step's last backward pass, every parameter in it
        assert r["deferred_reads"] == [len(r["names"])] * len(r["steps"]), r["deferred_reads"]
    # the ranks saw different data: their local gradients differ
    a = pick(rows(out, config, "acc", "weight_grad", 0), step=0, module_name="output_layer.weight", scope="unreduced")
    b = pick(rows(out, config, "acc", "weight_grad", 1), step=0, module_name="output_layer.weight", scope="unreduced")
    assert a["norm"] != b["norm"]


@pytest.mark.parametrize("config", CONFIGS)
def test_unreduced_per_micro_batch_is_each_micro_batch_alone(out, config):
    for rank in RANKS:
        r = ref(out, config, "mbs", rank)
        wg = rows(out, config, "mbs", "weight_grad", rank)
        assert not [x for x in wg if x["scope"] == "unreduced" and x["micro_step"] not in ("1", "2")]
        for s, st in enumerate(r["steps"]):
            for name in r["names"]:
                first = st["acc"][0][name]
                second = st["acc"][1][name] - st["acc"][0][name]
                # bf16: the row is of the bf16 gradient, the reference a difference of its fp32 sums
                assert_row_matches(pick(wg, step=s, module_name=name, scope="unreduced", micro_step=1),
                                   numpy_stats(first), rtol=RTOL, atol=ATOL)
                assert_row_matches(pick(wg, step=s, module_name=name, scope="unreduced", micro_step=2),
                                   numpy_stats(second), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("run", ["acc", "mbs"])
def test_reduced_is_main_grad_at_step_and_norms_give_the_grad_norm(out, config, run):
    refs = [ref(out, config, run, rank) for rank in RANKS]
    wgs = [rows(out, config, run, "weight_grad", rank) for rank in RANKS]
    for s in range(STEPS):
        squares = []
        for rank in RANKS:
            st = refs[rank]["steps"][s]
            ranges = st["ranges"]
            for name in ranges or refs[rank]["names"]:
                row = pick(wgs[rank], step=s, module_name=name, scope="reduced")
                assert row["micro_step"] == str(ACC)
                # the synced gradient is the mean of the ranks' local accumulations
                mean = (refs[0]["steps"][s]["acc"][-1][name] + refs[1]["steps"][s]["acc"][-1][name]) / 2
                expected = local_slice(st["synced"][name], ranges, name)
                assert torch.allclose(expected, local_slice(mean, ranges, name), rtol=1e-5, atol=1e-7)
                assert_row_matches(row, numpy_stats(expected), rtol=RTOL, atol=ATOL)
                squares.append(float(row["norm"]) ** 2)
        grad_norm = refs[0]["steps"][s]["grad_norm"]
        assert grad_norm == refs[1]["steps"][s]["grad_norm"]
        if not refs[0]["steps"][s]["ranges"]:  # every rank holds every parameter: count one rank
            squares = squares[: len(squares) // 2]
        assert math.isclose(math.sqrt(sum(squares)), grad_norm, rel_tol=1e-5), (s, math.sqrt(sum(squares)), grad_norm)


@pytest.mark.parametrize("config", CONFIGS)
def test_distributed_optimizer_shards_cover_each_parameter_once(out, config):
    r0, r1 = ref(out, config, "acc", 0), ref(out, config, "acc", 1)
    if not config.endswith("distopt"):
        assert r0["steps"][0]["ranges"] == {}
        return
    sizes = {n: p.numel() for n, p in r0["final"].items()}
    covered = {n: 0 for n in sizes}
    for r in (r0, r1):
        for n, (start, end) in r["steps"][0]["ranges"].items():
            covered[n] += end - start
    assert covered == sizes


@pytest.mark.parametrize("config", CONFIGS)
def test_optimizer_moments_and_masters_per_parameter_name(out, config):
    for rank in RANKS:
        r = ref(out, config, "acc", rank)
        opt = rows(out, config, "acc", "optimizer", rank)
        par = rows(out, config, "acc", "param", rank)
        for s, st in enumerate(r["steps"]):
            assert st["state"], "the worker found no optimizer state"
            for name, state in st["state"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    row = pick(opt, step=s, module_name=f"{name}.{key}", scope=key)
                    # absolute slack for a mean near 0: fp32 summation error at this scale
                    scale = float(state[key].abs().max())
                    assert_row_matches(row, numpy_stats(state[key]), rtol=RTOL, atol=1e-6 * scale)
                before, after = st["before"][name], st["after"][name]
                assert before.dtype == torch.float32  # fp32 masters (or fp32 parameters)
                assert_row_matches(pick(par, step=s, module_name=name, scope="param_origin"), numpy_stats(before),
                                   rtol=RTOL, atol=ATOL)
                assert_row_matches(pick(par, step=s, module_name=name, scope="param_updated"), numpy_stats(after),
                                   rtol=RTOL, atol=ATOL)
                assert not np.array_equal(before.numpy(), after.numpy()) or name.endswith("bias")


@pytest.mark.parametrize("config", CONFIGS)
def test_training_is_bit_identical_with_and_without_the_monitor(out, config):
    for rank in RANKS:
        plain = ref(out, config, "plain", rank)
        for run in ("acc", "mbs"):
            mon = ref(out, config, run, rank)
            assert torch.equal(torch.stack(plain["losses"]), torch.stack(mon["losses"]))
            for name, p in plain["final"].items():
                assert torch.equal(p, mon["final"][name]), (run, name)
            assert [s["grad_norm"] for s in plain["steps"]] == [s["grad_norm"] for s in mon["steps"]]
            assert mon["restored"], "stop() left an attribute on the optimizer or the DDP object"


@pytest.mark.parametrize("run", ["acc", "mbs"])
def test_overlap_grad_reduce(out, run):
    """With overlap_grad_reduce the reduction starts inside the last backward pass: no
    accumulated 'unreduced' rows (said once in the log), per-micro-batch rows still
    exact. The reference is the run without overlap (same seeds, data and arithmetic:
    the trained parameters are bit-identical)."""
    for rank in RANKS:
        r = ref(out, "fp32-overlap", run, rank)
        base = ref(out, "fp32", "plain", rank)
        for name, p in base["final"].items():
            assert torch.equal(p, r["final"][name]), name
        wg = rows(out, "fp32-overlap", run, "weight_grad", rank)
        said = [m for level, m in r["logs"] if "overlap_grad_reduce" in m]
        unreduced = [x for x in wg if x["scope"] == "unreduced"]
        if run == "acc":
            assert unreduced == [] and len(said) == 1, said
        else:
            assert said == []
            for s, st in enumerate(base["steps"]):
                for name in base["names"]:
                    assert_row_matches(pick(wg, step=s, module_name=name, scope="unreduced", micro_step=1),
                                       numpy_stats(st["acc"][0][name]), rtol=RTOL, atol=ATOL)
                    assert_row_matches(pick(wg, step=s, module_name=name, scope="unreduced", micro_step=2),
                                       numpy_stats(st["acc"][1][name] - st["acc"][0][name]), rtol=RTOL, atol=ATOL)
        for s, st in enumerate(base["steps"]):
            for name in base["names"]:
                assert_row_matches(pick(wg, step=s, module_name=name, scope="reduced"), numpy_stats(st["synced"][name]),
                                   rtol=RTOL, atol=ATOL)


def test_private_attribute_moved_is_one_log_line_not_a_crash(out):
    """A Megatron version without ``_get_model_param_range_map``: one warning naming the
    optimizer and what is not written; unreduced rows and training unaffected."""
    for rank in RANKS:
        r = ref(out, "fp32-distopt", "moved", rank)
        said = [m for level, m in r["logs"] if level == "WARNING"]
        assert len(said) == 1 and "DistributedOptimizer" in said[0] and "not written" in said[0], said
        assert not [m for level, m in r["logs"] if level == "ERROR"]
        wg = rows(out, "fp32-distopt", "moved", "weight_grad", rank)
        assert {x["scope"] for x in wg} == {"unreduced"}
        assert rows(out, "fp32-distopt", "moved", "optimizer", rank) == []
        assert rows(out, "fp32-distopt", "moved", "param", rank) == []
        plain = ref(out, "fp32-distopt", "plain", rank)
        for name, p in plain["final"].items():
            assert torch.equal(p, r["final"][name]), name


def test_list_of_chunks_prefixes_names_and_changes_no_value(out):
    """``model=[ddp]``: every name gets the chunk prefix ``0:``; the values are those of the
    same training given ``model=ddp`` (bit-identical runs)."""
    for rank in RANKS:
        for monitor in ("weight_grad", "param", "optimizer"):
            single = rows(out, "fp32-distopt", "acc", monitor, rank)
            chunked = rows(out, "fp32-distopt", "chunks", monitor, rank)
            assert chunked and all(r["module_name"].startswith("0:") and r["vpp_stage"] == "0" for r in chunked)
            key = lambda r: (r["step"], r["module_name"].split(":", 1)[-1], r["scope"], r.get("micro_step"))
            assert sorted((key(r), r["norm"], r["min"], r["max"]) for r in chunked) == \
                sorted((key(r), r["norm"], r["min"], r["max"]) for r in single)


def test_an_error_in_the_end_of_pass_read_of_main_grad_is_said_once_and_training_goes_on(out):
    """Without overlap_grad_reduce the accumulated main_grads are read in one batch, in a
    callback of the autograd engine, inside backward(). The worker makes that read raise
    ("broken" run): it is contained and said once under its site, the pass's unreduced rows
    are left out, the reduced rows at the step are written, and the training is the one
    without the monitor, bit for bit."""
    for rank in RANKS:
        r = ref(out, "fp32", "broken", rank)
        assert r["deferred_reads"] == [len(r["names"])] * STEPS, "the end-of-pass batch read was the one that ran"
        said = [m for level, m in r["logs"] if "weight_grad unreduced batch" in m]
        assert len(said) == 1 and "statistics engine broke inside backward" in said[0], said
        wg = rows(out, "fp32", "broken", "weight_grad", rank)
        assert [x for x in wg if x["scope"] == "unreduced"] == []
        base = ref(out, "fp32", "plain", rank)
        for s, st in enumerate(base["steps"]):
            for name in base["names"]:
                assert_row_matches(pick(wg, step=s, module_name=name, scope="reduced"), numpy_stats(st["synced"][name]),
                                   rtol=RTOL, atol=ATOL)
        for name, p in base["final"].items():
            assert torch.equal(p, r["final"][name]), name
        assert r["restored"]
