"""The module monitor's forward wrapper (the extension's ``CallWrapper``): on a written step a
module that is not a model chunk has its ``forward`` wrapped instead of a pair of forward
hooks, so PyTorch calls it on its fast path. The rows are those of the hooks, byte for byte;
the wrapper reads as the module's own forward (signature, ``__func__``, ``__self__``); an
exception goes through unchanged; a forward that someone swaps after ``start()`` is found
before the model's next call (set again where it was removed, hooked where it was replaced),
one missed is said once and hooked from then on; a class a kernel library marks keeps hooks;
and ``stop()`` leaves each module as it was."""

import copy
import functools
import inspect
import io
import logging
import pickle
import types
from pathlib import Path
from typing import Dict

import pytest
import torch

from support import TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, rows_of
from test_graph_hooks_library import csv_files
from test_module import TinyGPT, make_data, run_monitored
from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.frameworks.pytorch.module import WRAP_SWITCH
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

EVERY_MODULE = {"module": {"enabled": True, "targets": []}}


@pytest.fixture(scope="module")
def ext():
    ext = native.extension()
    assert ext is not None, "the kernel's extension is not built here: there is no CallWrapper"
    return ext


def wrapped(model: torch.nn.Module, ext) -> Dict[str, bool]:
    return {name: type(vars(m).get("forward")) is ext.CallWrapper for name, m in model.named_modules()}


def _train_gpt(out: Path, ckpt, seen: list, ext):
    model = TinyGPT(ckpt=ckpt)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(sum(wrapped(model, ext).values())),
                                    with_kwargs=True)
    config = {"output_dir": str(out), "monitors": EVERY_MODULE}
    _, losses = run_monitored(model, [[b] for b in make_data(3)], config, optimizer=opt)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("ckpt", [None, "nonreentrant", "reentrant"])
def test_rows_are_the_same_wrapped_and_hooked(tmp_path, monkeypatch, ext, ckpt):
    # TinyGPT: attention, a module called twice, split and dict outputs, in-place ops, tied
    # weights, and a checkpointed block (whose forward runs again in the backward pass)
    seen = []
    losses, params = _train_gpt(tmp_path / "wrapped", ckpt, seen, ext)
    assert seen and min(seen) > 5, f"forwards wrapped while the model ran: {seen}"
    monkeypatch.setenv(WRAP_SWITCH, "0")
    seen_hooked = []
    ref_losses, ref_params = _train_gpt(tmp_path / "hooked", ckpt, seen_hooked, ext)
    assert set(seen_hooked) == {0}
    got, want = csv_files(tmp_path / "wrapped"), csv_files(tmp_path / "hooked")
    assert b",backward," in b"".join(got.values()) and b",forward," in b"".join(got.values())
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(params[k], ref_params[k]) for k in params)


def test_chunks_modules_with_hooks_and_with_a_forward_of_their_own_keep_hooks(tmp_path, ext):
    model = TinyMLP()
    model.fc2.forward = functools.partial(torch.nn.Linear.forward, model.fc2)  # as a library's wrapper
    own = vars(model.fc2)["forward"]
    theirs = model.act.register_forward_hook(lambda m, args, out: None)  # a framework's hook: the slow path anyway
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
    mon.start(model=model)
    assert wrapped(model, ext) == {"": False, "fc1": True, "act": False, "fc2": False}
    assert model._forward_pre_hooks and model.fc2._forward_pre_hooks and not model.fc1._forward_pre_hooks
    assert list(model.act._forward_hooks)[0] == theirs.id, "the monitor's hook after the ones it found"
    mon.stop()
    assert not any(wrapped(model, ext).values()) and vars(model.fc2)["forward"] is own
    assert "forward" not in vars(model.fc1) and not model.fc1._forward_pre_hooks
    assert list(model.act._forward_hooks) == [theirs.id]


def test_a_global_module_hook_keeps_hooks_everywhere(tmp_path, ext):
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: None)
    try:
        model = TinyMLP()
        mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
        mon.start(model=model)
        assert not any(wrapped(model, ext).values())
        mon.stop()
    finally:
        handle.remove()


