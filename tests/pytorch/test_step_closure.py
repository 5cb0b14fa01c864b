"""Optimizer-step hooks with ``step(closure)`` and on wrappers of an optimizer.

With a closure, the gradient is made inside the call: 'reduced' and 'param_origin' are
read after the closure's first call, before the update; the monitor's step ends once."""

import pytest
import torch

from support import TinyMLP, assert_row_matches, find_row, make_batches, numpy_stats, rows_of
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2


class _HookFreeWrapper(torch.optim.Optimizer):
    """Like Accelerate's AcceleratedOptimizer: a torch.optim.Optimizer subclass that never
    runs Optimizer.__init__ and steps the wrapped optimizer only every ``every`` calls."""

    def __init__(self, optimizer, every=1):
        self.optimizer, self.every, self.calls = optimizer, every, 0

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        self.calls += 1
        if self.calls % self.every == 0:
            return self.optimizer.step(closure)
        return None

    def zero_grad(self, set_to_none=True):
        if self.calls % self.every == 0:
            self.optimizer.zero_grad(set_to_none)


def _closure_training(tmp_path, optimizer_cls, monitored, by_keyword, **opt_kwargs):
    model = TinyMLP(seed=1)
    optimizer = optimizer_cls(model.parameters(), **opt_kwargs)
    names = {id(p): n for n, p in model.named_parameters()}
    used, losses = [], []
    # Reference: the gradient as the update starts, cloned at the end of the first
    # closure call (what every optimizer's update uses first).
    mon = None
    if monitored:
        mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"),
                                "monitors": {"weight_grad": {"enabled": True}, "param": {"enabled": True}}})
        mon.start(model, optimizer)
    for x, y in make_batches(3, seed=7):
        calls = []

        def closure():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if not calls:
                used.append({names[id(p)]: (p.grad.clone(), p.detach().clone()) for p in model.parameters()})
            calls.append(loss.detach().clone())
            return loss

        optimizer.step(closure=closure) if by_keyword else optimizer.step(closure)
        losses.append(torch.stack(calls))
    if mon is not None:
        assert mon.current_step == 3
        mon.stop()
        assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    return model, used, losses


@pytest.mark.parametrize("optimizer_cls,kwargs,by_keyword", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, True),
    (torch.optim.SGD, {"lr": 0.1}, False),
    (torch.optim.LBFGS, {"lr": 0.5, "max_iter": 3}, True),  # calls the closure several times
])
def test_closure_reduced_is_read_after_the_closure(tmp_path, optimizer_cls, kwargs, by_keyword):
    model, used, losses = _closure_training(tmp_path, optimizer_cls, True, by_keyword, **kwargs)
    plain, _, plain_losses = _closure_training(tmp_path, optimizer_cls, False, by_keyword, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    grads, params = rows_of(tmp_path / "out", "weight_grad"), rows_of(tmp_path / "out", "param")
    for step, ref in enumerate(used):
        for name, (grad, value) in ref.items():
            assert_row_matches(find_row(grads, step=step, module_name=name, scope="reduced"), numpy_stats(grad))
            assert_row_matches(find_row(params, step=step, module_name=name, scope="param_origin"), numpy_stats(value))


def test_closure_never_called_still_reads_before_update(tmp_path):
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": {"param": {"enabled": True}}})
    mon.start(model, optimizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = make_batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step(lambda: None)  # SGD calls the closure; its value is ignored
    mon.stop()
    rows = rows_of(tmp_path / "out", "param")
    for name, value in before.items():
        assert_row_matches(find_row(rows, step=0, module_name=name, scope="param_origin"), numpy_stats(value))


def test_wrapper_without_optimizer_init_is_hooked_through_the_wrapped_one(tmp_path):
    model = TinyMLP()
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    wrapper = _HookFreeWrapper(inner, every=2)
    assert not hasattr(wrapper, "_optimizer_step_pre_hooks")
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": {
        "weight_grad": {"enabled": True}, "optimizer": {"enabled": True}}})
    mon.start(model, wrapper, grad_acc_steps=2)
    for x, y in make_batches(8):
        (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        wrapper.step()
        wrapper.zero_grad()
    assert mon.current_step == 4 and wrapper.calls == 8
    mon.stop()
    assert vars(wrapper).keys() == {"optimizer", "every", "calls"}
    assert not inner._optimizer_step_pre_hooks and not inner._optimizer_step_post_hooks
    rows = rows_of(tmp_path / "out", "optimizer")
    assert sorted({int(r["step"]) for r in rows}) == [0, 1, 2, 3]
    for name, p in model.named_parameters():
        assert_row_matches(find_row(rows, step=3, module_name=f"{name}.exp_avg", scope="exp_avg"),
                           numpy_stats(inner.state[p]["exp_avg"]))


def test_hook_free_optimizer_without_a_wrapped_one_gets_a_step_wrapper(tmp_path):
    class Bare(torch.optim.Optimizer):  # never runs Optimizer.__init__, wraps nothing
        def __init__(self, params):
            self.param_groups = [{"params": list(params)}]
            self.state = {}

        def step(self, closure=None):
            with torch.no_grad():
                for p in self.param_groups[0]["params"]:
                    p.sub_(0.1 * p.grad)

    model = TinyMLP()
    optimizer = Bare(model.parameters())
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": {"weight_grad": {"enabled": True}}})
    mon.start(model, optimizer)
    for x, y in make_batches(2):
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    assert mon.current_step == 2
    mon.stop()
    assert "step" not in vars(optimizer)
