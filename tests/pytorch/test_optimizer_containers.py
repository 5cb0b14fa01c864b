"""Containers of optimizers (issue 46): what holds several optimizers, each over part of
the model, gives ``optimizer`` rows under the model's parameter names and ``param`` /
``reduced`` rows for the parameters of every optimizer it holds, and ends the monitor's
step once per step of the container, never once per optimizer inside.

Containers: a user's own wrapper with ``.optimizers`` (not a torch optimizer), one shaped
like TorchTitan's (a ``torch.optim.Optimizer`` over every parameter, whose own ``state``
stays empty), a plain list passed to ``start()`` (stepped one optimizer after the other,
in the reverse order), and TorchTitan's real ``OptimizersContainer`` built as its
``Trainer`` builds it (``config.optimizer.build(model_parts=...)``, one AdamW per model
part). Values are checked against NumPy on copies of the inner optimizers' own state and
of the gradients, and the monitored training against an unmonitored copy, bit for bit.

What the monitor cannot read is said once at WARNING: an object without torch's
``param_groups``/``state`` (inside a container or passed alone), a container that keeps
its optimizers where the monitor does not look (its own state stays empty)."""

import logging
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

from support import TinyMLP, assert_row_matches, find_row, make_batches, numpy_stats, rows_of
from support.extras import require
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STATES = ("exp_avg", "exp_avg_sq")
STEPS = 3
LOGGER = "msprobe.monitor_v2"


