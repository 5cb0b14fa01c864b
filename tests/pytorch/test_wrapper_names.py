"""Wrapper modules leave no trace (issue 19): ``checkpoint_wrapper`` (non-reentrant and
reentrant), ``offload_wrapper``, ``torch.compile``'s ``OptimizedModule`` around blocks (as
torchtitan compiles each block), ``DataParallel``, and chains of them. Every monitor names
modules and parameters as the plain model does, each real module gets one row set, and
the wrapper none. Values against an unmonitored plain replica (plain forward and full
backward hooks, NumPy statistics); training with the monitor is bit-identical.

The FSDP1/FSDP2 and pipelining cases run with 2 ranks in
tests/distributed/test_internal_passes.py.
"""

import copy
import logging
from collections import defaultdict

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, checkpoint_wrapper, offload_wrapper)

from support import assert_row_matches, numpy_stats, rows_of
from msprobe.core.monitor_v2.frameworks.pytorch import naming
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STEPS, MICRO = 2, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.lin(x)) + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 6)  # reentrant checkpointing trains a block only if its input needs grad
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _compile(m):
    return torch.compile(m, backend="eager")


WRAPPERS = {
    "checkpoint": lambda m: checkpoint_wrapper(m),
    "checkpoint_reentrant": lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.REENTRANT),
    "offload": offload_wrapper,
    "compile": _compile,
    "compile_over_checkpoint": lambda m: _compile(checkpoint_wrapper(m)),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def wrapped(kind: str):
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    if kind == "data_parallel":
        return nn.DataParallel(model), model, plain
    for i, layer in enumerate(model.layers):
        model.layers[i] = WRAPPERS[kind](layer)
    return model, model, plain


def batches():
    g = torch.Generator().manual_seed(3)
    return [[(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(MICRO)]
            for _ in range(STEPS)]


def train(model, params, monitor_dir=None):
    opt = torch.optim.AdamW(params, lr=0.01)
    mon = None
    if monitor_dir is not None:
        mon = TrainerMonitorV2({"output_dir": str(monitor_dir), "monitors": {
            "module": {"enabled": True}, "weight_grad": {"enabled": True}, "param": {"enabled": True},
            "optimizer": {"enabled": True}}})
        mon.start(model=model, optimizer=opt, grad_acc_steps=MICRO)
    losses = []
    for micro in batches():
        for x, y in micro:
            loss = torch.nn.functional.mse_loss(model(x), y) / MICRO
            loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.stop()
        assert mon.errors.count == 0
    return losses


def reference_step0(plain: nn.Module):
    """What every module of the plain model saw at step 0: clones by tag."""
    exp = defaultdict(list)
    handles = []
    for name, mod in plain.named_modules():
        tag = name or "Net"

        def fwd(m, args, out, tag=tag):
            for i, t in enumerate(a for a in args if isinstance(a, torch.Tensor)):
                exp[f"{tag}.input.{i}"].append(t.detach().clone())
            exp[f"{tag}.output.0"].append(out.detach().clone())

        def bwd(m, grad_input, grad_output, tag=tag):
            for kind, grads in (("grad_input", grad_input), ("grad_output", grad_output)):
                for i, g in enumerate(grads):
                    if g is not None:
                        exp[f"{tag}.{kind}.{i}"].append(g.detach().clone())

        if not isinstance(mod, nn.ModuleList):  # never called
            handles += [mod.register_forward_hook(fwd), mod.register_full_backward_hook(bwd)]
    for x, y in batches()[0]:
        (torch.nn.functional.mse_loss(plain(x), y) / MICRO).backward()
    for h in handles:
        h.remove()
    return exp


@pytest.mark.parametrize("kind", [*WRAPPERS, "data_parallel"])
def test_wrapped_blocks_are_named_and_recorded_as_the_plain_model(tmp_path, kind, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    model, inner, plain = wrapped(kind)
    unmonitored, _, _ = wrapped(kind)
    exp = reference_step0(copy.deepcopy(plain))
    losses = train(model, inner.parameters(), tmp_path / "out")
    torch._dynamo.reset()
    # bit-identical training: same losses and parameters as without the monitor
    assert all(torch.equal(a, b) for a, b in zip(losses, train(unmonitored, list(unmonitored.parameters()))))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), unmonitored.parameters()))

    rows = rows_of(tmp_path / "out", "module")
    step0 = {}
    for r in rows:
        if r["step"] == "0":
            assert r["module_name"] not in step0, f"two rows for {r['module_name']}"
            step0[r["module_name"]] = r
    assert sorted(step0) == sorted(exp)  # one row set per real module, under the plain names
    for tag, tensors in exp.items():
        want = numpy_stats(torch.cat([t.reshape(-1) for t in tensors]))
        assert_row_matches(step0[tag], want, rtol=1e-4, atol=1e-6 * max(abs(want["min"]), abs(want["max"])))
    param_names = {n for n, _ in plain.named_parameters()}
    for monitor in ("weight_grad", "param", "optimizer"):
        names = {r["module_name"].split(".exp_avg")[0] for r in rows_of(tmp_path / "out", monitor)}
        assert names == param_names, (monitor, sorted(names))
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


