"""Incident mode on a real 2-process MindSpore job (``msrun``, 2 workers, CPU), one
launch shared by the tests of this file (~15-25 s); the worker is
workers/ms_incident_worker.py.

- a config edit written by rank 0 alone, after rank 1 has checked the file at that
  boundary, turns ``module`` on at the same step on both ranks for exactly its steps;
- a NaN on rank 1 only escalates both ranks at the same step, and ``"targets": "auto"``
  narrows both to the same Cell (rank 1's name, gathered);
- the agreement ran (MindSpore 2.10's CPU backend has no ``comm_func`` kernels and
  all-reduces with SUM only: the session all-gathers), so the fallback warning is absent.
"""

import json
from pathlib import Path

import pytest
from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import rows_of, run_msrun  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "ms_incident_worker.py"
RANKS = (0, 1)
STEPS = 10


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("ms_incident")
    run_msrun(WORKER, out, timeout=300)
    warnings = [json.loads((out / f"warnings_rank{r}.json").read_text()) for r in RANKS]
    return out, warnings


def steps_of(rows):
    return sorted({int(r["step"]) for r in rows})


def test_edit_by_rank_0_applies_at_the_same_step_on_both_ranks(job):
    out, warnings = job
    seen = [dict((s, c) for s, c in json.loads((out / f"seen_rank{r}.json").read_text())) for r in RANKS]
    assert seen[0][3] is True and seen[1][3] is False  # rank 1 looked before rank 0 wrote
    for r in RANKS:
        module = rows_of(out / "edit", "module", rank=r)
        assert steps_of(module) == [4, 5, 6], r
        assert {m["module_name"].split(".")[0] for m in module} == {"fc1"}, r
        assert steps_of(rows_of(out / "edit", "weight_grad", rank=r)) == list(range(STEPS)), r
        assert any(f"rank {r}: config edit applied from step 4" in w for w in warnings[r]), warnings[r]


def test_anomaly_on_rank_1_escalates_both_ranks_at_the_same_step(job):
    out, warnings = job
    for r in RANKS:
        module = rows_of(out / "anomaly", "module", rank=r)
        assert steps_of(module) == [5, 6, 7], r
        # the offending tensor is rank 1's fc2.weight: both ranks narrow to fc2
        assert {m["module_name"].split(".")[0] for m in module} == {"fc2"}, r
    assert all(row["nans"] == "0" for row in rows_of(out / "anomaly", "param", rank=0))
    assert "an anomaly seen on another rank" in " ".join(warnings[0])
    # the evidence is the seeing rank's own
    assert not (out / "anomaly" / "rank_0" / "anomalies.jsonl").exists()
    first = json.loads((out / "anomaly" / "rank_1" / "anomalies.jsonl").read_text().splitlines()[0])
    assert (first["step"], first["module_name"], first["first"]) == (4, "fc2.weight", True)


def test_the_ranks_agreed_through_a_collective(job):
    _, warnings = job
    for r in RANKS:
        assert not [w for w in warnings[r] if "could not run the small collective" in w], warnings[r]


def test_the_agreement_is_no_cc_row(job):
    """The anomaly run has ``cc`` on and no collective of its own: the monitor's
    per-step agreement and its gather are not recorded as the training's."""
    out, _ = job
    for r in RANKS:
        assert rows_of(out / "anomaly", "cc", rank=r) == [], r
