"""Runs that share one output_dir, beside each other in ``.run<k>`` files and appended to
the same files, read back as runs (issue 47).

Real training runs of ``TinyMLP`` with ``weight_grad`` and ``param`` on two ranks (the
rank from ``RANK``, as a launcher sets it; rank 1 trains the same replica), one after
another, into one output_dir:

1. the **first run**: every statistic, steps ``0..FIRST_LAST``; a NaN in one input at
   ``NAN_FIRST`` (its gradients are NaN; the trainer zeroes what went non-finite before
   the update, so training goes on finite); a gradient spike at ``SPIKE_FIRST`` (the loss
   times 100 for one step, the gradients divided by 100 again before the update: the
   local gradients spike, the update does not);
2. a **re-run with other ops** (``max,norm,nans``: the writer puts it beside the first run,
   in ``.run2`` files), the loss scaled by ten and the learning rate divided by ten (the
   same parameters, gradients ten times larger), steps ``0..RERUN_LAST``, a gradient spike
   at ``SPIKE_RERUN``, a NaN at ``NAN_RERUN``; rank 1 alone moves ``fc1.weight`` at ``DESYNC_RERUN``; it saves a
   checkpoint before step ``resume``;
3. the **resumed run**: the re-run's checkpoint, the same ops, from step ``resume`` on
   (``start(first_step=...)``) to ``LAST``, a NaN at ``NAN_RESUMED``; rank 1 alone moves
   ``fc1.weight`` at ``DESYNC_RESUMED``.

Two layouts: ``steps`` (one step a file, the resumed run starts past the first run's
steps, so its files are plain ones beside the re-run's ``.run2`` files of the same
columns: only their modification times say which came last) and ``window`` (one file for
all steps, the resumed run appended to the ``.run2`` file).

What ``summary``, ``anomalies`` (both engines), the rank check, ``merge`` (both
implementations), ``diff`` and ``plot``'s series report is checked against the files read
with the ``csv`` module, each line credited to the run that wrote it (the files' line
counts after each run): each step's latest rows are those of the last run that wrote the
step, the others are earlier runs'. Spikes are checked against each run's rows analysed
alone.
"""

import copy
import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest
import torch

from support import TinyMLP, make_batches
from support.extras import POLARS_ENGINE, require

from analysis_helpers import cli
from msprobe.core.monitor_v2.analysis.plot import PlotCollector, PlotSettings
from msprobe.core.monitor_v2.analysis.reader import Problems
from msprobe.core.monitor_v2.analysis.reference import ReferenceEngine
from msprobe.core.monitor_v2.analysis.report import RankCheckSettings, SpikeSettings
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

require("polars", POLARS_ENGINE)

LAST, FIRST_LAST, RERUN_LAST = 19, 11, 15
NAN_FIRST, NAN_RERUN, NAN_RESUMED = 5, 14, 17
SPIKE_FIRST, SPIKE_RERUN = 11, 10
DESYNC_RERUN, DESYNC_RESUMED = 15, 18
RERUN_OPS = ["max", "norm", "nans"]
STATS = ("min", "max", "mean", "norm", "nans")
MONITORS = ("weight_grad", "param")
RANKS = (0, 1)
# layout -> (step_count_per_record, the step the resumed run starts at)
LAYOUTS = {"steps": (1, 13), "window": (LAST + 1, 8)}


