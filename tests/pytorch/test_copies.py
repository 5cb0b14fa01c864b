"""Copies and checkpoints of a monitored model and optimizer (issue 12, item 1).

Real ``torch.save``/``torch.load``, ``pickle``, ``copy.deepcopy`` and
``torch.optim.swa_utils.AveragedModel`` while every monitor is on: they work, the copies
carry none of the monitor's hooks (neither while it runs nor after ``stop()``), a
copy's forward and backward passes never reach the original's rows (checked against
NumPy statistics of the batches the original saw), and training is unchanged.
"""

import copy
import io
import pickle
import warnings

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from support import TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, rows_of
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

ALL_MONITORS = {"module": {"enabled": True}, "weight_grad": {"enabled": True},
                "optimizer": {"enabled": True}, "param": {"enabled": True}}


def hook_counts(model: torch.nn.Module):
    """Every hook and flag a monitor could leave on a model, and instance attributes."""
    state = {}
    for name, m in model.named_modules():
        state["module:" + name] = tuple(len(getattr(m, a)) for a in (
            "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
            "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")) + (
            sorted(k for k in vars(m) if k.startswith("__") or k in ("forward", "_replicate_for_data_parallel")),)
    for name, p in model.named_parameters():
        state["param:" + name] = (len(p._backward_hooks or {}),
                                  len(getattr(p, "_post_accumulate_grad_hooks", None) or {}))
    return state


def save_and_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("mbs_grad", [False, True], ids=["accumulated", "per_micro_batch"])
def test_checkpoint_of_the_whole_model_and_optimizer_while_monitoring(write_config, tmp_path, mbs_grad):
    model = TinyMLP()
    twin = copy.deepcopy(model)  # trained without the monitor: the losses must not change
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    clean = hook_counts(model)
    monitors = dict(ALL_MONITORS, weight_grad={"enabled": True, "monitor_mbs_grad": mbs_grad})
    mon = TrainerMonitorV2(write_config({"monitors": monitors}))
    mon.start(model=model, optimizer=opt)
    batches = make_batches(4)
    ckpt = tmp_path / "ckpt.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "backward hook ... will not be serialized"
        for s, (x, y) in enumerate(batches):
            loss = loss_fn(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            twin_loss = loss_fn(twin, x, y)
            twin_loss.backward()
            twin_opt.step()
            twin_opt.zero_grad()
            assert torch.equal(loss, twin_loss)
            if s == 1:  # a checkpoint as users write it: whole objects, then state dicts
                torch.save({"model": model, "optimizer": opt, "step": s}, ckpt)
                loaded = torch.load(ckpt, weights_only=False)
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "sd.pt")
    loaded_model, loaded_opt = loaded["model"], loaded["optimizer"]
    assert hook_counts(loaded_model) == clean
    assert not loaded_opt._optimizer_step_pre_hooks and not loaded_opt._optimizer_step_post_hooks
    # the checkpoint holds the model as it was after step 1
    assert torch.equal(loaded_model(batches[0][0]), save_and_load(loaded_model)(batches[0][0]))
    mon.stop()
    assert hook_counts(model) == clean
    # the loaded model trains without writing anything
    n_rows = len(rows_of(mon.config.output_dir, "module"))
    loss_fn(loaded_model, *batches[0]).backward()
    loaded_opt.step()
    assert len(rows_of(mon.config.output_dir, "module")) == n_rows
    steps = sorted({r["step"] for r in rows_of(mon.config.output_dir, "weight_grad")})
    assert steps == ["0", "1", "2", "3"]


def test_deepcopy_and_ema_copies_do_not_carry_the_hooks(write_config):
    model = TinyMLP()
    clean = hook_counts(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2(write_config({"monitors": ALL_MONITORS}))
    mon.start(model=model, optimizer=opt)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))  # deep copies the monitored model
    copied = copy.deepcopy(model)
    shallow = copy.copy(model)  # shares the original's submodules, as a shallow copy does
    assert hook_counts(shallow)["module:"] == clean["module:"] and shallow.fc1 is model.fc1
    for c in (ema.module, copied):
        assert hook_counts(c) == clean
    batches = make_batches(3, seed=5)
    other = make_batches(3, seed=6)
    for s, (x, y) in enumerate(batches):
        # the copies run forward and backward passes inside the original's step, with other data
        x2, y2 = other[s]
        loss_fn(copied, x2 * 3.0, y2).backward()
        with torch.no_grad():
            ema(x2)
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model)
    mon.stop()
    for c in (ema.module, copied, shallow):
        assert hook_counts(c) == clean
    assert hook_counts(model) == clean
    rows = rows_of(mon.config.output_dir, "module")
    for s, (x, _) in enumerate(batches):
        # the model's input is the batch alone: a copy's call would have been merged into it
        assert_row_matches(find_row(rows, step=s, module_name="fc1.input.0", scope="forward"), numpy_stats(x))
        assert not [r for r in rows if r["step"] == str(s) and r["scope"] == "eval_forward"]
    wg = rows_of(mon.config.output_dir, "weight_grad")
    assert len([r for r in wg if r["step"] == "0" and r["module_name"] == "fc1.weight"]) == 2  # unreduced, reduced


