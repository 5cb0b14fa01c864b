"""Shared machines (issue 20): the monitor runs as root under directories other users can
write. Nothing is written through a symbolic link, modes are 0750/0640 whatever the umask,
an ``output_dir`` another user owns or can write is refused before training, no content of
a foreign file reaches the log, a FIFO or a device is refused without blocking (CSV files
and config files), and text cells a spreadsheet would run as formulas are escaped and read
back unchanged.

"Another user" is uid 65534 (``os.chown``/``os.lchown``, which needs root; those tests say
so when skipped). Links, FIFOs and hard links are real. A test that could hang if the code
under test blocked runs in a subprocess with a timeout.
"""

import csv
import json
import logging
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from msprobe.core.monitor_v2 import safe_fs
from msprobe.core.monitor_v2.analysis.reader import CsvFile, FILE_RE, Problems, iter_rows
from msprobe.core.monitor_v2.analysis.validate import validate
from msprobe.core.monitor_v2.config import MAX_CONFIG_BYTES
from msprobe.core.monitor_v2.errors import ConfigError, OutputError, UnsafePathError
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

from support import TinyMLP, loss_fn, make_batches
from support.extras import needs_matplotlib, needs_polars

LOGGER = "msprobe.monitor_v2"
OTHER_UID = 65534
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MONITORS = {"weight_grad": {"enabled": True}, "param": {"enabled": True}}
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root (CI runs as root)")


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(safe_fs.DIR_MODE_ENV, raising=False)
    monkeypatch.delenv(safe_fs.FILE_MODE_ENV, raising=False)


def _messages(caplog, level=logging.WARNING):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= level]


def _train(cfg, steps=3, async_write=False):
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2({**cfg, "async_write": async_write})
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(steps):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return model


def _steps(path, monitor):
    m = FILE_RE.match(os.path.basename(path))
    problems = Problems(strict=True)
    return [r.step for r in iter_rows(CsvFile(0, monitor, int(m["a"]), int(m["b"]), str(path)), problems)]


def _secret(path, text="root:$6$hash:19000:0:99999:7:::\n"):
    """A root-only file, as /etc/shadow is."""
    path.write_text(text)
    os.chmod(path, 0o600)
    return path, path.read_bytes(), os.stat(path)


def _unchanged(path, content, info):
    now = os.lstat(path)
    assert path.read_bytes() == content
    assert (now.st_mode, now.st_size, now.st_mtime_ns) == (info.st_mode, info.st_size, info.st_mtime_ns)


# ------------------------------------------------------------------ links at CSV paths
@pytest.mark.parametrize("async_write", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("dangling", [False, True], ids=["link", "dangling-link"])
def test_link_at_a_csv_path_is_refused_and_only_its_rows_are_lost(tmp_path, caplog, async_write, dangling):
    out = tmp_path / "out"
    (out / "rank_0").mkdir(parents=True)
    out.chmod(0o750)
    (out / "rank_0").chmod(0o750)
    secret = tmp_path / "secret"
    if dangling:
        target = tmp_path / "created_by_nobody"
        os.symlink(target, out / "rank_0" / "param_step1-1.csv")
    else:
        _, content, info = _secret(secret)
        os.symlink(secret, out / "rank_0" / "param_step1-1.csv")
    _train({"output_dir": str(out), "monitors": MONITORS}, steps=3, async_write=async_write)
    if dangling:
        assert not os.path.lexists(target), "a dangling link must not create its target"
    else:
        _unchanged(secret, content, info)
    link = out / "rank_0" / "param_step1-1.csv"
    assert link.is_symlink()  # left as it was: not ours to remove
    warnings = _messages(caplog)
    refused = [m for m in warnings if "cannot write step 1" in m]
    assert len(refused) == 1 and str(link) in refused[0] and "symbolic link" in refused[0], warnings
    assert "root:$6$" not in "\n".join(warnings)
    # the other rows of step 1 and every other step are written
    rank = out / "rank_0"
    assert _steps(rank / "weight_grad_step1-1.csv", "weight_grad") == [1] * 8
    assert _steps(rank / "param_step0-0.csv", "param") == [0] * 8
    assert _steps(rank / "param_step2-2.csv", "param") == [2] * 8
    # step 1 is on disk in part (its weight_grad rows): counted as such, never as a lost step (issue 47)
    assert not [m for m in warnings if "of output were lost" in m], warnings
    lost = [m for m in warnings if "lack them" in m]
    assert len(lost) == 1 and "1 step(s) were written in part" in lost[0], lost
    assert "(8 row(s) lost: the files of param lack them" in lost[0] and "steps 1." in lost[0], lost


def test_link_in_place_of_rank_dir_is_refused_at_start(tmp_path):
    out = tmp_path / "out"
    out.mkdir(mode=0o750)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "rank_0")
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": {}, **MONITORS}})
    with pytest.raises(OutputError) as info:
        mon.start(model=model, optimizer=opt)
    assert isinstance(info.value, UnsafePathError)
    assert str(out / "rank_0") in str(info.value) and "symbolic link" in str(info.value)
    assert os.listdir(elsewhere) == []
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    mon.stop()


