"""Lightning ``DeepSpeedStrategy(stage=2)`` with ``MonitorLightningCallback``, 2 gloo ranks
on the CPU, gradient accumulation 2 and ``gradient_clip_val`` (which Lightning hands to
DeepSpeed: it clips inside its step). The callback starts the monitor on the engine
(``trainer.strategy.model``). References: see lightning_deepspeed_worker.py."""

from pathlib import Path

import pytest

from support import assert_row_matches, numpy_stats, rows_of, run_torchrun
from support.shards import assert_shards_make_up
from support.extras import require

for _package in ("deepspeed", "lightning"):
    # not imported here: the worker does, with DS_ACCELERATOR=cpu
    require(_package, "the Lightning + DeepSpeed test fits a LightningModule with the DeepSpeed strategy",
            load=False)

import torch  # noqa: E402

WORKER = Path(__file__).with_name("lightning_deepspeed_worker.py")
STEPS, ACC = 3, 2
NAMES = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_ds")
    run_torchrun(WORKER, out, timeout=600, env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    refs = [torch.load(out / f"ref_rank{r}.pt", weights_only=False) for r in range(2)]
    return out, refs


def _rows(out, monitor, rank, **match):
    return [x for x in rows_of(out, monitor, rank) if all(x[k] == str(v) for k, v in match.items())]


def test_names_steps_logged_steps_and_training_unchanged(launched):
    out, refs = launched
    for r in range(2):
        ref = refs[r]
        assert ref["kind"] == "DeepSpeedZeroOptimizer"
        assert ref["identical"] is True
        assert ref["warnings"] == []
        assert ref["micro_batches"] == [ACC] * STEPS
        # After each batch the monitor's step is trainer.global_step; Lightning logs the
        # training loss of update s at step s, as the CSV numbers it.
        assert ref["seen"] == [((b + 1) // ACC, (b + 1) // ACC) for b in range(STEPS * ACC)], ref["seen"]
        assert ref["logged"] == list(range(STEPS))
        for monitor in ("weight_grad", "param", "optimizer", "module"):
            assert {x["step"] for x in rows_of(out, monitor, r)} == {str(s) for s in range(STEPS)}, monitor
        assert {x["module_name"] for x in rows_of(out, "module", r)} >= {"net.0.input.0", "net.0.output.0"}
    for monitor, suffixes in (("weight_grad", [""]), ("param", [""]), ("optimizer", [".exp_avg", ".exp_avg_sq"])):
        names = {x["module_name"] for r in range(2) for x in rows_of(out, monitor, r)}
        assert names == {n + s for n in NAMES for s in suffixes}, (monitor, names)


def test_unreduced_per_micro_batch_is_the_replicas(launched):
    out, refs = launched
    for r in range(2):
        for s in range(STEPS):
            for name in NAMES:
                for mb in range(1, ACC + 1):
                    rows = _rows(out, "weight_grad", r, step=s, module_name=name, scope="unreduced", micro_step=mb)
                    assert len(rows) == 1, (r, s, name, mb)
                    assert_row_matches(rows[0], numpy_stats(refs[r]["mb"][s][mb - 1][name]), rtol=1e-4, atol=1e-8)


def test_reduced_is_the_rank_mean_before_deepspeeds_clipping(launched):
    out, refs = launched
    clipped = 0
    for s in range(STEPS):
        total = 0.0
        for name in NAMES:
            per_rank = [_rows(out, "weight_grad", r, step=s, module_name=name, scope="reduced") for r in range(2)]
            assert_shards_make_up(per_rank, refs[0]["mean"][s][name], 1e-4, 1e-8, (s, name))
            total += float(refs[0]["mean"][s][name].pow(2).sum())
        clipped += total ** 0.5 > 0.05
    assert clipped, "gradient_clip_val must clip, or 'reduced' before clipping cannot be told apart"


def test_params_and_moments_are_deepspeeds_full_state(launched):
    out, refs = launched
    for s in range(STEPS):
        full = refs[0]["ds"][s]
        for name in NAMES:
            per_rank = [_rows(out, "param", r, step=s, module_name=name, scope="param_updated") for r in range(2)]
            assert_shards_make_up(per_rank, full[name], 1e-5, 1e-9, (s, name))
            for key in ("exp_avg", "exp_avg_sq"):
                per_rank = [_rows(out, "optimizer", r, step=s, module_name=f"{name}.{key}", scope=key)
                            for r in range(2)]
                assert_shards_make_up(per_rank, full[f"{name}.{key}"], 1e-5, 1e-12, (s, name, key))
