"""Passes per thread, dict outputs by key, deep nesting said (issue 20).

- A second thread calling the model under ``no_grad`` while the main thread is inside
  its training forward is its own (evaluation) pass: its rows go under ``eval_forward``,
  the training ``forward`` rows hold the training batch only. Both are checked against
  NumPy on copies of what each thread computed.
- A module returning ``{"logits": y}`` on one call and ``{"aux": a, "logits": y}`` on the
  next writes ``output.logits`` (and ``grad_output.logits``) both times.
- An output nested deeper than 16 levels is said once, naming it; its other tensors and
  the other rows are written.
"""

import logging
import threading

import pytest
import torch

from support import TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, rows_of
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

LOGGER = "msprobe.monitor_v2"
OPS = ["min", "max", "mean", "norm", "nans"]


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


def test_a_second_thread_evaluating_mid_pass_is_its_own_pass(write_config, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "ops": OPS}}}))
    mon.start(model=model, optimizer=opt)
    main = threading.current_thread()
    go, done, stop = threading.Event(), threading.Event(), threading.Event()
    seen = {"train": [], "eval": []}
    eval_x = torch.randn(7, 6, generator=torch.Generator().manual_seed(5)) * 3.0

    def evaluator():
        while go.wait() and not stop.is_set():
            go.clear()
            with torch.no_grad():
                model(eval_x)
            done.set()

    def fc1_hook(m, args, out):  # the main thread, inside its training pass: let the other thread run a whole call
        if threading.current_thread() is main and torch.is_grad_enabled():
            go.set()
            assert done.wait(30)
            done.clear()

    def fc2_hook(m, args, out):
        seen["train" if threading.current_thread() is main else "eval"].append(out.detach().clone())

    worker = threading.Thread(target=evaluator)
    worker.start()
    model.fc1.register_forward_hook(fc1_hook)
    model.fc2.register_forward_hook(fc2_hook)
    steps = make_batches(5)
    try:
        for x, y in steps:
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        stop.set()
        go.set()
        worker.join(30)
    mon.stop()
    assert mon.errors.count == 0
    assert len(seen["train"]) == len(seen["eval"]) == len(steps)
    rows = rows_of(tmp_path / "out", "module")
    for s in range(len(steps)):
        for tag in ("fc2.output.0", "TinyMLP.output.0"):
            assert_row_matches(find_row(rows, step=s, module_name=tag, scope="forward"), numpy_stats(seen["train"][s]))
            assert_row_matches(find_row(rows, step=s, module_name=tag, scope="eval_forward"),
                               numpy_stats(seen["eval"][s]))
        assert_row_matches(find_row(rows, step=s, module_name="TinyMLP.input.0", scope="eval_forward"),
                           numpy_stats(eval_x))


class KeyedHead(torch.nn.Module):
    """``{"logits": y}`` on even calls, ``{"aux": a, "logits": y}`` on odd ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(6, 3)
        self.gate = torch.nn.Linear(6, 2)
        self.calls = 0

    def forward(self, x):
        y = self.proj(x)
        self.calls += 1
        if self.calls % 2:
            return {"logits": y}
        return {"aux": self.gate(x).tanh(), "logits": y}


class KeyedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = KeyedHead()

    def forward(self, x):
        out = self.head(x)
        return out["logits"].square().mean() + sum(v.mean() for k, v in out.items() if k != "logits")


def test_dict_outputs_are_named_by_key(write_config, tmp_path):
    model = KeyedModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "ops": OPS, "targets": ["head"]}}}))
    mon.start(model=model, optimizer=opt)
    seen = []
    for s, (x, _) in enumerate(make_batches(4, d_in=6)):
        with torch.no_grad():  # not calls of the modules: no rows of their own
            y = torch.nn.functional.linear(x, model.head.proj.weight, model.head.proj.bias)
            aux = torch.nn.functional.linear(x, model.head.gate.weight, model.head.gate.bias).tanh()
        seen.append((y, aux))
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert mon.errors.count == 0
    rows = rows_of(tmp_path / "out", "module")
    names = {r["module_name"] for r in rows if r["module_name"].startswith("head.")
             and not r["module_name"].startswith(("head.proj.", "head.gate."))}
    assert names == {"head.input.0", "head.output.logits", "head.output.aux",
                     "head.grad_output.logits", "head.grad_output.aux"}, names
    for s, (y, aux) in enumerate(seen):
        assert_row_matches(find_row(rows, step=s, module_name="head.output.logits", scope="forward"), numpy_stats(y))
        # d(mean(y^2))/dy = 2y/numel
        assert_row_matches(find_row(rows, step=s, module_name="head.grad_output.logits", scope="backward"),
                           numpy_stats(2 * y / y.numel()))
        aux_rows = [r for r in rows if r["step"] == str(s) and r["module_name"] == "head.output.aux"]
        if s % 2:
            assert_row_matches(aux_rows[0], numpy_stats(aux))
        else:
            assert aux_rows == []


class Deep(torch.nn.Module):
    def forward(self, x):
        nested = x * 3.0
        for _ in range(20):
            nested = [nested]
        return x * 2.0, nested


class DeepModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 3)
        self.deep = Deep()

    def forward(self, x):
        a, _ = self.deep(self.fc(x))
        return a


def test_outputs_nested_too_deep_are_said_once(write_config, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = DeepModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "ops": OPS}}}))
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(3, d_in=6):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    said = [r.getMessage() for r in caplog.records if "nested deeper than 16" in r.getMessage()]
    assert len(said) == 1 and "deep.output" in said[0], said
    rows = rows_of(tmp_path / "out", "module")
    assert {r["step"] for r in rows if r["module_name"] == "deep.output.0"} == {"0", "1", "2"}
    assert not [r for r in rows if r["module_name"] == "deep.output.1"]
    assert {r["step"] for r in rows if r["module_name"] == "fc.output.0"} == {"0", "1", "2"}
