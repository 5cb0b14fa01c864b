"""A run that dies and is resumed from its checkpoint into the same output_dir (issue 47,
items 5 and 6).

The dying run (``workers/dying_run.py``, a process of its own) trains ``TinyMLP`` with
``weight_grad``, ``param`` and ``"alert": {"dump": true}``, saves a checkpoint before step
``RESUME``, gets a NaN written into ``fc2.weight[0, 0]`` before step ``NAN_DEAD`` and is
killed with SIGKILL after step ``DIE``. The resumed run loads the checkpoint and trains
from step ``RESUME`` (``start(first_step=RESUME)``) into the same directory, with a NaN of
its own written into ``fc2.weight[1, 1]``:

- before step ``NAN_RESUMED``, a later step: ``summary``/``anomalies`` name the resumed
  run's first NaN and its alert first, and the dead run's as an earlier run's;
- before step ``NAN_DEAD`` again: the resumed run's dump of that step gets a new name,
  the dead run's dump stays byte for byte, the log says which, and the reading tools
  list both.

What the reports say is checked against the files read independently: the dead run's
rows and alert lines are the ones on disk when it died (a copy taken then), the resumed
run's are the rest; the dumps against the tensors each run saved itself.
"""

import csv
import hashlib
import json
import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch

from support import TinyMLP, make_batches
from support.launch import worker_env

from analysis_helpers import cli
from msprobe.core.monitor_v2.errors import NonFiniteGradientError
from msprobe.core.monitor_v2.evidence import load_dump
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

WORKER = Path(__file__).parent / "workers" / "dying_run.py"
RESUME, NAN_DEAD, DIE, NAN_RESUMED, LAST = 10, 15, 16, 17, 20


def config(out: Path) -> Dict[str, Any]:
    return {"output_dir": str(out), "alert": {"dump": True},
            "monitors": {"weight_grad": {"enabled": True}, "param": {"enabled": True}}}


