"""``msprobe-monitor plot`` and ``export`` on a shared machine (issue 20): a link planted
where the CLI writes (a report file, a PNG, a Parquet part) is replaced, never written
through; a linked report or partition directory is refused with an error naming it;
modes are 0750/0640 whatever the umask."""

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from analysis_helpers import cli

from support import TinyMLP, loss_fn, make_batches
from support.extras import MATPLOTLIB_PLOT, POLARS_ENGINE, needs_polars, require
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

OTHER_UID = 65534


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A small single-rank run: param and weight_grad over 6 steps."""
    out = tmp_path_factory.mktemp("safe_output") / "run"
    old_rank = os.environ.pop("RANK", None)
    try:
        torch.manual_seed(0)
        model = TinyMLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"param": {"enabled": True},
                                                                    "weight_grad": {"enabled": True}}})
        mon.start(model=model, optimizer=opt)
        for x, y in make_batches(6):
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        mon.stop()
    finally:
        if old_rank is not None:
            os.environ["RANK"] = old_rank
    return out


def _secret(path: Path):
    path.write_bytes(b"root-only content\n")
    os.chmod(path, 0o600)
    return path.read_bytes(), os.stat(path).st_mtime_ns


def _plant(link: Path, target: Path) -> None:
    os.symlink(target, link)
    if os.geteuid() == 0:
        os.lchown(link, OTHER_UID, OTHER_UID)  # planted by another user


def test_plot_replaces_planted_links_and_never_writes_through_them(run, tmp_path):
    require("matplotlib", MATPLOTLIB_PLOT)
    names = cli("plot", run, "--out", tmp_path / "probe", "--json").json()
    png = os.path.basename(names["images"][0])
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    report = copy / "analysis_report"
    report.mkdir(mode=0o750)
    html_secret, png_secret = tmp_path / "secret.html", tmp_path / "secret.png"
    want = {p: _secret(p) for p in (html_secret, png_secret)}
    _plant(report / "report.html", html_secret)
    _plant(report / png, png_secret)
    old = os.umask(0)
    try:
        res = cli("plot", copy, "--embed")
    finally:
        os.umask(old)
    assert res.code == 0, res.err
    for p, (content, mtime) in want.items():
        assert p.read_bytes() == content and os.stat(p).st_mtime_ns == mtime
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    for name in ("report.html", png):
        info = os.lstat(report / name)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o640, name
    assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<html" in (report / "report.html").read_text()
    assert not [n for n in os.listdir(report) if n.endswith(".tmp")]


def test_plot_refuses_a_linked_report_directory(run, tmp_path):
    require("matplotlib", MATPLOTLIB_PLOT)
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    target = tmp_path / "somewhere_else"
    target.mkdir()
    _plant(copy / "analysis_report", target)
    res = cli("plot", copy)
    assert res.code == 2, res.err
    assert str(copy / "analysis_report") in res.err and "symbolic link" in res.err, res.err
    assert os.listdir(target) == []


def test_plot_creates_its_directory_0750_whatever_the_umask(run, tmp_path):
    require("matplotlib", MATPLOTLIB_PLOT)
    out = tmp_path / "reports" / "r1"
    old = os.umask(0)
    try:
        res = cli("plot", run, "--out", out)
    finally:
        os.umask(old)
    assert res.code == 0, res.err
    for d in (tmp_path / "reports", out):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o750, d
    for f in out.iterdir():
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o640, f


def test_export_replaces_a_planted_part_and_refuses_a_linked_partition(run, tmp_path):
    require("polars", POLARS_ENGINE)
    dest = tmp_path / "dest"
    part_dir = dest / "monitor=param" / "rank=0"
    part_dir.mkdir(parents=True)
    secret = tmp_path / "secret.parquet"
    content, mtime = _secret(secret)
    _plant(part_dir / "part-00000.parquet", secret)
    res = cli("export", run, dest)
    assert res.code == 0, res.err
    assert secret.read_bytes() == content and os.stat(secret).st_mtime_ns == mtime
    part = part_dir / "part-00000.parquet"
    assert stat.S_ISREG(os.lstat(part).st_mode) and part.read_bytes()[:4] == b"PAR1"
    summary = cli("summary", dest, "--json")
    original = cli("summary", run, "--json")
    assert summary.code == original.code == 0, summary.err
    assert summary.json()["monitors"]["param"]["rows"] == original.json()["monitors"]["param"]["rows"] == 48

    dest2 = tmp_path / "dest2"
    dest2.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _plant(dest2 / "monitor=param", elsewhere)
    res = cli("export", run, dest2)
    assert res.code == 2 and str(dest2 / "monitor=param") in res.err and "symbolic link" in res.err, res.err
    assert os.listdir(elsewhere) == []


SRC = str(Path(__file__).resolve().parents[2] / "src")


def _cli_subprocess(*argv, timeout=120):
    """The CLI in its own process: a read that blocked would fail this test, not hang the suite."""
    import subprocess
    import sys

    try:
        return subprocess.run([sys.executable, "-m", "msprobe.core.monitor_v2.analysis.cli", *map(str, argv)],
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": SRC})
    except subprocess.TimeoutExpired:
        pytest.fail(f"msprobe-monitor {argv[0]} blocked for {timeout} s")


@needs_polars  # summary and anomalies on the default engine, then export
def test_readers_skip_a_fifo_and_another_users_link_without_blocking_or_showing_it(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    os.mkfifo(copy / "rank_0" / "param_step9-9.csv")
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$hash:19000:0:99999:7:::\n")
    secret.chmod(0o600)
    link = copy / "rank_0" / "param_step8-8.csv"
    _plant(link, secret)
    for command in ("summary", "anomalies"):
        res = _cli_subprocess(command, copy)
        assert res.returncode in (0, 1), res.stderr
        assert "param_step9-9.csv" in res.stderr and "FIFO" in res.stderr, res.stderr
        assert "root:" not in res.stdout + res.stderr and "$6$" not in res.stdout + res.stderr
        if os.geteuid() == 0:  # the link belongs to another user: not read
            assert "param_step8-8.csv" in res.stderr and "owned by uid 65534" in res.stderr, res.stderr
    # the columnar engine takes the same way (export reads through it)
    res = _cli_subprocess("export", copy, tmp_path / "dest")
    assert res.returncode == 0 and "FIFO" in res.stderr, res.stderr
    assert "root:" not in res.stdout + res.stderr
