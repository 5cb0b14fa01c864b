"""``torch.compile`` (issue 12, item 5), with real compilation.

The ``module`` monitor on a compiled model records the original model's modules under
their own names (no ``_orig_mod.``), whether it was given the ``OptimizedModule`` or
started before the model was compiled, and Dynamo never recompiles because of the
monitor (``error_on_recompile`` turns a recompilation into an error). Values are checked
against NumPy computations of the same step: the batch, the layers' affine maps from the
parameters, the mean-squared-error gradient. One test compiles with Inductor (a few
seconds for this model); the others use Dynamo with the ``eager`` backend, which traces
exactly as Inductor does and runs the same kernels as eager mode (bit-identical).
"""

import copy
import logging

import numpy as np
import pytest
import torch

from support import TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, rows_of
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STEPS = 6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def reference(params, x: torch.Tensor, y: torch.Tensor):
    """fc1 output, fc2 output and d(loss)/d(output) of TinyMLP in NumPy fp64."""
    w1, b1, w2, b2 = (p.astype(np.float64) for p in params)
    xs = x.numpy().astype(np.float64)
    h = xs @ w1.T + b1
    out = np.maximum(h, 0) @ w2.T + b2
    grad_out = 2.0 * (out - y.numpy()) / out.size
    return h, out, grad_out


def train(cm, model, opt, mon_or_none, batches, no_recompile_after: int = 2):
    """Train ``cm`` (the compiled model); returns the losses and, per step, the parameters
    it started from (NumPy copies)."""
    losses, params = [], []
    for s, (x, y) in enumerate(batches):
        params.append([p.detach().numpy().copy() for p in model.parameters()])
        with torch._dynamo.config.patch(error_on_recompile=s >= no_recompile_after):
            loss = loss_fn(cm, x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses, params


def check_rows(out_dir, batches, params, written, rtol=1e-5):
    rows = rows_of(out_dir, "module")
    names = {r["module_name"] for r in rows} | {r["module_name"] for r in rows_of(out_dir, "weight_grad")}
    assert not [n for n in names if "_orig_mod" in n or "OptimizedModule" in n], sorted(names)
    assert sorted({int(r["step"]) for r in rows}) == written
    for s in written:
        x, y = batches[s]
        h, out, grad_out = reference(params[s], x, y)
        step_rows = [r for r in rows if r["step"] == str(s)]
        for tag, scope, want in (("fc1.input.0", "forward", x), ("TinyMLP.input.0", "forward", x),
                                 ("fc1.output.0", "forward", h), ("fc2.output.0", "forward", out),
                                 ("TinyMLP.output.0", "forward", out), ("fc2.grad_output.0", "backward", grad_out),
                                 ("TinyMLP.grad_output.0", "backward", grad_out)):
            want = numpy_stats(torch.as_tensor(np.asarray(want)))
            assert_row_matches(find_row(step_rows, module_name=tag, scope=scope), want, rtol=rtol, atol=1e-6)
        assert {r["module_name"] for r in step_rows} >= {"act.input.0", "act.output.0", "fc2.grad_input.0",
                                                         "fc1.grad_output.0", "act.grad_output.0"}


@pytest.mark.parametrize("when", ["compiled_before_start", "compiled_after_start"])
def test_compiled_model_records_the_original_modules_without_recompiling(write_config, when):
    model = TinyMLP()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    cfg = {"step_interval": 2, "monitors": {"module": {"enabled": True}, "weight_grad": {"enabled": True}}}
    mon = TrainerMonitorV2(write_config(cfg))
    if when == "compiled_before_start":
        cm = torch.compile(model, backend="eager")
        mon.start(model=cm, optimizer=opt)
    else:
        mon.start(model=model, optimizer=opt)
        cm = torch.compile(model, backend="eager")
    batches = make_batches(STEPS, seed=7)
    losses, params = train(cm, model, opt, mon, batches)
    mon.stop()
    assert mon.errors.count == 0
    twin_losses, _ = train(twin, twin, twin_opt, None, batches)
    assert all(torch.equal(a, b) for a, b in zip(losses, twin_losses))
    check_rows(mon.config.output_dir, batches, params, written=[0, 2, 4])
    wg = {r["module_name"] for r in rows_of(mon.config.output_dir, "weight_grad")}
    assert wg == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    # after stop(): the compiled model runs without hooks
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    loss_fn(cm, *batches[0]).backward()


def test_model_compiled_and_run_before_start(write_config, caplog):
    """Dynamo does not guard on module hooks: code compiled before ``start()`` does not
    call them. ``start()`` says so; after ``torch._dynamo.reset()`` every module is
    recorded again."""
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cm = torch.compile(model, backend="eager")
    batches = make_batches(STEPS, seed=8)
    loss_fn(cm, *batches[0]).backward()  # compiled without hooks
    opt.zero_grad()
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True}}}))
    mon.start(model=cm, optimizer=opt)
    mon.stop()
    assert any("torch._dynamo.reset()" in r.getMessage() for r in caplog.records)
    torch._dynamo.reset()
    caplog.clear()
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True}}}))
    mon.start(model=cm, optimizer=opt)
    assert not any("torch._dynamo.reset()" in r.getMessage() for r in caplog.records)
    _, params = train(cm, model, opt, mon, batches)
    mon.stop()
    assert mon.errors.count == 0
    check_rows(mon.config.output_dir, batches, params, written=list(range(STEPS)))


