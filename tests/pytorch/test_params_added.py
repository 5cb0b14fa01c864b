"""Parameters and modules added after ``start()`` (issue 47, item 4): a param group added
for gradual unfreezing, a layer appended to a ``ModuleList``, a head set on the model.
The session finds them at the beginning of the next written step (a few sizes and a flag
compared while nothing changed) and every monitor observes them from that step on:
``weight_grad`` unreduced and reduced, ``param``, ``optimizer``, and the ``module`` rows of
new modules that ``targets`` select. Where a stack cannot (FSDP's shards laid out at
``start()``), that is said once at WARNING, naming them.

Real training, values against NumPy statistics of copies taken by the test, training
bit-identical to an unmonitored run, nothing left on the model, the optimizer or torch's
global registration hooks after ``stop()``. The 2-rank DDP case runs this file as a
``torchrun`` worker."""

import logging
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from support import assert_row_matches, find_row, numpy_stats, rows_of, run_torchrun
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

ACC = 2  # micro-batches per step in the unfreezing test


def _init(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


class Net(nn.Module):
    """Layers in a ``ModuleList`` (one can be appended), a head, and an optional second
    head and tail that a run may set on the model after ``start()``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)
        _init(self, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        x = self.head(x)
        head2 = self._modules.get("head2")
        if head2 is not None:
            x = x + head2(x)
        tail = self._modules.get("tail")
        return x if tail is None else tail(x)


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def state_copies(opt: torch.optim.Optimizer, named) -> dict:
    """Copies of each named parameter's optimizer state tensors (not the scalar step)."""
    out = {}
    for name, p in named:
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                out[f"{name}.{key}"] = value.detach().clone()
    return out


def leftovers(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every hook or wrapper found on the model and the optimizer (empty: none)."""
    found = {}
    for name, p in model.named_parameters():
        n = len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        if n:
            found[name] = n
    for name, m in model.named_modules():
        n = sum(len(getattr(m, attr)) for attr in (
            "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))
        if n or "forward" in vars(m):
            found["module:" + name] = n
    n = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks) + ("step" in vars(opt))
    if n:
        found["optimizer"] = n
    return found


def registration_hooks() -> tuple:
    """How many of torch's global module and parameter registration hooks exist now."""
    registry = torch.nn.modules.module
    return (len(registry._global_module_registration_hooks), len(registry._global_parameter_registration_hooks))


ALL = {"weight_grad": {"enabled": True}, "param": {"enabled": True}, "optimizer": {"enabled": True}}


# ---------------------------------------------------------------- (a) gradual unfreezing
def unfreeze_run(config, how: str, steps: int = 7, unfreeze_at: int = 3):
    """Train ``Net`` with its head frozen until step ``unfreeze_at``, then trainable: a new
    param group (``add_param_group``), or a group the optimizer held from the start
    (``in_optimizer``). Returns losses, final parameters, the head's copies per step and
    the monitor."""
    model = Net()
    model.head.requires_grad_(False)
    if how == "add_param_group":
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = None
    if config is not None:
        mon = TrainerMonitorV2(config)
        mon.start(model=model, optimizer=opt, grad_acc_steps=ACC)
    head = [(f"head.{n}", p) for n, p in model.head.named_parameters()]
    losses, copies = [], {}
    data = batches(steps * ACC)
    for step in range(steps):
        if step == unfreeze_at:
            model.head.requires_grad_(True)
            if how == "add_param_group":
                opt.add_param_group({"params": list(model.head.parameters()), "lr": 0.02})
        for x, y in data[step * ACC:(step + 1) * ACC]:
            loss = torch.nn.functional.mse_loss(model(x), y) / ACC
            loss.backward()
            losses.append(loss.detach().clone())
        copies[step] = {
            "grad": {n: p.grad.detach().clone() for n, p in head if p.grad is not None},
            "param_origin": {n: p.detach().clone() for n, p in head},
        }
        opt.step()
        copies[step]["param_updated"] = {n: p.detach().clone() for n, p in head}
        copies[step]["state"] = state_copies(opt, head)
        opt.zero_grad()
    if mon is not None:
        mon.stop()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], copies, mon, model, opt


@pytest.mark.parametrize("how", ["add_param_group", "in_optimizer"])
def test_a_layer_unfrozen_after_start_is_monitored_from_the_next_written_step(write_config, how):
    """Gradual unfreezing at step 3, written steps 0, 2, 4, 6: the head's parameters get
    every row from step 4 (the first written step that begins after the change), with the
    values of the gradients, parameters and AdamW moments the test copied."""
    hooks_before = registration_hooks()
    config = write_config({"step_interval": 2, "monitors": ALL})
    losses_off, params_off, _, _, _, _ = unfreeze_run(None, how)
    losses_on, params_on, copies, mon, model, opt = unfreeze_run(config, how)
    assert torch.equal(losses_off, losses_on)
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_on))
    assert mon.errors.count == 0
    assert leftovers(model, opt) == {}
    assert registration_hooks() == hooks_before

    out = mon.config.output_dir
    grads, params, states = rows_of(out, "weight_grad"), rows_of(out, "param"), rows_of(out, "optimizer")
    names = ("head.weight", "head.bias")
    assert {int(r["step"]) for r in grads} == {0, 2, 4, 6}
    # frozen until step 3 (written steps 0 and 2): no gradient rows
    assert not [r for r in grads if r["module_name"] in names and int(r["step"]) < 4]
    for step in (4, 6):
        for name in names:
            g = numpy_stats(copies[step]["grad"][name])
            # one process: the accumulated local gradient of both micro-batches is the reduced one
            for scope in ("unreduced", "reduced"):
                row = find_row(grads, step=step, module_name=name, scope=scope)
                assert row["micro_step"] == str(ACC)
                assert_row_matches(row, g)
            for scope in ("param_origin", "param_updated"):
                assert_row_matches(find_row(params, step=step, module_name=name, scope=scope),
                                   numpy_stats(copies[step][scope][name]))
            for state in ("exp_avg", "exp_avg_sq"):
                assert_row_matches(find_row(states, step=step, module_name=f"{name}.{state}", scope=state),
                                   numpy_stats(copies[step]["state"][f"{name}.{state}"]))


