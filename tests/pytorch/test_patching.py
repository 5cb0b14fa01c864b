"""patching.py: every kind of patch the monitor installs, on real torch objects, leaves
the object exactly as it was once removed (same instance attributes, the same values,
hook dictionaries empty), and removing it a second time changes nothing.

The snapshots are taken by the test itself (``vars()`` copies and hook dictionary
lengths), not by the code under test."""

import copy
import logging

import pytest
import torch
import torch.distributed as dist

from msprobe.core.monitor_v2.frameworks.pytorch.copies import ModuleHooks
from msprobe.core.monitor_v2.frameworks.pytorch.stacks import TrainingStack, optimizer_step_hooks
from msprobe.core.monitor_v2.patching import Patch, hooks, remove_all, replace_attribute, wrap_method

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def _snapshot(obj):
    """Instance attributes by name, with the identity of each value."""
    return {k: id(v) for k, v in vars(obj).items()}


def _optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train_step(model, opt):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()


def test_patch_remove_runs_the_undo_once():
    calls = []
    patch = Patch(lambda: calls.append("undo"))
    assert patch.installed
    patch.remove()
    patch.remove()
    assert calls == ["undo"] and not patch.installed
    empty = Patch()
    empty.remove()
    assert not empty.installed


def test_optimizer_step_hooks_removed_leave_the_optimizer_as_before():
    model, opt = _optimizer()
    before = _snapshot(opt)
    calls = []
    patch = optimizer_step_hooks(opt, lambda: calls.append("before"), lambda: calls.append("after"))
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_step_post_hooks) == 1
    _train_step(model, opt)
    assert calls == ["before", "after"]
    patch.remove()
    assert _snapshot(opt) == before
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0
    patch.remove()
    _train_step(model, opt)
    assert calls == ["before", "after"] and _snapshot(opt) == before


def test_stack_step_hooks_of_an_object_with_step_are_a_method_wrapper_removed_symmetrically():
    model, opt = _optimizer()

    class Stepper:  # not a torch.optim.Optimizer: an instance-level wrapper is put on it
        def __init__(self, inner):
            self.inner = inner

        def step(self):
            self.inner.step()

    stepper = Stepper(opt)
    before = _snapshot(stepper)
    calls = []
    patch = TrainingStack([model], stepper).install_step_hooks(lambda: calls.append("b"), lambda: calls.append("a"))
    assert set(vars(stepper)) == set(before) | {"step", "__getstate__"}
    copied = copy.deepcopy(stepper)
    assert "step" not in vars(copied) and "__getstate__" not in vars(copied)
    stepper.step()
    assert calls == ["b", "a"]
    patch.remove()
    assert _snapshot(stepper) == before
    patch.remove()
    assert _snapshot(stepper) == before and type(stepper).step is Stepper.step


def test_wrap_method_keeps_an_own_attribute_and_copies_get_the_original():
    model, opt = _optimizer()
    own_step = opt.step  # a bound method put on the instance by the user, before the monitor
    opt.step = own_step
    before = _snapshot(opt)
    calls = []
    patch = wrap_method(opt, "step", lambda: calls.append("b"), lambda: calls.append("a"))
    copied = copy.copy(opt)
    assert vars(copied)["step"] is own_step  # the copy has the method as it was, not the wrapper
    assert "__getstate__" not in vars(copied)
    _train_step(model, opt)
    assert calls == ["b", "a"]
    patch.remove()
    assert _snapshot(opt) == before and vars(opt)["step"] is own_step
    patch.remove()
    assert _snapshot(opt) == before


def test_wrap_method_replaced_after_install_is_left_alone_with_one_warning(caplog):
    model, opt = _optimizer()
    patch = wrap_method(opt, "step", lambda: None, lambda: None)
    theirs = lambda *a, **k: None  # noqa: E731
    opt.step = theirs
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        patch.remove()
        patch.remove()
    assert vars(opt)["step"] is theirs
    assert [r.getMessage() for r in caplog.records] == [
        "monitor_v2: SGD.step was replaced after start(); leaving it as it is"]
    assert "__getstate__" not in vars(opt)


