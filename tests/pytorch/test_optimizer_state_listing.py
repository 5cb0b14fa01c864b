"""The optimizer monitor finds the state tensors of a step again without walking every
parameter's state (stacks/state_listing.py, and the row keys it keeps in optimizer.py).
Whatever the optimizer does to its state between steps, each step's rows are those of
the state as it is after that step's update, checked with NumPy on a copy read from the
optimizer; the monitor keeps no state tensor alive. Every case runs with the native
extension's check and with the Python one."""

import gc
import types
import weakref
from typing import Callable, Dict, List, Tuple

import pytest
import torch

from support import TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, rows_of
from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.frameworks.pytorch.stacks import state_listing
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

Expected = Dict[Tuple[str, str], dict]


@pytest.fixture(params=["extension", "python"])
def check(request, monkeypatch):
    """Which of StateListing.again's two checks runs: the native extension's, or the
    Python one (what runs where the extension cannot be built)."""
    if request.param == "extension":
        assert native.extension() is not None, "the native extension did not build on this machine"
    else:
        monkeypatch.setattr(state_listing, "native", types.SimpleNamespace(extension=lambda: None))
    return request.param


def _state_now(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Expected:
    """NumPy statistics of every state tensor the optimizer holds now, by row name."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {(names[id(p)], key): numpy_stats(value)
            for p, state in opt.state.items() for key, value in state.items()
            if key != "step" and isinstance(value, torch.Tensor) and value.dim() > 0}


def _train(write_config, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
           between: Callable[[int], None] = lambda step: None) -> Tuple[str, List[Expected]]:
    mon = TrainerMonitorV2(write_config({"monitors": {"optimizer": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    expected = []
    for step, (x, y) in enumerate(make_batches(steps)):
        between(step)
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        expected.append(_state_now(model, opt))
    mon.stop()
    return mon.config.output_dir, expected


def _assert_rows(out_dir: str, expected: List[Expected]) -> None:
    rows = rows_of(out_dir, "optimizer")
    for step, state in enumerate(expected):
        written = {(r["module_name"].rsplit(".", 1)[0], r["scope"]) for r in rows if r["step"] == str(step)}
        assert written == set(state), f"step {step}: rows {sorted(written)}, state {sorted(state)}"
        for (name, key), want in state.items():
            assert_row_matches(find_row(rows, step=step, module_name=f"{name}.{key}"), want)


def test_the_state_loaded_by_load_state_dict_is_the_one_written_and_the_old_one_is_freed(write_config, check):
    model = TinyMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    other_model = TinyMLP(seed=3)
    other = torch.optim.Adam(other_model.parameters(), lr=0.01)
    for x, y in make_batches(2):
        loss_fn(other_model, x * 3, y).backward()
        other.step()
    saved = other.state_dict()
    old: List[weakref.ref] = []

    def between(step: int) -> None:
        if step == 2:
            old.extend(weakref.ref(s["exp_avg"]) for s in opt.state.values())
            opt.load_state_dict(saved)  # new tensors in the state: the old ones must go

    out, expected = _train(write_config, model, opt, 4, between)
    gc.collect()
    assert old and all(r() is None for r in old), "the monitor kept a state tensor of before load_state_dict"
    _assert_rows(out, expected)


class OutOfPlace(torch.optim.Optimizer):
    """A momentum optimizer that puts a new tensor in its state at every step (as
    functional-style optimizers do), and one more entry from the third step on."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        self.steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["buf"] = state["buf"] * 0.9 + p.grad if "buf" in state else p.grad.clone()
                if self.steps >= 3:
                    state["peak"] = torch.maximum(state.get("peak", state["buf"].abs()), state["buf"].abs())
                p.add_(state["buf"], alpha=-group["lr"])


def test_state_tensors_replaced_and_added_at_every_step_are_the_ones_written(write_config, check):
    model = TinyMLP()
    opt = OutOfPlace(model.parameters())
    out, expected = _train(write_config, model, opt, 4)
    assert {key for _, key in expected[3]} == {"buf", "peak"}
    _assert_rows(out, expected)


def test_a_parameter_whose_state_begins_later_and_a_cleared_state_are_written_as_they_are(write_config, check):
    model = TinyMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def between(step: int) -> None:
        model.fc2.weight.requires_grad_(step >= 1)  # no gradient, no state before step 1
        if step == 3:
            opt.state.clear()  # Adam starts the state anew at this step

    out, expected = _train(write_config, model, opt, 5, between)
    assert ("fc2.weight", "exp_avg") not in expected[0] and ("fc2.weight", "exp_avg") in expected[1]
    _assert_rows(out, expected)
