"""DeepSpeed 0.19.8 (ZeRO-0/1/2/3, fp32 and bf16, gradient accumulation): every row is
checked against an independent reference (see workers/deepspeed_train.py), with real
2-rank torchrun jobs on the CPU (gloo, ``DS_ACCELERATOR=cpu``).

The user's loop is ``mon.start(model=engine, optimizer=optimizer)`` with what
``deepspeed.initialize`` returned, then ``engine.backward(loss); engine.step()`` per
micro-batch. One launch per ZeRO stage trains its configurations (each twice: with the
monitors and without); the checks share it.
"""

import math
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from support import assert_row_matches, numpy_stats, rows_of, run_torchrun
from support.extras import require

# not imported here: the workers do, with DS_ACCELERATOR=cpu
require("deepspeed", "the DeepSpeed stack tests run its ZeRO stages 0-3 on the CPU", load=False)

WORKER = Path(__file__).parent / "workers" / "deepspeed_train.py"
STEPS = 3
GROUPS = {
    0: ["z0-fp32-gas2", "z0-bf16-gas2"],
    1: ["z1-fp32-gas2", "z1-bf16-gas2"],
    2: ["z2-fp32-gas2", "z2-bf16-gas2"],
    3: ["z3-fp32-gas2", "z3-bf16-gas2", "z3-fp32-gas1"],
}
CONFIGS = [c for group in GROUPS.values() for c in group]
KINDS = {"z0-fp32": "AdamW", "z0-bf16": "FP16_UnfusedOptimizer", "z1-fp32": "DeepSpeedZeroOptimizer",
         "z1-bf16": "BF16_Optimizer", "z2-fp32": "DeepSpeedZeroOptimizer", "z2-bf16": "DeepSpeedZeroOptimizer",
         "z3-fp32": "DeepSpeedZeroOptimizer_Stage3", "z3-bf16": "DeepSpeedZeroOptimizer_Stage3"}


# stage -> its job's output, for the whole session: test_deepspeed_merge.py imports the
# fixture below and reads the same runs (a fixture imported into another module is
# another fixture to pytest, so the cache is this module's, not the fixture's)
_LAUNCHED: Dict[int, Path] = {}


