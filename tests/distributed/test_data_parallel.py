"""weight_grad under DDP, FSDP1 (use_orig_params false/true) and FSDP2, with real
2-rank torchrun jobs (gloo, CPU) and gradient accumulation (no_sync /
set_requires_gradient_sync).

References are independent: every step, each rank computes its local per-micro-batch
gradients with torch.autograd.grad on a plain, unmonitored copy of the model whose
parameters are synced from the trained model (see workers/data_parallel.py).
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from msprobe.core.monitor_v2.analysis.merge import merge_run
from msprobe.core.monitor_v2.layout import load_layout
from support import assert_row_matches, numpy_stats, read_csv, rows_of, run_torchrun

WORKER = Path(__file__).parent / "workers" / "data_parallel.py"
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
STEPS, ACC = 3, 2


def run(mode, tmp_path, mbs=False):
    out = tmp_path / mode
    out.mkdir()
    run_torchrun(WORKER, mode, out, *(["--mbs"] if mbs else []))
    refs = [torch.load(out / f"ref_rank{r}.pt") for r in range(2)]
    rows = [rows_of(out, "weight_grad", rank=r) for r in range(2)]
    return out, refs, rows


def pick(rows, **match):
    found = [r for r in rows if all(r[k] == str(v) for k, v in match.items())]
    assert len(found) == 1, f"expected one row for {match}, found {len(found)}"
    return found[0]


def local_grad(ref, step, name):
    return sum(g[name] for g in ref["grads"][step])


def check_unreduced(refs, rows, mbs, acc=ACC):
    for r in range(2):
        for s in range(STEPS):
            for name in PARAMS:
                if mbs:
                    for mb in range(1, ACC + 1):
                        row = pick(rows[r], step=s, module_name=name, scope="unreduced", micro_step=mb)
                        assert_row_matches(row, numpy_stats(refs[r]["grads"][s][mb - 1][name]), rtol=1e-4, atol=1e-6)
                else:
                    row = pick(rows[r], step=s, module_name=name, scope="unreduced", micro_step=acc)
                    assert_row_matches(row, numpy_stats(local_grad(refs[r], s, name)), rtol=1e-4, atol=1e-6)
    # the two ranks saw different data: their local gradients differ
    a = pick(rows[0], step=0, module_name="fc1.weight", scope="unreduced", micro_step=acc)
    b = pick(rows[1], step=0, module_name="fc1.weight", scope="unreduced", micro_step=acc)
    assert a["norm"] != b["norm"]


def check_layout(out, mode, refs, rows):
    """``rank_<r>/layout.json`` says what each rank's rows are of: dp is the 2-rank world,
    every parameter has its model shape; DDP rows are of whole tensors, FSDP's reduced,
    param and optimizer rows of this rank's part of the shard (``[dp, r, 2]``, element
    counts that add up to the whole, none where the rank writes no row), and those
    element counts weight the shards' means into the mean of the whole gradient."""
    docs = [load_layout(str(out / f"rank_{r}" / "layout.json")) for r in range(2)]
    shapes = {n: list(g.shape) for n, g in refs[0]["grads"][0][0].items()}
    for r, doc in enumerate(docs):
        assert (doc["rank"], doc["world_size"], doc["stack"]) == (r, 2, "torch")
        assert doc["groups"] == {"dp": {"rank": r, "size": 2}}, doc["groups"]
        assert doc["unknown"] == [] and set(doc["params"]) == set(PARAMS), doc
        for name in PARAMS:
            entry = doc["params"][name]
            assert entry["shape"] == shapes[name], (mode, name, entry)
            whole = {"numel": math.prod(shapes[name]), "split": []}
            assert entry["pieces"]["unreduced"] == whole
            for cls in ("reduced", "param", "optimizer"):
                if mode == "ddp":
                    assert entry["pieces"][cls] == whole
                else:
                    assert entry["pieces"][cls]["split"] == [["dp", r, 2]], (mode, name, entry)
                    assert entry["pieces"][cls] == entry["pieces"]["reduced"]
    if mode == "ddp":
        return
    for name in PARAMS:
        numels = [doc["params"][name]["pieces"]["reduced"]["numel"] for doc in docs]
        assert sum(numels) == math.prod(shapes[name]), (mode, name, numels)
        for s in range(STEPS):
            got = [[x for x in rows[r] if x["step"] == str(s) and x["module_name"] == name and x["scope"] == "reduced"]
                   for r in range(2)]
            assert [len(g) for g in got] == [int(n > 0) for n in numels], (mode, name, numels, got)
            mean = ((local_grad(refs[0], s, name) + local_grad(refs[1], s, name)) / 2).double().mean().item()
            combined = sum(float(g[0]["mean"]) * n for g, n in zip(got, numels) if n) / sum(numels)
            assert math.isclose(combined, mean, rel_tol=1e-4, abs_tol=1e-7), (mode, name, s, combined, mean)
        for r in range(2):
            written = {x["module_name"] for x in rows_of(out, "param", rank=r)}
            assert (name in written) == (numels[r] > 0), (mode, name, r)


