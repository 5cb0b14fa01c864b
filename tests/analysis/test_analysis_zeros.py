"""The reading commands and the notebook API on output holding the optional ``zeros``
column (written by a real run), checked against the CSV files read with the ``csv``
module; a Parquet dataset exported before the column existed still reads."""

import csv
import shutil
from pathlib import Path

import pytest
import torch

from analysis_helpers import cli
from support import TinyMLP, make_batches
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

from support.extras import POLARS_ENGINE, require

pl = require("polars", POLARS_ENGINE)

from msprobe.core.monitor_v2.analysis import load  # noqa: E402

STEPS = 4


def _run(out: Path, ops) -> Path:
    torch.manual_seed(0)
    model = TinyMLP(d_hidden=32, seed=2)
    with torch.no_grad():
        model.fc1.weight[::4] = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {
        "module": {"ops": ops}, "weight_grad": {"enabled": True, "ops": ops},
        "param": {"enabled": True, "ops": ops}}})
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(STEPS):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return _run(tmp_path_factory.mktemp("zeros") / "out", ["norm", "nans", "zeros"])


def csv_zeros(root: Path):
    out = {}
    for f in sorted(root.glob("rank_*/*.csv")):
        monitor = f.name.split("_step")[0]
        with open(f, newline="") as fh:
            for row in csv.DictReader(fh):
                out[(monitor, int(row["step"]), row["module_name"], row["scope"], row.get("micro_step"))] = \
                    int(row["zeros"])
    return out


def frame_zeros(df):
    return {(r["monitor"], r["step"], r["module_name"], r["scope"],
             None if r["micro_step"] is None else str(r["micro_step"])): r["zeros"] for r in df.iter_rows(named=True)}


def test_load_and_parquet_export_carry_the_zeros_column(run, tmp_path):
    want = csv_zeros(run)
    assert any(v > 0 for v in want.values()) and len(want) > 20
    df = load(run)
    assert df.schema["zeros"] == pl.Int64 and df["min"].null_count() == len(df)  # min was not asked for
    assert frame_zeros(df) == want
    assert cli("export", run, tmp_path / "pq").code == 0
    assert frame_zeros(load(tmp_path / "pq")) == want


def test_a_parquet_dataset_without_the_zeros_column_still_reads(run, tmp_path):
    old = _run(tmp_path / "old", None)
    assert cli("export", old, tmp_path / "pq").code == 0
    for part in (tmp_path / "pq").glob("monitor=*/rank=*/part-*.parquet"):  # as an older version wrote it
        pl.read_parquet(part).drop("zeros").write_parquet(part)
    df = load(tmp_path / "pq")
    assert df["zeros"].null_count() == len(df) and df["norm"].null_count() == 0
    assert cli("summary", tmp_path / "pq").code == 0


def test_summary_diff_and_plot_accept_zeros(run, tmp_path):
    summary = cli("summary", run, "--json")
    assert summary.code == 0
    assert summary.json()["monitors"]["module"]["ops"] == ["norm", "nans", "zeros"]
    assert cli("diff", run, run, "--stats", "zeros").code == 0
    changed = tmp_path / "changed"
    shutil.copytree(run, changed)
    f = sorted((changed / "rank_0").glob("param_step2-2.csv"))[0]
    lines = f.read_text().splitlines()
    cells = lines[1].split(",")
    cells[-1] = str(int(cells[-1]) + 1)
    f.write_text("\n".join([lines[0], ",".join(cells)] + lines[2:]) + "\n")
    res = cli("diff", run, changed, "--stats", "zeros", "--json")
    assert res.code == 1
    first = res.json()["first"]
    assert (first["stat"], first["step"], first["tensor"]) == ("zeros", 2, cells[2])
    assert cli("diff", run, changed, "--stats", "norm").code == 0
    plot = cli("plot", run, "--stat", "zeros", "--out", tmp_path / "plots", "--no-html")
    assert plot.code == 0, plot.err
    assert any("zeros" in p.name for p in (tmp_path / "plots").glob("*.png"))
