"""The module monitor's hooks on the autograd graph (grad_output pre-hooks, grad_input
post-hooks): an error inside them is contained and logged once per site, training stays
bit-identical to an unmonitored copy, and the rows that do not depend on them are
written; without errors their rows match gradients computed independently."""

import copy
import logging

import pytest
import torch

from support import TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, rows_of
from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.frameworks.pytorch import module as module_mod
from msprobe.core.monitor_v2.frameworks.pytorch.module import ModuleMonitor
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2


def train(model, opt, batches):
    for x, y in batches:
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def _train_with_a_failing_read(write_config, caplog, fails):
    """TinyMLP trained 3 steps with the module monitor on ``fc2``, its reads failing where
    ``fails(name, scope)`` says; checked bit-identical to an unmonitored copy. Returns the
    monitor (stopped), the module monitor and the planted failures' log messages."""
    model = TinyMLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "targets": ["fc2"]}}}))
    mon.start(model=model, optimizer=opt)
    module = next(m for m in mon.monitors if m.name == "module")
    read = module._read  # the engine's recorder: the monitor's own code, not the framework

    def failing(t, vpp, name, scope, *args):
        if fails(name, scope):
            raise RuntimeError("planted failure in a hook")
        return read(t, vpp, name, scope, *args)

    module._read = failing
    batches = make_batches(3)
    with caplog.at_level(logging.ERROR, logger="msprobe.monitor_v2"):
        train(model, opt, batches)
    mon.stop()
    train(ref, ref_opt, batches)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    return mon, module, [r.getMessage() for r in caplog.records if "planted failure" in r.getMessage()]


def test_an_error_in_a_graph_hook_is_contained_and_training_is_unchanged(write_config, caplog):
    mon, _, sites = _train_with_a_failing_read(write_config, caplog, lambda name, scope: scope == "backward")
    assert len([m for m in sites if "grad_output hook of fc2" in m]) == 1
    assert len([m for m in sites if "grad_input hook of fc2" in m]) == 1
    rows = rows_of(mon.config.output_dir, "module")
    assert {r["scope"] for r in rows} == {"forward"}
    assert len({r["step"] for r in rows}) == 3


def test_graph_hook_rows_match_independent_gradients(write_config):
    model = TinyMLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "targets": ["fc2"]}}}))
    mon.start(model=model, optimizer=opt)
    x, y = make_batches(1)[0]
    hidden = ref.act(ref.fc1(x)).detach().requires_grad_(True)
    out = ref.fc2(hidden)
    out.retain_grad()
    torch.nn.functional.mse_loss(out, y).backward()
    train(model, opt, [(x, y)])
    mon.stop()
    rows = rows_of(mon.config.output_dir, "module")
    backward = {r["module_name"]: r for r in rows if r["scope"] == "backward"}
    grad_out = next(r for n, r in backward.items() if "output" in n)
    grad_in = next(r for n, r in backward.items() if "input" in n)
    assert_row_matches(grad_out, numpy_stats(out.grad))
    assert_row_matches(grad_in, numpy_stats(hidden.grad))


class _Inner(torch.nn.Module):
    """Reads a tensor its parent did not pass it: its output's node has an edge into the
    parent's input, so that node carries this module's grad_output and the parent's
    grad_input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.context = None

    def forward(self, y):
        return self.fc(y) * self.context


class _Shared(torch.nn.Module):
    """Nodes shared by several modules' graph hooks: ``x`` reaches the root's graph by
    three edges (inner's product, pre's matmul, the sum), ``wrap``'s output is its
    Linear's; with ``extra`` the call has two inputs (the general walk, not the one-input
    one)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(6, 6)
        self.inner = _Inner()
        self.wrap = torch.nn.Sequential(torch.nn.Linear(6, 6))

    def forward(self, x, extra=None):
        self.inner.context = x
        p = self.pre(x)
        h = self.inner(p)
        s = h + x
        o = self.wrap(s)
        if extra is not None:
            o = o + 0.0 * extra
        return o