def test_rank_dir_recreated_mid_run_as_a_link_is_refused(tmp_path, caplog):
    """The user removes the output while the run writes; someone plants a link where
    ``rank_0`` was before the monitor re-creates it."""
    out = tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": MONITORS})
    mon.start(model=model, optimizer=opt)
    for i, (x, y) in enumerate(make_batches(4)):
        if i == 2:
            for p in (out / "rank_0").iterdir():
                p.unlink()
            (out / "rank_0").rmdir()
            os.symlink(elsewhere, out / "rank_0")
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert os.listdir(elsewhere) == []
    assert any("cannot write step 2" in m and "symbolic link" in m for m in _messages(caplog))


@needs_root
def test_csv_file_of_another_user_or_with_two_links_is_not_appended(tmp_path, caplog):
    out = tmp_path / "out"
    rank = out / "rank_0"
    rank.mkdir(parents=True)
    foreign = rank / "param_step0-0.csv"
    foreign.write_text("x\n")
    os.chown(foreign, OTHER_UID, OTHER_UID)
    secret, content, info = _secret(tmp_path / "secret")
    os.link(secret, rank / "param_step1-1.csv")  # a hard link to a root-only file
    _train({"output_dir": str(out), "monitors": MONITORS}, steps=2)
    assert foreign.read_text() == "x\n"
    assert secret.read_bytes() == content
    warnings = "\n".join(_messages(caplog))
    assert "owned by uid 65534" in warnings and "2 hard links" in warnings, warnings
    assert _steps(rank / "weight_grad_step0-0.csv", "weight_grad") == [0] * 8


# ------------------------------------------------------------------ foreign content
def test_header_check_never_logs_the_files_content(tmp_path, caplog):
    out = tmp_path / "out"
    rank = out / "rank_0"
    rank.mkdir(parents=True)
    (rank / "param_step0-0.csv").write_text("root:$6$hash:19000:0:99999:7:::\n")
    _train({"output_dir": str(out), "monitors": MONITORS}, steps=1)
    warnings = _messages(caplog)
    differs = [m for m in warnings if "does not start with a header this version writes" in m]
    assert len(differs) == 1 and "param_step0-0.csv" in differs[0], warnings
    assert all("root:" not in m and "$6$" not in m for m in warnings), warnings
    # never appended to (issue 47): the run's rows went beside it
    assert (rank / "param_step0-0.csv").read_text() == "root:$6$hash:19000:0:99999:7:::\n"
    assert _steps(rank / "param_step0-0.run2.csv", "param") == [0] * 8
    # an ordinary resume (same header) says nothing about the header
    caplog.clear()
    _train({"output_dir": str(out), "monitors": MONITORS}, steps=1)
    assert not [m for m in _messages(caplog) if "does not start with a header" in m and "weight_grad" in m]