class OptimizerList:
    """A user's own container: not a torch optimizer, its optimizers in ``.optimizers``."""

    def __init__(self, optimizers: List[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class MergedContainer(torch.optim.Optimizer):
    """Shaped like TorchTitan's ``OptimizersContainer``: a ``torch.optim.Optimizer`` over
    every parameter (one merged param group, step hooks of its own, an own ``state`` that
    stays empty) whose ``step()`` steps each optimizer it holds."""

    def __init__(self, optimizers: List[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        params = [p for opt in self.optimizers for group in opt.param_groups for p in group["params"]]
        torch.optim.Optimizer.__init__(self, params, {})

    def step(self, closure: Any = None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class HiddenContainer(torch.optim.Optimizer):
    """A container that keeps its optimizers where the monitor does not look (a dict):
    its own ``state`` stays empty, so the monitor can read no moment."""

    def __init__(self, optimizers: List[torch.optim.Optimizer]) -> None:
        self.by_name = {f"part{k}": opt for k, opt in enumerate(optimizers)}
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        torch.optim.Optimizer.__init__(self, params, {})

    def step(self, closure: Any = None) -> None:
        for opt in self.by_name.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.by_name.values():
            opt.zero_grad(set_to_none=set_to_none)


class PlainSGD:
    """An optimizer of a user's own: plain SGD with no ``param_groups`` nor ``state``."""

    def __init__(self, params: List[torch.Tensor], lr: float) -> None:
        self.params, self.lr = list(params), lr

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _two_adamw(model: TinyMLP) -> List[torch.optim.Optimizer]:
    """Two AdamW over the two halves of the model, with different learning rates."""
    return [torch.optim.AdamW(model.fc1.parameters(), lr=0.01), torch.optim.AdamW(model.fc2.parameters(), lr=0.03)]


# Each builder: model -> (what start() gets as model, as optimizer; the optimizers that hold
# the moments; one training step of the optimizer; zero_grad). The steps look the method up
# at each call, as a training loop does (the monitor may wrap an instance's step()).
Built = Tuple[Any, Any, List[torch.optim.Optimizer], Callable[[], None], Callable[[], None]]


def _own_wrapper(model: TinyMLP) -> Built:
    container = OptimizerList(_two_adamw(model))
    return model, container, container.optimizers, lambda: container.step(), lambda: container.zero_grad()


def _merged(model: TinyMLP) -> Built:
    container = MergedContainer(_two_adamw(model))
    return model, container, container.optimizers, lambda: container.step(), lambda: container.zero_grad()


def _plain_list(model: TinyMLP) -> Built:
    optimizers = _two_adamw(model)

    def step() -> None:  # one after the other, the last first: the order is the user's
        for opt in reversed(optimizers):
            opt.step()

    def zero_grad() -> None:
        for opt in optimizers:
            opt.zero_grad()

    return model, optimizers, optimizers, step, zero_grad


def _torchtitan(model: TinyMLP) -> Built:
    titan = require("torchtitan.components.optimizer", "the optimizer monitor reads TorchTitan's real "
                                                       "OptimizersContainer")
    # one model part a pipeline stage, as TorchTitan's Trainer passes them: one AdamW each
    parts = [model.fc1, model.fc2]
    container = titan.default_adamw(lr=0.01).build(model_parts=parts)
    assert isinstance(container, titan.OptimizersContainer) and len(container.optimizers) == 2
    return parts, container, container.optimizers, lambda: container.step(), lambda: container.zero_grad()


BUILDERS = {"own_wrapper": _own_wrapper, "merged_like_torchtitan": _merged, "plain_list": _plain_list,
            "torchtitan": _torchtitan}


def _row_names(start_model: Any) -> Dict[int, str]:
    """Parameter id -> the name its rows carry (a list of model parts: ``<part>:<name>``)."""
    if isinstance(start_model, list):
        return {id(p): f"{k}:{n}" for k, part in enumerate(start_model) for n, p in part.named_parameters()}
    return {id(p): n for n, p in start_model.named_parameters()}


def _config(tmp_path, patch: bool) -> Dict[str, Any]:
    return {"output_dir": str(tmp_path / "out"), "patch_optimizer_step": patch,
            "monitors": {"optimizer": {"enabled": True}, "param": {"enabled": True},
                         "weight_grad": {"enabled": True}}}


def _train(builder: Callable[[TinyMLP], Built], tmp_path=None, patch: bool = True) -> Dict[str, Any]:
    """Train ``STEPS`` steps; with ``tmp_path``, monitored. Returns the losses, the final
    parameters, and per step copies of the gradients and of the inner optimizers' state."""
    model = TinyMLP(seed=3)
    start_model, optimizer, inner, step, zero_grad = builder(model)
    names = _row_names(start_model)
    hookables = [o for o in [optimizer, *inner] if isinstance(o, torch.optim.Optimizer)]
    hooks_before = _hooks_of(hookables)
    mon = None
    if tmp_path is not None:
        mon = TrainerMonitorV2(_config(tmp_path, patch))
        mon.start(start_model, optimizer)
    losses, grads, states = [], [], []
    for x, y in make_batches(STEPS, seed=5):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({names[id(p)]: p.grad.detach().clone() for p in model.parameters()})
        step()
        states.append({(names[id(p)], s): st[s].detach().clone()
                       for opt in inner for p, st in opt.state.items() for s in STATES})
        zero_grad()
        if mon is not None and not patch:
            mon.step()
    out = {"losses": losses, "params": [p.detach().clone() for p in model.parameters()], "grads": grads,
           "states": states, "names": sorted(names.values())}
    if mon is not None:
        out["steps"], out["optimizer_steps"] = mon.current_step, mon.optimizer_steps
        mon.stop()
        # stop() leaves the container and its optimizers as they were
        assert _hooks_of(hookables) == hooks_before
        assert not any("step" in vars(o) for o in [optimizer, *inner] if not isinstance(o, list))
    return out


def _hooks_of(optimizers: List[torch.optim.Optimizer]) -> List[Tuple[int, int]]:
    return [(len(o._optimizer_step_pre_hooks), len(o._optimizer_step_post_hooks)) for o in optimizers]


@pytest.mark.parametrize("kind,patch", [
    ("own_wrapper", True),
    ("merged_like_torchtitan", True),
    ("plain_list", True),
    ("plain_list", False),
    ("torchtitan", True),
    ("torchtitan", False),  # as the TorchTitan user: mon.step() after train_step
])
def test_container_gives_rows_of_every_inner_optimizer(tmp_path, kind, patch):
    builder = BUILDERS[kind]
    seen = _train(builder, tmp_path, patch)
    plain = _train(builder)
    # training computes exactly what it computes without the monitor
    assert all(torch.equal(a, b) for a, b in zip(seen["losses"], plain["losses"]))
    assert all(torch.equal(a, b) for a, b in zip(seen["params"], plain["params"]))
    # one monitor step per step of the container (never one per optimizer inside)
    assert seen["steps"] == STEPS and seen["optimizer_steps"] == STEPS

    out = tmp_path / "out"
    optimizer_rows, param_rows = rows_of(out, "optimizer"), rows_of(out, "param")
    grad_rows = rows_of(out, "weight_grad")
    names = seen["names"]
    assert len(names) == 4 and len(optimizer_rows) == STEPS * len(names) * len(STATES)
    for step in range(STEPS):
        states = seen["states"][step]
        assert set(states) == {(n, s) for n in names for s in STATES}  # both inner optimizers hold moments
        for (name, state), value in states.items():
            row = find_row(optimizer_rows, step=step, module_name=f"{name}.{state}")  # exactly one
            assert row["scope"] == state
            assert_row_matches(row, numpy_stats(value))
        for name in names:
            assert_row_matches(find_row(grad_rows, step=step, module_name=name, scope="reduced"),
                               numpy_stats(seen["grads"][step][name]))
            find_row(param_rows, step=step, module_name=name, scope="param_updated")


def _warnings(caplog) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == LOGGER]


def _train_with(tmp_path, make: Callable[[TinyMLP], Tuple[Any, Callable[[], None], Callable[[], None]]],
                monitored: bool) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    model = TinyMLP(seed=4)
    optimizer, step, zero_grad = make(model)
    mon = None
    if monitored:
        mon = TrainerMonitorV2(_config(tmp_path, True))
        mon.start(model, optimizer)
    losses = []
    for x, y in make_batches(STEPS, seed=6):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach().clone())
        step()
        zero_grad()
    if mon is not None:
        assert mon.current_step == STEPS
        mon.stop()
    return losses, [p.detach().clone() for p in model.parameters()]


def _with_plain_sgd(model: TinyMLP):
    container = OptimizerList([torch.optim.AdamW(model.fc1.parameters(), lr=0.01),
                               PlainSGD(list(model.fc2.parameters()), lr=0.1)])
    return container, lambda: container.step(), lambda: container.zero_grad()


def _plain_sgd_alone(model: TinyMLP):
    opt = PlainSGD(list(model.parameters()), lr=0.1)
    return opt, lambda: opt.step(), lambda: opt.zero_grad()


@pytest.mark.parametrize("make,says", [
    (_with_plain_sgd, ("optimizer 1 (PlainSGD)", "OptimizerList", "no param_groups", "no state")),
    (_plain_sgd_alone, ("(PlainSGD)", "no param_groups", "no state", "holds no list of optimizers")),
], ids=["inside_a_container", "alone"])
def test_an_optimizer_it_cannot_read_is_said_once(tmp_path, caplog, make, says):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    seen = _train_with(tmp_path, make, monitored=True)
    plain = _train_with(tmp_path, make, monitored=False)
    assert all(torch.equal(a, b) for a, b in zip(seen[0], plain[0]))
    assert all(torch.equal(a, b) for a, b in zip(seen[1], plain[1]))
    said = [m for m in _warnings(caplog) if all(s in m for s in says)]
    assert len(said) == 1, _warnings(caplog)
    assert "not written" in said[0]
    out = tmp_path / "out"
    read = {r["module_name"] for r in rows_of(out, "optimizer")}
    if make is _with_plain_sgd:  # the AdamW beside it still gives its rows
        assert read == {f"fc1.{n}.{s}" for n in ("weight", "bias") for s in STATES}
        assert {r["module_name"] for r in rows_of(out, "param")} == {"fc1.weight", "fc1.bias"}
    else:
        assert not read
    # the unreduced gradients are read on the model's parameters, whatever the optimizer
    assert {r["module_name"] for r in rows_of(out, "weight_grad") if r["scope"] == "unreduced"} == {
        "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


def test_a_container_whose_state_stays_empty_is_said_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)

    def make(model):
        container = HiddenContainer(_two_adamw(model))
        return container, lambda: container.step(), lambda: container.zero_grad()

    seen = _train_with(tmp_path, make, monitored=True)
    plain = _train_with(tmp_path, make, monitored=False)
    assert all(torch.equal(a, b) for a, b in zip(seen[1], plain[1]))
    said = [m for m in _warnings(caplog) if "HiddenContainer" in m and "holds no tensor" in m]
    assert len(said) == 1, _warnings(caplog)
    assert not rows_of(tmp_path / "out", "optimizer")


def test_a_list_member_that_steps_again_ends_the_step_and_says_so(tmp_path, caplog):
    """A step of a list is one step() of each optimizer: one stepped twice while the other
    never is ends the monitor's step there, said once."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = TinyMLP(seed=4)
    first, second = _two_adamw(model)
    mon = TrainerMonitorV2(_config(tmp_path, True))
    mon.start(model, [first, second])
    for x, y in make_batches(STEPS, seed=6):
        torch.nn.functional.mse_loss(model(x), y).backward()
        first.step()  # `second` never steps
        first.zero_grad()
    assert mon.current_step == STEPS - 1  # each step of `first` after the first ends the one before
    mon.stop()
    said = [m for m in _warnings(caplog) if "stepped again" in m and "optimizer 0 (AdamW)" in m]
    assert len(said) == 1, _warnings(caplog)
