"""weight_grad's batched 'unreduced' read (the gradients of a backward pass read together
when the pass ends): the rows are those of the gradients as each was accumulated, even
where something else changes .grad in the same pass (another post-accumulate hook: the
optimizer-step-in-backward pattern), DDP without a bucket view is read in the batch too,
and wrappers that change .grad during backward keep the per-parameter read. References are computed independently with torch.autograd.grad on
a copy of the model."""

import copy

import pytest
import torch
import torch.distributed as dist

from support import TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, rows_of
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2


def weight_grad_monitor(mon):
    return next(m for m in mon.monitors if m.name == "weight_grad")


def reference_grads(model, batches):
    params = list(model.parameters())
    total = None
    for x, y in batches:
        grads = torch.autograd.grad(loss_fn(model, x, y), params)
        total = list(grads) if total is None else [t + g for t, g in zip(total, grads)]
    return {n: g for (n, _), g in zip(model.named_parameters(), total)}


def test_batched_read_gives_each_accumulated_gradient_over_micro_batches_and_steps(write_config):
    model = TinyMLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt, grad_acc_steps=2)
    assert weight_grad_monitor(mon)._batched, "plain torch reads a backward pass's gradients together"
    batches = make_batches(6)
    expected = []
    for s in range(3):
        micro = batches[2 * s:2 * s + 2]
        expected.append(reference_grads(ref, micro))
        with torch.no_grad():  # the reference takes the same SGD step
            for p, g in zip(ref.parameters(), expected[-1].values()):
                p -= 0.1 * g
        for x, y in micro:
            loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    rows = rows_of(mon.config.output_dir, "weight_grad")
    for s, grads in enumerate(expected):
        for name, g in grads.items():
            row = find_row(rows, step=s, module_name=name, scope="unreduced")
            assert row["micro_step"] == "2"
            assert_row_matches(row, numpy_stats(g))


def test_another_post_accumulate_hook_changing_grad_is_read_before_it(write_config):
    """A user hook that runs after the monitor's and changes .grad in place (scaling, or
    zeroing after an update in backward) or drops it: 'unreduced' is the gradient as
    accumulated, not what the end of the pass finds."""
    model = TinyMLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    seen = {}
    names = {id(p): n for n, p in model.named_parameters()}

    def after_monitor(p):  # registered after the monitor's hook, so it runs after it
        seen[names[id(p)]] = p.grad.clone()
        if names[id(p)] == "fc1.weight":
            p.grad = None
        else:
            p.grad.mul_(0.0)

    handles = [p.register_post_accumulate_grad_hook(after_monitor) for p in model.parameters()]
    x, y = make_batches(1)[0]
    want = reference_grads(ref, [(x, y)])
    loss_fn(model, x, y).backward()
    opt.step()
    for h in handles:
        h.remove()
    mon.stop()
    rows = rows_of(mon.config.output_dir, "weight_grad")
    for name, g in want.items():
        torch.testing.assert_close(seen[name], g)
        assert_row_matches(find_row(rows, module_name=name, scope="unreduced"), numpy_stats(g))


@pytest.mark.parametrize("bucket_view", [False, True], ids=["default", "bucket-view"])
def test_ddp_is_read_in_one_batch_unless_grad_is_the_bucket(write_config, tmp_path, bucket_view):
    """DDP's default reducer copies gradients into its own buckets and writes the mean
    back into .grad only when the backward pass ends, after the monitor's end-of-pass
    read (tested with two ranks in tests/distributed/test_data_parallel.py): one batch.
    With a bucket view .grad is the bucket, all-reduced in place during backward: each
    gradient is read in its own hook."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = TinyMLP()
        ref = copy.deepcopy(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
        mon.start(model=ddp, optimizer=opt)
        monitor = weight_grad_monitor(mon)
        assert monitor._batched is not bucket_view
        reads = []
        original = monitor._read_batch
        monitor._batch_site = lambda: (reads.append(len(monitor._pending)), original())
        x, y = make_batches(1)[0]
        want = reference_grads(ref, [(x, y)])
        loss_fn(ddp, x, y).backward()
        opt.step()
        mon.stop()
    finally:
        dist.destroy_process_group()
    assert reads == ([] if bucket_view else [len(want)])  # every parameter in the one end-of-pass read
    rows = rows_of(mon.config.output_dir, "weight_grad")
    for name, g in want.items():
        assert_row_matches(find_row(rows, module_name=name, scope="unreduced"), numpy_stats(g))


def test_a_gradient_dropped_later_in_the_same_pass_is_said_once_and_the_others_are_written(write_config, caplog):
    """A tensor hook of the user's code that runs later in the backward pass sets an already
    accumulated parameter's .grad to None: the end-of-pass read finds nothing there. It
    says so once, naming the parameter; every other parameter's row is the gradient."""
    model = TinyMLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    x, y = make_batches(1)[0]
    want = reference_grads(ref, [(x, y)])
    hidden = model.fc1(x)  # fc2's gradients accumulate before this activation's gradient is computed
    hidden.register_hook(lambda g: setattr(model.fc2.weight, "grad", None))
    with caplog.at_level("WARNING", logger="msprobe.monitor_v2"):
        torch.nn.functional.mse_loss(model.fc2(torch.relu(hidden)), y).backward()
        opt.step()
        mon.stop()
    said = [r.getMessage() for r in caplog.records if "set to None" in r.getMessage()]
    assert len(said) == 1 and "fc2.weight" in said[0], said
    rows = rows_of(mon.config.output_dir, "weight_grad")
    assert [r for r in rows if r["module_name"] == "fc2.weight" and r["scope"] == "unreduced"] == []
    for name in ("fc1.weight", "fc1.bias", "fc2.bias"):
        assert_row_matches(find_row(rows, module_name=name, scope="unreduced"), numpy_stats(want[name]))


