"""Incident evidence with a real model: a NaN written into one weight before step K.

- ``alert.dump`` keeps the parameters, gradients and root inputs of step K as they were
  before the update; replaying them offline in a fresh model gives the same non-finite
  gradient positions and the same finite values;
- ``alert.stop_on_nonfinite`` raises before the update (parameters bit-identical);
- the byte budget holds; tensors that died are listed as skipped;
- ``anomalies.jsonl`` matches the CSV rows of step K (read independently);
- without an anomaly, training is bit-identical with and without these fields.
"""

import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch

from support import TinyMLP, make_batches, rows_of
from msprobe.core.monitor_v2.errors import ConfigError, NonFiniteGradientError
from msprobe.core.monitor_v2.evidence import load_dump
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

K = 3  # the step whose gradients go non-finite


def poison(model):
    # one output column goes NaN: fc2's gradients are partly finite, fc1's all NaN
    with torch.no_grad():
        model.fc2.weight[0, 0] = float("nan")


def train(write_config, alert, steps=5, nan_step=K, monitors=None, keep_inputs=True, on_step=None, **extra):
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cfg = {"alert": alert, "monitors": monitors or {"weight_grad": {"enabled": True}}, **extra}
    mon = TrainerMonitorV2(write_config(cfg))
    mon.start(model=model, optimizer=opt)
    seen = {}
    try:
        for s, (x, y) in enumerate(make_batches(steps)):
            if s == nan_step:
                poison(model)
            inp = x if keep_inputs else x.clone()  # a clone dies after backward
            torch.nn.functional.mse_loss(model(inp), y).backward()
            del inp
            if s == nan_step:
                seen["before"] = {n: p.detach().clone() for n, p in model.named_parameters()}
                seen["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            if on_step is not None:
                on_step(s, opt)
            else:
                opt.step()
            opt.zero_grad()
    finally:
        mon.stop()
    return model, mon, seen


def dump_dir(tmp_path, step=K, rank=0) -> Path:
    return tmp_path / "out" / f"rank_{rank}" / f"dump_step{step}"


def same_nonfinite(a, b):
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(a[torch.isfinite(a)], b[torch.isfinite(b)])


def test_dump_replays_the_failing_step_offline(write_config, tmp_path):
    _, _, seen = train(write_config, {"dump": True})
    assert not dump_dir(tmp_path, K + 1).exists()  # the first non-finite step only
    dump = load_dump(str(dump_dir(tmp_path)))
    man = dump["manifest"]
    assert (man["step"], man["rank"], man["skipped"]) == (K, 0, [])
    assert man["bytes"] == sum(t["bytes"] for t in man["tensors"]) <= man["max_bytes"] == 256 << 20
    # parameters with a non-finite gradient first (here all four hold a NaN somewhere), each
    # followed by its gradient; then the root module's inputs
    names = [(t["kind"], t["name"]) for t in man["tensors"]]
    assert names[:2] == [("param", "fc1.weight"), ("grad", "fc1.weight")]
    assert ("input", "call0.args.0") in names
    # as they were before the update
    for name, value in seen["before"].items():
        same_nonfinite(dump["params"][name], value)
        same_nonfinite(dump["grads"][name], seen["grads"][name])
    assert math.isnan(dump["params"]["fc2.weight"][0, 0])

    # the replay: a fresh model, the dumped parameters, the dumped inputs
    fresh = TinyMLP(seed=123)
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            p.copy_(dump["params"][name])
    (call,) = dump["calls"]
    y = make_batches(K + 1)[K][1]  # the loss's target is not a model input: the script keeps it
    torch.nn.functional.mse_loss(fresh(*call["args"], **call["kwargs"]), y).backward()
    for name, p in fresh.named_parameters():
        same_nonfinite(p.grad, dump["grads"][name])
    assert torch.isfinite(dump["grads"]["fc2.weight"][1:]).all()  # some values are finite: compared
    mode = os.stat(dump_dir(tmp_path) / "tensors.pt").st_mode & 0o777
    assert mode == 0o640 and os.stat(dump_dir(tmp_path)).st_mode & 0o777 == 0o750


def test_stop_on_nonfinite_raises_before_the_update(write_config, tmp_path):
    holder = {}

    def step(s, opt):
        if s == K:
            holder["before"] = copy.deepcopy(opt.state_dict())
            with pytest.raises(NonFiniteGradientError) as err:
                opt.step()
            holder["err"] = err.value
            raise RuntimeError("stop")  # what the job would do: end
        opt.step()

    with pytest.raises(RuntimeError, match="stop"):
        train(write_config, {"dump": True, "stop_on_nonfinite": True}, on_step=step)
    err = holder["err"]
    assert err.step == K and err.names[0] == "fc1.weight" and len(err.names) == 4
    assert f"step {K}: 4 of 4 gradient(s) are non-finite" in str(err)
    assert str(dump_dir(tmp_path)) in str(err) and err.dump == str(dump_dir(tmp_path))
    assert (dump_dir(tmp_path) / "manifest.json").exists()
    # the step's rows were written (the step ended without its update): the alert saw them
    lines = (tmp_path / "out" / "rank_0" / "anomalies.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["step"] == K


def test_stop_leaves_the_parameters_bit_identical(write_config, tmp_path):
    got = {}

    def step(s, opt):
        if s == K:
            params = [p for g in opt.param_groups for p in g["params"]]
            before = [p.detach().clone() for p in params]
            bufs = [opt.state[p]["momentum_buffer"].clone() for p in params]
            with pytest.raises(NonFiniteGradientError):
                opt.step()
            for p, b in zip(params, before):
                assert torch.equal(p.isnan(), b.isnan()) and torch.equal(p[~p.isnan()], b[~b.isnan()])
            for p, b in zip(params, bufs):
                assert torch.equal(opt.state[p]["momentum_buffer"], b)  # no update of any kind
            got["checked"] = True
            return
        if s > K:  # the NaN is still in the weight: every later update is refused too
            with pytest.raises(NonFiniteGradientError, match=f"step {s}:"):
                opt.step()
            got["again"] = True
            return
        opt.step()

    train(write_config, {"stop_on_nonfinite": True}, steps=K + 2, on_step=step)
    assert got == {"checked": True, "again": True}
    assert not dump_dir(tmp_path).exists()  # no dump asked for


def test_byte_budget_and_dead_inputs(write_config, tmp_path):
    budget = 200  # fc1.weight is 240 bytes: skipped; fc1.bias (40) fits
    train(write_config, {"dump": {"max_bytes": budget}}, keep_inputs=False)
    man = json.loads((dump_dir(tmp_path) / "manifest.json").read_text())
    assert man["max_bytes"] == budget and man["bytes"] <= budget
    assert man["bytes"] == sum(t["bytes"] for t in man["tensors"])
    skipped = {(s["kind"], s["name"]): s for s in man["skipped"]}
    assert "over the byte budget" in skipped[("param", "fc1.weight")]["why"]
    assert skipped[("param", "fc1.weight")]["bytes"] == 240
    assert skipped[("input", "call0.args.0")]["why"] == "no longer alive"
    dump = load_dump(str(dump_dir(tmp_path)))
    assert dump["calls"][0]["args"] == [None]
    assert set(dump["params"]) | {n for k, n in skipped if k == "param"} == {
        "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    on_disk = torch.load(dump_dir(tmp_path) / "tensors.pt", weights_only=True)
    assert sum(t.numel() * t.element_size() for t in on_disk.values()) == man["bytes"]


@pytest.mark.parametrize("async_write", [False, True])
def test_anomalies_jsonl_matches_the_csv_rows(write_config, tmp_path, async_write):
    monitors = {"module": {"enabled": True, "targets": ["fc2"]}, "weight_grad": {"enabled": True}}
    train(write_config, {"spike_factor": None}, monitors=monitors, async_write=async_write)
    path = tmp_path / "out" / "rank_0" / "anomalies.jsonl"
    assert os.stat(path).st_mode & 0o777 == 0o640
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(line["step"] == K for line in lines)  # the first anomalous step only
    assert [line["first"] for line in lines] == [True] + [False] * (len(lines) - 1)
    assert [line["order"] for line in lines] == sorted(line["order"] for line in lines)
    assert lines[0]["monitor"] == "module" and lines[0]["scope"] == "forward"

    def bad(r):
        return r["nans"] != "0" or any(not math.isfinite(float(r[op])) for op in ("min", "max", "mean", "norm"))

    for monitor in ("module", "weight_grad"):
        csv_rows = [r for r in rows_of(tmp_path / "out", monitor) if r["step"] == str(K)]
        want = [r for r in csv_rows if bad(r)]
        got = [line for line in lines if line["monitor"] == monitor]
        assert [(g["module_name"], g["scope"]) for g in got] == [(r["module_name"], r["scope"]) for r in want]
        for g, r in zip(got, want):
            assert (g["rows_nonfinite"], g["rows_total"], g["kind"]) == (len(want), len(csv_rows), "nonfinite")
            assert g["stats"]["nans"] == int(r["nans"]) and g["rank"] == 0 and g["vpp_stage"] == int(r["vpp_stage"])
            assert g["micro_step"] == (int(r["micro_step"]) if r.get("micro_step") else None)
            for op in ("min", "max", "mean", "norm"):
                value = g["stats"][op]
                if isinstance(value, str):
                    assert value in ("nan", "inf", "-inf") and value == r[op].lower().replace("+", "")
                else:
                    assert value == pytest.approx(float(r[op]), rel=1e-6)


def test_training_is_bit_identical_when_nothing_is_non_finite(write_config, tmp_path):
    plain, _, _ = train(write_config, None, nan_step=None, steps=6)
    guarded, _, _ = train(write_config, {"dump": True, "stop_on_nonfinite": True}, nan_step=None, steps=6)
    for (n, a), (_, b) in zip(plain.named_parameters(), guarded.named_parameters()):
        assert torch.equal(a, b), n
    rank_dir = tmp_path / "out" / "rank_0"
    assert not list(rank_dir.glob("dump_step*")) and not (rank_dir / "anomalies.jsonl").exists()


@pytest.mark.parametrize("alert, problem", [
    ({"dump": 5}, "alert.dump"),
    ({"dump": {"max_bytes": 0}}, "alert.dump.max_bytes"),
    ({"dump": {"bytes": 10}}, "alert.dump.bytes"),
    ({"stop_on_nonfinite": "yes"}, "alert.stop_on_nonfinite"),
])
def test_bad_evidence_fields_fail_at_construction(write_config, alert, problem):
    with pytest.raises(ConfigError) as err:
        TrainerMonitorV2(write_config({"alert": alert, "monitors": {"weight_grad": {"enabled": True}}}))
    assert err.value.field == problem


def test_an_anomalies_file_that_cannot_be_written_costs_neither_the_training_nor_the_rows(tmp_path, caplog):
    # anomalies.jsonl is a link planted by someone else: refused (never written through),
    # said once, and the step's rows and the training go on
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True}}, "alert": True})
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon.start(model, opt)
    target = tmp_path / "elsewhere.txt"
    target.write_text("not the monitor's\n")
    (out / "rank_0" / "anomalies.jsonl").symlink_to(target)
    with caplog.at_level("WARNING", logger="msprobe.monitor_v2"):
        for step, (x, y) in enumerate(make_batches(6)):
            if step == 3:
                with torch.no_grad():
                    model.fc2.weight[0, 0] = float("nan")
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        mon.stop()
    assert target.read_text() == "not the monitor's\n"
    errors = [r.getMessage() for r in caplog.records if "could not write anomalies.jsonl" in r.getMessage()]
    assert len(errors) == 1
    assert sorted({int(r["step"]) for r in rows_of(out, "weight_grad")}) == list(range(6))