def check_merge(out, refs, mbs, tmp_path):
    """``merge_run`` on the run: nothing left out, replicas (DDP's reduced gradients,
    parameters and moments on both ranks) agree, and each merged reduced gradient is the
    mean of the two ranks' local gradients of the whole tensor."""
    dest = tmp_path / "merged"
    summary = merge_run(str(out), str(dest)).to_json()
    assert summary["disagreements"] == 0, summary
    assert summary["left_out"] == {"unknown": 0, "partial": 0, "incomplete": 0, "cc": 0, "no_layout": 0, "moe": 0}, summary
    merged = read_csv(dest / "weight_grad.csv")
    for s in range(STEPS):
        for name in PARAMS:
            mean = (local_grad(refs[0], s, name) + local_grad(refs[1], s, name)) / 2
            row = pick(merged, step=s, module_name=name, scope="reduced")
            assert_row_matches(row, numpy_stats(mean), rtol=1e-4, atol=1e-6)
            if not mbs:  # one accumulated unreduced row per dp rank, of that rank's whole gradient
                for r in range(2):
                    row = pick(merged, step=s, module_name=name, scope="unreduced", dp_rank=r)
                    assert_row_matches(row, numpy_stats(local_grad(refs[r], s, name)), rtol=1e-4, atol=1e-6)
    return dest


@pytest.mark.parametrize("mbs", [False, True], ids=["accumulated", "per-micro-batch"])
def test_ddp_unreduced_is_local_and_reduced_is_the_mean(tmp_path, mbs):
    out, refs, rows = run("ddp", tmp_path, mbs)
    check_unreduced(refs, rows, mbs)
    # accumulated rows: DDP (no bucket view) writes .grad only at the pass's end, so the
    # local gradients are read in one batch there, before that write
    assert [ref["batched"] for ref in refs] == [not mbs] * 2
    check_layout(out, "ddp", refs, rows)
    check_merge(out, refs, mbs, tmp_path)
    if not mbs:
        # a replica that disagrees (rank 1's reduced fc2.weight at step 1, edited) is reported
        path = out / "rank_1" / "weight_grad_step1-1.csv"
        lines = path.read_text().splitlines(keepends=True)
        k = next(i for i, x in enumerate(lines) if ",fc2.weight,reduced," in x)
        cells = lines[k].rstrip("\n").split(",")
        norm_at = lines[0].rstrip("\n").split(",").index("norm")
        cells[norm_at] = repr(float(cells[norm_at]) * 1.01)
        lines[k] = ",".join(cells) + "\n"
        path.write_text("".join(lines))
        summary = merge_run(str(out), str(tmp_path / "merged_edited")).to_json()
        assert summary["disagreements"] == 1, summary
        (found,) = read_csv(tmp_path / "merged_edited" / "disagreements.csv")
        assert (found["step"], found["monitor"], found["module_name"], found["scope"], found["stat"]) == (
            "1", "weight_grad", "fc2.weight", "reduced", "norm"), found
    for s in range(STEPS):
        for name in PARAMS:
            mean = (local_grad(refs[0], s, name) + local_grad(refs[1], s, name)) / 2
            r0 = pick(rows[0], step=s, module_name=name, scope="reduced")
            r1 = pick(rows[1], step=s, module_name=name, scope="reduced")
            assert {k: r0[k] for k in ("min", "max", "mean", "norm")} == {k: r1[k] for k in ("min", "max", "mean", "norm")}
            assert r0["micro_step"] == str(ACC)
            assert_row_matches(r0, numpy_stats(mean), rtol=1e-4, atol=1e-6)
    # the monitored training is bit-identical to the unmonitored one (all monitors, cc too;
    # a row per micro-batch, and accumulated rows read in the end-of-pass batch)
    for r in range(2):
        bitwise = torch.load(out / f"bitwise_rank{r}.pt")
        assert bitwise["bit_identical"] is True
        assert bitwise["batched"] is True


