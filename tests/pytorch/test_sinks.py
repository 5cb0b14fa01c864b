"""Live sinks (``sinks``) on a real PyTorch training run, each library run offline and read
back with its own reader (TensorBoard's ``EventAccumulator``, MLflow's ``MlflowClient`` on a
local file store, SwanLab's ``DataStoreReader`` of its offline run file, W&B's offline
``.wandb`` run file with W&B's own protobuf records): every key a dashboard got equals the
value computed here, with NumPy, from the CSV rows of the same step."""

import glob
import json
import logging
import math
import re
import struct
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from support import TinyMLP, loss_fn, make_batches, read_csv
from support.extras import require
from msprobe.core.monitor_v2.errors import ConfigError
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

for _lib in ("tensorboard", "wandb", "mlflow"):
    require(_lib, "the sink tests write to the TensorBoard, W&B and MLflow sinks and read each back")
# SwanLab 0.10 requires protobuf<7 and MindSpore 2.10 protobuf>=7.34.1: pip cannot resolve both
# in the test profile, so SwanLab is installed apart (it runs with protobuf 7) and its tests say
# so when it is missing.
SWANLAB_HELP = ("the SwanLab sink test logs to it offline; pip install swanlab==0.10.3 --no-deps beside MindSpore "
                "(its protobuf<7 pin conflicts with MindSpore's protobuf>=7.34.1; it runs with protobuf 7)")

STEPS, ACC = 4, 2
OPS = ("min", "max", "mean", "norm", "nans")
MONITORS = {
    "module": {"enabled": True},
    "weight_grad": {"enabled": True, "monitor_mbs_grad": True},
    "optimizer": {"enabled": True},
    "param": {"enabled": True, "ops": ["min", "max", "norm"]},
}


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Nothing may reach the network: every library in its offline mode, in tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab_home"))


def all_sinks(out: Path, swanlab: bool = False):
    sinks = {"tensorboard": True, "wandb": {"mode": "offline", "project": "test"},
             "mlflow": {"tracking_uri": (out / "mlruns").as_uri()}}
    if swanlab:
        sinks["swanlab"] = {"mode": "offline", "project": "test"}
    return sinks


