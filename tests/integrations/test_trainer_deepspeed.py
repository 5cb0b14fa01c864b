"""transformers.Trainer with ``TrainingArguments(deepspeed=...)`` (ZeRO-2 and ZeRO-3,
gradient accumulation 2, clipping), 2 gloo ranks on the CPU, wired as
docs/integrations.md shows: ``MonitorTrainerCallback`` in the Trainer's callbacks.

The callback starts the monitor on the engine (``trainer.deepspeed``); a plain
``TrainerMonitorV2`` started in the same run on what a callback receives (the bare model and
Accelerate's ``DeepSpeedOptimizerWrapper``) finds that engine itself and writes the same
rows. References (see trainer_deepspeed_worker.py): a plain-torch replica fed the same
micro-batches, DeepSpeed's public full-state API, the Trainer's own logged ``grad_norm``.
One launch trains both stages; the checks share it."""

import math
from pathlib import Path
from typing import List

import pytest

from support import assert_row_matches, numpy_stats, rows_of, run_torchrun
from support.shards import assert_shards_make_up
from support.extras import require

for _package in ("deepspeed", "transformers", "accelerate"):
    # not imported here: the worker does, with DS_ACCELERATOR=cpu
    require(_package, "the Trainer + DeepSpeed test runs a transformers Trainer on DeepSpeed (through Accelerate)",
            load=False)

import torch  # noqa: E402

