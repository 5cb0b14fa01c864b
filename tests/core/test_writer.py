"""CSV output (spec: "Output"): header, appending to existing files, async writing,
value formatting."""

import logging
import math
import threading

import pytest
import torch

import msprobe.core.monitor_v2.writer as writer_mod
from msprobe.core.monitor_v2.stats import format_value
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

from support import TinyMLP, loss_fn, make_batches, read_rank_dir, rows_of

LOGGER = "msprobe.monitor_v2"
BASE = ["vpp_stage", "step", "module_name", "scope"]


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    """Output goes to rank_0: no launcher RANK variable leaks into these tests."""
    monkeypatch.delenv("RANK", raising=False)


def _warnings(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def _train(cfg, steps, optimizer_cls=torch.optim.Adam, grad_acc=1, poison=None):
    torch.manual_seed(0)
    model = TinyMLP()
    if poison is not None:
        poison(model)
    opt = optimizer_cls(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2(cfg)
    mon.start(model=model, optimizer=opt, grad_acc_steps=grad_acc)
    batches = make_batches(steps * grad_acc)
    for s in range(steps):
        for x, y in batches[s * grad_acc:(s + 1) * grad_acc]:
            loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return mon, model


def _file_texts(out):
    d = out / "rank_0"
    return {p.name: p.read_text() for p in sorted(d.glob("*.csv"))}


# ---------------------------------------------------------------------------- header
@pytest.mark.parametrize(
    "monitor, ops, expected_ops",
    [
        pytest.param("weight_grad", None, ["min", "max", "mean", "norm", "nans"], id="weight_grad-all"),
        pytest.param("weight_grad", ["nans", "min"], ["min", "nans"], id="weight_grad-nans-min"),
        pytest.param("param", None, ["min", "max", "mean", "norm", "nans"], id="param-all"),
        pytest.param("param", ["norm", "max", "mean"], ["max", "mean", "norm"], id="param-reordered"),
        pytest.param("optimizer", ["nans", "norm", "mean", "max", "min"], ["min", "max", "mean", "norm", "nans"],
                     id="optimizer-reversed"),
        pytest.param("optimizer", ["norm", "bogus"], ["norm"], id="optimizer-unknown-dropped"),
    ],
)
def test_header(tmp_path, monitor, ops, expected_ops):
    out = tmp_path / "out"
    entry = {"enabled": True}
    if ops is not None:
        entry["ops"] = ops
    _train({"output_dir": str(out), "monitors": {monitor: entry}}, 2)
    texts = _file_texts(out)
    assert sorted(texts) == [f"{monitor}_step0-0.csv", f"{monitor}_step1-1.csv"]
    micro = ["micro_step"] if monitor == "weight_grad" else []
    expected = ",".join(BASE + micro + expected_ops)
    for name, text in texts.items():
        lines = text.splitlines()
        assert lines[0] == expected, name
        # one header per file, and every row has as many cells as the header
        assert sum(1 for ln in lines if ln.startswith("vpp_stage")) == 1
        assert len(lines) > 1
        assert all(len(ln.split(",")) == len(expected.split(",")) for ln in lines)


def test_header_all_monitors_together(tmp_path):
    out = tmp_path / "out"
    _train({"output_dir": str(out), "step_count_per_record": 2, "monitors": {
        "weight_grad": {"enabled": True, "ops": ["norm"]},
        "param": {"enabled": True, "ops": ["mean", "min"]},
        "optimizer": {"enabled": True, "ops": ["nans", "max"]},
    }}, 2)
    texts = _file_texts(out)
    assert sorted(texts) == ["optimizer_step0-1.csv", "param_step0-1.csv", "weight_grad_step0-1.csv"]
    assert texts["weight_grad_step0-1.csv"].splitlines()[0] == "vpp_stage,step,module_name,scope,micro_step,norm"
    assert texts["param_step0-1.csv"].splitlines()[0] == "vpp_stage,step,module_name,scope,min,mean"
    assert texts["optimizer_step0-1.csv"].splitlines()[0] == "vpp_stage,step,module_name,scope,max,nans"
    rows = rows_of(out, "weight_grad")
    assert {r["micro_step"] for r in rows} == {"1"}
    assert {r["vpp_stage"] for r in rows} == {"0"}
    assert [r["step"] for r in rows] == ["0"] * 8 + ["1"] * 8  # 4 params x (unreduced, reduced)
    assert {r["scope"] for r in rows} == {"unreduced", "reduced"}


# -------------------------------------------------------------------------- append
def test_second_run_appends_and_warns_once(tmp_path, caplog):
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "monitors": {
        "weight_grad": {"enabled": True}, "param": {"enabled": True, "ops": ["norm"]}}}
    caplog.set_level(logging.WARNING, logger=LOGGER)
    _train(cfg, 2)
    assert _warnings(caplog) == []
    first = _file_texts(out)
    assert sorted(first) == ["param_step0-0.csv", "param_step1-1.csv",
                             "weight_grad_step0-0.csv", "weight_grad_step1-1.csv"]

    caplog.clear()
    _train(cfg, 2)
    second = _file_texts(out)
    assert sorted(second) == sorted(first)
    for name, text in second.items():
        assert text.startswith(first[name]), name  # first run kept as is
        added = text[len(first[name]):]
        assert added, name
        assert not any(ln.startswith("vpp_stage") for ln in added.splitlines()), name  # no second header
        # the same training again: the same rows once more
        assert added == "".join(first[name].splitlines(keepends=True)[1:]), name
    warns = _warnings(caplog)
    assert len(warns) == 1, [w.getMessage() for w in warns]
    assert str(out) in warns[0].getMessage()


def test_resumed_run_continues_window(tmp_path, caplog):
    """A run resumed at start_step inside an existing window appends to that file."""
    out = tmp_path / "out"
    base = {"output_dir": str(out), "step_count_per_record": 4,
            "monitors": {"param": {"enabled": True, "ops": ["norm"]}}}
    caplog.set_level(logging.WARNING, logger=LOGGER)
    _train(base, 2)  # steps 0, 1 -> param_step0-3.csv
    _train(dict(base, start_step=0, stop_step=4), 4)  # steps 0..3 again into the same file
    rows = rows_of(out, "param")
    assert sorted(read_rank_dir(out)) == ["param_step0-3.csv"]
    assert [r["step"] for r in rows][::8] == ["0", "1", "0", "1", "2", "3"]
    assert len(_warnings(caplog)) == 1


def test_empty_existing_file_gets_header(tmp_path):
    out = tmp_path / "out"
    (out / "rank_0").mkdir(parents=True)
    (out / "rank_0" / "param_step0-0.csv").write_text("")
    _train({"output_dir": str(out), "monitors": {"param": {"enabled": True, "ops": ["norm"]}}}, 1)
    lines = (out / "rank_0" / "param_step0-0.csv").read_text().splitlines()
    assert lines[0] == "vpp_stage,step,module_name,scope,norm"
    assert len(lines) == 1 + 8


# --------------------------------------------------------------------------- async
CFG_ALL = {"step_count_per_record": 3, "monitors": {
    "weight_grad": {"enabled": True},
    "param": {"enabled": True},
    "optimizer": {"enabled": True, "ops": ["norm", "mean", "nans"]},
}}


def test_async_write_identical_to_sync(tmp_path):
    sync_out, async_out = tmp_path / "sync", tmp_path / "async"
    _train(dict(CFG_ALL, output_dir=str(sync_out), async_write=False), 10, grad_acc=2)
    _train(dict(CFG_ALL, output_dir=str(async_out), async_write=True), 10, grad_acc=2)
    sync_files, async_files = _file_texts(sync_out), _file_texts(async_out)
    assert len(sync_files) == 3 * 4  # windows 0-2, 3-5, 6-8, 9-11 for three monitors
    assert async_files == sync_files


def test_async_stop_flushes_everything(tmp_path):
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "async_write": True, "monitors": {"param": {"enabled": True}}}
    mon, _ = _train(cfg, 30, optimizer_cls=torch.optim.SGD)
    # right after stop(): every step is on disk, complete
    rows = rows_of(out, "param")
    assert len(rows) == 30 * 8
    assert [r["step"] for r in rows][::8] == [str(s) for s in range(30)]
    assert all(r["nans"] == "0" for r in rows)
    mon.stop()  # a second stop is harmless
    assert len(rows_of(out, "param")) == 30 * 8