@pytest.fixture(scope="module")
def dead_run(tmp_path_factory) -> Path:
    """The directory of the dead run: ``out/`` (its output as it died), ``ckpt/``."""
    root = tmp_path_factory.mktemp("dead_run")
    (root / "ckpt").mkdir()
    cfg = root / "monitor_config.json"
    cfg.write_text(json.dumps(config(root / "out")))
    proc = subprocess.run([sys.executable, str(WORKER), str(cfg), str(root / "ckpt"), str(NAN_DEAD), str(DIE),
                           str(RESUME)], env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stdout + proc.stderr  # killed by its own SIGKILL, after the dump
    assert (root / "out" / "rank_0" / f"dump_step{NAN_DEAD}" / "manifest.json").exists()
    return root


@pytest.fixture
def resumed_dir(dead_run, tmp_path) -> Path:
    """A copy of the dead run's directory, for one resumed run."""
    shutil.copytree(dead_run, tmp_path / "run")
    return tmp_path / "run"


def resume(run: Path, nan_step: int) -> Dict[str, Any]:
    """The resumed run, in this process: from the checkpoint, into the same output_dir; a
    NaN written into ``fc2.weight[1, 1]`` before ``nan_step``. Returns its alerter's run id
    and the parameters and gradients of ``nan_step`` before the update."""
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = torch.load(run / "ckpt" / "ckpt.pt")
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    (run / "monitor_config.json").write_text(json.dumps(config(run / "out")))
    mon = TrainerMonitorV2(str(run / "monitor_config.json"))
    mon.start(model=model, optimizer=opt, first_step=RESUME)
    seen: Dict[str, Any] = {}
    for step, (x, y) in enumerate(make_batches(LAST + 1)):
        if step < RESUME:
            continue
        if step == nan_step:
            with torch.no_grad():
                model.fc2.weight[1, 1] = float("nan")
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == nan_step:
            seen["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            seen["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    mon.stop()
    seen["run"] = mon._alerter.run.id
    return seen


# ------------------------------------------------------------------ independent reading
def rows_by_run(dead: Path, run: Path) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """``(dead, resumed)``: every CSV row of the final output, the dead run's being the
    lines each file had when it died (the fixture's copy), the resumed run's the rest."""
    out: Tuple[List[Dict[str, Any]], List[Dict[str, Any]]] = ([], [])
    for f in sorted((run / "out" / "rank_0").glob("*.csv")):
        before = dead / "out" / "rank_0" / f.name
        n_dead = sum(1 for _ in open(before)) - 1 if before.exists() else 0
        with open(f, newline="") as fh:
            for i, row in enumerate(csv.DictReader(fh)):
                vals = [float(row[k]) for k in ("min", "max", "mean", "norm")]
                row.update(file=f.name, line=i + 2, step=int(row["step"]), nans=int(row["nans"]),
                           bad=int(row["nans"]) > 0 or not all(math.isfinite(v) for v in vals))
                out[0 if i < n_dead else 1].append(row)
    return out


def alert_lines(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def both(*argv: Any):
    """The result of both engines (which must print the same)."""
    ref = cli(*argv, "--engine", "reference")
    new = cli(*argv)
    assert (new.code, new.out, new.err) == (ref.code, ref.out, ref.err)
    return new


# ------------------------------------------------------------------ item 6
def test_the_resumed_runs_first_nan_and_alert_come_first(dead_run, resumed_dir):
    seen = resume(resumed_dir, NAN_RESUMED)
    dead_rows, resumed_rows = rows_by_run(dead_run, resumed_dir)
    assert {r["step"] for r in resumed_rows} == set(range(RESUME, LAST + 1))
    rewritten = {r["step"] for r in resumed_rows}
    # the latest rows of each step: the resumed run's, and the dead run's of the steps it did not train again
    latest = resumed_rows + [r for r in dead_rows if r["step"] not in rewritten]
    earlier = [r for r in dead_rows if r["step"] in rewritten]
    assert min(r["step"] for r in latest if r["bad"]) == NAN_RESUMED
    assert min(r["step"] for r in earlier if r["bad"]) == NAN_DEAD

    data = both("anomalies", resumed_dir / "out", "--json").json()
    nf = data["nonfinite"]
    # the first row of the step in execution order: the poisoned parameter as the step began
    first = nf["first"]
    assert (first["step"], first["monitor"], first["scope"], first["tensor"]) == \
        (NAN_RESUMED, "param", "param_origin", "fc2.weight")
    want = next(r for r in resumed_rows if r["step"] == NAN_RESUMED and r["module_name"] == "fc2.weight"
                and r["scope"] == "param_origin")
    assert (first["file"].split("/")[-1], first["line"]) == (want["file"], want["line"])
    # its NaN count, from a NumPy copy of the tensor the resumed run trained with
    assert first["values"]["nans"] == int(np.isnan(seen["params"]["fc2.weight"].numpy()).sum()) == 1
    assert nf["count"] == sum(r["bad"] for r in latest)
    old = nf["earlier_runs"]["first"]
    assert (old["step"], old["monitor"], old["scope"], old["tensor"]) == \
        (NAN_DEAD, "param", "param_origin", "fc2.weight")
    was = next(r for r in dead_rows if r["step"] == NAN_DEAD and r["module_name"] == "fc2.weight"
               and r["scope"] == "param_origin")
    assert (old["file"].split("/")[-1], old["line"]) == (was["file"], was["line"])
    assert nf["earlier_runs"]["count"] == sum(r["bad"] for r in earlier)
    loc = data["localisation"]["per_rank"][0]
    assert (loc["first_bad_step"], loc["last_clean_step"]) == (NAN_RESUMED, NAN_RESUMED - 1)

    # anomalies.jsonl: the dead run's block, then the resumed run's, each naming its run
    lines = alert_lines(resumed_dir / "out" / "rank_0" / "anomalies.jsonl")
    n_dead = len(alert_lines(dead_run / "out" / "rank_0" / "anomalies.jsonl"))
    dead_id = lines[0]["run"]
    assert {x["run"] for x in lines[:n_dead]} == {dead_id} and {x["run"] for x in lines[n_dead:]} == {seen["run"]}
    assert [x["first"] for x in lines].count(True) == 2
    alert = data["alerts"]["per_rank"][0]
    assert (alert["first"]["step"], alert["run"], alert["first"]["line"]) == (NAN_RESUMED, seen["run"], n_dead + 1)
    assert alert["records"] == len(lines) - n_dead
    assert alert["explanation"].startswith("the alert and this report name the same tensor, fc2.weight")
    assert [(b["first"]["step"], b["run"], b["first"]["line"], b["records"]) for b in alert["earlier_runs"]] == \
        [(NAN_DEAD, dead_id, 1, n_dead)]

    text = both("summary", resumed_dir / "out").out
    assert (f"  first NaN/Inf:     rank 0, step {NAN_RESUMED}, parameters at step start: fc2.weight "
            f"(param param_origin) is nan [rank_0/{want['file']}:{want['line']}]") in text
    assert (f"  earlier runs:      rank 0, step {NAN_DEAD}, parameters at step start: fc2.weight "
            f"(param param_origin) is nan [rank_0/{was['file']}:{was['line']}]; {len([r for r in earlier if r['bad']])} "
            f"non-finite row(s) among the rows that a later run wrote again") in text
    assert f"[rank_0/anomalies.jsonl:{n_dead + 1}] (run {seen['run']} started " in text
    assert (f"  earlier alerts:    rank 0: run {dead_id} started {lines[0]['run_started']}: step {NAN_DEAD}, "
            f"nonfinite fc2.weight (param, parameters at step start) [rank_0/anomalies.jsonl:1]") in text
    assert text.index("first NaN/Inf:") < text.index("earlier runs:")
    text = both("anomalies", resumed_dir / "out").out
    assert text.index("ONLINE ALERT (") < text.index("ONLINE ALERTS OF EARLIER RUNS") < text.index(
        "FIRST NON-FINITE VALUE OF EARLIER RUNS")


def test_blocks_of_an_older_version_are_told_apart_by_their_first_line(dead_run, resumed_dir):
    """An anomalies.jsonl without run fields (written before they existed): each block
    begins with its ``first`` line, and the last is the latest run's."""
    resume(resumed_dir, NAN_RESUMED)
    path = resumed_dir / "out" / "rank_0" / "anomalies.jsonl"
    lines = alert_lines(path)
    path.write_text("".join(json.dumps({k: v for k, v in x.items() if k not in ("run", "run_started")}) + "\n"
                            for x in lines))
    alert = both("anomalies", resumed_dir / "out", "--json").json()["alerts"]["per_rank"][0]
    starts = [i + 1 for i, x in enumerate(lines) if x.get("first")]
    assert (alert["first"]["step"], alert["first"]["line"], alert["run"]) == (NAN_RESUMED, starts[1], None)
    assert [(b["first"]["step"], b["first"]["line"]) for b in alert["earlier_runs"]] == [(NAN_DEAD, starts[0])]


# ------------------------------------------------------------------ item 5
def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def same_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal as NumPy arrays: the same NaN positions and the same finite values."""
    a, b = got.numpy(), want.numpy()
    assert a.shape == b.shape and np.array_equal(np.isnan(a), np.isnan(b))
    assert np.array_equal(a[~np.isnan(a)], b[~np.isnan(b)])


def test_a_resumed_run_that_dumps_the_same_step_keeps_the_first_dump(dead_run, resumed_dir, caplog):
    rank_dir = resumed_dir / "out" / "rank_0"
    first = rank_dir / f"dump_step{NAN_DEAD}"
    before = {p.name: sha256(p) for p in first.iterdir()}
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        seen = resume(resumed_dir, NAN_DEAD)
    second = rank_dir / f"dump_step{NAN_DEAD}.2"
    assert {p.name: sha256(p) for p in first.iterdir()} == before  # the dead run's evidence, untouched
    assert sorted(p.name for p in rank_dir.glob("dump_step*")) == [first.name, second.name]
    said = [r.getMessage() for r in caplog.records if "dumped to" in r.getMessage()]
    assert said == [f"monitor_v2 alert: rank 0 step {NAN_DEAD}: gradients non-finite before the update; 9 tensor(s) "
                    f"(920 bytes, 0 skipped) dumped to {second} (dump_step{NAN_DEAD} holds an earlier run's dump of "
                    f"this step: kept as it was, this one has a new name)"]

    # each dump holds its own run's tensors, compared with what each run saved itself
    dead_saw = torch.load(dead_run / "ckpt" / "nan_step.pt")
    for path, saw in ((first, dead_saw), (second, seen)):
        dump = load_dump(str(path))
        assert dump["params"].keys() == saw["params"].keys()
        for name in saw["params"]:
            same_tensor(dump["params"][name], saw["params"][name])
            same_tensor(dump["grads"][name], saw["grads"][name])
    assert math.isnan(load_dump(str(first))["params"]["fc2.weight"][0, 0])
    assert math.isnan(load_dump(str(second))["params"]["fc2.weight"][1, 1])
    dead_id = alert_lines(dead_run / "out" / "rank_0" / "anomalies.jsonl")[0]["run"]
    assert json.loads((first / "manifest.json").read_text())["run"] == dead_id
    assert json.loads((second / "manifest.json").read_text())["run"] == seen["run"]

    data = both("anomalies", resumed_dir / "out", "--json").json()
    assert [(d["step"], d["dump"], d["dir"].split("/")[-1], d["run"]) for d in data["dumps"]] == \
        [(NAN_DEAD, 1, first.name, dead_id), (NAN_DEAD, 2, second.name, seen["run"])]
    text = both("anomalies", resumed_dir / "out").out
    assert f"  rank 0 step {NAN_DEAD}: rank_0/{first.name}, 9 tensor(s)" in text
    assert f"  rank 0 step {NAN_DEAD}: rank_0/{second.name}, 9 tensor(s)" in text
    summary = both("summary", resumed_dir / "out").out
    line = next(x for x in summary.splitlines() if x.startswith("  dump:"))
    assert line.startswith(f"  dump:              rank 0 step {NAN_DEAD}: rank_0/{second.name}, ")  # the latest run's
    assert line.endswith(f"; 2 dump(s) in all (also rank_0/{first.name})")


def test_stop_on_nonfinite_names_the_new_dump(tmp_path):
    """Two runs in one process into one output_dir, both stopped by a non-finite gradient
    at the same step: the second exception names the second dump's directory."""
    cfg = tmp_path / "monitor_config.json"
    cfg.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "monitors": {"weight_grad": {"enabled": True}},
                               "alert": {"dump": True, "stop_on_nonfinite": True}}))
    dumps = []
    for _ in range(2):
        model = TinyMLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        mon = TrainerMonitorV2(str(cfg))
        mon.start(model=model, optimizer=opt)
        with pytest.raises(NonFiniteGradientError) as info:
            for step, (x, y) in enumerate(make_batches(4)):
                if step == 2:
                    with torch.no_grad():
                        model.fc2.weight[0, 0] = float("nan")
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        mon.stop()
        dumps.append(info.value.dump)
    assert dumps == [str(tmp_path / "out" / "rank_0" / "dump_step2"), str(tmp_path / "out" / "rank_0" / "dump_step2.2")]
    assert load_dump(dumps[0])["manifest"]["run"] != load_dump(dumps[1])["manifest"]["run"]