@pytest.mark.parametrize("two_inputs", [False, True])
def test_nodes_shared_by_several_modules_give_their_gradients(write_config, two_inputs, tmp_path):
    torch.manual_seed(3)
    model = _Shared()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inp = torch.randn(4, 6, requires_grad=True)
    extra = torch.randn(4, 6, requires_grad=True)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "targets": []}}}))
    mon.start(model=model, optimizer=opt)
    x = inp * 2
    out = model(x, extra) if two_inputs else model(x)
    out.pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    mon.stop()
    assert mon.errors.count == 0

    # the reference: the same computation without the monitor, gradients from autograd
    x = inp.detach() * 2
    x.requires_grad_(True)
    p = ref.pre(x)
    f = ref.inner.fc(p)
    h = f * x
    s = h + x
    o = ref.wrap(s)
    loss = o.pow(2).mean()
    g_x, g_p, g_f, g_h, g_s, g_o = torch.autograd.grad(loss, [x, p, f, h, s, o], retain_graph=True)
    g_x_pre, = torch.autograd.grad(p, x, g_p)  # what pre alone sends to its input

    rows = rows_of(mon.config.output_dir, "module")
    backward = {r["module_name"]: r for r in rows if r["scope"] == "backward"}
    root = "_Shared"
    want = {
        f"{root}.grad_output.0": g_o, f"{root}.grad_input.0": g_x,  # a sum of three parts
        "pre.grad_output.0": g_p, "pre.grad_input.0": g_x_pre,
        "inner.grad_output.0": g_h, "inner.grad_input.0": g_p,
        "inner.fc.grad_output.0": g_f, "inner.fc.grad_input.0": g_p,
        "wrap.grad_output.0": g_o, "wrap.grad_input.0": g_s,
        "wrap.0.grad_output.0": g_o, "wrap.0.grad_input.0": g_s,
    }
    if two_inputs:
        want[f"{root}.grad_input.1"] = torch.zeros(4, 6)
    assert set(backward) == set(want)
    for name, g in want.items():
        assert_row_matches(backward[name], numpy_stats(g), rtol=1e-5, atol=1e-7)
    # each node's grad_output rows come before its grad_input rows, as separate hooks gave them
    order = [r["module_name"] for r in rows if r["scope"] == "backward"]
    assert order.index("wrap.0.grad_output.0") < order.index("wrap.grad_output.0") < order.index("wrap.0.grad_input.0")