class WrapperOptimizer:
    """Not a torch.optim.Optimizer (as Megatron's and some frameworks' optimizers):
    ``start()`` wraps its ``step`` on the instance."""

    def __init__(self, params, lr=0.1):
        self.param_groups = [{"params": list(params)}]
        self.state = {}
        self.lr = lr
        self.calls = 0

    def step(self):
        self.calls += 1
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                if p.grad is not None:  # a pickled copy has no gradients
                    p -= self.lr * p.grad

    def zero_grad(self):
        for p in self.param_groups[0]["params"]:
            p.grad = None


def test_patched_wrapper_optimizer_pickles_and_copies_without_the_patch(write_config):
    model = TinyMLP()
    opt = WrapperOptimizer(model.parameters())
    mon = TrainerMonitorV2(write_config({"monitors": {"param": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    assert "step" in vars(opt)
    x, y = make_batches(1)[0]
    loss_fn(model, x, y).backward()
    opt.step()  # step 0 ends
    assert mon.current_step == 1
    restored = pickle.loads(pickle.dumps(opt))
    ckpt = save_and_load({"model": model, "optimizer": opt})
    copied = copy.deepcopy(opt)
    for c in (restored, ckpt["optimizer"], copied):
        assert "step" not in vars(c) and "__getstate__" not in vars(c)
        c.step()  # the copy's own step: the original monitor does not advance
        assert c.calls == 2
    assert mon.current_step == 1
    mon.stop()
    assert "step" not in vars(opt) and "__getstate__" not in vars(opt)
    assert opt.calls == 1
    pickle.dumps(opt)


def test_torch_optimizer_copies_have_no_step_hooks(write_config):
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters())
    mon = TrainerMonitorV2(write_config({"monitors": ALL_MONITORS}))
    mon.start(model=model, optimizer=opt)
    loss_fn(model, *make_batches(1)[0]).backward()
    opt.step()
    for c in (copy.deepcopy(opt), save_and_load(opt), pickle.loads(pickle.dumps(opt))):
        assert not c._optimizer_step_pre_hooks and not c._optimizer_step_post_hooks
    mon.stop()


def test_an_existing_instance_getstate_is_kept(write_config):
    """Another tool that overrides ``__getstate__`` on the instance keeps its override,
    during monitoring (copies go through it) and after ``stop()``."""
    model = TinyMLP()
    calls = []

    def getstate():
        calls.append(1)
        state = torch.nn.Module.__getstate__(model.fc1)
        state.pop("__getstate__")
        return state

    model.fc1.__getstate__ = getstate
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True}}}))
    mon.start(model=model)
    copied = copy.deepcopy(model)
    assert calls and not copied.fc1._forward_pre_hooks and "__getstate__" not in vars(copied.fc1)
    mon.stop()
    assert vars(model.fc1)["__getstate__"] is getstate


def test_start_stop_cycles_with_copies_leave_nothing_behind(write_config):
    """Three start/stop cycles over many steps, each with checkpoints, copies and
    evaluation passes: after each stop() nothing references the monitor any more (it is
    garbage collected), and the model is as it was."""
    import gc
    import weakref

    model = TinyMLP()
    clean = hook_counts(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = make_batches(4, seed=11)
    copies = []
    for cycle in range(3):
        mon = TrainerMonitorV2(write_config({"step_interval": 50, "monitors": ALL_MONITORS}))
        mon.start(model=model, optimizer=opt)
        for s in range(300):
            x, y = batches[s % 4]
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
            if s % 100 == 0:
                copies.append(save_and_load(model))
                copies.append(copy.deepcopy(model))
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
        assert mon.current_step == 300 and mon.errors.count == 0
        mon.stop()
        ref = weakref.ref(mon)
        del mon
        gc.collect()
        assert ref() is None, f"cycle {cycle}: something still references the monitor"
        assert hook_counts(model) == clean
        assert all(hook_counts(c) == clean for c in copies)


def test_two_monitors_on_one_model(write_config, tmp_path):
    """Each monitor's copies leave out both monitors' hooks; the first to stop leaves the
    second working (copies still clean), the last leaves the model as it was."""
    model = TinyMLP()
    clean = hook_counts(model)
    first = TrainerMonitorV2({"output_dir": str(tmp_path / "a"), "monitors": {"module": {"enabled": True}}})
    second = TrainerMonitorV2({"output_dir": str(tmp_path / "b"), "monitors": {"module": {"enabled": True}}})
    first.start(model=model)
    second.start(model=model)
    assert hook_counts(copy.deepcopy(model)) == clean
    first.stop()
    assert hook_counts(save_and_load(model)) == clean
    x, y = make_batches(1)[0]
    loss_fn(model, x, y).backward()
    second.step()
    second.stop()
    assert hook_counts(model) == clean
    assert_row_matches(find_row(rows_of(tmp_path / "b", "module"), step=0, module_name="fc1.input.0"), numpy_stats(x))
