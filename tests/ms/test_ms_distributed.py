"""A real 2-process MindSpore job (``msrun``, 2 workers, CPU, MCCL), one launch shared
by the tests of this file (~15-25 s).

The worker (workers/ms_dist_worker.py) trains an MLP on different data on each rank,
with ``nn.DistributedGradReducer(mean=True)`` between backward and
``optimizer(grads)``, and calls ``mint.distributed`` all_reduce / all_gather /
broadcast and the ``ops.AllReduce`` primitive; it saves copies of every tensor
involved. Checked here with NumPy:

- weight_grad ``unreduced`` = the rank's local gradients; ``reduced`` = the mean of the
  two ranks' local gradients (computed here from both ranks' copies), equal on both
  ranks;
- cc ``pre`` (``cc_pre_hook``) and ``post`` rows of each call = the tensors passed and
  received, tagged with the call's line; for an ``async_op=True`` call, the result as it
  was when ready (at ``wait()``), although the buffer is reused before the step ends;
- after ``stop()`` every patched function is the original object again and no
  communication primitive class keeps a ``__call__`` of its own.
"""

import json
import re
from pathlib import Path

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import assert_row_matches, find_row, rows_of, run_msrun  # noqa: E402
from support.ms_helpers import np, np_stats  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "ms_dist_worker.py"
RANKS = (0, 1)
RTOL, ATOL = 1e-5, 1e-7
TAG = re.compile(r"^(?P<op>[\w.]+)\.(?P<dir>pre|post)\.(?P<idx>\d+)@(?P<site>.+)$")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("ms_dist")
    run_msrun(WORKER, out, timeout=300)
    saved = [dict(np.load(out / f"rank{r}.npz")) for r in RANKS]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in RANKS]
    return out, saved, reports


def test_weight_grad_unreduced_is_local_and_reduced_is_the_mean(job):
    out, saved, reports = job
    names = reports[0]["param_names"]
    assert names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    rows = {r: rows_of(out, "weight_grad", rank=r) for r in RANKS}
    for step in (0, 1):
        for name in names:
            local = [saved[r][f"local.{step}.{name}"] for r in RANKS]
            assert not np.allclose(local[0], local[1]), "the ranks must see different data"
            mean = (local[0].astype(np.float64) + local[1]) / 2
            for r in RANKS:
                np.testing.assert_allclose(saved[r][f"passed.{step}.{name}"], mean, rtol=1e-5, atol=1e-7)
                unreduced = find_row(rows[r], step=step, module_name=name, scope="unreduced")
                assert unreduced["micro_step"] == "1"
                assert_row_matches(unreduced, np_stats(local[r]), RTOL, ATOL)
                reduced = find_row(rows[r], step=step, module_name=name, scope="reduced")
                assert reduced["micro_step"] == "1"
                assert_row_matches(reduced, np_stats(mean), RTOL, ATOL)
            r0 = find_row(rows[0], step=step, module_name=name, scope="reduced")
            r1 = find_row(rows[1], step=step, module_name=name, scope="reduced")
            for op in ("min", "max", "mean", "norm", "nans"):
                assert np.isclose(float(r0[op]), float(r1[op]), rtol=1e-6, atol=1e-9), (step, name, op, r0, r1)


EXPECTED_TAGS = {
    # marker of the call in the worker: (op in the tag, pre indices, post indices)
    "all_reduce": ("all_reduce", [0], [0]),
    "all_gather": ("all_gather", [0], [0, 1]),
    "broadcast": ("broadcast", [0], [0]),
    "AllReduce": ("AllReduce", [0], [0]),
}
ASYNC = {"all_reduce_async": ("all_reduce", [0], [0])}


def expected_rows(saved, lines, calls):
    want = {}
    for marker, (op, pre, post) in calls.items():
        site = f"ms_dist_worker.py[{lines[marker]}]"
        for direction, idxs in (("pre", pre), ("post", post)):
            for i in idxs:
                want[f"{op}.{direction}.{i}@{site}"] = saved[f"{marker}.{direction}.{i}"]
    return want