def train(out: Path, sinks=None, monitor=True, async_write=False):
    model = TinyMLP(seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = None
    if monitor:
        cfg = {"output_dir": str(out), "monitors": MONITORS, "async_write": async_write}
        if sinks is not None:
            cfg["sinks"] = sinks
        mon = TrainerMonitorV2(cfg)
        mon.start(model=model, optimizer=opt, grad_acc_steps=ACC)
    losses = []
    for x, y in make_batches(STEPS * ACC, seed=7):
        loss = loss_fn(model, x, y) / ACC
        loss.backward()
        losses.append(loss.item())
        if len(losses) % ACC == 0:
            opt.step()
            opt.zero_grad()
    if mon is not None:
        mon.stop()
    return losses, [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------- expected, from the CSV rows
def csv_steps(out: Path):
    """{step: {monitor: [row, ...]}} of rank 0, with the csv module."""
    steps = defaultdict(lambda: defaultdict(list))
    for f in sorted((out / "rank_0").glob("*.csv")):
        monitor = f.name.split("_step")[0]
        for r in read_csv(f):
            steps[int(r["step"])][monitor].append(r)
    return steps


def nonfinite(r) -> bool:
    return any(not math.isfinite(float(r[op])) for op in ("min", "max", "mean", "norm") if op in r) or \
        int(r.get("nans", 0)) > 0


def expected(out: Path, top_k: int, patterns=()):
    """{step: {key: value}} by the documented rules, computed with NumPy from the CSV."""
    want = {}
    for step, per_monitor in csv_steps(out).items():
        keys = {}
        firsts, chosen, tops = {}, {}, {}
        for monitor in ("module", "weight_grad", "optimizer", "param"):
            rows = per_monitor.get(monitor, [])
            count = Counter((r["module_name"], r["scope"]) for r in rows)
            groups = defaultdict(list)
            for r in rows:
                micro = r["micro_step"] if count[(r["module_name"], r["scope"])] > 1 else None
                r["_name"] = r["module_name"] + (f"/micro_{micro}" if micro else "")
                groups[r["scope"] + (f"/micro_{micro}" if micro else "")].append(r)
            for scope, items in groups.items():
                if "norm" in items[0]:
                    norms = np.array([float(r["norm"]) for r in items], dtype=np.float64)
                    firsts[f"{monitor}/{scope}/global_norm"] = float(np.sqrt(np.sum(norms ** 2)))
                firsts[f"{monitor}/{scope}/nonfinite_tensors"] = float(sum(nonfinite(r) for r in items))
                if "nans" in items[0]:
                    firsts[f"{monitor}/{scope}/nans"] = float(sum(int(r["nans"]) for r in items))
            for r in rows:
                if any(re.search(p, r["module_name"]) for p in patterns):
                    for op in OPS:
                        if op in r:
                            chosen[f"{monitor}/{r['scope']}/{r['_name']}/{op}"] = float(r[op])
            by_scope = defaultdict(list)
            for r in rows:
                if "norm" in r:
                    by_scope[r["scope"]].append(r)
            for scope, items in by_scope.items():
                norms = np.array([float(r["norm"]) for r in items])
                for i in np.argsort(-norms, kind="stable")[:top_k]:
                    r = items[i]
                    tops[f"{monitor}/{scope}/{r['_name']}/norm"] = float(r["norm"])
        keys.update(firsts)
        keys.update(chosen)
        for k, v in tops.items():
            keys.setdefault(k, v)
        want[step] = keys
    return want


# ---------------------------------------------------------------- read back, per library
def read_tensorboard(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    ea = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    ea.Reload()
    got = defaultdict(dict)
    for t in ea.Tags()["tensors"]:
        for ev in ea.Tensors(t):
            got[ev.step][t] = float(tensor_util.make_ndarray(ev.tensor_proto))
    return got


def read_wandb(wandb_dir: Path):
    """History records of the offline run file. W&B 0.31 ships no Python reader of it; the
    file is W&B's ``:W&B`` header and LevelDB-log records (32 KiB blocks, 7-byte record
    headers) of its own ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, got = 7, b"", defaultdict(dict)
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                step = items.pop("_step")
                got[step].update({k: float(v) for k, v in items.items() if not k.startswith("_")})
    return got


def read_mlflow(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "msprobe-monitor"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "rank_0" and run.info.status == "FINISHED"
    got = defaultdict(dict)
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            got[m.step][key] = m.value
    return got


def read_swanlab(log_dir: Path):
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (path,) = glob.glob(str(log_dir / "run-*" / "run-*.swanlab"))
    reader = DataStoreReader()
    reader.open(path)
    got = defaultdict(dict)
    try:
        for data in reader:
            rec = Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "scalar":
                got[rec.scalar.step][rec.scalar.key] = rec.scalar.value.number
    finally:
        reader.close()
    return got


def assert_equal(got, want, name: str, f32: bool = False, key=lambda k: k):
    assert sorted(got) == sorted(want), f"{name}: steps {sorted(got)} != {sorted(want)}"
    for step in want:
        w = {key(k): v for k, v in want[step].items()}
        assert set(got[step]) == set(w), (name, step, set(got[step]) ^ set(w))
        for k, v in w.items():
            g = got[step][k]
            if math.isnan(v):
                assert math.isnan(g), (name, step, k, g)
            else:  # the CSV holds 9 significant digits; global norms are sums over them
                v = float(np.float32(v)) if f32 else v
                assert g == pytest.approx(v, rel=2e-6 if f32 else 1e-7, abs=1e-30), (name, step, k, g, v)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("async_write", [False, True])
def test_every_sink_gets_the_csv_values(tmp_path, async_write):
    out = tmp_path / "out"
    sinks = dict(all_sinks(out), top_k=3, tensors=[r"^fc1\."])
    train(out, sinks, async_write=async_write)
    want = expected(out, top_k=3, patterns=[r"^fc1\."])
    assert sorted(want) == list(range(STEPS)) and all(len(w) > 30 for w in want.values())
    assert "weight_grad/unreduced/micro_2/global_norm" in want[0]  # the micro-batches are apart
    assert_equal(read_tensorboard(out / "tensorboard" / "rank_0"), want, "tensorboard", f32=True)
    assert_equal(read_wandb(out), want, "wandb")
    assert_equal(read_mlflow((out / "mlruns").as_uri()), want, "mlflow",
                 key=lambda k: re.sub(r"[^/\w.\- :]", "_", k))


def test_swanlab_gets_the_csv_values(tmp_path):
    require("swanlab", SWANLAB_HELP)
    out = tmp_path / "out"
    losses, params = train(out, dict(all_sinks(out, swanlab=True), top_k=2, tensors=[r"^fc2\.weight"]))
    assert_equal(read_swanlab(out / "swanlog"), expected(out, top_k=2, patterns=[r"^fc2\.weight"]), "swanlab")
    base_losses, base_params = train(tmp_path / "none", monitor=False)
    assert losses == base_losses and all(torch.equal(a, b) for a, b in zip(params, base_params))


def test_training_is_bit_identical_with_every_sink(tmp_path):
    base_losses, base_params = train(tmp_path / "none", monitor=False)
    losses, params = train(tmp_path / "out", all_sinks(tmp_path / "out"))
    assert losses == base_losses
    assert all(torch.equal(a, b) for a, b in zip(params, base_params))


def test_max_keys_caps_every_step_and_says_so_once(tmp_path, caplog):
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        train(out, {"tensorboard": True, "max_keys": 4, "tensors": [".*"]})
    got = read_tensorboard(out / "tensorboard" / "rank_0")
    want = expected(out, top_k=5, patterns=[".*"])
    assert sorted(got) == list(range(STEPS))
    for step, keys in got.items():
        first4 = dict(list(want[step].items())[:4])
        assert keys.keys() == first4.keys()  # the aggregates come first
        assert all(v == pytest.approx(float(np.float32(first4[k])), rel=2e-6) for k, v in keys.items())
    capped = [r for r in caplog.records if "sinks.max_keys = 4" in r.getMessage()]
    assert len(capped) == 1 and "Logged once" in capped[0].getMessage()


def test_a_failing_sink_is_said_once_and_the_rest_goes_on(tmp_path, caplog):
    out = tmp_path / "out"
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the event files would go")
    sinks = {"tensorboard": {"log_dir": str(blocker)}, "mlflow": {"tracking_uri": (out / "mlruns").as_uri()}}
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        losses, _ = train(out, sinks)
    failed = [r for r in caplog.records if "sink failed" in r.getMessage()]
    assert len(failed) == 1 and "tensorboard" in failed[0].getMessage()
    assert losses == train(tmp_path / "none", monitor=False)[0]
    assert_equal(read_mlflow((out / "mlruns").as_uri()), expected(out, top_k=5), "mlflow",
                 key=lambda k: re.sub(r"[^/\w.\- :]", "_", k))
    assert len(list((out / "rank_0").glob("weight_grad_step*.csv"))) == STEPS


def test_a_missing_library_is_a_config_error_at_construction(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ConfigError) as err:
        TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": MONITORS, "sinks": {"wandb": True}})
    assert err.value.field == "sinks.wandb" and "pip install wandb" in str(err.value)


def test_sinks_send_from_rank_0_only_by_default(tmp_path):
    """A process whose rank is not in sinks.ranks sends nothing (rank 0 without a process group)."""
    out = tmp_path / "out"
    train(out, {"tensorboard": True, "ranks": [1]})
    assert not (out / "tensorboard").exists()
    assert len(list((out / "rank_0").glob("*.csv"))) == STEPS * len(MONITORS)


def test_tensorboard_sink_files_are_private_and_no_link_is_followed(tmp_path, caplog):
    out = tmp_path / "out"
    train(out, {"tensorboard": True})
    run = out / "tensorboard" / "rank_0"
    assert (run.stat().st_mode & 0o777) == 0o750 and ((out / "tensorboard").stat().st_mode & 0o777) == 0o750
    files = list(run.glob("events.out.tfevents.*"))
    assert files and all((f.stat().st_mode & 0o777) == 0o640 for f in files)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out2").mkdir()
    (tmp_path / "out2" / "tensorboard").symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        train(tmp_path / "out2", {"tensorboard": True})
    assert not any(elsewhere.iterdir())
    (failed,) = [r for r in caplog.records if "sink failed" in r.getMessage()]
    assert "symbolic link" in failed.getMessage()
    assert len(list((tmp_path / "out2" / "rank_0").glob("weight_grad_step*.csv"))) == STEPS


def test_nonfinite_counts_follow_the_written_statistics(tmp_path):
    """A gradient with +Inf (no NaN): max and norm are Inf, min stays finite. The counts the
    sinks send equal the CSV rows' own non-finite cells, whatever ops are written."""
    for ops in (["min"], ["max"], ["min", "norm"], ["nans"], ["min", "max", "mean", "norm", "nans"]):
        out = tmp_path / "_".join(ops)
        model = TinyMLP(seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True, "ops": ops}},
                                "sinks": {"tensorboard": True, "top_k": 0}})
        mon.start(model=model, optimizer=opt)
        for x, y in make_batches(1, seed=7):  # one step: the Inf makes the updated weights NaN
            loss_fn(model, x, y).backward()
            model.fc2.bias.grad[0] = math.inf
            opt.step()
            opt.zero_grad()
        mon.stop()
        got = read_tensorboard(out / "tensorboard" / "rank_0")
        for step in (0,):
            (f,) = (out / "rank_0").glob(f"weight_grad_step{step}-{step}.csv")
            rows = [r for r in read_csv(f) if r["scope"] == "reduced"]
            want = sum(any(not math.isfinite(float(r[op])) for op in ops if op != "nans") or
                       int(r.get("nans", 0)) > 0 for r in rows)
            assert got[step]["weight_grad/reduced/nonfinite_tensors"] == want, (ops, step)
        assert want == (0 if ops in (["min"], ["nans"]) else 1), ops