# --------------------------------------------------------------------------- modes
def test_modes_whatever_the_umask(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    old = os.umask(0)
    try:
        _train({"output_dir": str(out), "monitors": MONITORS}, steps=2)
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", out, out / "rank_0"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o750, d
    files = list((out / "rank_0").iterdir())
    assert len(files) == 5 and (out / "rank_0" / "layout.json") in files  # 4 CSVs and the layout
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o640, f


def test_modes_may_be_loosened_for_reading_only(tmp_path, monkeypatch):
    monkeypatch.setenv(safe_fs.DIR_MODE_ENV, "755")
    monkeypatch.setenv(safe_fs.FILE_MODE_ENV, "0644")
    out = tmp_path / "out"
    old = os.umask(0o077)
    try:
        _train({"output_dir": str(out), "monitors": {"param": {"enabled": True}}}, steps=1)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(out / "rank_0").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(out / "rank_0" / "param_step0-0.csv").st_mode) == 0o644
    for name, value in ((safe_fs.FILE_MODE_ENV, "0666"), (safe_fs.DIR_MODE_ENV, "0775"),
                        (safe_fs.DIR_MODE_ENV, "0550"), (safe_fs.FILE_MODE_ENV, "rw-r-----")):
        monkeypatch.setenv(safe_fs.DIR_MODE_ENV, "0750")
        monkeypatch.setenv(safe_fs.FILE_MODE_ENV, "0640")
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError) as info:
            TrainerMonitorV2({"output_dir": str(tmp_path / "other")})
        assert name in str(info.value) and repr(value) in str(info.value) and "write access never" in str(info.value)


# ------------------------------------------------------------------ output_dir owner
@needs_root
def test_output_dir_of_another_user_is_refused_before_training(tmp_path):
    out = tmp_path / "theirs"
    out.mkdir(mode=0o755)
    os.chown(out, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2({"output_dir": str(out), "monitors": MONITORS})
    msg = str(info.value)
    assert info.value.field == "output_dir" and str(out) in msg and "owned by uid 65534" in msg, msg
    assert os.listdir(out) == []
    res = validate(_write_cfg(tmp_path, {"output_dir": str(out)}))
    assert not res.ok and res.message == msg


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777], ids=["0777", "0770", "1777"])
def test_output_dir_others_can_write_is_refused(tmp_path, mode):
    out = tmp_path / "shared"
    out.mkdir()
    out.chmod(mode)
    if os.geteuid() == 0:
        os.chown(out, -1, OTHER_UID)  # a group others are in (nogroup), not the owner's own
    elif mode == 0o770:
        pytest.skip("needs root to give the directory a group other than this user's private group")
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2({"output_dir": str(out), "monitors": MONITORS})
    msg = str(info.value)
    assert str(out) in msg and f"mode {mode:04o}" in msg and "chmod go-w" in msg, msg
    assert os.listdir(out) == []


@needs_root
def test_output_dir_writable_by_the_owners_private_group_is_fine(tmp_path):
    """umask 002 under user private groups (Debian, Ubuntu): the owner's own group, with
    nobody else in it, may write; root's group here."""
    import grp
    import pwd
    me = pwd.getpwuid(os.geteuid())
    assert grp.getgrgid(me.pw_gid).gr_name == me.pw_name and not grp.getgrgid(me.pw_gid).gr_mem
    out = tmp_path / "mine"
    out.mkdir()
    out.chmod(0o2775)
    os.chown(out, -1, me.pw_gid)
    _train({"output_dir": str(out), "monitors": {"param": {"enabled": True}}}, steps=1)
    assert (out / "rank_0" / "param_step0-0.csv").is_file()


def test_world_writable_sticky_parent_is_fine(tmp_path):
    shared = tmp_path / "scratch"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp is
    _train({"output_dir": str(shared / "mine"), "monitors": {"param": {"enabled": True}}}, steps=1)
    assert stat.S_IMODE(os.stat(shared / "mine").st_mode) == 0o750
    assert (shared / "mine" / "rank_0" / "param_step0-0.csv").is_file()