def test_async_writes_off_the_training_thread(tmp_path, monkeypatch):
    threads = []
    original = writer_mod.CsvWriter.write_step

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(writer_mod.CsvWriter, "write_step", spy)
    out = tmp_path / "out"
    _train({"output_dir": str(out), "async_write": True, "monitors": {"param": {"enabled": True}}}, 3)
    assert len(threads) == 3
    assert all(t is not threading.main_thread() for t in threads)
    assert len(rows_of(out, "param")) == 3 * 8


@pytest.mark.parametrize("async_write, on_training_thread", [(None, False), (False, True)],
                         ids=["default", "sync"])
def test_rows_are_on_disk_when_step_returns(tmp_path, monkeypatch, async_write, on_training_thread):
    """The default writer writes on its own thread and step() waits for it (issue 47: a
    stalled file system then stalls training 1 s at most, test_stalled_fs.py); "async_write":
    false writes on the training thread. Either way a step's rows are on disk, whole, when
    the optimizer step that ends it returns."""
    threads = []
    original = writer_mod.CsvWriter.write_step

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(writer_mod.CsvWriter, "write_step", spy)
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "step_count_per_record": 100, "monitors": {"param": {"enabled": True}}}
    if async_write is not None:
        cfg["async_write"] = async_write
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2(cfg)
    mon.start(model=model, optimizer=opt)
    for step, (x, y) in enumerate(make_batches(5)):
        loss_fn(model, x, y).backward()
        opt.step()
        rows = rows_of(out, "param")  # no stop(), no drain
        assert [int(r["step"]) for r in rows] == [s for s in range(step + 1) for _ in range(8)]
        opt.zero_grad()
    mon.stop()
    assert len(threads) == 5
    assert all((t is threading.main_thread()) == on_training_thread for t in threads), threads