def test_a_hook_added_after_start_puts_the_monitors_hooks_first(tmp_path, ext):
    """fc1 is wrapped; a forward hook added after start() that scales its output: the
    monitor's hooks go on fc1 at its next call, first, so its output rows are fc1's own
    output, before the user's hook, as they were when every module was hooked at start()."""
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
    mon.start(model=model, optimizer=opt)
    assert wrapped(model, ext)["fc1"]
    user = model.fc1.register_forward_hook(lambda m, args, out: out * 10)
    x, y = make_batches(1)[0]
    want = torch.nn.functional.linear(x, model.fc1.weight.detach(), model.fc1.bias.detach())
    loss_fn(model, x, y).backward()
    opt.step()
    assert not wrapped(model, ext)["fc1"]
    assert list(model.fc1._forward_hooks)[-1] == user.id, "the monitor's hook first, the user's after it"
    mon.stop()
    assert list(model.fc1._forward_hooks) == [user.id] and not model.fc1._forward_pre_hooks
    rows = rows_of(tmp_path, "module")
    assert_row_matches(find_row(rows, step=0, module_name="fc1.output.0", scope="forward"), numpy_stats(want))
    assert_row_matches(find_row(rows, step=0, module_name="act.input.0", scope="forward"), numpy_stats(want * 10))


def test_a_wrapped_forward_reads_as_the_modules_own(tmp_path, ext):
    model = TinyMLP()
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
    mon.start(model=model)
    fc1 = model.fc1
    forward = fc1.forward
    assert type(forward) is ext.CallWrapper
    assert inspect.signature(forward) == inspect.signature(torch.nn.Linear(2, 2).forward)
    assert forward.__func__ is torch.nn.Linear.forward and forward.__self__ is fc1
    assert forward.__name__ == "forward" and forward.__wrapped__ == fc1.__class__.forward.__get__(fc1)
    assert "Linear.forward" in repr(forward)
    x = torch.randn(3, 6)
    assert torch.equal(forward(x), torch.nn.functional.linear(x, fc1.weight, fc1.bias))
    with pytest.raises(AttributeError):
        forward.no_such_attribute
    mon.stop()