@pytest.mark.parametrize("mode", ["ddp_bucket_view", "ddp_static_graph"])
def test_ddp_that_writes_grad_during_backward_is_read_in_each_hook(tmp_path, mode):
    """A bucket view makes .grad the bucket, all-reduced in place as its bucket fills;
    static_graph queues its first iteration's all-reduce as backward starts. Either would
    write the mean into .grad before an end-of-pass batch read: each gradient is read in
    its own hook, and the rows are still each rank's local gradient."""
    out, refs, rows = run(mode, tmp_path)
    acc = 1 if mode == "ddp_static_graph" else ACC  # static_graph fails in torch under no_sync()
    check_unreduced(refs, rows, mbs=False, acc=acc)
    assert [ref["batched"] for ref in refs] == [False, False]
    for s in range(STEPS):
        for name in PARAMS:
            mean = (local_grad(refs[0], s, name) + local_grad(refs[1], s, name)) / 2
            assert_row_matches(pick(rows[0], step=s, module_name=name, scope="reduced"), numpy_stats(mean),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["fsdp1", "fsdp1_orig", "fsdp2"])
def test_fsdp_unreduced_is_captured_before_reduce_scatter(tmp_path, mode):
    out, refs, rows = run(mode, tmp_path, mbs=(mode == "fsdp2"))
    check_unreduced(refs, rows, mbs=(mode == "fsdp2"))
    check_layout(out, mode, refs, rows)
    check_merge(out, refs, mode == "fsdp2", tmp_path)
    # reduced rows are local shards: across ranks they make up the mean gradient
    for s in range(STEPS):
        for name in PARAMS:
            mean = ((local_grad(refs[0], s, name) + local_grad(refs[1], s, name)) / 2).double().numpy()
            shards = [[x for x in rows[r] if x["step"] == str(s) and x["module_name"] == name and x["scope"] == "reduced"]
                      for r in range(2)]
            assert sum(len(x) for x in shards) >= 1, f"no reduced shard of {name}"
            for x in shards:
                assert len(x) <= 1
            got = [x[0] for x in shards if x]
            norm = math.sqrt(sum(float(x["norm"]) ** 2 for x in got))
            assert math.isclose(norm, float(np.linalg.norm(mean)), rel_tol=1e-4), (name, s)
            assert math.isclose(min(float(x["min"]) for x in got), float(mean.min()), rel_tol=1e-4, abs_tol=1e-7)
            assert math.isclose(max(float(x["max"]) for x in got), float(mean.max()), rel_tol=1e-4, abs_tol=1e-7)
    # optimizer state and parameters are reported per original parameter name (local shards)
    for monitor in ("optimizer", "param"):
        names = {x["module_name"].split(".exp_avg")[0] for r in range(2) for x in rows_of(out, monitor, rank=r)}
        assert names == set(PARAMS), names
