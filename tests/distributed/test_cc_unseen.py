"""Collectives the ``cc`` monitor cannot see are said once at WARNING, never silent
(real 2-rank torchrun jobs, gloo, CPU; worker: workers/cc_unseen.py).

- ``unseen``: an expert-parallel all-to-all in the forward and its backward
  (``_functional_collectives.all_to_all_single_autograd``) and a functional all-reduce
  on a group ``experts``, a DTensor redistribution on the world: one WARNING on each
  rank naming the count (3 on ``experts``, 1 on the world at step 0), the groups' ranks
  and the likely sources; the rows of the c10d calls (the gradients' ``dist.all_reduce``)
  still equal NumPy statistics of the tensors, and no row for what was not seen.
- ``seen``: only ``torch.distributed`` functions (barriers, point-to-point, async,
  objects, a sub-group): no such warning, and none for a group on the ``fake`` backend;
  with ``"dynamic"``, the monitor's own all-reduce between steps is neither a row nor
  counted.
- ``ddp``: DDP's C++ reducer, named as the likely source.

Every mode trains bit-identically with and without the monitor.
"""

import re
from pathlib import Path

import pytest
import torch

from support import assert_row_matches, numpy_stats, rows_of, run_torchrun

WORKER = Path(__file__).parent / "workers" / "cc_unseen.py"
GRAD_ALL_REDUCE_LINE = next(i for i, line in enumerate(WORKER.read_text(encoding="utf-8").splitlines(), 1)
                            if line.rstrip().endswith("# cc-unseen-grad-all-reduce"))
GRAD_TAG = f"all_reduce.post.0@cc_unseen.py[{GRAD_ALL_REDUCE_LINE}]"
STEP_LINE = next(i for i, line in enumerate(WORKER.read_text(encoding="utf-8").splitlines(), 1)
                 if line.rstrip().endswith("# cc-unseen-step"))
RANKS = (0, 1)
STEPS = 3
UNSEEN = "collective(s) ran that the cc monitor did not see"


def launch(mode, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"cc_unseen_{mode}")
    run_torchrun(WORKER, mode, out)
    return out, [torch.load(out / f"{mode}_rank{r}.pt", weights_only=False) for r in RANKS]


@pytest.fixture(scope="module")
def unseen_run(tmp_path_factory):
    return launch("unseen", tmp_path_factory)


@pytest.fixture(scope="module")
def seen_run(tmp_path_factory):
    return launch("seen", tmp_path_factory)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return launch("ddp", tmp_path_factory)


def unseen_warnings(result):
    return [m for m in result["warnings"] if UNSEEN in m]


def check_grad_rows(out, mode, results):
    """The gradients' all-reduce rows of every step against NumPy on the worker's clones."""
    for r in RANKS:
        rows = [row for row in rows_of(out / mode, "cc", rank=r) if row["module_name"] == GRAD_TAG]
        assert sorted(int(row["step"]) for row in rows) == list(range(STEPS)), (r, rows)
        for row in rows:
            want = next(c["post"] for c in results[r]["reduced"] if c["step"] == int(row["step"]))
            assert_row_matches(row, numpy_stats(want), rtol=1e-5, atol=1e-6)


def test_functional_collectives_and_dtensor_redistribution_are_said_once(unseen_run):
    """One WARNING per rank over 3 steps: the count at the first written step, each group
    with its ranks, the likely sources, and that the tensors are not in the rows."""
    _, results = unseen_run
    for r in RANKS:
        said = unseen_warnings(results[r])
        assert len(said) == 1, (r, results[r]["warnings"])
        msg = said[0]
        assert msg.startswith(f"monitor_v2 cc: step 0: 4 {UNSEEN} ("), msg
        # the all-to-all forward and backward and the functional all-reduce on 'experts'
        assert "3 on process group [0, 1] ('experts')" in msg, msg
        # the redistribution's all-gather on the mesh's group (the world)
        assert "1 on process group [0, 1] ('default_pg')" in msg, msg
        assert "functional collectives" in msg and "expert-parallel all-to-all" in msg, msg
        assert "DTensor redistribution" in msg, msg
        assert "Their tensors are not in the cc rows" in msg, msg


def test_rows_of_the_c10d_calls_are_right_beside_unseen_ones(unseen_run):
    out, results = unseen_run
    check_grad_rows(out, "unseen", results)
    for r in RANKS:  # what was not seen has no row (and none is made up)
        assert {row["module_name"] for row in rows_of(out / "unseen", "cc", rank=r)} == {GRAD_TAG}


def test_no_warning_when_every_collective_is_seen(seen_run):
    """Barriers, send/recv, an async all-reduce, all_gather_object and a sub-group's
    calls all go through the wrappers: nothing is said."""
    out, results = seen_run
    for r in RANKS:
        assert unseen_warnings(results[r]) == [], results[r]["warnings"]
        # nor a group that cannot be counted: the fake-backend group is left out
        assert not [m for m in results[r]["warnings"] if "cannot count" in m], results[r]["warnings"]
    check_grad_rows(out, "seen", results)
    for r in RANKS:
        ops = {row["module_name"].split(".")[0] for row in rows_of(out / "seen", "cc", rank=r)}
        assert {"all_reduce", "all_to_all_single", "broadcast", "all_gather"} <= ops, ops


def test_the_monitors_own_collective_is_no_row(seen_run):
    """With "dynamic" the ranks agree on config edits (an all-reduce of the monitor's own
    between steps): no row tagged with the line of ``mon.step()``, no unseen warning
    (the other test)."""
    out, _ = seen_run
    for r in RANKS:
        sites = {row["module_name"] for row in rows_of(out / "seen", "cc", rank=r)}
        assert not [t for t in sites if t.endswith(f"@cc_unseen.py[{STEP_LINE}]")], sites


def test_ddp_reducer_is_named(ddp_run):
    _, results = ddp_run
    for r in RANKS:
        said = unseen_warnings(results[r])
        assert len(said) == 1, (r, results[r]["warnings"])
        assert re.search(r"step 0: 1 collective\(s\) .* \(1 on process group \[0, 1\] \('default_pg'\)\)", said[0])
        assert "the model is wrapped in DistributedDataParallel: DDP's C++ reducer" in said[0], said[0]


@pytest.mark.parametrize("fixture", ["unseen_run", "seen_run", "ddp_run"])
def test_training_is_bit_identical(fixture, request):
    _, results = request.getfixturevalue(fixture)
    for r in RANKS:
        assert results[r]["bit_identical"], (fixture, r)