# ------------------------------------------------------- (b) modules added to the model
def growing_run(config, steps: int = 5, grow_at: int = 2, capture: bool = False):
    """Train ``Net``; at step ``grow_at`` a layer is appended to ``layers``, a second head
    and a parameterless tail are set on the model, and the new parameters join the
    optimizer in a param group. With ``capture`` (the unmonitored run only), the new
    modules' inputs, outputs and output gradients are copied by the test's own hooks."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = None
    if config is not None:
        mon = TrainerMonitorV2(config)
        mon.start(model=model, optimizer=opt)
    seen: dict = {}
    step_now = [0]

    def keep(name):
        def hook(module, args, output):
            at = seen.setdefault(step_now[0], {})
            at[f"{name}.input.0"] = args[0].detach().clone()
            at[f"{name}.output.0"] = output.detach().clone()
            output.register_hook(lambda g: at.__setitem__(f"{name}.grad_output.0", g.detach().clone()))
        return hook

    losses, copies = [], {}
    data = batches(steps)
    for step, (x, y) in enumerate(data):
        step_now[0] = step
        if step == grow_at:
            model.layers.append(_init(nn.Linear(8, 8), 7))
            model.head2 = _init(nn.Linear(3, 3), 8)
            model.tail = nn.Softsign()
            opt.add_param_group({"params": [*model.layers[2].parameters(), *model.head2.parameters()]})
            if capture:
                model.layers[2].register_forward_hook(keep("layers.2"))
                model.head2.register_forward_hook(keep("head2"))
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach().clone())
        named = [(n, p) for n, p in model.named_parameters() if n.startswith(("layers.2.", "head2."))]
        copies[step] = {"grad": {n: p.grad.detach().clone() for n, p in named},
                        "param_origin": {n: p.detach().clone() for n, p in named}}
        opt.step()
        copies[step]["param_updated"] = {n: p.detach().clone() for n, p in named}
        copies[step]["state"] = state_copies(opt, named)
        opt.zero_grad()
    if mon is not None:
        mon.stop()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], copies, seen, mon, model, opt


def test_modules_added_to_the_model_are_monitored_from_the_next_written_step(write_config):
    """A layer appended to a ``ModuleList`` and a head set on the model at step 2 (and
    given to the optimizer): from step 3 on, module rows for those ``targets`` selects
    (not for the new tail, which it does not), weight_grad, param and optimizer rows for
    their parameters, under their model names, against the copies."""
    hooks_before = registration_hooks()
    config = write_config({"monitors": {**ALL, "module": {"enabled": True, "targets": ["layers", "head"]}}})
    losses_off, params_off, _, seen, _, _, _ = growing_run(None, capture=True)
    losses_on, params_on, copies, _, mon, model, opt = growing_run(config)
    assert torch.equal(losses_off, losses_on)
    assert len(params_off) == len(params_on)
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_on))
    assert mon.errors.count == 0
    assert leftovers(model, opt) == {}
    assert registration_hooks() == hooks_before

    out = mon.config.output_dir
    modules = rows_of(out, "module")
    new = ("layers.2.", "head2.")
    assert {int(r["step"]) for r in modules if r["module_name"].startswith(new)} == {3, 4}
    assert not [r for r in modules if r["module_name"].startswith("tail")]
    for step in (3, 4):
        for name, tensor in seen[step].items():
            scope = "backward" if ".grad_output." in name else "forward"
            assert_row_matches(find_row(modules, step=step, module_name=name, scope=scope), numpy_stats(tensor))
    # the modules there from the start keep their rows at every step
    assert {int(r["step"]) for r in modules if r["module_name"] == "head.output.0"} == set(range(5))

    grads, params, states = rows_of(out, "weight_grad"), rows_of(out, "param"), rows_of(out, "optimizer")
    for rows_ in (grads, params, states):
        assert {int(r["step"]) for r in rows_ if r["module_name"].startswith(new)} == {3, 4}
    for step in (3, 4):
        for name, grad in copies[step]["grad"].items():
            for scope in ("unreduced", "reduced"):
                assert_row_matches(find_row(grads, step=step, module_name=name, scope=scope), numpy_stats(grad))
            for scope in ("param_origin", "param_updated"):
                assert_row_matches(find_row(params, step=step, module_name=name, scope=scope),
                                   numpy_stats(copies[step][scope][name]))
        assert copies[step]["state"]
        for name, value in copies[step]["state"].items():
            scope = name.rsplit(".", 1)[1]
            assert_row_matches(find_row(states, step=step, module_name=name, scope=scope), numpy_stats(value))


# ------------------------------------------- what cannot be monitored: FSDP2's shards
def test_parameters_sharded_by_fsdp2_after_start_are_said_once_at_warning(write_config, tmp_path, caplog):
    """FSDP2 (one gloo rank): a head set on the model and sharded with ``fully_shard``
    after ``start()``, then given to the optimizer. Its shards cannot be read through the
    layout found at ``start()``: one WARNING names both parameters and says why; no
    weight_grad or param rows for them, while the module monitor's rows of the new head
    are written from the next step on; the training is untouched."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = Net()
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        mon = TrainerMonitorV2(write_config({"monitors": {**ALL, "module": {"enabled": True}}}))
        mon.start(model=model, optimizer=opt)
        with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
            for step, (x, y) in enumerate(batches(5)):
                if step == 2:
                    model.head2 = _init(nn.Linear(3, 3), 8)
                    fully_shard(model.head2)
                    opt.add_param_group({"params": list(model.head2.parameters())})
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        mon.stop()
    finally:
        dist.destroy_process_group()
    said = [r.getMessage() for r in caplog.records if "added after start()" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("monitor_v2: 2 parameters (head2.weight, head2.bias) added after start() are not "
                              "monitored"), said[0]
    assert "FSDP" in said[0]
    assert mon.errors.count == 0
    out = mon.config.output_dir
    for monitor in ("weight_grad", "param", "optimizer"):
        assert not [r for r in rows_of(out, monitor) if r["module_name"].startswith("head2")]
    assert {int(r["step"]) for r in rows_of(out, "module") if r["module_name"].startswith("head2.")} == {3, 4}


# --------------------------------------------------------------- (c) DDP, 2 gloo ranks
def test_under_ddp_on_two_ranks(tmp_path):
    """Both cases under torch DDP (2 gloo ranks, batched unreduced reads): a param group
    added for the head that DDP reduces, and a second head set on the inner model (which
    DDP, built before it, does not reduce). Each rank checks its rows from step 3 against
    the local gradients entering the all-reduce (a communication hook's copies), the
    gradients at the step and the AdamW moments, and the training against an unmonitored
    run (see ``_worker``)."""
    run_torchrun(__file__, tmp_path, timeout=300)
    for rank in (0, 1):
        assert (tmp_path / f"ok_rank{rank}").exists()


def ddp_run(out_dir, rank: int, monitored: bool, steps: int = 5, grow_at: int = 2):
    from torch.nn.parallel import DistributedDataParallel

    from support.ddp import clone_then_average

    model = Net()
    ddp = DistributedDataParallel(model)
    names = {id(p): n for n, p in model.named_parameters()}
    local: dict = {}
    step_now = [0]
    ddp.register_comm_hook(None, clone_then_average(local, names, lambda: step_now[0]))
    opt = torch.optim.AdamW(model.layers.parameters(), lr=0.05)
    mon = None
    if monitored:
        mon = TrainerMonitorV2({"output_dir": out_dir, "monitors": ALL})
        mon.start(model=ddp, optimizer=opt)
    added = ("head.", "head2.")
    losses, copies = [], {}
    for step, (x, y) in enumerate(batches(steps, seed=10 + rank)):
        step_now[0] = step
        if step == grow_at:
            opt.add_param_group({"params": list(model.head.parameters()), "lr": 0.02})
            model.head2 = _init(nn.Linear(3, 3), 8)
            opt.add_param_group({"params": list(model.head2.parameters())})
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        losses.append(loss.detach().clone())
        named = [(n, p) for n, p in model.named_parameters() if n.startswith(added)]
        copies[step] = {"grad": {n: p.grad.detach().clone() for n, p in named}}
        opt.step()
        copies[step]["state"] = state_copies(opt, named)
        opt.zero_grad()
    if mon is not None:
        mon.stop()
        assert mon.errors.count == 0
        assert leftovers(ddp, opt) == {}
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], copies, local


