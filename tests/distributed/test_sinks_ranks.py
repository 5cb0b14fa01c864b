"""``sinks.ranks`` in a 2-rank DDP job (torchrun, gloo): by default only rank 0 sends; with
``"all"`` each rank writes its own run, whose global norms equal that rank's CSV rows."""

import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from support import read_csv, run_torchrun
from support.extras import require

require("tensorboard", "the 2-rank sink tests read back each rank's TensorBoard event files")

WORKER = Path(__file__).parent / "workers" / "sinks_ranks.py"


def events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    ea = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    ea.Reload()
    got = defaultdict(dict)
    for t in ea.Tags()["tensors"]:
        for ev in ea.Tensors(t):
            got[ev.step][t] = float(tensor_util.make_ndarray(ev.tensor_proto))
    return got


def test_rank_0_sends_by_default_and_every_rank_with_all(tmp_path):
    run_torchrun(WORKER, tmp_path)
    assert sorted(p.name for p in (tmp_path / "default" / "tensorboard").iterdir()) == ["rank_0"]
    assert sorted(p.name for p in (tmp_path / "all" / "tensorboard").iterdir()) == ["rank_0", "rank_1"]
    norms = {}
    for rank in (0, 1):
        got = events(tmp_path / "all" / "tensorboard" / f"rank_{rank}")
        assert sorted(got) == [0, 1, 2]
        for step in range(3):
            (f,) = (tmp_path / "all" / f"rank_{rank}").glob(f"weight_grad_step{step}-{step}.csv")
            for scope in ("unreduced", "reduced"):
                rows = [r for r in read_csv(f) if r["scope"] == scope]
                want = float(np.sqrt(np.sum(np.array([float(r["norm"]) for r in rows]) ** 2)))
                assert got[step][f"weight_grad/{scope}/global_norm"] == pytest.approx(want, rel=2e-6)
                assert got[step][f"weight_grad/{scope}/nonfinite_tensors"] == 0
            norms[(rank, step)] = got[step]["weight_grad/unreduced/global_norm"]
            assert set(got[step]) == {f"weight_grad/{s}/{k}" for s in ("unreduced", "reduced")
                                      for k in ("global_norm", "nonfinite_tensors", "nans")}  # top_k 0
    # each rank's own data: local gradients differ, so the runs are the ranks' own
    assert all(not math.isclose(norms[(0, s)], norms[(1, s)]) for s in range(3))
