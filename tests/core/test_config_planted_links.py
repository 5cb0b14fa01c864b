"""The config reader on a shared machine (issue 47, item 10): a config path that is a
symbolic link another user planted, a FIFO, and a file of secrets that is not a config.

The rule is the CSV readers' (``safe_fs.open_for_reading``): a symbolic link anywhere on
the way to the file (the file itself, a directory above it, a link met inside the target
of a link followed) is followed only when this user or root owns it; the file must be a
regular file (nothing blocks); and a file that is not a valid config is never quoted:
the path and the reason only. Each case is checked where the config is read: the
constructor (``ConfigError``), ``msprobe-monitor validate`` and ``control`` (their
output), and the dynamic reload of a running job (the log), where training goes on
bit-identical to a run without the monitor.

Planting another user's link needs root (``os.lchown``): those tests skip, saying so,
when not run as root; CI runs as root.
"""

import io
import json
import logging
import os
import threading
import traceback
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from support import loss_fn, make_batches
from support.models import TinyMLP

from msprobe.core.monitor_v2.analysis.cli import main as cli_main
from msprobe.core.monitor_v2.errors import ConfigError
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

NOBODY = 65534  # the uid of "nobody": another user
SECRET = "S3CRET-7f3a91"  # in the file behind the link: must appear in no message
ROOT_ONLY = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                               reason="planting another user's symbolic link needs os.lchown, hence root "
                                      "(CI runs as root)")


def secret_config(out: Path) -> Dict[str, Any]:
    """A file of root's that reads as a config, so that a reader which follows the link
    would quote its field names and values in its error (an unknown monitor field and a
    value out of range)."""
    return {"output_dir": str(out), "start_step": f"{SECRET}-value",
            "monitors": {"weight_grad": {"enabled": True, f"{SECRET}_field": 1}}}


def write_root_only(path: Path, text: str) -> Path:
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


def plant_link(link: Path, target: Path) -> Path:
    """``link`` -> ``target``, owned by another user."""
    os.symlink(target, link)
    os.lchown(link, NOBODY, NOBODY)
    return link