class UsesModuleAttribute(nn.Module):
    """A user's own module whose submodule is called ``module``: not a wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)

    def forward(self, x):
        return self.module(x)


def test_naming_rule_strips_only_wrappers():
    torch.manual_seed(0)
    own = UsesModuleAttribute()
    model = nn.Sequential(checkpoint_wrapper(own), _compile(offload_wrapper(nn.Linear(2, 2))))
    dp = nn.DataParallel(model)
    assert [n for n, _ in naming.named_modules(dp)] == ["", "0", "0.module", "1"]
    assert [n for n, m in naming.named_modules(dp, wrappers=True)] == ["", "", "0", "0", "0.module", "1", "1", "1"]
    assert [n for n, _ in naming.named_parameters(dp)] == ["0.module.weight", "0.module.bias", "1.weight", "1.bias"]
    assert [id(p) for _, p in naming.named_parameters(dp)] == [id(p) for p in dp.parameters()]
    assert naming.unwrap(dp) is model and naming.unwrap(model[1]) is model[1]._orig_mod._checkpoint_wrapped_module
    assert naming.is_wrapper(model[0]) and not naming.is_wrapper(own)
    assert naming.clean_path(dp, "module.0._checkpoint_wrapped_module.module.weight") == "0.module.weight"
    assert naming.clean_path(dp, "module.1._orig_mod._checkpoint_wrapped_module.bias") == "1.bias"
    assert naming.class_name(dp) == "DataParallel" and naming.class_name(own) == "UsesModuleAttribute"


def test_pass_on_fake_tensors_writes_no_rows(tmp_path, caplog):
    """A framework's shape pass on fake tensors (FakeTensorMode) inside a training step
    adds nothing to that step's rows: they are those of the real micro-batches."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    caplog.set_level(logging.INFO, logger="msprobe.monitor_v2")
    torch.manual_seed(0)
    model = Net()
    exp = reference_step0(copy.deepcopy(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": {"module": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        model(fake.from_tensor(torch.randn(4, 6)))
    for x, y in batches()[0]:
        (torch.nn.functional.mse_loss(model(x), y) / MICRO).backward()
    opt.step()
    mon.stop()
    assert mon.errors.count == 0
    rows = {r["module_name"]: r for r in rows_of(tmp_path / "out", "module")}
    assert sorted(rows) == sorted(exp)
    for tag, tensors in exp.items():
        want = numpy_stats(torch.cat([t.reshape(-1) for t in tensors]))
        assert_row_matches(rows[tag], want, rtol=1e-4, atol=1e-6 * max(abs(want["min"]), abs(want["max"])))
    assert [r for r in caplog.records if "framework-internal pass" in r.getMessage()]