class Fragile(torch.nn.Module):
    """Raises on an input with a negative first element (a bad batch), as a user's check does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0, 0] < 0:
            raise ValueError("bad batch")
        return self.fc(x)


def test_an_exception_in_a_wrapped_forward_goes_through_unchanged(tmp_path, ext):
    model = torch.nn.Sequential(Fragile(), torch.nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
    mon.start(model=model, optimizer=opt)
    assert wrapped(model, ext)["0"]
    bad = -torch.ones(4, 6)
    with pytest.raises(ValueError, match="bad batch") as raised:
        model(bad)
    assert raised.traceback[-1].name == "forward"  # raised in Fragile.forward, not by the monitor
    x = torch.rand(4, 6) + 0.1  # the next call is recorded as any other
    want = torch.nn.functional.linear(x, model[0].fc.weight.detach(), model[0].fc.bias.detach())
    model(x).sum().backward()
    opt.step()
    mon.stop()
    assert mon.errors.count == 0
    rows = rows_of(tmp_path, "module")
    # the failed call's input was read before its forward ran (as a pre-hook reads it); it has no output
    inputs = numpy_stats(torch.cat([bad, x]))
    assert_row_matches(find_row(rows, step=0, module_name="0.input.0", scope="forward"), inputs)
    assert_row_matches(find_row(rows, step=0, module_name="0.output.0", scope="forward"), numpy_stats(want))


def _chained(module, calls):
    """A library's forward around the one it finds (accelerate's ``add_hook_to_module``)."""
    found = module.forward

    def library_forward(*args, **kwargs):
        calls.append(module)
        return found(*args, **kwargs)

    module.forward = library_forward


def _swapped(module, calls):
    """A kernel's forward set on the instance, calling nothing it found (``kernels``'
    ``kernelize`` where a kernel exists for the device: ``MethodType(layer.forward, module)``)."""
    def kernel_forward(self, x):
        calls.append(self)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    module.forward = types.MethodType(kernel_forward, module)


def _removed(module, calls):
    """The instance's forward popped, its class's runs again (``kernels``' ``kernelize``
    falling back, as transformers 5 runs it on ``train()``; accelerate's
    ``remove_hook_from_module``)."""
    calls.append(module)
    vars(module).pop("forward", None)


@pytest.mark.parametrize("swap", [_chained, _swapped, _removed])
def test_a_forward_swapped_between_steps_loses_no_row(tmp_path, ext, caplog, swap):
    """Before the model's call at steps 1 and 2 (the swap that Trainer's ``model.train()``
    makes every step with hub kernels) fc1's forward is swapped. The model's call finds it
    before fc1 is called: every step has fc1's rows, once each (a doubled call would double
    the norm), said once at INFO (nothing was missed). A removed forward gets the wrapper
    back (the fast path stays); any other keeps the library's forward and fc1 gets hooks.
    Training is bit-identical to an unmonitored copy with the same swaps."""
    model, ref = TinyMLP(), TinyMLP()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
    mon.start(model=model, optimizer=opt)
    calls, wanted, still_wrapped = [], [], []
    batches = make_batches(4)
    with caplog.at_level(logging.INFO, logger="msprobe.monitor_v2"):
        for step, (x, y) in enumerate(batches):
            if step in ((1, 2) if swap is _removed else (1,)):
                for m in (model, ref):
                    swap(m.fc1, calls)
            wanted.append(torch.nn.functional.linear(x, ref.fc1.weight.detach(), ref.fc1.bias.detach()))
            for m, o in ((model, opt), (ref, ref_opt)):
                loss_fn(m, x, y).backward()
                o.step()
                o.zero_grad()
            still_wrapped.append(wrapped(model, ext)["fc1"])
        mon.stop()
    assert mon.errors.count == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    said = [r for r in caplog.records if "the forward of fc1 was" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, [r.getMessage() for r in caplog.records]
    rows = rows_of(tmp_path, "module")
    for step, (x, _) in enumerate(batches):
        assert_row_matches(find_row(rows, step=step, module_name="fc1.input.0", scope="forward"), numpy_stats(x))
        assert_row_matches(find_row(rows, step=step, module_name="fc1.output.0", scope="forward"),
                           numpy_stats(wanted[step]))
    if swap is _removed:
        assert still_wrapped == [True] * 4, "set again: fc1 stays on the fast path"
        assert "forward" not in vars(model.fc1)
    else:
        assert len(calls) == 2 * 3, "the library's forward ran on steps 1 to 3, in both models"
        assert still_wrapped == [True, False, False, False]
        theirs = vars(model.fc1)["forward"]
        assert getattr(theirs, "__name__", None) in ("library_forward", "kernel_forward"), "left in place"
        assert not model.fc1._forward_pre_hooks and not model.fc1._forward_hooks
        assert torch.equal(model.fc1(batches[0][0]), ref.fc1(batches[0][0]))


def test_a_forward_replaced_where_calls_can_be_missed_is_said_once_and_hooked_from_then_on(tmp_path, ext, caplog):
    """The training calls the submodules itself, never the model (as a LightningModule's
    ``training_step`` can): no model call comes before them to find a swap. At step 1 a
    kernel's forward replaces fc1's before its call: that call has no rows, which is said
    once at WARNING at the step's end, and fc1's rows come from hooks from step 2 on."""
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
    mon.start(model=model, optimizer=opt)
    calls = []
    batches = make_batches(4)
    with caplog.at_level(logging.INFO, logger="msprobe.monitor_v2"):
        for step, (x, y) in enumerate(batches):
            if step == 1:
                _swapped(model.fc1, calls)
            out = model.fc2(model.act(model.fc1(x)))
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
        mon.stop()
    said = [r for r in caplog.records if "the forward of fc1 was replaced" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert len(calls) == 3
    rows = rows_of(tmp_path, "module")
    assert not [r for r in rows if r["step"] == "1" and r["module_name"].startswith("fc1.")]
    find_row(rows, step=1, module_name="fc2.input.0", scope="forward")  # a written step, fc1 missed
    for step in (0, 2, 3):
        x = batches[step][0]
        assert_row_matches(find_row(rows, step=step, module_name="fc1.input.0", scope="forward"), numpy_stats(x))


def test_a_class_a_kernel_library_marks_keeps_hooks(tmp_path, ext):
    """A module whose class ``kernels`` marks for kernelizing (``kernel_layer_name``, set by its
    ``use_kernel_forward_from_hub``) may have its instance forward popped or swapped by
    ``kernelize`` at any time, wherever it is called from: it keeps the monitor's hooks, which
    ``kernelize`` leaves alone. (The real library: tests/integrations/test_hub_kernels.py.)"""

    class MarkedLinear(torch.nn.Linear):
        kernel_layer_name = "MarkedLinear"

    model = torch.nn.Sequential(MarkedLinear(6, 6), torch.nn.Linear(6, 3))
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
    mon.start(model=model)
    assert wrapped(model, ext) == {"": False, "0": False, "1": True}
    assert model[0]._forward_pre_hooks and model[0]._forward_hooks
    mon.stop()
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks


def test_a_class_forward_replaced_after_start_is_followed(tmp_path, ext, monkeypatch):
    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2

    model = torch.nn.Sequential(torch.nn.Linear(6, 6), Scale())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
    mon.start(model=model, optimizer=opt)
    monkeypatch.setattr(Scale, "forward", lambda self, x: x * 3)  # a patched class, as kernel libraries do
    x = torch.randn(4, 6)
    out = model(x)
    assert torch.equal(out, model[0](x).detach() * 3)
    out.sum().backward()
    opt.step()
    mon.stop()
    rows = rows_of(tmp_path, "module")
    assert_row_matches(find_row(rows, step=0, module_name="1.output.0", scope="forward"), numpy_stats(out))


def test_the_switch_keeps_hooks_everywhere(tmp_path, ext, monkeypatch):
    monkeypatch.setenv(WRAP_SWITCH, "0")
    model = TinyMLP()
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
    mon.start(model=model)
    assert not any(wrapped(model, ext).values())
    assert all(len(m._forward_pre_hooks) >= 1 for m in model.modules())
    mon.stop()


def test_a_data_parallel_replica_runs_its_own_forward(tmp_path, ext):
    """torch's DataParallel copies each module's instance dictionary into its replicas (on
    other devices, with their own parameters): a replica of a wrapped module gets a wrapper
    of its own, so it computes with its own parameters, and its calls are recorded as the
    module's. (DataParallel replicates only on several GPUs; the replica is made here as it
    makes it, with ``_replicate_for_data_parallel``.)"""
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
    mon.start(model=model, optimizer=opt)
    fc1 = model.fc1
    replica = fc1._replicate_for_data_parallel()
    replica.weight = torch.nn.Parameter(fc1.weight.detach() * 2)  # as replicate() sets the replica's copies
    replica.bias = torch.nn.Parameter(fc1.bias.detach() * 2)
    assert type(vars(replica)["forward"]) is ext.CallWrapper and vars(replica)["forward"] is not vars(fc1)["forward"]
    assert "_replicate_for_data_parallel" not in vars(replica)
    x = torch.randn(4, 6)
    with torch.no_grad():
        got = replica(x)
    want = torch.nn.functional.linear(x, fc1.weight.detach() * 2, fc1.bias.detach() * 2)
    assert torch.equal(got, want)
    loss_fn(model, x, torch.zeros(4, 3)).backward()
    opt.step()
    mon.stop()
    assert "forward" not in vars(fc1) and "_replicate_for_data_parallel" not in vars(fc1)
    rows = rows_of(tmp_path, "module")
    # the replica's call and the model's call of fc1, one row (the replica's under no_grad is an evaluation
    # outside a chunk's call: the model's mode decides, training, so both are forward rows)
    assert_row_matches(find_row(rows, step=0, module_name="fc1.input.0", scope="forward"), numpy_stats(torch.cat([x, x])))


def test_a_wrapper_left_in_a_module_copies_and_pickles_as_its_plain_forward(ext):
    """A wrapper someone's chain still holds (disarmed) is never copied as the monitor's: a
    deep copy of the module gets the copy's own forward, a pickle the module's."""
    module = torch.nn.Linear(3, 2)
    wrapper = ext.CallWrapper(module, lambda *a: None, lambda *a: None, lambda m: False, ())
    vars(module)["forward"] = wrapper
    copied = copy.deepcopy(module)
    forward = vars(copied)["forward"]
    assert forward.__self__ is copied and forward.__func__ is torch.nn.Linear.forward
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert vars(loaded)["forward"].__self__ is loaded
    assert pickle.loads(pickle.dumps(wrapper)).__func__ is torch.nn.Linear.forward
    x = torch.randn(1, 3)
    assert torch.equal(copied(x), module(x)) and torch.equal(loaded(x), module(x))


def test_an_error_in_a_wrapped_modules_statistics_is_contained_and_said_once(tmp_path, ext, caplog):
    """Every read of the module monitor raises: the wrapped calls' hooks contain it (one line
    for each site), the modules stay wrapped, and training is the same as without the
    monitor, to the bit."""
    model, ref = TinyMLP(), TinyMLP()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": EVERY_MODULE})
    mon.start(model=model, optimizer=opt)
    module_monitor = next(m for m in mon.monitors if m.name == "module")

    def broken(*args):
        raise RuntimeError("injected read failure")

    module_monitor._read = broken
    with caplog.at_level(logging.ERROR, logger="msprobe.monitor_v2"):
        for x, y in make_batches(3):
            assert wrapped(model, ext)["fc1"]
            for m, o in ((model, opt), (ref, ref_opt)):
                loss_fn(m, x, y).backward()
                o.step()
                o.zero_grad()
        mon.stop()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert mon.errors.count >= 3 * 2 * 2, "fc1 and fc2: a pre and a post read a call, three steps"
    logged = [r.getMessage() for r in caplog.records if "injected read failure" in r.getMessage()]
    assert len(logged) == len({line.split(",")[0] for line in logged}), "each site once"
    assert any("fc1" in line for line in logged)