def check(rows, want, what):
    got = {row["module_name"]: row for row in rows}
    missing = sorted(set(want) - set(got))
    assert not missing, f"{what}: missing cc rows {missing}; got {sorted(got)}"
    for tag, tensor in want.items():
        row = got[tag]
        assert row["scope"] == "comm" and row["vpp_stage"] == "0"
        assert TAG.match(tag)
        try:
            assert_row_matches(row, np_stats(tensor), RTOL, ATOL)
        except AssertionError as exc:
            raise AssertionError(f"{what} {tag}: {exc}") from None


def test_cc_rows_match_the_tensors_passed_and_received(job):
    out, saved, reports = job
    for r in RANKS:
        lines = reports[r]["lines"]
        rows = rows_of(out, "cc", rank=r)
        assert rows, f"rank {r}: no cc rows"
        assert {row["step"] for row in rows} == {"0"}, "collectives were only called in step 0"
        want = expected_rows(saved[r], lines, EXPECTED_TAGS)
        got = {row["module_name"] for row in rows}
        assert len(got) == len(rows), "a tag has two rows in one step"
        # Anything else may only come from the async call (next test) or the reducer.
        allowed = set(want) | set(expected_rows(saved[r], lines, ASYNC))
        reducer_site = f"@ms_dist_worker.py[{lines['reducer']}]"
        extra = sorted(t for t in got - allowed if not t.endswith(reducer_site))
        assert not extra, f"rank {r}: unexpected cc rows {extra}"
        check(rows, want, f"rank {r}")


def test_cc_async_all_reduce_is_recorded_when_its_result_is_ready(job):
    """``all_reduce(..., async_op=True)``; ``wait()``; then the training code reuses the
    buffer (zeroes it in place) before the step ends. The ``post`` row is the reduced
    result available at ``wait()``, not whatever the buffer holds at the end of the step
    (the spec: asynchronous ops are recorded when their result is ready)."""
    out, saved, reports = job
    for r in RANKS:
        rows = rows_of(out, "cc", rank=r)
        check(rows, expected_rows(saved[r], reports[r]["lines"], ASYNC), f"rank {r} async")


def test_cc_values_are_the_collectives_results(job):
    """The saved tensors themselves (what the rows were compared with) are the results
    of the collectives, computed here from both ranks' inputs."""
    _, saved, _ = job
    s0, s1 = saved
    for s in saved:
        np.testing.assert_allclose(s["all_reduce.post.0"], s0["all_reduce.pre.0"] + s1["all_reduce.pre.0"])
        np.testing.assert_allclose(s["all_gather.post.0"], s0["all_gather.pre.0"])
        np.testing.assert_allclose(s["all_gather.post.1"], s1["all_gather.pre.0"])
        np.testing.assert_allclose(s["broadcast.post.0"], s0["broadcast.pre.0"])
        np.testing.assert_allclose(s["AllReduce.post.0"], s0["AllReduce.pre.0"] + s1["AllReduce.pre.0"])
        np.testing.assert_allclose(s["all_reduce_async.post.0"],
                                   s0["all_reduce_async.pre.0"] + s1["all_reduce_async.pre.0"])
    assert not np.allclose(s1["broadcast.pre.0"], s0["broadcast.pre.0"])


def test_stop_restores_the_communication_api(job):
    _, _, reports = job
    for rep in reports:
        patched = set(rep["patched_during"])
        for name in ("mint.distributed.all_reduce", "mint.distributed.all_gather", "mint.distributed.broadcast",
                     "mint.distributed.distributed.all_reduce"):
            assert name in patched, f"rank {rep['rank']}: {name} was not wrapped while monitoring"
        assert "AllReduce" in rep["own_call_during"]
        assert rep["not_restored"] == [], f"rank {rep['rank']}: not the originals after stop(): {rep['not_restored']}"
        assert rep["own_call_before"] == [] and rep["own_call_after"] == [], rep
        assert rep["errors_contained"] == 0
