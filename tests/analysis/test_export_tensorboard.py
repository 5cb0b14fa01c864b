"""``msprobe-monitor export --tensorboard`` on the real 2-rank runs: the event files are read
back with TensorBoard's own ``EventAccumulator`` and every value is compared with the CSV
rows read with the ``csv`` module (as float32, the type TensorBoard stores)."""

import csv
import math
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from analysis_helpers import NAN_STEP, STEPS, cli, training_runs
from support.extras import POLARS_ENGINE, require

require("tensorboard", "export --tensorboard writes event files, read back with TensorBoard's EventAccumulator")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402

OPS = ("min", "max", "mean", "norm", "nans")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return training_runs(tmp_path_factory)


def expected_scalars(root: Path):
    """{(rank, tag, step): value} from the CSV files, tags built here from the documented rule:
    ``<monitor>/<scope>/<tensor>/<stat>``, with ``micro_<k>`` after the tensor when the tensor
    has rows of several micro-batches in the step."""
    out = {}
    for f in sorted(root.glob("rank_*/*.csv")):
        rank = int(f.parent.name.split("_")[1])
        monitor = f.name.split("_step")[0]
        with open(f, newline="") as fh:
            rows = list(csv.DictReader(fh))
        per_step = Counter((r["step"], r["module_name"], r["scope"]) for r in rows)
        for r in rows:
            name = r["module_name"]
            if per_step[(r["step"], name, r["scope"])] > 1:
                name = f"{name}/micro_{r['micro_step']}"
            for op in OPS:
                if op in r:
                    key = (rank, f"{monitor}/{r['scope']}/{name}/{op}", int(r["step"]))
                    assert key not in out, f"two CSV rows give {key}"
                    out[key] = float(r[op])
    return out


def read_events(tb_dir: Path):
    got = {}
    runs = sorted(p.name for p in tb_dir.iterdir())
    for run in runs:
        ea = EventAccumulator(str(tb_dir / run), size_guidance={"tensors": 0, "scalars": 0})
        ea.Reload()
        rank = int(run.split("_")[1])
        for t in ea.Tags()["tensors"]:
            for ev in ea.Tensors(t):
                key = (rank, t, ev.step)
                assert key not in got, f"{key} written twice"
                got[key] = float(tensor_util.make_ndarray(ev.tensor_proto))
    return runs, got


def same_f32(a: float, b: float) -> bool:
    a32 = float(np.float32(a))
    return (math.isnan(a32) and math.isnan(b)) or a32 == b


def test_export_tensorboard_values_equal_the_csv_rows(runs, tmp_path):
    tb = tmp_path / "tb"
    res = cli("export", "--tensorboard", tb, runs / "nan", "--json")
    assert res.code == 0, res.err
    data = res.json()
    want = expected_scalars(runs / "nan")
    names, got = read_events(tb)
    assert names == ["rank_0", "rank_1"]
    assert set(got) == set(want)
    bad = [(k, want[k], got[k]) for k in want if not same_f32(want[k], got[k])]
    assert not bad, bad[:5]
    assert (data["tensorboard_runs"], data["scalars"]) == (2, len(want))
    assert data["tags"] == len({(r, t) for r, t, _ in want})
    # the monitor's steps are the x axis; the NaN of rank 1 is in its micro-batch 2 at NAN_STEP
    assert {s for _, _, s in got} == set(range(STEPS))
    nan_tag = "weight_grad/unreduced/fc2.weight/micro_2/norm"
    assert math.isnan(got[(1, nan_tag, NAN_STEP)]) and math.isfinite(got[(0, nan_tag, NAN_STEP)])
    # files 0640, directories 0750
    for path in [tb, tb / "rank_0"] + list((tb / "rank_0").iterdir()):
        assert (path.stat().st_mode & 0o777) == (0o750 if path.is_dir() else 0o640), path


def test_export_tensorboard_from_parquet_and_with_parquet(runs, tmp_path):
    require("polars", POLARS_ENGINE)
    res = cli("export", runs / "clean", tmp_path / "pq", "--tensorboard", tmp_path / "tb_csv")
    assert res.code == 0, res.err
    assert "Parquet file(s)" in res.out and "tensorboard --logdir" in res.out
    res = cli("export", "--tensorboard", tmp_path / "tb_pq", tmp_path / "pq")
    assert res.code == 0, res.err
    _, from_csv = read_events(tmp_path / "tb_csv")
    _, from_pq = read_events(tmp_path / "tb_pq")
    assert from_csv.keys() == from_pq.keys() and len(from_csv) > 1000
    assert all(same_f32(from_csv[k], from_pq[k]) for k in from_csv)


def test_export_tensorboard_selects_and_replaces(runs, tmp_path):
    tb = tmp_path / "tb"
    assert cli("export", "--tensorboard", tb, runs / "clean").code == 0
    # a second export into the same directory replaces the event files (no doubled points)
    res = cli("export", "--tensorboard", tb, runs / "clean", "--ranks", "1", "--monitors", "weight_grad",
              "--steps", "3:5")
    assert res.code == 0, res.err
    assert len(list((tb / "rank_1").glob("events.out.tfevents.*"))) == 1
    _, got = read_events(tb)
    rank1 = {k for k in got if k[0] == 1}
    assert rank1 and all(t.startswith("weight_grad/") and 3 <= s <= 5 for _, t, s in rank1)
    assert any(k[0] == 0 and k[1].startswith("param/") for k in got)  # rank 0 was not exported again


def test_export_tensorboard_bad_input(runs, tmp_path, monkeypatch):
    res = cli("export", runs / "clean")
    assert res.code == 2 and "--tensorboard" in res.err
    res = cli("export", "--tensorboard", runs / "clean", runs / "clean")
    assert res.code == 2 and "must differ from OUT_DIR" in res.err
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    res = cli("export", "--tensorboard", tmp_path / "link" / "tb", runs / "clean")
    assert res.code == 2 and "symbolic link" in res.err and not any(real.iterdir())
    for name in list(sys.modules):
        if name == "tensorboard" or name.startswith("tensorboard."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    res = cli("export", "--tensorboard", tmp_path / "tb", runs / "clean")
    assert res.code == 2 and "pip install tensorboard" in res.err and not (tmp_path / "tb").exists()