@pytest.fixture(scope="session")
def launched(tmp_path_factory):
    """``launched(config)`` -> the config's output directory; one torchrun job per stage
    and session."""

    def get(config: str) -> Path:
        stage = int(config[1])
        if stage not in _LAUNCHED:
            out = tmp_path_factory.mktemp(f"zero{stage}")
            # 1 thread per rank: the references recompute the same kernels, bit for bit
            run_torchrun(WORKER, out, *GROUPS[stage], timeout=600,
                         env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
            _LAUNCHED[stage] = out
        return _LAUNCHED[stage] / config

    return get


class Run:
    def __init__(self, out: Path, config: str) -> None:
        self.config = config
        stage, dtype, gas = config.split("-")
        self.stage, self.bf16, self.gas = int(stage[1:]), dtype == "bf16", int(gas[3:])
        self.sharded = self.stage >= 1
        self.refs = [torch.load(out / f"ref_rank{r}.pt", weights_only=False) for r in range(2)]
        self.names: List[str] = self.refs[0]["names"]
        self.acc = [{m: rows_of(out / "acc", m, rank=r) for m in ("weight_grad", "optimizer", "param")}
                    for r in range(2)]
        self.mbs = [rows_of(out / "mbs", "weight_grad", rank=r) for r in range(2)]
        self.module = [rows_of(out / "mbs", "module", rank=r) for r in range(2)]
        # bf16 gradients are reduced (and moments updated) in bf16 by DeepSpeed, in fp64 here
        self.rtol, self.atol = (3e-2, 3e-3) if self.bf16 else (1e-4, 1e-7)

    def rows(self, rank: int, monitor: str = "weight_grad", mbs: bool = False, **match) -> List[dict]:
        rows = self.mbs[rank] if mbs else self.acc[rank][monitor]
        return [x for x in rows if all(x[k] == str(v) for k, v in match.items())]


def one(rows: List[dict]) -> dict:
    assert len(rows) == 1, f"expected one row, found {len(rows)}: {rows}"
    return rows[0]


def check_whole_or_shards(run: Run, monitor: str, scope: str, step: int, name: str, full: torch.Tensor,
                          rtol: float, atol: float, module_name: str = None) -> None:
    """ZeRO-0: every rank reports the whole tensor. ZeRO-1/2/3: each rank its local shard
    (or nothing); across ranks they make up the whole: sqrt of the summed squared norms is
    its norm, min of the minima its minimum, max of the maxima its maximum."""
    module_name = module_name or name
    per_rank = [run.rows(r, monitor, step=step, module_name=module_name, scope=scope) for r in range(2)]
    ref = numpy_stats(full)
    if run.bf16:  # bf16 rounding is relative to the tensor's magnitude, not to each element
        atol = max(atol, rtol * max(abs(ref["min"]), abs(ref["max"])))
    if not run.sharded:
        for r in range(2):
            assert_row_matches(one(per_rank[r]), ref, rtol=rtol, atol=atol)
        return
    got = [one(x) for x in per_rank if x]
    assert got, f"no {scope} shard of {module_name} at step {step} on any rank"
    assert all(len(x) <= 1 for x in per_rank)
    norm = math.sqrt(sum(float(x["norm"]) ** 2 for x in got))
    assert math.isclose(norm, ref["norm"], rel_tol=rtol, abs_tol=atol), (module_name, scope, step, norm, ref["norm"])
    assert math.isclose(min(float(x["min"]) for x in got), ref["min"], rel_tol=rtol, abs_tol=atol)
    assert math.isclose(max(float(x["max"]) for x in got), ref["max"], rel_tol=rtol, abs_tol=atol)
    assert sum(int(x["nans"]) for x in got) == 0


@pytest.fixture(params=CONFIGS)
def run(request, launched) -> Run:
    return Run(launched(request.param), request.param)


def test_names_steps_and_training_unchanged(run: Run):
    kind = run.refs[0]["kind"]
    assert kind == KINDS[run.config.rsplit("-", 1)[0]], kind
    assert run.names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for r in range(2):
        # bit-identical training with and without the monitors; stop() restored the engine
        assert run.refs[r]["identical"] is True
        assert run.refs[r]["restored"] is True
        # one monitor step per real optimizer step (engine.step() ran gas times per step)
        for monitor in ("weight_grad", "optimizer", "param"):
            assert {x["step"] for x in run.acc[r][monitor]} == {str(s) for s in range(STEPS)}, monitor
        assert {x["step"] for x in run.mbs[r]} == {str(s) for s in range(STEPS)}
    # the model's own names (no "module." of the engine), optimizer rows per parameter name
    for monitor, suffixes in (("weight_grad", [""]), ("param", [""]), ("optimizer", [".exp_avg", ".exp_avg_sq"])):
        names = {x["module_name"] for r in range(2) for x in run.acc[r][monitor]}
        assert names == {n + s for n in run.names for s in suffixes}, (monitor, names)
    for r in range(2):  # module rows too: the root is named after the model's class, not the engine
        modules = {x["module_name"].rsplit(".", 2)[0] for x in run.module[r]}
        assert modules == {"Net", "fc1", "fc2"}, modules
        assert {x["step"] for x in run.module[r]} == {str(s) for s in range(STEPS)}


def test_unreduced_per_micro_batch(run: Run):
    for r in range(2):
        for s in range(STEPS):
            for name in run.names:
                for mb in range(1, run.gas + 1):
                    row = one(run.rows(r, mbs=True, step=s, module_name=name, scope="unreduced", micro_step=mb))
                    assert_row_matches(row, numpy_stats(run.refs[r]["mb"][s][mb - 1][name]), rtol=1e-5, atol=1e-8)
    a = one(run.rows(0, mbs=True, step=0, module_name="fc1.weight", scope="unreduced", micro_step=1))
    b = one(run.rows(1, mbs=True, step=0, module_name="fc1.weight", scope="unreduced", micro_step=1))
    assert a["norm"] != b["norm"]  # each rank's own gradient, not a reduced one


def test_unreduced_accumulated(run: Run):
    never_held = run.stage >= 2 and run.gas > 1
    for r in range(2):
        rows = run.rows(r, scope="unreduced")
        if never_held:
            # ZeRO-2/3 never hold the accumulated local gradient: no row, and the log says why
            assert rows == []
            assert any("never holds the accumulated local gradient" in m for m in run.refs[r]["warnings"]), \
                run.refs[r]["warnings"]
            continue
        assert not run.refs[r]["warnings"], run.refs[r]["warnings"]
        assert len(rows) == STEPS * len(run.names)
        for s in range(STEPS):
            for name in run.names:
                row = one(run.rows(r, step=s, module_name=name, scope="unreduced"))
                assert row["micro_step"] == str(run.gas)
                assert_row_matches(row, numpy_stats(run.refs[r]["acc"][s][name]), rtol=1e-5, atol=1e-8)


def test_reduced_is_the_rank_mean_and_its_norm_the_frameworks(run: Run):
    for s in range(STEPS):
        for name in run.names:
            check_whole_or_shards(run, "weight_grad", "reduced", s, name, run.refs[0]["mean"][s][name],
                                  run.rtol, run.atol)
        for r in range(2):
            assert all(x["micro_step"] == str(run.gas) for x in run.rows(r, scope="reduced"))
        norm = run.refs[0]["grad_norm"][s]
        if norm is None:  # ZeRO-0 with a plain torch optimizer: DeepSpeed computes none
            continue
        ranks = range(2) if run.sharded else range(1)
        total = math.sqrt(sum(float(x["norm"]) ** 2 for r in ranks for x in run.rows(r, step=s, scope="reduced")))
        assert math.isclose(total, norm, rel_tol=1e-4 if not run.bf16 else 1e-2), (s, total, norm)


def test_params_and_moments_match_deepspeeds_public_api(run: Run):
    """ZeRO-1/2/3: the local shards make up what safe_get_full_fp32_param and
    safe_get_full_optimizer_state return (the fp32 masters and their Adam moments)."""
    if not run.sharded:
        assert run.refs[0]["ds"] == [None] * STEPS  # ZeRO-0 has no such API: replica only
        return
    for s in range(STEPS):
        full = run.refs[0]["ds"][s]
        for name in run.names:
            check_whole_or_shards(run, "param", "param_updated", s, name, full[name], 1e-5, 1e-9)
            for key in ("exp_avg", "exp_avg_sq"):
                check_whole_or_shards(run, "optimizer", key, s, name, full[f"{name}.{key}"], 1e-5, 1e-12,
                                      module_name=f"{name}.{key}")


def test_params_and_moments_per_parameter(run: Run):
    refs = run.refs[0]
    # The fp32 masters, updated by DeepSpeed from its own reduction and by torch AdamW here.
    # bf16: DeepSpeed reduces in bf16; where the ranks' gradients nearly cancel, the
    # rounding changes the sign-like first Adam steps by up to 2 * lr per element.
    rtol, atol = (1e-4, 1e-7) if not run.bf16 else (5e-3, 2 * 1e-2)
    for s in range(STEPS):
        for name in run.names:
            check_whole_or_shards(run, "param", "param_origin", s, name, refs["masters_before"][s][name], rtol, atol)
            check_whole_or_shards(run, "param", "param_updated", s, name, refs["masters_after"][s][name], rtol, atol)
            for key in ("exp_avg", "exp_avg_sq"):
                m_rtol = rtol if not run.bf16 else 6e-2
                check_whole_or_shards(run, "optimizer", key, s, name, refs[key][s][name], m_rtol, 1e-9,
                                      module_name=f"{name}.{key}")
