"""The training-stack seam (frameworks/pytorch/stacks/) on plain torch: what the
session reads when no framework adapter recognises the objects given to start()."""

import pytest
import torch

from support import TinyMLP
from msprobe.core.monitor_v2.frameworks.pytorch.session import TorchSession
from msprobe.core.monitor_v2.frameworks.pytorch.stacks import TrainingStack, UnreducedCapture, detect_stack, wrap_method


def test_plain_model_gets_the_plain_torch_stack_and_its_own_names():
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters())
    stack = detect_stack([model], opt)
    assert type(stack) is TrainingStack
    session = TorchSession(model, opt, {}, "unused")
    assert [i.name for i in session.table.optimizer_params()] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert session.stack.unreduced_capture(session.table, False, 1) is None  # the default hooks on the parameters
    assert session.reduced_grads() == []  # no gradients yet
    assert [t is i.param for i, t in session.param_values()] == [True] * 4


def test_unreduced_capture_takes_exactly_one_of_install_or_reason():
    with pytest.raises(ValueError):
        UnreducedCapture()
    with pytest.raises(ValueError):
        UnreducedCapture(install=lambda a, b: [], not_observable="why")
    assert UnreducedCapture(not_observable="why").install is None


def test_wrap_method_runs_around_selected_calls_and_undo_restores_the_instance():
    class Engine:
        def step(self, x):
            calls.append(("step", x))
            return x + 1

    calls = []
    engine = Engine()
    boundary = iter([False, True])
    patch = wrap_method(engine, "step", lambda: calls.append("before"), lambda: calls.append("after"),
                       when=lambda: next(boundary))
    assert engine.step(1) == 2 and engine.step(2) == 3
    assert calls == [("step", 1), "before", ("step", 2), "after"]
    patch.remove()
    assert "step" not in vars(engine)