@needs_root
def test_output_dir_through_a_link_another_user_planted_is_refused(tmp_path):
    shared = tmp_path / "scratch"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "root_only"
    victim.mkdir(mode=0o700)
    link = shared / "run"
    os.symlink(victim, link)
    os.lchown(link, OTHER_UID, OTHER_UID)
    for output_dir in (link, link / "sub"):
        with pytest.raises(ConfigError) as info:
            TrainerMonitorV2({"output_dir": str(output_dir), "monitors": MONITORS})
        msg = str(info.value)
        assert str(link) in msg and "symbolic link owned by uid 65534" in msg, msg
    assert os.listdir(victim) == []
    # the user's own link (or root's) is followed
    os.lchown(link, 0, 0)
    _train({"output_dir": str(link / "sub"), "monitors": {"param": {"enabled": True}}}, steps=1)
    assert (victim / "sub" / "rank_0" / "param_step0-0.csv").is_file()
    _train({"output_dir": str(link), "monitors": {"param": {"enabled": True}}}, steps=1)
    assert (victim / "rank_0" / "param_step0-0.csv").is_file()


# --------------------------------------------------------------- FIFOs and devices
_FIFO_RUN = textwrap.dedent("""
    import logging, os, sys, torch
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
    from support import TinyMLP, loss_fn, make_batches
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2
    out, async_write = sys.argv[1], sys.argv[2] == "async"
    torch.manual_seed(0)
    model = TinyMLP(); opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2({"output_dir": out, "async_write": async_write,
                            "monitors": {"weight_grad": {"enabled": True}, "param": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(3):
        loss_fn(model, x, y).backward(); opt.step(); opt.zero_grad()
    mon.stop()
    print("STOPPED")
""")


def _python(code, *args, timeout=120):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS]), "MSPROBE_MONITOR_NATIVE": "0"}
    env.pop("RANK", None)
    try:
        return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                              env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"blocked: the process did not finish in {timeout} s")