WORKER = Path(__file__).with_name("trainer_deepspeed_worker.py")
STEPS, GAS = 3, 2
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
KINDS = {2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trainer_ds")
    # 1 thread per rank: the replica recomputes the same kernels
    run_torchrun(WORKER, out, 2, 3, timeout=600, env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    return out


@pytest.fixture(params=[2, 3], ids=["zero2", "zero3"])
def stage(request) -> int:
    return request.param


def _refs(out: Path, stage: int) -> List[dict]:
    return [torch.load(out / f"z{stage}" / f"ref_rank{r}.pt", weights_only=False) for r in range(2)]


def _rows(out: Path, stage: int, run: str, monitor: str, rank: int, **match) -> List[dict]:
    rows = rows_of(out / f"z{stage}" / run, monitor, rank)
    return [x for x in rows if all(x[k] == str(v) for k, v in match.items())]


def test_names_steps_no_warning_and_training_unchanged(launched, stage):
    refs = _refs(launched, stage)
    for r in range(2):
        assert refs[r]["kind"] == KINDS[stage]
        assert refs[r]["names"] == NAMES
        assert refs[r]["identical"] is True  # losses and weights as without the monitors, bit for bit
        assert refs[r]["restored"] is True
        assert refs[r]["warnings"] == []  # every row is observable: nothing to warn about
        assert refs[r]["micro_batches"] == [GAS] * STEPS
        for run in ("callback", "plain"):
            for monitor in ("weight_grad", "param", "optimizer"):
                assert {x["step"] for x in _rows(launched, stage, run, monitor, r)} == {str(s) for s in range(STEPS)}
        module = _rows(launched, stage, "callback", "module", r)
        assert {x["step"] for x in module} == {str(s) for s in range(STEPS)}
        assert {x["module_name"] for x in module} >= {"fc1.input.0", "fc1.output.0"}
        assert all(x["module_name"].startswith("fc1.") for x in module)
    for monitor, suffixes in (("weight_grad", [""]), ("param", [""]), ("optimizer", [".exp_avg", ".exp_avg_sq"])):
        names = {x["module_name"] for r in range(2) for x in _rows(launched, stage, "callback", monitor, r)}
        assert names == {n + s for n in NAMES for s in suffixes}, (monitor, names)


def test_unreduced_per_micro_batch_is_the_replicas(launched, stage):
    refs = _refs(launched, stage)
    for r in range(2):
        for s in range(STEPS):
            for name in NAMES:
                for mb in range(1, GAS + 1):
                    rows = _rows(launched, stage, "callback", "weight_grad", r, step=s, module_name=name,
                                 scope="unreduced", micro_step=mb)
                    assert len(rows) == 1, (r, s, name, mb, rows)
                    assert_row_matches(rows[0], numpy_stats(refs[r]["mb"][s][mb - 1][name]), rtol=1e-4, atol=1e-7)


def test_reduced_is_the_rank_mean_before_clipping_and_its_norm_the_logged_grad_norm(launched, stage):
    refs = _refs(launched, stage)
    clipped = 0
    for s in range(STEPS):
        for name in NAMES:
            per_rank = [_rows(launched, stage, "callback", "weight_grad", r, step=s, module_name=name,
                              scope="reduced") for r in range(2)]
            assert_shards_make_up(per_rank, refs[0]["mean"][s][name], 1e-4, 1e-7, (s, name))
        # The Trainer logs update s (0-based; monitor step s) under its global_step s + 1,
        # with DeepSpeed's norm of the reduced gradient before clipping.
        logged_step, grad_norm = refs[0]["logged"][s]
        assert logged_step == s + 1
        rows = [x for r in range(2) for x in _rows(launched, stage, "callback", "weight_grad", r, step=s,
                                                   scope="reduced")]
        total = math.sqrt(sum(float(x["norm"]) ** 2 for x in rows))
        assert math.isclose(total, grad_norm, rel_tol=1e-4), (s, total, grad_norm)
        clipped += grad_norm > 0.05
    assert clipped, "max_grad_norm must clip, or 'reduced' before clipping cannot be told apart"


def test_params_and_moments_are_deepspeeds_full_state(launched, stage):
    refs = _refs(launched, stage)
    for s in range(STEPS):
        full = refs[0]["ds"][s]
        for name in NAMES:
            per_rank = [_rows(launched, stage, "callback", "param", r, step=s, module_name=name,
                              scope="param_updated") for r in range(2)]
            assert_shards_make_up(per_rank, full[name], 1e-5, 1e-9, (s, name))
            for key in ("exp_avg", "exp_avg_sq"):
                per_rank = [_rows(launched, stage, "callback", "optimizer", r, step=s, module_name=f"{name}.{key}",
                                  scope=key) for r in range(2)]
                assert_shards_make_up(per_rank, full[f"{name}.{key}"], 1e-5, 1e-12, (s, name, key))


def test_a_plain_start_on_the_bare_model_finds_the_engine(launched, stage):
    """What the callbacks did before: start() on trainer.model and the optimizer wrapper.
    The monitor finds the engine that steps the ZeRO optimizer: the same rows."""
    for r in range(2):
        for monitor in ("weight_grad", "param", "optimizer"):
            plain = _rows(launched, stage, "plain", monitor, r)
            assert plain and plain == _rows(launched, stage, "callback", monitor, r), (monitor, r)


def test_an_optimizer_without_its_engine_writes_no_misnamed_rows_and_says_so(launched, stage):
    """start() on a model the engine does not train, with the engine's optimizer wrapper:
    the flat ZeRO partitions cannot be named; one WARNING says what is not written."""
    for r in range(2):
        messages = _refs(launched, stage)[r]["foreign_warnings"]
        said = [m for m in messages if "not a DeepSpeedEngine" in m]
        assert len(said) == 1, messages
        assert "'reduced', 'unreduced', 'param' and 'optimizer' rows are not written" in said[0]
        assert KINDS[stage] in said[0] and "trainer.deepspeed" in said[0]
        # its layout.json document (no parameter listed) was built without an error
        assert not [m for m in messages if "parallel layout" in m], messages
        for monitor in ("weight_grad", "param", "optimizer"):
            assert _rows(launched, stage, "foreign", monitor, r) == [], monitor


def test_accelerate_deepspeed_plugin_with_the_helper(launched):
    """Accelerate's DeepSpeed plugin, ZeRO-2, AccelerateMonitor given the unwrapped model:
    monitored through the engine, rows against the replica, one step per synchronised step."""
    out = launched / "accelerate"
    refs = [torch.load(out / f"ref_rank{r}.pt", weights_only=False) for r in range(2)]
    for r in range(2):
        assert refs[r]["model_kind"] == "DeepSpeedEngine" and refs[r]["names"] == NAMES
        assert refs[r]["identical"] is True and refs[r]["warnings"] == []
        assert refs[r]["seen"] == [1, 2, 3]
        for monitor in ("weight_grad", "param", "optimizer"):
            assert {x["step"] for x in rows_of(out, monitor, r)} == {"0", "1", "2"}, monitor
        for s in range(STEPS):
            for name in NAMES:
                for mb in range(1, GAS + 1):
                    rows = [x for x in rows_of(out, "weight_grad", r) if x["step"] == str(s) and
                            x["module_name"] == name and x["scope"] == "unreduced" and x["micro_step"] == str(mb)]
                    assert len(rows) == 1, (r, s, name, mb)
                    assert_row_matches(rows[0], numpy_stats(refs[r]["mb"][s][mb - 1][name]), rtol=1e-4, atol=1e-7)
    names = {x["module_name"] for r in range(2) for x in rows_of(out, "optimizer", r)}
    assert names == {f"{n}.{k}" for n in NAMES for k in ("exp_avg", "exp_avg_sq")}
    for s in range(STEPS):
        for name in NAMES:
            per_rank = [[x for x in rows_of(out, "weight_grad", r) if x["step"] == str(s) and
                         x["module_name"] == name and x["scope"] == "reduced"] for r in range(2)]
            assert_shards_make_up(per_rank, refs[0]["mean"][s][name], 1e-4, 1e-7, (s, name))