def cli(*argv: Any):
    out, err = io.StringIO(), io.StringIO()
    code = cli_main([str(a) for a in argv], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


class Records(logging.Handler):
    """Every record of the monitor's logger, at every level, with its exception text."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        fmt = logging.Formatter()
        return "\n".join(fmt.format(r) for r in self.records)


@pytest.fixture
def monitor_log():
    log = logging.getLogger("msprobe.monitor_v2")
    handler = Records()
    old = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def refused_everywhere(path: Path, *why: str) -> str:
    """The constructor, validate and control refuse ``path``, naming it and ``why``,
    quoting nothing of the file; returns the constructor's message."""
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2(str(path))
    msg = str(info.value)
    assert str(path) in msg and all(w in msg for w in why), msg
    shown = "".join(traceback.format_exception(info.type, info.value, info.tb))  # what an uncaught error prints
    assert SECRET not in msg and SECRET not in shown
    code, out, err = cli("validate", path)
    assert code == 2 and f"INVALID: {path}: {msg}" in err and SECRET not in out + err, (out, err)
    code, out, err = cli("validate", path, "--json")
    assert code == 2 and json.loads(out)["error"] == msg and SECRET not in out + err
    code, out, err = cli("control", path, "--enable", "module", "--steps", "3")
    assert code == 2 and str(path) in err and SECRET not in out + err, (out, err)
    return msg


# ------------------------------------------------------------------------ links
@ROOT_ONLY
def test_a_link_another_user_planted_is_not_followed(tmp_path, monitor_log):
    secret = write_root_only(tmp_path / "root_only.json", json.dumps(secret_config(tmp_path / "out")))
    shared = tmp_path / "shared"
    shared.mkdir()
    link = plant_link(shared / "monitor_config.json", secret)
    msg = refused_everywhere(link, "symbolic link owned by uid 65534, another user")
    assert msg.startswith(f"monitor_v2 config: cannot read '{link}': it is a symbolic link owned by uid 65534")
    assert SECRET not in monitor_log.text()
    # the file behind it, named by its own path, is read (and its faults named): the rule is the link's
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2(str(secret))
    assert SECRET in str(info.value)


@ROOT_ONLY
def test_a_link_of_another_user_on_the_way_is_not_followed(tmp_path):
    """A directory above the config that is another user's link, and this user's own
    link whose target leads through one: both refused, naming the planted link."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    write_root_only(private / "monitor_config.json", json.dumps(secret_config(tmp_path / "out")))
    planted = plant_link(tmp_path / "configs", private)
    msg = refused_everywhere(planted / "monitor_config.json", f"'{planted}' on its way is a symbolic link owned by "
                                                              f"uid 65534")
    assert "another user" in msg
    mine = tmp_path / "my_config.json"
    os.symlink(planted / "monitor_config.json", mine)  # root's own link, into the planted one
    refused_everywhere(mine, f"'{planted}' on its way is a symbolic link owned by uid 65534")


def test_a_link_of_this_user_is_followed(tmp_path):
    real = tmp_path / "configs" / "monitor_config.json"
    real.parent.mkdir()
    real.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "monitors": {"weight_grad": {"enabled": True}}}))
    os.symlink(real.parent, tmp_path / "current")
    os.symlink(tmp_path / "current" / "monitor_config.json", tmp_path / "link.json")
    assert TrainerMonitorV2(str(tmp_path / "link.json")).config.output_dir == str(tmp_path / "out")
    code, out, _ = cli("validate", tmp_path / "link.json")
    assert code == 0 and out.startswith("OK")


# ------------------------------------------------------------- not a config at all
@pytest.mark.parametrize("content", [
    f"db_password = {SECRET}\napi_token: {SECRET}\n",                    # not JSON
    f'{{"password": "{SECRET}\\q"}}',                                   # JSON with a bad escape
    json.dumps({f"{SECRET}_token": "x", "aws_secret_access_key": SECRET}),  # JSON, but no config field
    json.dumps([SECRET]),                                                  # JSON, not an object
], ids=["text", "bad-escape", "credentials-json", "list"])
def test_a_file_that_is_not_a_config_is_never_quoted(tmp_path, monitor_log, content):
    path = write_root_only(tmp_path / "secrets.txt", content)
    msg = refused_everywhere(path)
    assert msg.startswith(f"monitor_v2 config: '{path}' ")
    assert SECRET not in monitor_log.text()


def test_not_json_names_the_line_and_column_only(tmp_path):
    path = tmp_path / "monitor_config.json"
    path.write_text('{\n  "output_dir": "x",\n  "monitors" {}\n}')
    msg = refused_everywhere(path)
    assert msg == f"monitor_v2 config: '{path}' is not valid JSON: Expecting ':' delimiter at line 3, column 14"


def test_not_utf8_names_the_offset_not_the_byte(tmp_path):
    path = tmp_path / "monitor_config.json"
    path.write_bytes(b'{"output_dir": "caf\xe9"}')
    msg = refused_everywhere(path, "the byte at offset 19 is not valid UTF-8")
    assert "0xe9" not in msg and "\xe9" not in msg


# ------------------------------------------------------------------------ FIFO
def bounded(fn, seconds: float = 60.0):
    """``fn()``'s result or exception, failing the test if it has not returned in time."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"blocked for {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "monitor_config.json"
    os.mkfifo(fifo)  # nobody ever writes to it: opening it for reading without O_NONBLOCK blocks
    with pytest.raises(ConfigError) as info:
        bounded(lambda: TrainerMonitorV2(str(fifo)))
    assert str(info.value) == (f"monitor_v2 config: cannot read '{fifo}': it is a FIFO (named pipe), not a regular "
                               f"file (a config is read from a regular file; reading this one could block or never "
                               f"end)")
    code, _, err = bounded(lambda: cli("validate", fifo))
    assert code == 2 and "FIFO" in err


# --------------------------------------------------------- the dynamic reload
def train_with_swap(tmp_path: Path, swap, steps: int = 8, swap_at: int = 3):
    """A run with ``"dynamic": true`` whose config path is replaced by ``swap(path)`` at the
    end of step ``swap_at``; returns the final parameters and the rows of the run. Each
    step's training is bounded in time (a blocked read would hang the step boundary)."""
    cfg = tmp_path / "monitor_config.json"
    cfg.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "dynamic": True,
                               "monitors": {"weight_grad": {"enabled": True}}}))
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2(str(cfg))
    mon.start(model, opt)
    try:
        for step, (x, y) in enumerate(make_batches(steps)):
            def one() -> None:
                loss_fn(model, x, y).backward()
                opt.step()  # patched: the step boundary, where the config is looked at
                opt.zero_grad()
            bounded(one)
            if step == swap_at:
                swap(cfg)
    finally:
        mon.stop()
    return [p.detach().clone() for p in model.parameters()], mon


def unmonitored(steps: int = 8):
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in make_batches(steps):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def replaced_by(cfg: Path, make) -> None:
    """Replace ``cfg`` atomically (as an editor does) by what ``make(tmp)`` creates."""
    tmp = cfg.with_name(".swap")
    make(tmp)
    os.replace(tmp, cfg)


def assert_refused_and_trained_on(tmp_path, monitor_log, swap, *why: str) -> None:
    params, mon = train_with_swap(tmp_path, swap)
    for got, want in zip(params, unmonitored()):
        assert torch.equal(got, want)  # bit-identical: the refusal cost the training nothing
    refusals = [r for r in monitor_log.records if "is refused, the running configuration stays" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING, monitor_log.text()
    said = refusals[0].getMessage()
    assert str(tmp_path / "monitor_config.json") in said and all(w in said for w in why), said
    assert SECRET not in monitor_log.text()
    assert mon.config.monitors["weight_grad"].enabled  # the running config stays


@ROOT_ONLY
def test_dynamic_reload_does_not_follow_a_planted_link(tmp_path, monitor_log):
    secret = write_root_only(tmp_path / "root_only.json", json.dumps(secret_config(tmp_path / "out")))
    assert_refused_and_trained_on(tmp_path, monitor_log, lambda cfg: replaced_by(cfg, lambda t: plant_link(t, secret)),
                                  "symbolic link owned by uid 65534, another user")


def test_dynamic_reload_does_not_quote_a_file_of_secrets(tmp_path, monitor_log):
    def secrets_file(t: Path) -> None:
        t.write_text(json.dumps({f"{SECRET}_token": SECRET}))

    assert_refused_and_trained_on(tmp_path, monitor_log, lambda cfg: replaced_by(cfg, secrets_file),
                                  "is not a monitor_v2 config")


def test_dynamic_reload_of_a_fifo_does_not_block(tmp_path, monitor_log):
    assert_refused_and_trained_on(tmp_path, monitor_log, lambda cfg: replaced_by(cfg, os.mkfifo), "FIFO")