def _worker(out_dir: str) -> None:
    from support import finish

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hooks_before = registration_hooks()
    losses_off, params_off, _, _ = ddp_run(None, rank, monitored=False)
    out = os.path.join(out_dir, "out")
    losses_on, params_on, copies, local = ddp_run(out, rank, monitored=True)
    assert torch.equal(losses_off, losses_on)
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_on))
    assert registration_hooks() == hooks_before
    grads, states = rows_of(out, "weight_grad", rank), rows_of(out, "optimizer", rank)
    added = ("head.", "head2.")
    # the head was trained (and reduced) from the start: its unreduced rows are there at every
    # step; its reduced rows and every row of head2 from step 3, when the monitor found them
    head = [r for r in grads if r["module_name"].startswith("head.")]
    assert {int(r["step"]) for r in head if r["scope"] == "unreduced"} == set(range(5))
    assert {int(r["step"]) for r in head if r["scope"] == "reduced"} == {3, 4}
    assert {int(r["step"]) for r in grads if r["module_name"].startswith("head2.")} == {3, 4}
    assert {int(r["step"]) for r in states if r["module_name"].startswith(added)} == {3, 4}
    for step in (3, 4):
        for name, grad in copies[step]["grad"].items():
            # head2 is not in DDP's buckets: its local gradient is the one at the step
            before = local[step][name] if name.startswith("head.") else grad
            assert_row_matches(find_row(grads, step=step, module_name=name, scope="unreduced"), numpy_stats(before))
            assert_row_matches(find_row(grads, step=step, module_name=name, scope="reduced"), numpy_stats(grad))
        for name, value in copies[step]["state"].items():
            assert_row_matches(find_row(states, step=step, module_name=name, scope=name.rsplit(".", 1)[1]),
                               numpy_stats(value))
    # the ranks trained on different data: the head's local gradients differ, the reduced agree
    if rank == 0:
        assert not torch.equal(local[3]["head.weight"], copies[3]["grad"]["head.weight"])
    open(os.path.join(out_dir, f"ok_rank{rank}"), "w").close()
    finish()


if __name__ == "__main__":
    _worker(sys.argv[1])