class _Residual(torch.nn.Module):
    """A block of a deep stack: its call has one input made by one edge and one output,
    the common call that ``_hook_graph_one`` hooks. ``y += 1`` edits the Linear's output in
    place, which on a 3-D input is a view of the matmul: the view branch of the hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, x):
        y = self.linear(x)
        y += 1.0
        return x + self.norm(y)


def _residual_rows(write_config, out_dir, shape):
    torch.manual_seed(5)
    model = torch.nn.Sequential(_Residual(), _Residual())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"output_dir": str(out_dir),
                                         "monitors": {"module": {"enabled": True, "targets": []}}},
                                        name=f"{out_dir.name}.json"))
    mon.start(model=model, optimizer=opt)
    x = torch.randn(*shape, requires_grad=True) * 2  # made by a node: the first block's input has a producer
    for _ in range(2):
        model(x).pow(2).mean().backward(retain_graph=True)
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert mon.errors.count == 0
    return rows_of(out_dir, "module")


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6)])
def test_the_common_calls_hooks_give_the_general_walks_rows(write_config, tmp_path, shape, monkeypatch):
    """``_hook_graph_one`` is a shortcut of ``_hook_graph`` for the common call: with the
    shortcut routed to the general walk the rows are the same, in the same order, and the
    blocks' gradients match autograd's."""
    fast = _residual_rows(write_config, tmp_path / "fast", shape)

    def general(self, vpp, names, output, own, edge, call):
        self._hook_graph(vpp, names, (output,), (names.grad_output_0,), call)

    monkeypatch.setattr(ModuleMonitor, "_hook_graph_one", general)
    slow = _residual_rows(write_config, tmp_path / "slow", shape)
    assert [r for r in fast if r["scope"] == "backward"]  # the graph hooks wrote rows
    assert fast == slow

    # the second step's block gradients, independently: autograd on the trained-once model
    torch.manual_seed(5)
    ref = torch.nn.Sequential(_Residual(), _Residual())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(*shape, requires_grad=True) * 2
    ref(x).pow(2).mean().backward(retain_graph=True)
    ref_opt.step()
    ref_opt.zero_grad()
    h = ref[0](x)
    out = ref[1](h)
    g_x, g_h, g_out = torch.autograd.grad(out.pow(2).mean(), [x, h, out])
    second = {r["module_name"]: r for r in fast if r["scope"] == "backward" and r["step"] == "1"}
    want = {"0.grad_input.0": g_x, "0.grad_output.0": g_h, "1.grad_input.0": g_h, "1.grad_output.0": g_out,
            "Sequential.grad_input.0": g_x, "Sequential.grad_output.0": g_out}
    for name, g in want.items():
        assert_row_matches(second[name], numpy_stats(g), rtol=1e-5, atol=1e-7)


def test_a_graph_built_before_stop_backpropagates_after_it_unchanged_and_writes_nothing(write_config):
    """The graph hooks live on autograd nodes, which stop() cannot take back: a graph whose
    forward pass ran on a written step and whose backward pass runs after stop() gets the
    gradients of an unmonitored copy, to the bit, and its hooks record and write nothing."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(_Residual(), _Residual())
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "targets": []}}}))
    mon.start(model=model, optimizer=opt)
    x = torch.randn(2, 3, 6)
    loss = model(x).pow(2).mean()  # the forward hooks put the graph hooks on this graph
    mon.stop()
    written = rows_of(mon.config.output_dir, "module")
    module_monitor, = mon.monitors
    kept = list(module_monitor._records)
    loss.backward()
    ref(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert mon.errors.count == 0
    assert module_monitor._records == kept  # the node hooks recorded nothing
    assert rows_of(mon.config.output_dir, "module") == written


def test_the_extensions_graph_walk_finds_the_python_walks_edges_in_its_order():
    """``edges_into`` (the kernel's extension) and ``_edges_into`` (Python) walk the same
    graphs to the same ``(node, edge index)`` list, in the same order: a residual block
    whose input reaches two nodes, an input used three times through a shared node, a
    view of the input, and a boundary that stops the walk before the nodes made earlier."""
    ext = native.extension()
    assert ext is not None, "the extension is built on the test machines"
    get_seq = torch._C._autograd._get_sequence_nr
    lin = torch.nn.Linear(4, 4)
    w = torch.randn(4, 4, requires_grad=True)
    cases = []
    x = torch.randn(3, 4, requires_grad=True) * 2  # made before every boundary below
    edge = (x.grad_fn, 0)
    start = get_seq()
    cases.append((edge, [(x + lin(x)).grad_fn], start))                 # residual: two edges
    start = get_seq()
    h = torch.tanh(x)
    cases.append((edge, [(h * x + x @ w + h).grad_fn], start))          # three uses, a shared node
    start = get_seq()
    cases.append((edge, [(x.view(12).sin() + 1).grad_fn], start))       # through a view
    cases.append((edge, [(x + lin(x)).grad_fn], get_seq() + 10 ** 6))   # boundary after all: root only
    for target, roots, boundary in cases:
        want = module_mod._edges_into(target, roots, boundary)
        got = ext.edges_into(module_mod._ACCUMULATE_GRAD, module_mod._is_accumulate_grad, target, roots, boundary)
        assert want, "each case reaches the input at least once"
        assert [(id(n), e) for n, e in got] == [(id(n), e) for n, e in want]
    assert len(module_mod._edges_into(*cases[0])) == 2 and len(module_mod._edges_into(*cases[1])) == 3


@pytest.mark.parametrize("kind", ["extension", "python"])
def test_a_node_hook_records_its_slots_contains_each_slots_error_and_lets_an_interrupt_through(write_config, kind):
    """A node's hook object, the extension's ``NodeHook`` or the Python ``_NodeHook``: as a
    post-hook it records its ``grad_output`` slots from the node's incoming gradients and its
    ``grad_input`` slots from the outgoing ones, a sum's part goes to the running sum, a slot
    that fails is reported once under its own site while the others are still recorded, and
    an exception that is not an ``Exception`` (Ctrl-C) is not swallowed."""
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "targets": ["fc2"]}}}))
    mon.start(model=model, optimizer=opt)
    mod = next(m for m in mon.monitors if m.name == "module")
    assert mod.active, "the first step is written"
    ext = native.extension()
    assert ext is not None, "the extension is built on the test machines"
    hook = (ext.NodeHook(mod, module_mod._NODE_HOOK_SITE, "backward", object) if kind == "extension"
            else module_mod._NodeHook(mod, object))
    assert (hook.outs, hook.ins, hook.pre, hook.post) == ((), (), False, False) and hook.monitor is mod
    g_out, g_in, part = torch.randn(3, 4), torch.randn(3, 5), torch.randn(3, 5)
    hook.outs = ((0, 0, "n.grad_output.0", "site of n.grad_output"),)
    hook.ins = ((0, 1, "n.grad_input.0", -1, 1, "site of n.grad_input"),
                (0, 7, "m.grad_input.0", -1, 1, "site of m.grad_input"),  # no edge 7: IndexError
                (0, 1, "s.grad_input.0", 41, 2, "site of s.grad_input"))   # sum 41: one part of two
    mod._records.clear()
    errors_before = mod.errors.count
    assert hook((None, g_in), (g_out,)) is None
    assert [r.name for r in mod._records] == ["n.grad_output.0", "n.grad_input.0"]
    for record, t in zip(mod._records, (g_out, g_in)):
        assert record.numel == t.numel() and record.scope == "backward"
    assert mod.errors.count == errors_before + 1, "the IndexError of edge 7, contained"
    assert mod._sums[41][module_mod._COUNT] == 1 and mod._sums[41][module_mod._TOTAL] is g_in
    # the second part of sum 41 (through a view's node: another shape, as many elements)
    mod._records.clear()
    slots = hook.outs, hook.ins
    hook.outs, hook.ins = (), ((0, 0, "s.grad_input.0", 41, 2, "site of s.grad_input"),)
    assert hook((part.reshape(15),), (g_out,)) is None
    assert 41 not in mod._sums, "read and dropped once its last part is in"
    assert [(r.name, r.numel, r.scope) for r in mod._records] == [("s.grad_input.0", 15, "backward")]
    hook.outs, hook.ins = slots

    def interrupted(*args):
        raise KeyboardInterrupt

    mod._read = interrupted
    with pytest.raises(KeyboardInterrupt):
        hook((None, g_in), (g_out,))
    mon.stop()


