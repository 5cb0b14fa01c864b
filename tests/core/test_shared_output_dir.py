"""Runs that share one output_dir (issue 47): a re-run with other ``ops``, a resume into a
file a killed run left cut mid-line, and two live jobs writing to one rank directory.

Real trainings of the tiny MLP write the files; they are read back with the csv module,
with the CLI's reader (strict: any malformed line fails) and with ``msprobe-monitor
summary``. The two live jobs are two real processes (``shared_dir_worker.py``).
"""

import csv
import io
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from msprobe.core.monitor_v2.analysis.cli import main as cli_main
from msprobe.core.monitor_v2.analysis.reader import Problems, iter_rows, scan
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

from support import TinyMLP, loss_fn, make_batches

LOGGER = "msprobe.monitor_v2"
WORKER = Path(__file__).with_name("shared_dir_worker.py")
HEADER_START = "vpp_stage,step,module_name,scope"
ROWS = {"weight_grad": 8, "param": 8}  # TinyMLP: 4 parameters x 2 scopes


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def _infos(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


def _train(out, ops, steps, first_step=0, per_file=4, monitored=True):
    """``steps`` real Adam steps of the tiny MLP (``first_step``: a resumed run's numbering);
    the model's parameters after them."""
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = None
    if monitored:
        mon = TrainerMonitorV2({"output_dir": str(out), "step_count_per_record": per_file, "monitors": {
            "weight_grad": {"enabled": True}, "param": {"enabled": True, "ops": ops}}})
        mon.start(model=model, optimizer=opt, first_step=first_step)
    for x, y in make_batches(steps):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.stop()
    return [p.detach().clone() for p in model.parameters()]


def _csv_rows(path):
    """Every line of a file through the csv module: the header once, then rows of its width."""
    with open(path, newline="", encoding="utf-8") as f:
        lines = list(csv.reader(f))
    header, rows = lines[0], lines[1:]
    assert ",".join(header).startswith(HEADER_START), path
    assert all(len(r) == len(header) for r in rows), (path, [r for r in rows if len(r) != len(header)][:3])
    assert not any(",".join(r).startswith(HEADER_START) for r in rows), path  # no second header
    return header, rows


def _read_strict(out):
    """(file name -> [(step, name, scope, micro)]) of every CSV file, read by the CLI's reader
    in strict mode: one malformed line anywhere raises."""
    layout = scan(str(out))
    problems = Problems(strict=True)
    return {os.path.basename(f.path): [(r.step, r.name, r.scope, r.micro) for r in iter_rows(f, problems)]
            for f in layout.all_files()}


def _summary(out):
    """``msprobe-monitor summary OUT``, in-process: (exit code, stdout, stderr)."""
    so, se = io.StringIO(), io.StringIO()
    code = cli_main(["summary", str(out)], out=so, err=se)
    return code, so.getvalue(), se.getvalue()


# ------------------------------------------------------------------- re-runs
def test_reruns_with_other_ops_never_append_rows_of_another_width(tmp_path, caplog):
    """Four runs into one output_dir: A's ops, B's (other columns), A's again, C's. Each file
    holds rows of one width; each run that meets another header says it once."""
    out = tmp_path / "out"
    rank = out / "rank_0"
    a_ops, b_ops, c_ops = ["min", "max", "mean", "norm", "nans"], ["norm", "zeros"], ["max"]
    caplog.set_level(logging.INFO, logger=LOGGER)
    _train(out, a_ops, 6)
    assert _warnings(caplog) == []

    caplog.clear()
    monitored = _train(out, b_ops, 6)
    plain = _train(out, b_ops, 6, monitored=False)
    assert all(torch.equal(p, q) for p, q in zip(monitored, plain))  # training unchanged, bit for bit
    warnings = _warnings(caplog)
    other = [m for m in warnings if "other columns" in m]
    assert len(other) == 1, warnings
    assert str(rank) in other[0] and "param_step0-3.csv" in other[0], other
    assert "column(s) min,max,mean,nans only there and column(s) zeros only in this run" in other[0], other
    assert "<monitor>_step<a>-<b>.run2.csv" in other[0] and "param_step0-3.run2.csv" in other[0], other
    # the weight_grad files have this run's header: appended to, said once as before; nothing per file or step
    assert len(warnings) == 2 and any("appending to them" in m for m in warnings), warnings
    (stop_line,) = [m for m in _infos(caplog) if "stopped after" in m]
    assert "wrote 96 rows of 6 step(s) to" in stop_line and "lost" not in stop_line  # 6 x (8 + 8), all readable

    caplog.clear()
    _train(out, a_ops, 6)  # A's columns again: the plain param files are A's, appended to
    assert not [m for m in _warnings(caplog) if "other columns" in m]
    caplog.clear()
    _train(out, c_ops, 2)  # a third column set: neither the plain nor the .run2 files take it
    other = [m for m in _warnings(caplog) if "other columns" in m]
    assert len(other) == 1 and "param_step0-3.run3.csv" in other[0], other

    names = sorted(p.name for p in rank.glob("*.csv"))
    assert names == ["param_step0-3.csv", "param_step0-3.run2.csv", "param_step0-3.run3.csv",
                     "param_step4-7.csv", "param_step4-7.run2.csv",
                     "weight_grad_step0-3.csv", "weight_grad_step4-7.csv"]
    widths = {}
    for name in names:
        header, rows = _csv_rows(rank / name)
        widths[name] = header[4:]
        assert rows, name
    assert widths["param_step0-3.csv"] == a_ops and widths["param_step0-3.run2.csv"] == b_ops
    assert widths["param_step0-3.run3.csv"] == c_ops
    # every row read by the CLI's reader, strictly; each run's steps where they belong
    read = _read_strict(out)
    steps = {name: sorted({r[0] for r in rows}) for name, rows in read.items()}
    assert steps["param_step0-3.csv"] == [0, 1, 2, 3] and len(read["param_step0-3.csv"]) == 2 * 4 * 8  # runs 1 and 3
    assert len(read["param_step0-3.run2.csv"]) == 4 * 8 and len(read["param_step0-3.run3.csv"]) == 2 * 8
    assert len(read["weight_grad_step0-3.csv"]) == (3 * 4 + 2) * 8  # all four runs: one header
    total = sum(len(r) for r in read.values())
    assert total == (6 + 6 + 6 + 2) * 16
    code, text, err = _summary(out)
    assert code == 0 and "malformed" not in text + err, text + err
    # every row accounted for: each step's latest rows (steps 0-1 the fourth run's, 2-5 the third's: 6 steps
    # of 16 rows), the earlier runs' apart (msprobe-monitor counts a step that several runs wrote once)
    latest = 6 * 16
    assert f"{latest} rows" in text and f"{total - latest} row(s) of earlier runs" in text, text


def test_rerun_into_a_file_of_unknown_content_names_no_content(tmp_path, caplog):
    """A file under our name that holds something else is neither appended to nor quoted."""
    out = tmp_path / "out"
    (out / "rank_0").mkdir(parents=True)
    out.chmod(0o750)
    (out / "rank_0").chmod(0o750)
    (out / "rank_0" / "param_step0-3.csv").write_text("token=s3cr3t,vpp_stage\n")
    _train(out, ["norm"], 2)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "does not start with a header this version writes" in warnings[0], warnings
    assert "s3cr3t" not in warnings[0] and "token" not in warnings[0]
    assert (out / "rank_0" / "param_step0-3.csv").read_text() == "token=s3cr3t,vpp_stage\n"
    assert _csv_rows(out / "rank_0" / "param_step0-3.run2.csv")[0][4:] == ["norm"]


# ------------------------------------------------------------ cut last line
@pytest.mark.parametrize("cut", ["row", "header"])
def test_resume_after_a_row_cut_mid_line_starts_on_a_new_line(tmp_path, caplog, cut):
    """A SIGKILL cut the last write of the param file in the middle of a line (as at a page
    boundary); the resumed run's rows start on a line of their own, the cut row is lost,
    counted and named once."""
    out = tmp_path / "out"
    path = out / "rank_0" / "param_step0-9.csv"
    ops = ["min", "max", "mean", "norm", "nans"]
    _train(out, ops, 3, per_file=10)
    text = path.read_text()
    if cut == "row":
        last = text[:-1].rsplit("\n", 1)[1]
        path.write_text(text[:len(text) - len(last) // 2 - 1])  # half of the last row, no newline
    else:
        path.write_text(text[:17])  # a run killed while it created the file: part of its header
    caplog.clear()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    _train(out, ops, 3, first_step=3, per_file=10)  # resumed at step 3, into the same window
    warnings = _warnings(caplog)
    said = [m for m in warnings if "ended in the middle of a" in m]
    assert len(said) == 1 and str(path) in said[0] and f"middle of a {cut}" in said[0], warnings
    header, rows = _csv_rows(path)
    assert header[4:] == ops
    read = _read_strict(out)["param_step0-9.csv"]
    steps = [r[0] for r in read]
    if cut == "row":
        assert steps == [0] * 8 + [1] * 8 + [2] * 7 + [3] * 8 + [4] * 8 + [5] * 8  # the cut row of step 2 is gone
        summary = [m for m in warnings if "incomplete row(s)" in m]
        assert len(summary) == 1 and "1 incomplete row(s) that earlier runs left cut mid-line" in summary[0]
    else:
        assert steps == [3] * 8 + [4] * 8 + [5] * 8
    assert sum(1 for line in path.read_text().splitlines() if line.startswith(HEADER_START)) == 1
    code, text, err = _summary(out)
    assert code == 0 and "malformed" not in text + err, text + err


def _chattr(flag, path):
    return subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="an append-only file (chattr +a) needs root (CI runs as root)")
def test_a_cut_row_that_cannot_be_cut_off_is_never_appended_to(tmp_path, caplog):
    """An append-only file (chattr +a) cannot be truncated, and a newline after its cut row
    would make the cut last value read as a whole one: the resumed run writes beside it."""
    out = tmp_path / "out"
    rank = out / "rank_0"
    path = rank / "param_step0-9.csv"
    _train(out, ["norm"], 2, per_file=10)
    cut = path.read_text()[:-5]  # the last row without its last 4 characters and its newline
    path.write_text(cut)
    probe = _chattr("+a", path)
    if probe.returncode != 0:
        pytest.skip(f"chattr +a is not supported on {tmp_path}: {probe.stderr.strip()}")
    try:
        caplog.set_level(logging.WARNING, logger=LOGGER)
        _train(out, ["norm"], 2, first_step=2, per_file=10)
    finally:
        _chattr("-a", path)
    said = [m for m in _warnings(caplog) if "cannot append to" in m]
    assert len(said) == 1 and "param_step0-9.csv: its last row was cut mid-line" in said[0], said
    assert "cannot be cut off (Operation not permitted (errno 1))" in said[0] and "param_step0-9.run2.csv" in said[0]
    assert path.read_text() == cut
    problems = Problems()
    layout = scan(str(out))
    steps = {os.path.basename(f.path): [r.step for r in iter_rows(f, problems)] for f in layout.files_of(0, "param")}
    assert steps == {"param_step0-9.csv": [0] * 8 + [1] * 7, "param_step0-9.run2.csv": [2] * 8 + [3] * 8}
    assert problems.count == 1 and "ends in the middle of this line" in problems.items[0].message  # the cut row


# ----------------------------------------------------------- two live jobs
def _spawn(out, mode, ready, go):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("RANK", None)
    return subprocess.Popen([sys.executable, str(WORKER), str(out), mode, str(ready), str(go)],
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_ready(proc, ready, seconds=180.0):
    deadline = time.monotonic() + seconds
    while not ready.exists():
        if proc.poll() is not None:
            pytest.fail(f"the worker ended before start() returned: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.02)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_live_jobs_in_one_output_dir_never_share_a_file(tmp_path, mode):
    out, go = tmp_path / "out", tmp_path / "go"
    first = _spawn(out, mode, tmp_path / "ready1", go)
    _wait_ready(first, tmp_path / "ready1")
    second = _spawn(out, mode, tmp_path / "ready2", go)
    _wait_ready(second, tmp_path / "ready2")
    go.touch()  # both train at once, into the same windows
    errs = []
    for proc in (first, second):
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0 and "DONE" in err, err[-3000:]
        errs.append(err)
    rank = out / "rank_0"
    said = [line for line in errs[1].splitlines() if "another job is writing to" in line]
    assert len(said) == 1, errs[1][-3000:]
    assert str(rank) in said[0] and f"process {first.pid} on host" in said[0] and ".run2.csv" in said[0], said
    lines = errs[1].splitlines()
    assert lines.index(said[0]) < lines.index(f"STARTED {second.pid}")  # said at start(), before training
    assert "another job" not in errs[0]
    # each job has files of its own, one header each, every step once
    names = sorted(p.name for p in rank.glob("*.csv"))
    assert names == ["param_step0-99.csv", "param_step0-99.run2.csv",
                     "weight_grad_step0-99.csv", "weight_grad_step0-99.run2.csv"], names
    read = _read_strict(out)
    for name in names:
        _csv_rows(rank / name)
        keys = read[name]
        monitor = name.split("_step")[0]
        assert len(keys) == len(set(keys)) == 12 * ROWS[monitor], name
    # the two jobs trained the same model on the same data: their files hold the same rows
    for monitor in ROWS:
        assert (rank / f"{monitor}_step0-99.csv").read_bytes() == (rank / f"{monitor}_step0-99.run2.csv").read_bytes()
    assert not list(rank.glob(".csv-writer*")), "the locks are removed at stop()"


def test_a_job_killed_while_holding_the_directory_leaves_it_free(tmp_path, caplog):
    """The kernel drops the lock of a job killed by SIGKILL: the next run takes the plain names."""
    out, ready = tmp_path / "out", tmp_path / "ready"
    holder = _spawn(out, "hold", ready, tmp_path / "go")
    try:
        _wait_ready(holder, ready)
        lock = out / "rank_0" / ".csv-writer.lock"
        assert re.fullmatch(rf"{holder.pid} \S+\n", lock.read_text())
        # while it lives, a run here is told and writes beside it
        caplog.set_level(logging.WARNING, logger=LOGGER)
        _train(out, ["norm"], 1)
        assert [m for m in _warnings(caplog) if f"process {holder.pid} on host" in m]
        assert sorted(p.name for p in (out / "rank_0").glob("*.csv")) == ["param_step0-3.run2.csv",
                                                                         "weight_grad_step0-3.run2.csv"]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    assert lock.exists()  # left by the killed job; its lock went with it
    caplog.clear()
    _train(out, ["norm"], 2, first_step=1)
    assert _warnings(caplog) == []
    assert sorted(p.name for p in (out / "rank_0").glob("*.csv")) == [
        "param_step0-3.csv", "param_step0-3.run2.csv", "weight_grad_step0-3.csv", "weight_grad_step0-3.run2.csv"]
    assert [r[0] for r in _read_strict(out)["param_step0-3.csv"]] == [1] * 8 + [2] * 8
    assert not lock.exists()


# ------------------------------------------------------------------ the names
def test_run_file_names_are_read_after_the_plain_one_of_their_window(tmp_path):
    from msprobe.core.monitor_v2.rows import FILE_RE, file_name, file_run

    assert file_name("param", 0, 3) == "param_step0-3.csv" and file_name("param", 0, 3, 12) == "param_step0-3.run12.csv"
    for name, run in (("param_step0-3.csv", 1), ("param_step0-3.run2.csv", 2), ("param_step0-3.run12.csv", 12)):
        assert file_run(FILE_RE.match(name)) == run
    for name in ("param_step0-3.run1.csv", "param_step0-3.run0.csv", "param_step0-3.run02.csv", "param_step0-3.runx.csv",
                 "param_step0-3.run2.csv.tmp"):
        assert FILE_RE.match(name) is None, name
    rank = tmp_path / "out" / "rank_0"
    rank.mkdir(parents=True)
    head = "vpp_stage,step,module_name,scope,norm\n"
    for name, step in (("param_step4-7.csv", 4), ("param_step0-3.run10.csv", 2), ("param_step0-3.run2.csv", 1),
                       ("param_step0-3.csv", 0)):
        (rank / name).write_text(f"{head}0,{step},w,param_origin,1\n")
    files = scan(str(tmp_path / "out")).files_of(0, "param")
    assert [(os.path.basename(f.path), f.run) for f in files] == [
        ("param_step0-3.csv", 1), ("param_step0-3.run2.csv", 2), ("param_step0-3.run10.csv", 10),
        ("param_step4-7.csv", 1)]
    assert [r.step for f in files for r in iter_rows(f, Problems(strict=True))] == [0, 1, 2, 4]
