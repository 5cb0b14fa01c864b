"""Output faults on long runs (issue 12): a full disk, an output directory removed while
the run writes to it, a relative ``output_dir``, a file where ``rank_<r>`` should be, and
module names a CSV cannot hold as they are.

The full disk is real where the tests may mount a file system (root, outside a restricted
container): a 1 MiB tmpfs is mounted, filled and unmounted. The same tests also run with
the error injected at the writer's only write to the file system (``writer._write_all``),
which is what runs without root; the test id says which (``tmpfs`` or ``injected``).
"""

import collections
import csv
import errno
import functools
import logging
import os
import re
import shutil
import subprocess
import tempfile

import pytest
import torch

import msprobe.core.monitor_v2.writer as writer_mod
from msprobe.core.monitor_v2.analysis.reader import CsvFile, FILE_RE, Problems, iter_rows
from msprobe.core.monitor_v2.errors import MonitorError, OutputError
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

from support import TinyMLP, loss_fn, make_batches

LOGGER = "msprobe.monitor_v2"
CFG_MONITORS = {"weight_grad": {"enabled": True}, "param": {"enabled": True}}


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


def _messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def _csv_files(out):
    return sorted((out / "rank_0").glob("*.csv"))


def _steps_in_files(out, monitor):
    """Steps of every row of ``monitor``, read with our reader (which must see no problem)."""
    steps = []
    for p in _csv_files(out):
        m = FILE_RE.match(p.name)
        if m.group("monitor") != monitor:
            continue
        problems = Problems(strict=True)
        f = CsvFile(0, monitor, int(m.group("a")), int(m.group("b")), str(p))
        steps += [row.step for row in iter_rows(f, problems)]
    return steps


class _Loop:
    """A real training loop whose steps can be interleaved with faults."""

    def __init__(self, cfg, optimizer_cls=torch.optim.SGD):
        torch.manual_seed(0)
        self.model = TinyMLP()
        self.opt = optimizer_cls(self.model.parameters(), lr=0.01)
        self.mon = TrainerMonitorV2(cfg)
        self.mon.start(model=self.model, optimizer=self.opt)
        self.batches = make_batches(64)
        self.done = 0

    def run(self, steps):
        for _ in range(steps):
            x, y = self.batches[self.done % len(self.batches)]
            loss_fn(self.model, x, y).backward()
            self.opt.step()
            self.opt.zero_grad()
            self.done += 1


# ------------------------------------------------------------------------ full disk
class _TmpfsDisk:
    """A real 1 MiB tmpfs; ``fill()`` writes a filler file until the kernel says ENOSPC."""

    kind = "tmpfs"

    def __init__(self, root):
        self.root = root
        self.filler = root / ".filler"

    def fill(self):
        chunk = b"\0" * 4096
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while True:
                os.write(fd, chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)

    def free(self):
        os.unlink(self.filler)

    def free_one_page(self):
        """Room for one small file: one page of the full disk freed (tmpfs counts pages)."""
        os.truncate(self.filler, os.stat(self.filler).st_size - 4096)