def test_hooks_groups_module_and_tensor_hooks_and_removes_them_all():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    before = {n: (_snapshot(m), tuple(len(getattr(m, a)) for a in _HOOK_DICTS)) for n, m in model.named_modules()}
    seen = []
    handles = [model[0].register_forward_hook(lambda *a: seen.append("fwd")),
               model[1].register_forward_pre_hook(lambda *a: seen.append("pre")),
               model[0].weight.register_hook(lambda g: seen.append("grad"))]
    patch = hooks(handles)
    model(torch.ones(1, 4)).sum().backward()
    assert seen == ["fwd", "pre", "grad"]
    patch.remove()
    patch.remove()
    after = {n: (_snapshot(m), tuple(len(getattr(m, a)) for a in _HOOK_DICTS)) for n, m in model.named_modules()}
    assert after == before
    assert not model[0].weight._backward_hooks
    model(torch.ones(1, 4)).sum().backward()
    assert seen == ["fwd", "pre", "grad"]


def test_module_hooks_and_patches_share_one_list_and_remove_all():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    _, opt = _optimizer()
    before_model, before_opt = _snapshot(model), _snapshot(opt)
    module_hooks = ModuleHooks()
    module_hooks.forward(model, lambda *a: None)
    handles = [module_hooks, optimizer_step_hooks(opt, lambda: None, lambda: None),
               model.register_forward_pre_hook(lambda *a: None)]
    assert "__getstate__" in vars(model)
    remove_all(handles)
    assert handles == [] and _snapshot(model) == before_model and _snapshot(opt) == before_opt
    assert all(len(getattr(model, a)) == 0 for a in _HOOK_DICTS)
    module_hooks.remove()
    assert _snapshot(model) == before_model


def test_replace_attribute_of_torch_distributed_restores_the_module_function():
    original = dist.all_reduce
    own_before = "all_reduce" in vars(dist)
    patch = replace_attribute(dist, "all_reduce", lambda *a, **k: None)
    assert dist.all_reduce is not original
    patch.remove()
    assert dist.all_reduce is original and ("all_reduce" in vars(dist)) == own_before
    patch.remove()
    assert dist.all_reduce is original


def test_replace_attribute_of_an_inherited_method_deletes_ours_and_says_when_replaced():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    before = _snapshot(model)
    patch = replace_attribute(model, "forward", lambda x: x)
    assert torch.equal(model(torch.ones(1, 2)), torch.ones(1, 2))
    patch.remove()
    assert _snapshot(model) == before and "forward" not in vars(model)

    replaced = []
    patch = replace_attribute(model, "forward", lambda x: x, if_replaced=lambda: replaced.append(1))
    theirs = lambda x: 2 * x  # noqa: E731
    model.forward = theirs
    patch.remove()
    patch.remove()
    assert replaced == [1] and vars(model)["forward"] is theirs


def test_a_failing_undo_does_not_run_again():
    calls = []

    def undo():
        calls.append(1)
        raise RuntimeError("undo failed")

    patch = Patch(undo)
    with pytest.raises(RuntimeError, match="undo failed"):
        patch.remove()
    patch.remove()
    assert calls == [1]


_CC_SCRIPT = r"""
import json, sys, os, types
import torch, torch.distributed as dist
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)
names = [n for n in dir(dist) if callable(getattr(dist, n, None))]
before = {n: id(getattr(dist, n)) for n in names}


def own():  # the module's own attributes, without the submodules that importing torch.distributed.* adds
    return {k: id(v) for k, v in vars(dist).items() if not isinstance(v, types.ModuleType)}


own_before = own()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mon = TrainerMonitorV2({"output_dir": sys.argv[1], "monitors": {"module": {"enabled": False},
                                                                "cc": {"enabled": True}}})
mon.start(model=model, optimizer=opt)
patched = sorted(n for n in names if id(getattr(dist, n)) != before[n])
t = torch.ones(3)
dist.all_reduce(t)
model(torch.ones(1, 4)).sum().backward()
opt.step()
mon.stop()
after = {n: id(getattr(dist, n)) for n in names}
first_stop = (after == before, own() == own_before)
mon.stop()
second_stop = ({n: id(getattr(dist, n)) for n in names} == before, own() == own_before)
print(json.dumps({"patched": patched, "first_stop": first_stop, "second_stop": second_stop}))
dist.destroy_process_group()
"""


def test_cc_patches_of_torch_distributed_are_undone_by_stop(tmp_path):
    """The ``cc`` monitor on a real one-rank gloo group (its own process: a process group
    must not outlive the test): it replaces the functions of ``torch.distributed`` and
    ``stop()`` puts every one back, the module's own attributes as before (submodules
    that importing ``torch.distributed.*`` adds aside); a second
    ``stop()`` changes nothing."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(
        os.path.dirname(__file__), "..", "..", "src"), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", _CC_SCRIPT, str(tmp_path / "out"), str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert "all_reduce" in result["patched"] and "broadcast" in result["patched"]
    assert result["first_stop"] == [True, True] and result["second_stop"] == [True, True]