# ------------------------------------------------------------------------- values
@pytest.mark.parametrize(
    "op, value, expected",
    [
        pytest.param("min", math.nan, "nan", id="nan-min"),
        pytest.param("mean", float("nan"), "nan", id="nan-mean"),
        pytest.param("norm", math.nan, "nan", id="nan-norm"),
        pytest.param("max", math.inf, "inf", id="inf-max"),
        pytest.param("norm", math.inf, "inf", id="inf-norm"),
        pytest.param("min", -math.inf, "-inf", id="neg-inf-min"),
        pytest.param("nans", 0, "0", id="nans-0"),
        pytest.param("nans", 3, "3", id="nans-3"),
        pytest.param("nans", 3.0, "3", id="nans-float-3"),
        pytest.param("nans", 12345678, "12345678", id="nans-large"),
        pytest.param("mean", 0.0, "0", id="zero"),
        pytest.param("max", 1.5, "1.5", id="one-point-five"),
        pytest.param("min", -2.0, "-2", id="minus-two"),
    ],
)
def test_format_value(op, value, expected):
    assert format_value(op, value) == expected


@pytest.mark.parametrize("value", [0.1, 1 / 3, -123.456, 3.4028234663852886e38, 1.1754943508222875e-38, 1e-45, 7.0])
def test_format_value_round_trips_fp32(value):
    f32 = torch.tensor(value, dtype=torch.float32).item()
    text = format_value("mean", f32)
    assert torch.tensor(float(text), dtype=torch.float32).item() == f32


def test_nan_and_inf_written_in_csv(tmp_path):
    def poison(model):
        with torch.no_grad():
            model.fc1.weight[0, 0] = float("nan")
            model.fc1.weight[1, 1] = float("nan")
            model.fc2.bias[0] = float("inf")

    out = tmp_path / "out"
    _train({"output_dir": str(out), "monitors": {"param": {"enabled": True}}}, 1,
           optimizer_cls=torch.optim.SGD, poison=poison)
    rows = {(r["module_name"], r["scope"]): r for r in rows_of(out, "param")}
    w = rows[("fc1.weight", "param_origin")]
    assert [w[k] for k in ("min", "max", "mean", "norm", "nans")] == ["nan", "nan", "nan", "nan", "2"]
    b = rows[("fc2.bias", "param_origin")]
    assert b["max"] == "inf" and b["mean"] == "inf" and b["norm"] == "inf" and b["nans"] == "0"
    assert math.isfinite(float(b["min"]))
    ok = rows[("fc1.bias", "param_origin")]
    assert ok["nans"] == "0"
    for op in ("min", "max", "mean", "norm"):
        assert math.isfinite(float(ok[op]))
    # nans is always an integer literal
    assert all(r["nans"].isdigit() for r in rows.values())