def test_with_the_extension_one_python_hook_per_pass_arms_the_rest_in_c(write_config, monkeypatch):
    """Where the kernel's extension is built, the first post-accumulate hook of a backward
    pass runs in Python (it checks the pass and queues the end-of-pass read) and the other
    parameters' hooks only note their source in C (``GradNote``); a second hook on a
    parameter, added after start(), sends that one back to Python. The rows are the accumulated gradients."""
    import gc

    from msprobe.core.monitor_v2 import native
    from msprobe.core.monitor_v2.frameworks.pytorch.weight_grad import WeightGradMonitor

    kernel = native.load()
    assert kernel is not None and kernel.ext is not None, "the extension is built on the test machines"
    calls = []
    original = WeightGradMonitor._on_accumulated_grad_batched
    monkeypatch.setattr(WeightGradMonitor, "_on_accumulated_grad_batched",
                        lambda self, source, tensor: calls.append(source.rows[0][1]) or original(self, source, tensor))
    model = TinyMLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt, grad_acc_steps=2)
    hooks = [h for p in model.parameters() for h in p._post_accumulate_grad_hooks.values()]
    assert {type(h).__name__ for h in hooks} == {"GradNote"} and all(gc.is_tracked(h) for h in hooks)
    assert weight_grad_monitor(mon) in gc.get_referents(hooks[0]), "the collector sees the hook's references"
    # each hook holds the dict it sits in, and counts the hooks there (fc1.bias's below)
    assert all(h.hooks is p._post_accumulate_grad_hooks for p in model.parameters()
               for h in p._post_accumulate_grad_hooks.values())
    x, y = make_batches(1)[0]
    want = reference_grads(ref, [(x, y), (x, y)])
    loss_fn(model, x, y).backward()
    assert len(calls) == 1, calls
    extra = model.fc1.bias.register_post_accumulate_grad_hook(lambda p: None)  # fc1.bias: Python again
    loss_fn(model, x, y).backward()
    extra.remove()
    assert len(calls) == 3 and calls[2] == "fc1.bias", calls
    opt.step()
    mon.stop()
    rows = rows_of(mon.config.output_dir, "weight_grad")
    for name, g in want.items():
        row = find_row(rows, module_name=name, scope="unreduced")
        assert row["micro_step"] == "2"
        assert_row_matches(row, numpy_stats(g))


def test_a_named_ddp_counts_only_around_the_model_given(write_config, tmp_path):
    """An integration names the DDP its framework made (start()'s ``_ddp_wrapper``): it
    vouches for the model given only if that model is inside it."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model, other = TinyMLP(), TinyMLP()
        around, elsewhere = (torch.nn.parallel.DistributedDataParallel(m) for m in (model, other))
        seen = {}
        for name, wrapper in (("around", around), ("elsewhere", elsewhere)):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
            mon.start(model=model, optimizer=opt, _ddp_wrapper=wrapper)
            seen[name] = weight_grad_monitor(mon)._ddps
            mon.stop()
    finally:
        dist.destroy_process_group()
    assert seen == {"around": [around], "elsewhere": []}


def test_a_gradient_larger_than_a_group_member_is_read_in_its_own_hook(write_config):
    """Nothing would batch a gradient of more than GROUP_MAX_NUMEL elements (every engine
    reduces it alone), and in its hook it is still in the CPU's caches: it is read there.
    The small ones wait for the end-of-pass batch. Every row is the gradient's."""
    from msprobe.core.monitor_v2.stats import GROUP_MAX_NUMEL

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Tanh(), torch.nn.Linear(300, 2))
    assert model[0].weight.numel() > GROUP_MAX_NUMEL
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    monitor = weight_grad_monitor(mon)
    reads = []
    original = monitor._read_batch
    monitor._batch_site = lambda: (reads.append(sorted(s.rows[0][1] for s in monitor._pending)), original())
    x, y = torch.randn(4, 300), torch.randn(4, 2)
    params = list(ref.parameters())
    want = dict(zip([n for n, _ in ref.named_parameters()],
                    torch.autograd.grad(torch.nn.functional.mse_loss(ref(x), y), params)))
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    mon.stop()
    assert reads == [["0.bias", "2.bias", "2.weight"]]  # 0.weight was read in its hook
    rows = rows_of(mon.config.output_dir, "weight_grad")
    for name, g in want.items():
        assert_row_matches(find_row(rows, module_name=name, scope="unreduced"), numpy_stats(g))


def test_an_error_in_the_end_of_pass_read_is_logged_once_and_training_goes_on(write_config, caplog):
    """The batch read runs as an autograd-engine callback, inside backward(): an exception
    there would leave backward() with it. It is contained, said once under its site, and the
    training is what it is without the monitor."""
    model = TinyMLP()
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    assert weight_grad_monitor(mon)._batched

    def broken(*args, **kwargs):
        raise RuntimeError("statistics engine broke")

    mon._session.engine.record_many = broken
    with caplog.at_level("WARNING", logger="msprobe.monitor_v2"):
        for x, y in make_batches(3):
            for m, o in ((model, opt), (twin, twin_opt)):
                loss_fn(m, x, y).backward()
                o.step()
                o.zero_grad()
        mon.stop()
    said = [r.getMessage() for r in caplog.records if "weight_grad unreduced batch" in r.getMessage()]
    assert len(said) == 1 and "statistics engine broke" in said[0], said
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
