"""Incident mode on 2 gloo ranks (torchrun): a config edit seen by one rank first, and an
anomaly on one rank only, both start on every rank at the same step."""

import json
from pathlib import Path

from support import rows_of, run_torchrun

WORKER = Path(__file__).parent / "workers" / "incident.py"


def steps_of(rows):
    return sorted({int(r["step"]) for r in rows})


def test_edit_by_rank_0_applies_at_the_same_step_on_both_ranks(tmp_path):
    run_torchrun(WORKER, "edit", tmp_path)
    seen = [dict((s, c) for s, c in json.loads((tmp_path / f"seen_rank{r}.json").read_text())) for r in range(2)]
    assert seen[0][3] is True and seen[1][3] is False  # rank 1 looked before rank 0 wrote
    for r in range(2):
        module = rows_of(tmp_path, "module", rank=r)
        assert steps_of(module) == [4, 5, 6], r
        assert {m["module_name"].split(".")[0] for m in module} == {"fc1"}
        assert steps_of(rows_of(tmp_path, "weight_grad", rank=r)) == list(range(10))


def test_anomaly_on_rank_1_escalates_both_ranks_at_the_same_step(tmp_path):
    run_torchrun(WORKER, "anomaly", tmp_path)
    for r in range(2):
        module = rows_of(tmp_path, "module", rank=r)
        assert steps_of(module) == [5, 6, 7], r
        # the offending tensor is rank 1's fc2.weight: both ranks narrow to fc2
        assert {m["module_name"].split(".")[0] for m in module} == {"fc2"}, r
    clean = rows_of(tmp_path, "param", rank=0)
    assert all(row["nans"] == "0" for row in clean)