# ------------------------------------------------------------------ the runs
def train(out: Path, per_record: int, ops: Optional[List[str]], scale: float, lr: float, first: int, last: int,
          nan_step: int, desync: Optional[int], ckpt: Optional[Dict[str, Any]] = None,
          save_at: Optional[int] = None, spike: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """One run into ``out`` (the rank from ``RANK``); returns the checkpoint saved before
    step ``save_at``."""
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
    monitor = {"enabled": True} if ops is None else {"enabled": True, "ops": ops}
    mon = TrainerMonitorV2({"output_dir": str(out), "step_count_per_record": per_record,
                            "monitors": {m: dict(monitor) for m in MONITORS}})
    mon.start(model=model, optimizer=opt, first_step=first)
    saved = None
    batches = make_batches(LAST + 1)
    for step in range(first, last + 1):
        if step == save_at:
            saved = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
        if step == desync:
            with torch.no_grad():
                model.fc1.weight[0, 0] += 1e-3
        x, y = batches[step]
        if step == nan_step:
            x = x.clone()
            x[0, 0] = float("nan")
        spiked = 100.0 if step == spike else 1.0
        (spiked * scale * torch.nn.functional.mse_loss(model(x), y)).backward()
        for p in model.parameters():  # the trainer skips what went non-finite, as a loss scaler does
            p.grad.nan_to_num_(0.0, 0.0, 0.0)
            p.grad /= spiked
        opt.step()
        opt.zero_grad()
    mon.stop()
    return saved


@dataclass
class Written:
    """What each run wrote, read with the ``csv`` module."""

    out: Path
    layout: str  # a key of LAYOUTS
    resume: int  # the step the resumed run started at
    rows: List[Dict[str, Any]] = field(default_factory=list)  # each with the run that wrote it
    latest_run: Dict[Tuple[int, str, int], int] = field(default_factory=dict)  # (rank, monitor, step) -> run

    def latest(self, row: Dict[str, Any]) -> bool:
        return row["run"] == self.latest_run[(row["rank"], row["monitor"], row["step"])]

    def of(self, latest: bool, **match: Any) -> List[Dict[str, Any]]:
        return [r for r in self.rows if self.latest(r) == latest and all(r[k] == v for k, v in match.items())]


def line_counts(rank_dir: Path) -> Dict[Path, int]:
    return {p: len(p.read_text().splitlines()) for p in rank_dir.glob("*.csv")}


def read_written(w: Written, runs: List[Dict[Path, int]]) -> Written:
    """Every row, credited to the first run after which its line was in the file
    (``runs``: each file's line count after the first, second and third run)."""
    for path in runs[-1]:
        with open(path, newline="") as fh:
            for i, rec in enumerate(csv.DictReader(fh)):
                line = i + 2
                run = next(k + 1 for k, counts in enumerate(runs) if counts.get(path, 0) >= line)
                vals = {op: float(rec[op]) for op in STATS if op in rec}
                w.rows.append({"rank": int(path.parent.name[5:]), "monitor": path.name.split("_step")[0],
                               "file": path, "line": line, "run": run, "step": int(rec["step"]),
                               "module_name": rec["module_name"], "scope": rec["scope"],
                               "micro_step": rec.get("micro_step"), "vals": vals, "header": list(rec),
                               "bad": vals["nans"] > 0 or not all(math.isfinite(v) for v in vals.values())})
    for r in w.rows:
        key = (r["rank"], r["monitor"], r["step"])
        w.latest_run[key] = max(w.latest_run.get(key, 0), r["run"])
    return w


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def written(request, tmp_path_factory) -> Written:
    per_record, resume = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(f"runs_{request.param}") / "out"
    per_run: List[Dict[Path, int]] = [{}, {}, {}]  # each file's line count after each run of its rank
    with pytest.MonkeyPatch.context() as mp:
        for rank in RANKS:
            mp.setenv("RANK", str(rank))
            rank_dir = out / f"rank_{rank}"
            train(out, per_record, None, 1.0, 0.05, 0, FIRST_LAST, NAN_FIRST, None, spike=SPIKE_FIRST)
            per_run[0].update(line_counts(rank_dir))
            ckpt = train(out, per_record, RERUN_OPS, 10.0, 0.005, 0, RERUN_LAST, NAN_RERUN,
                         DESYNC_RERUN if rank else None, save_at=resume, spike=SPIKE_RERUN)
            per_run[1].update(line_counts(rank_dir))
            train(out, per_record, RERUN_OPS, 10.0, 0.005, resume, LAST, NAN_RESUMED,
                  DESYNC_RESUMED if rank else None, ckpt=ckpt)
            per_run[2].update(line_counts(rank_dir))
    return read_written(Written(out, request.param, resume), per_run)


def both(*argv: Any):
    """The result of both engines (which must print the same)."""
    ref = cli(*argv, "--engine", "reference")
    new = cli(*argv)
    assert (new.code, new.out, new.err) == (ref.code, ref.out, ref.err)
    return new


# ------------------------------------------------------------------ the layouts as written
def test_the_runs_wrote_beside_and_after_each_other(written):
    names = {p.name for p in written.out.glob("rank_0/weight_grad_*.csv")}
    if written.layout == "steps":
        # the re-run beside the first run; the resumed run's plain files past the first run's steps
        assert names == {f"weight_grad_step{s}-{s}.csv" for s in list(range(FIRST_LAST + 1)) +
                         list(range(written.resume, LAST + 1))} | \
            {f"weight_grad_step{s}-{s}.run2.csv" for s in range(RERUN_LAST + 1)}
        # files of the same columns in one window: the resumed run's (plain) file was written last
        a = written.out / "rank_0" / f"weight_grad_step{NAN_RERUN}-{NAN_RERUN}.csv"
        assert a.stat().st_mtime_ns > a.with_name(a.name.replace(".csv", ".run2.csv")).stat().st_mtime_ns
    else:
        assert names == {f"weight_grad_step0-{LAST}.csv", f"weight_grad_step0-{LAST}.run2.csv"}
    assert {r["run"] for r in written.rows} == {1, 2, 3}
    assert {tuple(r["header"]) for r in written.rows if r["run"] > 1 and r["monitor"] == "param"} == \
        {("vpp_stage", "step", "module_name", "scope", "max", "norm", "nans")}


# ------------------------------------------------------------------ summary and anomalies
def test_summary_and_anomalies_count_each_steps_latest_rows_and_the_earlier_runs_apart(written):
    data = both("anomalies", written.out, "--json", "--limit", "0").json()
    for m in MONITORS:
        assert data["monitors"][m]["rows"] == len(written.of(True, monitor=m))
        assert data["monitors"][m]["earlier_rows"] == len(written.of(False, monitor=m))
    for rank in RANKS:
        assert data["per_rank"][str(rank)]["rows"] == len(written.of(True, rank=rank))
    runs = data["runs"]
    assert runs["earlier_rows"] == len(written.of(False))
    assert runs["run_files"] == len(list(written.out.glob("rank_*/*.run*.csv")))
    assert runs["steps_repeated"] == sum(1 for key in written.latest_run
                                         if len({r["run"] for r in written.rows if (r["rank"], r["monitor"], r["step"])
                                                 == key}) > 1)
    # one item a window whose rows lie in several files; where the names cannot say which run came
    # last (the same columns in a plain and a .run2 file), the modification times did
    orders = {(i["rank"], i["monitor"], Path(i["files"][0]).name): i["order"] for i in runs["items"]}
    if written.layout == "steps":
        assert len(orders) == len(RANKS) * len(MONITORS) * (FIRST_LAST + 1 + RERUN_LAST + 1 - written.resume)
        assert {k[2]: v for k, v in orders.items() if k[:2] == (0, "param")} == {
            **{f"param_step{s}-{s}.csv": "names" for s in range(FIRST_LAST + 1)},
            **{f"param_step{s}-{s}.csv": "modification times" for s in range(written.resume, RERUN_LAST + 1)}}
    else:
        assert set(orders.values()) == {"names"} and len(orders) == len(RANKS) * len(MONITORS)

    nf = data["nonfinite"]
    latest_bad = written.of(True)
    latest_bad = [r for r in latest_bad if r["bad"]]
    earlier_bad = [r for r in written.of(False) if r["bad"]]
    assert nf["count"] == len(latest_bad) and nf["earlier_runs"]["count"] == len(earlier_bad)
    assert {r["run"] for r in latest_bad} == {3} and min(r["step"] for r in latest_bad) == NAN_RESUMED
    assert {r["run"] for r in earlier_bad} == {1, 2}
    for got, rows, step in ((nf["first"], latest_bad, NAN_RESUMED), (nf["earlier_runs"]["first"], earlier_bad,
                                                                       NAN_FIRST)):
        # the first in execution order: rank 0's first local gradient of that step (its first line)
        want = min((r for r in rows if r["rank"] == 0 and r["step"] == step and r["scope"] == "unreduced"),
                   key=lambda r: r["line"])
        assert (got["rank"], got["step"], got["monitor"], got["scope"], got["tensor"], Path(got["file"]), got["line"]) \
            == (0, step, "weight_grad", "unreduced", want["module_name"], want["file"], want["line"])
        assert got["values"]["nans"] == want["vals"]["nans"] > 0

    text = both("summary", written.out).out
    lines = text.splitlines()
    assert next(x for x in lines if x.startswith("  first NaN/Inf:")).startswith(
        f"  first NaN/Inf:     rank 0, step {NAN_RESUMED}, ")
    assert f": {nf['first']['tensor']} (weight_grad unreduced) is nan [" in text
    assert next(x for x in lines if x.startswith("  earlier runs:")).startswith(
        f"  earlier runs:      rank 0, step {NAN_FIRST}, ")
    # the resumed run appended to the .run2 file of the one-window layout (not in the other)
    appended = len(RANKS) * len(MONITORS) if written.layout == "window" else 0
    assert len(data["appended"]["items"]) == appended
    held = ([f"{appended} file(s) with runs appended to them (a re-run into the same files)"] if appended else []) + \
        [f"{runs['run_files']} .run<k> file(s) written beside earlier files (a re-run with other ops, or a second job "
         "at the same time)"]
    assert (f"  several runs:      {' and '.join(held)}; {runs['steps_repeated']} step(s) written more than once, "
            f"{runs['earlier_rows']} row(s) of earlier runs set aside (each step's latest rows are the report's); "
            "first: ") in text
    assert f"{len(written.of(False))} row(s) of earlier runs, which a later run wrote again, counted apart" in text
    anomalies = both("anomalies", written.out).out
    assert "WINDOWS WRITTEN BY SEVERAL RUNS INTO SEVERAL FILES" in anomalies


# ------------------------------------------------------------------ spikes
def split_by_run(written: Written, dest: Path) -> Dict[int, Path]:
    """Each run's rows alone, in an output_dir of their own (the files' plain names)."""
    out = {}
    for run in (1, 2, 3):
        root = dest / f"run{run}"
        per_file: Dict[Path, List[Dict[str, Any]]] = {}
        for r in written.rows:
            if r["run"] == run:
                name = r["file"].name.replace(".run2", "")
                per_file.setdefault(root / f"rank_{r['rank']}" / name, []).append(r)
        for path, rows in per_file.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", newline="") as fh:
                wr = csv.writer(fh, lineterminator="\n")
                wr.writerow(rows[0]["header"])
                src = list(csv.reader(open(rows[0]["file"], newline="")))
                for r in rows:
                    wr.writerow(src[r["line"] - 1])
        out[run] = root
    return out


def spike_key(item: Dict[str, Any]) -> Tuple[Any, ...]:
    return (item["rank"], item["step"], item["monitor"], item["scope"], item["tensor"], item["micro_step"],
            tuple(item["stats"]), item["value"], item["median"])


def test_each_run_has_its_own_spike_history(written, tmp_path):
    data = both("anomalies", written.out, "--json", "--limit", "0").json()["spikes"]
    want: Dict[bool, Set[Tuple[Any, ...]]] = {True: set(), False: set()}
    for run, root in split_by_run(written, tmp_path).items():
        for item in cli("anomalies", root, "--json", "--limit", "0").json()["spikes"]["items"]:
            latest = written.latest_run[(item["rank"], item["monitor"], item["step"])] == run
            want[latest].add(spike_key(item))
    # the re-run's larger gradients are never compared with the end of the first run: no spike at the seam
    assert not [i for i in data["items"] if i["monitor"] == "weight_grad" and i["step"] < 3]
    assert {spike_key(i) for i in data["items"]} == want[True] and data["count"] == len(want[True])
    assert {spike_key(i) for i in data["earlier_runs"]["items"]} == want[False]
    assert data["earlier_runs"]["count"] == len(want[False])
    assert not [i for i in data["earlier_runs"]["items"] if i["monitor"] == "weight_grad" and i["step"] < 3]
    # the first run's spike is an earlier run's (the re-run wrote its step again); the re-run's is the
    # latest where the resumed run did not write its step again
    assert {(i["step"], i["scope"]) for i in data["earlier_runs"]["items"]} >= {(SPIKE_FIRST, "unreduced")}
    rerun_latest = SPIKE_RERUN < written.resume
    assert {(i["step"], i["scope"]) for i in data["items"]} == ({(SPIKE_RERUN, "unreduced")} if rerun_latest else set())


# ------------------------------------------------------------------ the rank check
def close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return a == b or (a != a and b != b) or abs(a - b) <= rtol * max(abs(a), abs(b))


def test_the_rank_check_compares_each_steps_latest_rows(written):
    checked = [r for r in written.of(True) if r["monitor"] == "param" or r["scope"] == "reduced"]
    by_rank = {rank: {(r["monitor"], r["step"], r["module_name"], r["scope"]): r["vals"] for r in checked
                      if r["rank"] == rank} for rank in RANKS}
    assert by_rank[0].keys() == by_rank[1].keys()
    differing = [k for k, v in by_rank[1].items() if not all(close(v[op], by_rank[0][k][op]) for op in v)]
    assert differing and min(k[1] for k in differing) == DESYNC_RESUMED
    mm = both("anomalies", written.out, "--json", "--limit", "0").json()["rank_check"]
    assert mm["ranks_differing"] == 1
    first = mm["items"][0]
    assert (first["rank"], first["step"], first["rows_differing"]) == (1, DESYNC_RESUMED, len(differing))


# ------------------------------------------------------------------ merge
def row_key(step: str, name: str, scope: str, micro: Optional[str]) -> Tuple[int, str, str, Optional[str]]:
    """A row of a step (an empty micro_step cell, as a merged file writes outside gradients, is None)."""
    return int(step), name, scope, micro or None


@pytest.mark.parametrize("engine", ["python", "polars"])
def test_merge_merges_each_steps_latest_rows(written, tmp_path, engine):
    dest = tmp_path / "merged"
    res = cli("merge", written.out / "rank_0", dest, "--json", "--merge-engine", engine)
    assert res.code == 0, res.out + res.err
    assert "appears twice" not in res.err
    for m in MONITORS:
        with open(dest / f"{m}.csv", newline="") as fh:
            merged = list(csv.DictReader(fh))
        want = written.of(True, rank=0, monitor=m)
        got = {row_key(r["step"], r["module_name"], r["scope"], r.get("micro_step")): r for r in merged}
        assert len(got) == len(merged) == len(want)
        for r in want:
            row = got[row_key(r["step"], r["module_name"], r["scope"], r["micro_step"])]
            for op in ("max", "norm", "nans"):  # the statistics every file has
                assert close(float(row[op]), r["vals"][op], 1e-8), (r, row)
    rep = res.json()
    assert rep["problems"]["count"] == 0
    earlier = written.of(False, rank=0)
    assert rep["earlier_rows"] == len(earlier)
    assert rep["rows_read"] == len([r for r in written.rows if r["rank"] == 0])
    note = next(n for n in rep["notes"] if "of earlier runs set aside" in n)
    assert note.startswith(f"{len(earlier)} row(s) of earlier runs set aside (weight_grad "
                           f"{len(written.of(False, rank=0, monitor='weight_grad'))} on rank(s) 0, ")


# ------------------------------------------------------------------ diff
def latest_only(written: Written, dest: Path) -> Path:
    """Each step's latest rows alone, in an output_dir of their own (the files' plain names)."""
    per_file: Dict[Path, List[Dict[str, Any]]] = {}
    for r in written.of(True):
        per_file.setdefault(dest / f"rank_{r['rank']}" / r["file"].name.replace(".run2", ""), []).append(r)
    for path, rows in per_file.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        assert len({tuple(r["header"]) for r in rows}) == 1  # a window's latest rows lie in one file here
        lines = {r["file"]: open(r["file"]).read().splitlines(keepends=True) for r in rows}
        path.write_text(",".join(rows[0]["header"]) + "\n" + "".join(lines[r["file"]][r["line"] - 1] for r in rows))
    return dest


def test_diff_compares_each_steps_latest_rows(written, tmp_path):
    res = cli("diff", written.out, latest_only(written, tmp_path / "latest"), "--json")
    data = res.json()
    assert (data["differing_rows"], data["rows_only_in_a"], data["rows_only_in_b"]) == (0, 0, 0)
    assert data["compared_rows"] == len(written.of(True)) and res.code == 0


# ------------------------------------------------------------------ plot
@pytest.mark.parametrize("engine", ["reference", "columnar"])
def test_plot_draws_each_steps_latest_rows(written, engine):
    if engine == "reference":
        eng = ReferenceEngine()
    else:
        from msprobe.core.monitor_v2.analysis.engine import ColumnarEngine

        eng = ColumnarEngine()
    collector = PlotCollector(PlotSettings(stat="norm", by="tensor", rank=0), 0)
    layout = eng.open_layout(str(written.out))
    eng.analyse(layout, Problems(), SpikeSettings(), RankCheckSettings(enabled=False), visitors=[collector])
    drawn = [(s.steps, s.values) for fig in collector.figures.values() for s in fig.values()]
    for steps, _values in drawn:
        assert list(steps) == sorted(set(steps))  # one point a step: never an earlier run's beside it
    def in_order(values: List[float]) -> List[Tuple[bool, float]]:  # NaN last (sorted() cannot order it)
        return sorted((v != v, 0.0 if v != v else v) for v in values)

    points = in_order([v for _steps, values in drawn for v in values])
    want = in_order([r["vals"]["norm"] for r in written.of(True, rank=0)])
    assert len(points) == len(want) and all(a[0] == b[0] and close(a[1], b[1], 1e-6) for a, b in zip(points, want))

