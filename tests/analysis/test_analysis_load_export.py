"""The notebook API (``load``) and ``msprobe-monitor export`` to Parquet, on the real
2-rank runs; values checked against the CSV files read with the ``csv`` module."""

import csv
import math
from pathlib import Path

import pytest

from analysis_helpers import NAN_STEP, STEPS, cli, training_runs

from support.extras import POLARS_ENGINE, require

pl = require("polars", POLARS_ENGINE)

from msprobe.core.monitor_v2.analysis import load  # noqa: E402

OPS = ("min", "max", "mean", "norm", "nans")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return training_runs(tmp_path_factory)


def csv_rows(root: Path):
    """(rank, monitor, file name, line, row dict) of every row, with the csv module."""
    out = []
    for f in sorted(root.glob("rank_*/*.csv")):
        rank = int(f.parent.name.split("_")[1])
        monitor = f.name.split("_step")[0]
        with open(f, newline="") as fh:
            for i, row in enumerate(csv.DictReader(fh), start=2):
                out.append((rank, monitor, f.name, i, row))
    return out


def test_load_gives_every_row_with_its_rank(runs):
    df = load(runs / "nan", with_source=True)
    rows = csv_rows(runs / "nan")
    assert len(df) == len(rows)
    assert df.columns[:2] == ["rank", "monitor"]
    got = {(r["rank"], Path(r["file"]).name, r["line"]): r for r in df.iter_rows(named=True)}
    for rank, monitor, name, line, row in rows:
        g = got[(rank, name, line)]
        assert (g["monitor"], g["step"], g["module_name"], g["scope"]) == (monitor, int(row["step"]),
                                                                           row["module_name"], row["scope"])
        for op in OPS:
            a, b = g[op], (int(row[op]) if op == "nans" else float(row[op]))
            assert a == b or (math.isnan(a) and math.isnan(b))
        assert g["micro_step"] == (int(row["micro_step"]) if monitor == "weight_grad" else None)


def test_load_selects_ranks_monitors_steps(runs):
    df = load(runs / "nan", ranks=[1], monitors=["weight_grad"], steps=(NAN_STEP, NAN_STEP + 1))
    assert set(df["rank"]) == {1} and set(df["monitor"]) == {"weight_grad"}
    assert sorted(set(df["step"])) == [NAN_STEP, NAN_STEP + 1]
    first = df.filter(pl.col("nans") > 0).sort("step", "micro_step").row(0, named=True)
    assert (first["step"], first["scope"], first["micro_step"]) == (NAN_STEP, "unreduced", 2)


def test_export_then_every_command_reads_the_dataset(runs, tmp_path):
    dest = tmp_path / "parquet"
    res = cli("export", runs / "nan", dest)
    assert res.code == 0, res.err
    assert f"msprobe-monitor summary {dest}" in res.out
    parts = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*.parquet"))
    assert parts[0] == "monitor=module/rank=0/part-00000.parquet"
    assert {p.split("/")[0] for p in parts} == {"monitor=module", "monitor=weight_grad", "monitor=optimizer",
                                                "monitor=param"}
    # one dataset: any Parquet reader sees the partition columns
    ds = pl.scan_parquet(dest / "**" / "*.parquet", hive_partitioning=True).collect()
    assert len(ds) == len(csv_rows(runs / "nan")) and {"monitor", "rank"} <= set(ds.columns)
    a = load(runs / "nan")
    b = load(dest)
    assert a.equals(b)
    # the commands: same findings, the file of a finding is the Parquet partition
    ja = cli("anomalies", runs / "nan", "--json", "--limit", "0").json()
    jb = cli("anomalies", dest, "--json", "--limit", "0").json()
    for data in (ja, jb):
        data.pop("out_dir")
        for section in (data["nonfinite"]["first_per_rank"] + [data["nonfinite"]["first"]] + data["spikes"]["items"]
                        + data["rank_check"]["items"]):
            section.pop("file")
    assert ja == jb or str(ja) == str(jb)
    assert jb["nonfinite"]["first"]["tensor"] == "fc2.output.0"
    assert cli("summary", dest).code == 0
    diff = cli("diff", runs / "nan", dest)
    assert diff.code == 0 and "no difference" in diff.out
    assert cli("plot", dest, "--out", tmp_path / "plots", "--max-plots", "2", "--no-html").code == 0
    assert cli("summary", dest, "--steps", f"{STEPS + 5}:").code == 2


def test_export_keeps_bad_lines_out_with_a_warning(runs, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(runs / "clean", src)
    f = sorted((src / "rank_0").glob("param_step*.csv"))[0]
    lines = f.read_text().splitlines(keepends=True)
    f.write_text("".join(lines[:2] + ["garbage\n"] + lines[2:]))
    res = cli("export", src, tmp_path / "pq", "--progress")
    assert f"exporting: {len(list(src.glob('rank_*/*.csv')))}/" in res.err
    assert res.code == 0 and "1 malformed line(s)/file(s) skipped" in res.out
    assert f"{f.name}:3:" in res.err
    assert len(load(tmp_path / "pq")) == len(csv_rows(runs / "clean"))
    assert cli("export", src, tmp_path / "pq2", "--strict").code == 2