def test_inductor_compiled_model(write_config):
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2(write_config({"step_interval": 2, "monitors": {"module": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    cm = torch.compile(model)  # Inductor
    batches = make_batches(4, seed=9)
    _, params = train(cm, model, opt, mon, batches)
    mon.stop()
    assert mon.errors.count == 0
    # Inductor's kernels round differently from NumPy's fp64 in the last bits
    check_rows(mon.config.output_dir, batches, params, written=[0, 2], rtol=1e-4)


def test_fullgraph_compile_trains_and_says_what_is_not_recorded(write_config, caplog):
    """``fullgraph=True`` forbids graph breaks: the hooks then do nothing inside the
    compiled code (training must not fail); ``weight_grad`` is recorded as usual."""
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    model = TinyMLP()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True}, "weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    cm = torch.compile(model, backend="eager", fullgraph=True)
    batches = make_batches(3, seed=10)
    losses, params = train(cm, model, opt, mon, batches, no_recompile_after=1)
    mon.stop()
    assert mon.errors.count == 0
    twin_losses, _ = train(twin, twin, twin_opt, None, batches)
    assert all(torch.equal(a, b) for a, b in zip(losses, twin_losses))
    assert any("fullgraph=True" in r.getMessage() for r in caplog.records)
    # only the root call is outside the graph: its rows, and no row of a module inside it
    module_rows = rows_of(mon.config.output_dir, "module")
    assert {r["module_name"] for r in module_rows} == {"TinyMLP.input.0", "TinyMLP.output.0",
                                                       "TinyMLP.grad_output.0"}
    for s, (x, _) in enumerate(batches):
        assert_row_matches(find_row(module_rows, step=s, module_name="TinyMLP.input.0", scope="forward"),
                           numpy_stats(x), atol=1e-6)
    wg = rows_of(mon.config.output_dir, "weight_grad")
    assert len(wg) == 3 * 4 * 2  # steps x parameters x (unreduced, reduced)
    for s, (x, y) in enumerate(batches):
        _, _, grad_out = reference(params[s], x, y)
        want = numpy_stats(torch.as_tensor(grad_out.sum(axis=0)))  # d(loss)/d(fc2.bias)
        assert_row_matches(find_row(wg, step=s, module_name="fc2.bias", scope="reduced"), want, atol=1e-6)


def test_hooks_are_not_compiled_as_frames_of_their_own(write_config, caplog):
    """After a graph break Dynamo compiles the frames called next; the monitor's hooks are
    not among them (each hook's closure would be a new guard: recompiles until the limit)."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    batches = make_batches(4, seed=3)
    x0, y0 = batches[0]
    model = torch.nn.Sequential(torch.nn.Linear(x0.shape[1], 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.GELU(), torch.nn.Linear(16, y0.shape[1]))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True}, "weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    cm = torch.compile(model, backend="eager")
    caplog.set_level(logging.WARNING, logger="torch._dynamo")
    for x, y in batches:
        loss = loss_fn(cm, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    frames = {str(k) for k in dynamo_utils.counters["frames"]}
    limit_hits = [r.getMessage() for r in caplog.records if "recompile_limit" in r.getMessage()]
    assert limit_hits == []
    assert not any("module.py" in f and "hook" in f for f in frames), frames
    assert len(rows_of(mon.config.output_dir, "module")) > 0


def test_the_call_hooks_in_c_make_way_for_the_python_hooks_before_dynamo_traces(write_config):
    """The extension's ``CallHook`` runs the modules' common calls, but Dynamo must meet the
    Python hooks (it cannot trace a C object): when it starts to compile, each ``CallHook``
    is replaced by its Python hook, under the same handle, in the same place among the
    module's hooks, and the compiled steps are recorded as the others."""
    from msprobe.core.monitor_v2 import native

    ext = native.extension()
    if ext is None:
        pytest.fail("the kernel's extension is not built here: there is no CallHook to replace")
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    # the model, a chunk given to start(), is hooked (its forward is not wrapped)
    user = model.register_forward_pre_hook(lambda m, args: None)  # after the monitor's
    before = {name: list(getattr(model, name).items()) for name in ("_forward_pre_hooks", "_forward_hooks")}
    assert all(any(type(h) is ext.CallHook for _, h in hooks) for hooks in before.values())
    # fc1's forward is the monitor's CallWrapper: it gives way to the Python hooks too
    assert type(vars(model.fc1)["forward"]) is ext.CallWrapper and not model.fc1._forward_pre_hooks
    batches = make_batches(2, seed=3)
    cm = torch.compile(model, backend="eager")
    for x, y in batches:
        loss_fn(cm, x, y).backward()
        opt.step()
        opt.zero_grad()
    for name, hooks in before.items():
        after = list(getattr(model, name).items())
        assert [i for i, _ in after] == [i for i, _ in hooks]  # the same handles, in the same order
        for (_, was), (_, now) in zip(hooks, after):
            assert now is (was.fallback if type(was) is ext.CallHook else was)
    assert "forward" not in vars(model.fc1)
    fc1_hooks = [*model.fc1._forward_pre_hooks.values(), *model.fc1._forward_hooks.values()]
    assert len(fc1_hooks) == 2 and not any(type(h) is ext.CallHook for h in fc1_hooks)
    user.remove()
    mon.stop()
    assert mon.errors.count == 0
    rows = rows_of(mon.config.output_dir, "module")
    assert {r["step"] for r in rows} == {"0", "1"}
    assert {"fc1.input.0", "fc1.output.0", "fc1.grad_output.0"} <= {r["module_name"] for r in rows}