def test_the_extensions_node_hook_holds_its_monitor_weakly():
    """The extension's ``NodeHook`` is not tracked by the garbage collector, so it holds its
    monitor by a weak reference (a cycle through it could never be collected): once the
    monitor is gone, the hook says so and does nothing when the engine calls it."""
    import gc
    import weakref

    class Owner:  # stands in for the monitor: active, but never to be reached once gone
        active = True

    owner = Owner()
    hook = native.extension().NodeHook(owner, module_mod._NODE_HOOK_SITE, "backward", object)
    assert not gc.is_tracked(hook) and hook.monitor is owner
    gone = weakref.ref(owner)
    del owner
    assert gone() is None and hook.monitor is None
    assert hook((torch.ones(2),)) is None


class _Mixed(torch.nn.Module):
    """Calls of every kind the modules' call hooks meet: the common call (one tensor in, one
    out: the residual blocks, in C with the extension), two inputs and a keyword (``_Shared``
    with ``extra``), a view input (``x[:, :6]``), a tuple output, and a block whose forward
    runs again in the backward pass (activation checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(_Residual(), _Residual())
        self.shared = _Shared()
        self.split = _Split()
        self.again = _Residual()

    def forward(self, x):
        h = self.blocks(x)
        h = self.shared(h, extra=h * 0.5)
        a, b = self.split(torch.cat([h, h], dim=-1)[..., :12])
        h = a + b
        return torch.utils.checkpoint.checkpoint(self.again, h, use_reentrant=False)


class _Split(torch.nn.Module):
    def forward(self, x):
        return x[..., :6] * 2.0, x[..., 6:]


def _mixed_rows(write_config, out_dir):
    torch.manual_seed(11)
    model = _Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"output_dir": str(out_dir),
                                         "monitors": {"module": {"enabled": True, "targets": []}}},
                                        name=f"{out_dir.name}.json"))
    mon.start(model=model, optimizer=opt)
    monitor = next(m for m in mon.monitors if m.name == "module")
    hook_types = {type(h) for m in model.modules() for h in m._forward_pre_hooks.values()}
    leaf = torch.randn(4, 6, requires_grad=True)
    for _ in range(2):
        x = leaf * 2  # made by a node: the first block's input has a producer
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation pass: eval_forward rows
            model(x)
    mon.stop()
    assert mon.errors.count == 0
    return rows_of(out_dir, "module"), monitor._native_calls, hook_types


def test_the_call_hooks_in_c_give_the_python_hooks_rows(write_config, tmp_path, monkeypatch):
    """With the extension, the modules' common calls run in its ``CallHook``: the rows are
    those of the Python hooks, in the same order, value for value, for calls of every kind
    (the ones ``CallHook`` hands to the Python hook too)."""
    if native.extension() is None:
        pytest.fail("the kernel's extension is not built here: CallHook cannot be compared")
    fast, in_c, types = _mixed_rows(write_config, tmp_path / "c")
    assert in_c and native.extension().CallHook in types
    monkeypatch.setattr(module_mod, "_native_call_hooks", lambda ext: False)
    slow, in_c, types = _mixed_rows(write_config, tmp_path / "python")
    assert not in_c and native.extension().CallHook not in types
    assert {r["scope"] for r in fast} == {"forward", "backward", "eval_forward"}
    assert len(fast) > 100
    assert fast == slow


@pytest.mark.parametrize("kind", ["extension", "python"])
@pytest.mark.parametrize("failing_row, site, left", [
    ("fc2.input.0", "forward pre-hook of fc2", {("fc2.output.0", "forward"), ("fc2.grad_output.0", "backward")}),
    ("fc2.output.0", "forward hook of fc2", {("fc2.input.0", "forward")}),
])
def test_an_error_in_a_call_hook_is_contained_once_and_training_is_unchanged(write_config, caplog, kind, failing_row,
                                                                            site, left, monkeypatch):
    """A forward read that fails, in the extension's ``CallHook`` or in the Python hook: one
    error logged under its site, training bit-identical to an unmonitored copy, and the rows
    that do not depend on it written. The input's read fails first in the pre-hook, so the
    call has no state: its forward hook still records the output and its ``grad_output``
    (and no ``grad_input``, whose producer was not taken); the output's read fails first in
    the forward hook, before the graph hooks."""
    if kind == "python":
        monkeypatch.setattr(module_mod, "_native_call_hooks", lambda ext: False)
    mon, module, sites = _train_with_a_failing_read(write_config, caplog, lambda name, scope: name == failing_row)
    assert module._native_calls == (kind == "extension" and native.extension() is not None)
    assert len(sites) == 1 and site in sites[0]
    rows = rows_of(mon.config.output_dir, "module")
    assert {(r["module_name"], r["scope"]) for r in rows} == left
    assert len({r["step"] for r in rows}) == 3


@pytest.mark.parametrize("kind", ["extension", "python"])
def test_an_interrupt_in_a_call_hook_is_not_swallowed(write_config, kind, monkeypatch):
    """Ctrl-C while a call hook reads (a ``KeyboardInterrupt``, not an ``Exception``) stops
    the forward pass, in the extension's ``CallHook`` as in the Python hook."""
    if kind == "python":
        monkeypatch.setattr(module_mod, "_native_call_hooks", lambda ext: False)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "targets": ["fc2"]}}}))
    mon.start(model=model, optimizer=opt)
    module = next(m for m in mon.monitors if m.name == "module")
    assert module._native_calls == (kind == "extension")

    def interrupted(*args):
        raise KeyboardInterrupt

    module._read = interrupted
    x, y = make_batches(1)[0]
    with pytest.raises(KeyboardInterrupt):
        loss_fn(model, x, y)
    mon.stop()
    assert mon.errors.count == 0


def test_the_extensions_hooks_count_their_time_in_the_monitors_busy_seconds(write_config):
    """``CallHook`` and ``NodeHook`` add their time to the errors' C clock, not to a Python
    attribute: ``busy_seconds`` (what ``stop()`` reports) includes it, and a Python hook's
    ``busy +=`` still adds to it."""
    ext = native.extension()
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "targets": []}}}))
    mon.start(model=model, optimizer=opt)
    clock = mon.errors.clock
    assert type(clock) is ext.BusyClock and clock.seconds == 0.0
    train(model, opt, make_batches(2))
    assert clock.seconds > 0.0
    counted = mon.busy_seconds
    assert counted >= clock.seconds
    mon.errors.busy += 1.5  # as a Python hook adds its time
    assert mon.busy_seconds == pytest.approx(counted + 1.5)
    mon.stop()
