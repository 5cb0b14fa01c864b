"""Framework-internal passes and wrapper modules leave no trace in ``module`` rows, with
real 2-rank torchrun jobs (gloo, CPU):

- ``torch.distributed.pipelining`` (GPipe, 1F1B; 2 stages, 4 micro-batches) runs a
  shape-inference forward/backward at its first step (stage 1 on ``torch.empty``
  inputs): step 0's rows are those of the 4 real micro-batches only;
- FSDP2 and FSDP1 (flat parameters) over ``checkpoint_wrapper``-ed blocks: rows under the
  plain model's names, one row set per module; ``weight_grad``/``param``/``optimizer``
  under the plain parameter names.

References are independent: an unmonitored plain-torch replica fed the same
micro-batches by hand, its tensors taken by plain hooks, statistics by NumPy
(see workers/internal_passes.py). Training with the monitor is bit-identical.
"""

import math
from pathlib import Path

import pytest
import torch

from support import assert_row_matches, numpy_stats, rows_of, run_torchrun

WORKER = Path(__file__).parent / "workers" / "internal_passes.py"


def run(mode, tmp_path):
    out = tmp_path / mode
    out.mkdir()
    run_torchrun(WORKER, mode, out, timeout=400)
    return out, [torch.load(out / f"ref_rank{r}.pt") for r in range(2)]


def check_step(rows, expected, step):
    """Every row of ``step`` equals the reference of its tag (all calls of the step
    together), and every reference tag has exactly one row."""
    got = {}
    for r in rows:
        if r["step"] == str(step):
            assert r["module_name"] not in got, f"two rows for {r['module_name']} at step {step}"
            got[r["module_name"]] = r
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for tag, tensors in expected.items():
        row = got[tag]
        want = numpy_stats(torch.cat([t.reshape(-1) for t in tensors]))
        scale = max(abs(want["min"]), abs(want["max"]), 1e-30)
        assert_row_matches(row, want, rtol=1e-4, atol=1e-6 * scale)
        for op in ("min", "max", "mean", "norm"):
            assert math.isfinite(float(row[op])), row


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelining_shape_inference_writes_no_module_rows(tmp_path, schedule):
    out, refs = run(schedule, tmp_path)
    for rank in range(2):
        ref = refs[rank]
        assert ref["errors"] == 0
        assert ref["bit_identical"] is True
        rows = rows_of(out, "module", rank=rank)
        assert {r["step"] for r in rows} == {"0", "1"}
        root = "Front" if rank == 0 else "Back"
        # the stage's own input: micro-batch data on stage 0, the received activations on
        # stage 1 (where the shape inference fed torch.empty)
        assert len(ref["steps"][0][f"{root}.input.0"]) == 4  # 4 micro-batches, not 5
        for step in range(2):
            check_step(rows, ref["steps"][step], step)
    # stage 1 also reports the gradient it sends back to stage 0
    assert any(r["module_name"] == "Back.grad_input.0" for r in rows_of(out, "module", rank=1))


@pytest.mark.parametrize("mode", ["ckpt_fsdp2", "ckpt_fsdp1"])
def test_fsdp_over_checkpoint_wrapper_rows_under_plain_names(tmp_path, mode):
    out, refs = run(mode, tmp_path)
    for rank in range(2):
        ref = refs[rank]
        assert ref["errors"] == 0
        assert ref["bit_identical"] is True
        rows = rows_of(out, "module", rank=rank)
        modules = {r["module_name"].rsplit(".", 2)[0] for r in rows}
        called = {tag.rsplit(".", 2)[0] for tag in ref["steps"][0]}  # the ModuleList is never called
        assert modules == called and modules <= {n or "Stacked" for n in ref["module_names"]}, sorted(modules)
        assert not [r for r in rows if "_checkpoint_wrapped_module" in r["module_name"]]
        check_step(rows, ref["steps"][0], 0)
    # FSDP1's flat shards: a rank holding no element of a parameter writes no row for it
    for monitor in ("weight_grad", "param", "optimizer"):
        names = [{r["module_name"].split(".exp_avg")[0] for r in rows_of(out, monitor, rank=r)} for r in range(2)]
        assert names[0] | names[1] == set(refs[0]["param_names"]), (monitor, names)
        if mode == "ckpt_fsdp2":
            assert names[0] == names[1]