@pytest.mark.parametrize("async_write", ["sync", "async"])
def test_fifo_at_a_csv_path_is_refused_without_blocking(tmp_path, async_write):
    out = tmp_path / "out"
    (out / "rank_0").mkdir(parents=True, mode=0o750)
    out.chmod(0o750)
    fifo = out / "rank_0" / "param_step1-1.csv"
    os.mkfifo(fifo)
    res = _python(_FIFO_RUN, out, async_write, timeout=90)
    assert res.returncode == 0 and "STOPPED" in res.stdout, res.stdout + res.stderr
    assert "cannot write step 1" in res.stdout and str(fifo) in res.stdout and "FIFO" in res.stdout, res.stdout
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert _steps(out / "rank_0" / "weight_grad_step1-1.csv", "weight_grad") == [1] * 8
    assert _steps(out / "rank_0" / "param_step2-2.csv", "param") == [2] * 8


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_config_path_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    if kind == "fifo":
        path = tmp_path / "cfg.json"
        os.mkfifo(path)
        want = "FIFO"
    elif kind == "device":
        path, want = "/dev/zero", "a device"
    else:
        path, want = tmp_path, "a directory"
    code = textwrap.dedent("""
        import json, sys
        from msprobe.core.monitor_v2.errors import ConfigError
        from msprobe.core.monitor_v2.trainer import TrainerMonitorV2
        from msprobe.core.monitor_v2.analysis.cli import main
        try:
            TrainerMonitorV2(sys.argv[1])
        except ConfigError as exc:
            print(json.dumps(str(exc)))
        sys.exit(main(["validate", sys.argv[1]]))
    """)
    res = _python(code, path, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    msg = json.loads(res.stdout.splitlines()[0])
    assert str(path) in msg and want in msg and "not a regular file" in msg, msg
    assert msg in res.stderr  # validate says what the constructor says


def test_config_above_the_size_limit_is_refused(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text('{"output_dir": "%s", "monitors": {}}' % tmp_path + " " * MAX_CONFIG_BYTES)
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2(str(path))
    msg = str(info.value)
    assert str(path) in msg and f"more than the {MAX_CONFIG_BYTES} bytes a config may have" in msg, msg
    res = validate(str(path))
    assert not res.ok and res.message == msg
    path.write_text('{"output_dir": "%s", "monitors": {}}' % tmp_path)  # below the limit: fine
    assert TrainerMonitorV2(str(path)).config.output_dir == str(tmp_path)


def _write_cfg(tmp_path, cfg):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


# ------------------------------------------------------------------ the primitives
def test_open_append_refuses_without_touching(tmp_path):
    secret, content, info = _secret(tmp_path / "secret")
    os.symlink(secret, tmp_path / "link")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    os.mkfifo(tmp_path / "fifo")
    for name, why in (("link", "symbolic link"), ("dangling", "symbolic link"), ("fifo", "FIFO")):
        with pytest.raises(UnsafePathError) as exc:
            safe_fs.open_append(str(tmp_path / name))
        assert str(tmp_path / name) in str(exc.value) and why in str(exc.value)
    _unchanged(secret, content, info)
    assert not os.path.lexists(tmp_path / "nowhere")
    old = os.umask(0)
    try:
        fd, created = safe_fs.open_append(str(tmp_path / "new.csv"))
    finally:
        os.umask(old)
    os.close(fd)
    assert created and stat.S_IMODE(os.stat(tmp_path / "new.csv").st_mode) == 0o640
    fd, created = safe_fs.open_append(str(tmp_path / "new.csv"))
    os.close(fd)
    assert not created


def test_replace_never_writes_through_a_link(tmp_path):
    secret, content, info = _secret(tmp_path / "secret")
    report = tmp_path / "report"
    report.mkdir()
    os.symlink(secret, report / "report.html")
    with safe_fs.replace_file(str(report / "report.html")) as fh:
        fh.write(b"<html></html>")
    _unchanged(secret, content, info)
    assert not (report / "report.html").is_symlink() and (report / "report.html").read_bytes() == b"<html></html>"
    assert stat.S_IMODE(os.stat(report / "report.html").st_mode) == 0o640
    assert sorted(os.listdir(report)) == ["report.html"]  # no temporary file left
    with pytest.raises(RuntimeError):
        with safe_fs.replace_file(str(report / "report.html")) as fh:
            fh.write(b"half")
            raise RuntimeError("the writer failed")
    assert (report / "report.html").read_bytes() == b"<html></html>" and len(os.listdir(report)) == 1
    linked = tmp_path / "linked_report"
    os.symlink(report, linked)
    with pytest.raises(UnsafePathError) as exc:
        with safe_fs.replace_file(str(linked / "x.png")) as fh:
            fh.write(b"x")
    assert str(linked) in str(exc.value) and not (report / "x.png").exists()


# ----------------------------------------------------------------- formula cells
FORMULA_NAMES = ["=HYPERLINK(\"http://x\",\"y\")", "+plus", "-minus", "@at", "'quoted", "''two", "tab\tfirst"]


class _Named(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        for name in FORMULA_NAMES:
            layer = torch.nn.Linear(3, 3)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(3, 3, generator=g) - 2.0)  # negative values: numbers
            self.add_module(name, layer)

    def forward(self, x):
        for layer in self.children():
            x = layer(x)
        return x


def _cells(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


@needs_polars  # the columnar engine reads them back too
@pytest.mark.parametrize("async_write", [False, True], ids=["sync", "async"])
def test_formula_cells_are_escaped_and_read_back_unchanged(tmp_path, async_write):
    from msprobe.core.monitor_v2.analysis.columnar import read_batch

    out = tmp_path / "out"
    model = _Named()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2({"output_dir": str(out), "async_write": async_write,
                            "monitors": {"param": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    weights = {n: p.detach().numpy().astype(np.float64).copy() for n, p in model.named_parameters()}
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    mon.stop()
    path = out / "rank_0" / "param_step0-0.csv"
    rows = _cells(path)[1:]
    names = {r[2] for r in rows}
    for cell in names:  # a spreadsheet runs none of them
        assert cell[:1] not in "=+-@\t\r", cell
    assert "'=HYPERLINK(\"http://x\",\"y\").weight" in names and "''quoted.weight" in names
    assert "tab\\tfirst.weight" in names  # escaped by csv_text: starts with a letter, no quote
    expected = set(weights)
    # the reference reader and the columnar engine give back the real names, numbers stay numbers
    got = list(iter_rows(CsvFile(0, "param", 0, 0, str(path)), Problems(strict=True)))
    real = {n.replace("\t", "\\t") for n in expected}
    assert {r.name for r in got} == real
    for r in got:
        if r.scope == "param_origin":
            name = r.name.replace("\\t", "\t")
            assert r.vals["min"] == pytest.approx(weights[name].min(), rel=1e-6)
            assert r.vals["max"] == pytest.approx(weights[name].max(), rel=1e-6)
    assert any(r.vals["min"] < 0 for r in got)
    minus = [row for row in rows if row[2] == "'-minus.weight"]
    assert minus and all(not c.startswith("'") for c in minus[0][4:]) and minus[0][4].startswith("-")
    frame = read_batch([CsvFile(0, "param", 0, 0, str(path))], Problems(strict=True), None).frame
    assert set(frame["module_name"].to_list()) == real
    assert set(frame["scope"].to_list()) == {"param_origin", "param_updated"}


def test_csv_cell_rule():
    from msprobe.core.monitor_v2.analysis.reader import text_cell
    from msprobe.core.monitor_v2.writer import csv_cell

    for name in ["=1+1", "+", "-", "-1.5", "@SUM(A1)", "'", "'x", "''", "a=b", "", "layer.0", "模块"]:
        written = csv_cell(name)
        assert written[:1] not in ("=", "+", "-", "@") and text_cell(written) == name, (name, written)
    assert csv_cell("layer.0") == "layer.0" and csv_cell("") == ""
    assert csv_cell("\r=x") == "\\r=x"


_CC_LOG_ONLY = textwrap.dedent("""
    import logging, os, sys, torch, torch.distributed as dist
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
    from support import TinyMLP, loss_fn, make_batches
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2
    out, store = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = TinyMLP(); opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2({"output_dir": out, "monitors": {"cc": {"enabled": True, "cc_log_only": True}}})
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(2):
        loss_fn(model, x, y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step(); opt.zero_grad()
    mon.stop()
    dist.destroy_process_group()
    print("STOPPED")
""")


def test_cc_stack_log_never_written_through_a_link(tmp_path):
    out = tmp_path / "out"
    (out / "rank_0").mkdir(parents=True, mode=0o750)
    out.chmod(0o750)
    secret, content, info = _secret(tmp_path / "secret")
    os.symlink(secret, out / "rank_0" / "cc_call_stacks.log")
    res = _python(_CC_LOG_ONLY, out, tmp_path / "store", timeout=120)
    assert res.returncode == 0 and "STOPPED" in res.stdout, res.stdout + res.stderr
    _unchanged(secret, content, info)
    assert "[cc_log_only] all_reduce called from" in res.stdout  # still logged to the console
    errors = [ln for ln in res.stdout.splitlines() if ln.startswith("ERROR") and "cc_log_only stack file" in ln]
    assert len(errors) == 1 and "symbolic link" in errors[0], res.stdout


@pytest.mark.parametrize("how", ["mode-0777", "other-owner"])
def test_rank_dir_others_could_write_is_refused_at_start(tmp_path, how):
    if how == "other-owner" and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root (CI runs as root)")
    out = tmp_path / "out"
    rank = out / "rank_0"
    rank.mkdir(parents=True)
    out.chmod(0o750)
    if how == "mode-0777":
        rank.chmod(0o777)
        want = "mode 0777"
    else:
        os.chown(rank, OTHER_UID, OTHER_UID)
        want = "owned by uid 65534"
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": MONITORS})
    with pytest.raises(UnsafePathError) as info:
        mon.start(model=model, optimizer=opt)
    assert str(rank) in str(info.value) and want in str(info.value), str(info.value)
    assert os.listdir(rank) == []
    mon.stop()


@needs_polars
@needs_matplotlib
def test_cli_names_a_bad_mode_setting(tmp_path, monkeypatch):
    import io

    from msprobe.core.monitor_v2.analysis.cli import main

    out = tmp_path / "run"
    _train({"output_dir": str(out), "monitors": {"param": {"enabled": True}}}, steps=1)
    monkeypatch.setenv(safe_fs.DIR_MODE_ENV, "0777")
    err = io.StringIO()
    assert main(["plot", str(out), "--out", str(tmp_path / "rep")], out=io.StringIO(), err=err) == 2
    assert safe_fs.DIR_MODE_ENV in err.getvalue() and "internal error" not in err.getvalue(), err.getvalue()
    assert not (tmp_path / "rep").exists()