class _InjectedDisk:
    """No root: ENOSPC raised at the writer's file-system boundary."""

    kind = "injected"

    def __init__(self, root, monkeypatch):
        self.root = root
        self.full = False
        self.room = 0  # writes that still succeed on the full disk
        real = writer_mod._write_all

        def write_all(fd, data):
            if self.full and self.room:
                self.room -= 1
            elif self.full:
                os.write(fd, data[: len(data) // 2])  # a write cut short, as a real disk does
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd, data)

        monkeypatch.setattr(writer_mod, "_write_all", write_all)

    def fill(self):
        self.full = True

    def free(self):
        self.full = False

    def free_one_page(self):
        self.room = 1


@functools.lru_cache(maxsize=None)
def _tmpfs_mountable():
    """Whether this process may mount a tmpfs (root, and a kernel/container that allows it);
    tried once, at collection."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    where = tempfile.mkdtemp(prefix="msprobe_tmpfs_probe_")
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", where],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", where], check=True)
        return ok
    finally:
        os.rmdir(where)


# A real full disk where a tmpfs can be mounted, and the injected error everywhere (the
# path CI takes without root): the test ids say which ran.
DISKS = (["tmpfs"] if _tmpfs_mountable() else []) + ["injected"]


@pytest.fixture(params=DISKS)
def small_disk(request, tmp_path, monkeypatch):
    root = tmp_path / "disk"
    root.mkdir()
    if request.param == "injected":
        yield _InjectedDisk(root, monkeypatch)
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], check=True)
    try:
        yield _TmpfsDisk(root)
    finally:
        subprocess.run(["umount", "-l", str(root)], check=True)


@pytest.mark.parametrize("async_write", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("per_file", [1, 3])
def test_disk_full_loses_whole_steps_and_recovers(small_disk, caplog, async_write, per_file):
    out = small_disk.root / "out"
    cfg = {"output_dir": str(out), "async_write": async_write, "step_count_per_record": per_file,
           "monitors": CFG_MONITORS}
    caplog.set_level(logging.INFO, logger=LOGGER)
    loop = _Loop(cfg)
    loop.run(4)
    _drain(loop.mon)
    small_disk.fill()
    loop.run(5)
    _drain(loop.mon)
    small_disk.free()
    loop.run(4)
    loop.mon.stop()  # must not raise

    warnings = _messages(caplog, logging.WARNING)
    failed = [m for m in warnings if "cannot write step" in m]
    recovered = [m for m in warnings if "works again from step" in m]
    summary = [m for m in warnings if "of output were lost" in m]
    assert len(failed) == 1 and "No space left on device" in failed[0], warnings
    assert len(recovered) == 1, warnings
    assert len(summary) == 1, warnings
    lost_n, lost_rows = map(int, re.search(r"(\d+) step\(s\) of output were lost \((\d+) row", summary[0]).groups())

    # every file is complete and parses; no empty file; each step is whole or absent
    for p in _csv_files(out):
        assert p.stat().st_size > 0, p
        with open(p, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        assert len({len(r) for r in rows}) == 1, p
    wg, par = _steps_in_files(out, "weight_grad"), _steps_in_files(out, "param")
    n_params = 4
    for s in set(wg) | set(par):
        assert wg.count(s) == 2 * n_params and par.count(s) == 2 * n_params, s
    written = set(wg)
    assert set(par) == written
    lost = set(range(13)) - written
    assert set(range(4)) <= written and set(range(9, 13)) <= written
    assert len(lost) == lost_n >= 1
    assert lost_rows == lost_n * 4 * n_params  # two weight_grad and two param rows per parameter
    if per_file == 1:  # each step needs a new file, and none can be created while the disk is full
        assert lost == set(range(4, 9))
    final = [m for m in _messages(caplog, logging.INFO) if "stopped after" in m]
    assert final and f"rows of {13 - lost_n} step(s) ({lost_n} step(s) lost" in final[0], final


@pytest.mark.parametrize("async_write", [False, True], ids=["sync", "async"])
def test_a_step_written_in_part_is_counted_as_the_disk_holds_it(small_disk, caplog, async_write):
    """Space freed on a full disk between two monitors' files of one step lands one file and
    not the other (issue 47): the step is said to be written in part, and the counts of
    steps and rows lost match what the disk lacks."""
    out = small_disk.root / "out"
    caplog.set_level(logging.INFO, logger=LOGGER)
    loop = _Loop({"output_dir": str(out), "async_write": async_write, "monitors": CFG_MONITORS})
    loop.run(3)  # steps 0-2
    _drain(loop.mon)
    small_disk.fill()
    loop.run(2)  # steps 3, 4: lost whole
    _drain(loop.mon)
    small_disk.free_one_page()
    loop.run(3)  # step 5 gets the room for one monitor's file; 6 and 7 are lost whole
    _drain(loop.mon)
    small_disk.free()
    loop.run(2)  # steps 8, 9
    loop.mon.stop()

    n_params = 4
    per_step = {m: 2 * n_params for m in ("weight_grad", "param")}
    on_disk = {m: collections.Counter(_steps_in_files(out, m)) for m in per_step}
    steps = range(10)
    whole = [s for s in steps if all(on_disk[m][s] == per_step[m] for m in per_step)]
    none = [s for s in steps if not any(on_disk[m][s] for m in per_step)]
    part = [s for s in steps if s not in whole and s not in none]
    assert whole == [0, 1, 2, 8, 9] and none == [3, 4, 6, 7] and part == [5], on_disk
    missing_rows = sum(per_step[m] - on_disk[m][s] for m in per_step for s in part)
    assert all(on_disk[m][5] in (0, per_step[m]) for m in per_step)  # each file has the step whole or not

    warnings = _messages(caplog, logging.WARNING)
    (summary,) = [m for m in warnings if "were lost" in m and "First error" in m]
    assert "4 step(s) of output were lost (64 row(s))" in summary and "steps 3-4, 6-7;" in summary, summary
    assert f"1 step(s) were written in part ({missing_rows} row(s) lost" in summary and "steps 5." in summary
    recovered = [m for m in warnings if "works again from step" in m]
    assert len(recovered) == 1 and "4 step(s) were lost (3-4, 6-7); 1 step(s) were written in part (5)" in \
        recovered[0], recovered
    (final,) = [m for m in _messages(caplog, logging.INFO) if "stopped after" in m]
    written = sum(sum(c.values()) for c in on_disk.values())
    assert f"wrote {written} rows of 6 step(s) (4 step(s) lost, 1 written in part: see the warning above)" in final


def _drain(mon):
    """Wait until the background writer has written what it was given (async only), so
    that the fault hits the steps trained while it lasts."""
    if isinstance(mon._writer, writer_mod.AsyncCsvWriter):
        mon._writer.drain()


def test_stop_does_not_mask_the_training_error(small_disk, caplog):
    """The pattern of the issue: stop() in a finally block after a disk-full episode."""
    out = small_disk.root / "out"
    loop = _Loop({"output_dir": str(out), "monitors": CFG_MONITORS})
    loop.run(2)
    small_disk.fill()
    with pytest.raises(KeyError, match="the training's own error"):
        try:
            loop.run(3)
            raise KeyError("the training's own error")
        finally:
            loop.mon.stop()
    assert any("of output were lost" in m for m in _messages(caplog, logging.WARNING))


# ------------------------------------------------------------- removed output dir
@pytest.mark.parametrize("per_file", [1, 3])
def test_output_dir_removed_mid_run_is_recreated(tmp_path, caplog, per_file):
    out = tmp_path / "out"
    caplog.set_level(logging.INFO, logger=LOGGER)
    loop = _Loop({"output_dir": str(out), "step_count_per_record": per_file, "monitors": CFG_MONITORS})
    loop.run(4)
    shutil.rmtree(out)
    loop.run(4)  # steps 4..7
    shutil.rmtree(out / "rank_0")
    loop.run(2)  # steps 8, 9
    loop.mon.stop()
    recreated = [m for m in _messages(caplog, logging.WARNING) if "re-created" in m]
    assert len(recreated) == 1, recreated
    assert not _messages(caplog, logging.ERROR)
    # what the user deleted is gone; every step written after each removal is on disk
    assert sorted(set(_steps_in_files(out, "weight_grad"))) == [8, 9]
    assert sorted(set(_steps_in_files(out, "param"))) == [8, 9]
    assert not any("lost" in m for m in _messages(caplog, logging.WARNING))


def test_deleted_file_is_recreated_not_written_blind(tmp_path, caplog):
    """Several steps per file: rows never go to a deleted file."""
    out = tmp_path / "out"
    loop = _Loop({"output_dir": str(out), "step_count_per_record": 10, "monitors": CFG_MONITORS})
    loop.run(3)
    (out / "rank_0" / "param_step0-9.csv").unlink()
    loop.run(1)
    loop.mon.stop()
    recreated = [m for m in _messages(caplog, logging.WARNING) if "re-created" in m]
    assert len(recreated) == 1 and "param_step0-9.csv was deleted" in recreated[0]
    assert sorted(set(_steps_in_files(out, "param"))) == [3]
    assert sorted(set(_steps_in_files(out, "weight_grad"))) == [0, 1, 2, 3]


def test_relative_output_dir_resolved_at_construction(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    mon = TrainerMonitorV2({"output_dir": "rel/out", "monitors": {"param": {"enabled": True}}})
    assert mon.config.output_dir == str(first / "rel" / "out")
    monkeypatch.chdir(second)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.start(model=model, optimizer=opt)
    x, y = make_batches(1)[0]
    loss_fn(model, x, y).backward()
    opt.step()
    mon.stop()
    assert (first / "rel" / "out" / "rank_0" / "param_step0-0.csv").is_file()
    assert not (second / "rel").exists()


def test_file_in_place_of_rank_dir_is_our_error(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "rank_0").write_text("not a directory")
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": {}, "weight_grad": {"enabled": True}}})
    with pytest.raises(OutputError) as info:
        mon.start(model=model, optimizer=opt)
    assert isinstance(info.value, MonitorError) and not isinstance(info.value, FileExistsError)
    msg = str(info.value)
    assert str(out / "rank_0") in msg and "not a directory" in msg and "Move or delete" in msg
    # nothing stays installed
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    mon.stop()


# --------------------------------------------------------------------- hostile names
HOSTILE = {
    "cr\rname": "cr\\rname",
    "lf\nname": "lf\\nname",
    'quo"te': 'quo"te',
    "com,ma": "com,ma",
    "lone\udcffsurrogate": "lone\\udcffsurrogate",
    "tab\tand\x1bescape": "tab\\tand\\x1bescape",
    "ünï€ode": "ünï€ode",
}


class _Hostile(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        for name in HOSTILE:
            layer = torch.nn.Linear(4, 4)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(4, 4, generator=g))
            self.add_module(name, layer)

    def forward(self, x):
        for layer in self.children():
            x = layer(x)
        return x


@pytest.mark.parametrize("async_write", [False, True], ids=["sync", "async"])
def test_hostile_module_names_keep_the_csv_parseable(tmp_path, caplog, async_write):
    out = tmp_path / "out"
    model = _Hostile()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2({"output_dir": str(out), "async_write": async_write, "step_count_per_record": 2,
                            "monitors": {"module": {}, "weight_grad": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        model(torch.randn(2, 4, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert not _messages(caplog, logging.ERROR)
    assert not any("lost" in m for m in _messages(caplog, logging.WARNING))
    for monitor in ("module", "weight_grad"):
        files = [p for p in _csv_files(out) if p.name.startswith(monitor)]
        assert len(files) == 2
        names = set()
        for p in files:
            raw = p.read_bytes()
            raw.decode("utf-8")  # strict: valid UTF-8
            text = raw.decode("utf-8")
            assert "\r" not in text
            with open(p, newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
            assert len(text.splitlines()) == len(rows) + 1  # one line per row
            names |= {r["module_name"] for r in rows}
        # our reader reads every row, strictly
        assert sorted(set(_steps_in_files(out, monitor))) == [0, 1, 2]
        for name, written in HOSTILE.items():
            if monitor == "weight_grad":
                assert f"{written}.weight" in names and f"{written}.bias" in names, (name, names)
            else:
                assert f"{written}.output.0" in names, (name, names)
    # values of the surrogate-named layer's gradient are right: weight_grad is written for it
    with open(out / "rank_0" / "weight_grad_step2-3.csv", newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["module_name"] == "lone\\udcffsurrogate.weight"]
    assert {r["scope"] for r in rows} == {"unreduced", "reduced"}


def test_csv_text_is_identity_for_ordinary_names():
    for name in ("layers.0.attention.q_proj.weight", "0:embed.output.0", "模块.权重", "a,b", 'a"b', ""):
        assert writer_mod.csv_text(name) == name
