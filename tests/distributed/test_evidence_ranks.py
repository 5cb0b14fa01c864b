"""2 gloo ranks, a NaN in rank 1's input only: each rank writes its own anomalies.jsonl
and dump. Rank 1's first anomalous row is its local gradient; rank 0's local gradients
are finite and its first anomalous row is the reduced gradient (the all-reduce brought
the NaN)."""

import json
from pathlib import Path

from support import run_torchrun
from msprobe.core.monitor_v2.evidence import load_dump

WORKER = Path(__file__).parent / "workers" / "evidence_ranks.py"
NAN_STEP = 2


def test_each_rank_keeps_its_own_evidence(tmp_path):
    run_torchrun(WORKER, tmp_path)
    first = {}
    for rank in (0, 1):
        lines = [json.loads(x) for x in (tmp_path / f"rank_{rank}" / "anomalies.jsonl").read_text().splitlines()]
        assert {line["rank"] for line in lines} == {rank} and {line["step"] for line in lines} == {NAN_STEP}
        first[rank] = lines[0]
        scopes = {line["scope"] for line in lines}
        assert scopes == ({"reduced"} if rank == 0 else {"unreduced", "reduced"})
        dump = load_dump(str(tmp_path / f"rank_{rank}" / f"dump_step{NAN_STEP}"))
        assert dump["manifest"]["rank"] == rank and dump["manifest"]["step"] == NAN_STEP
        x = dump["inputs"]["call0.args.0"]
        assert bool(x.isnan().any()) == (rank == 1)
    assert first[1]["scope"] == "unreduced" and first[0]["scope"] == "reduced"
    assert (first[1]["order"][2], first[0]["order"][2]) == (3, 5)  # phases: local, then reduced gradient
