"""Accelerate, one process: the plain API on accelerator.prepare's objects (the
``AcceleratedOptimizer`` is hooked through the optimizer it wraps) and AccelerateMonitor.

References are NumPy statistics of clones the test takes: the accumulated gradient right
before the loop clips it (``unreduced``) and, in a step pre-hook on the wrapped
optimizer, the gradient the update uses (``reduced``)."""

import logging

import pytest
import torch

from support.extras import require

accelerate = require("accelerate", "the Accelerate tests train through its Accelerator")

from support import TinyMLP, assert_row_matches, find_row, numpy_stats, rows_of  # noqa: E402
from msprobe.core.monitor_v2.integrations import AccelerateMonitor  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

STEPS, ACC = 6, 2
MONITORS = {"weight_grad": {"enabled": True}, "param": {"enabled": True}, "optimizer": {"enabled": True},
            "module": {"enabled": True}}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()


def _train(start=None, scaler=None):
    """6 optimizer steps of 2 micro-batches with clipping; ``start(accelerator, model,
    optimizer)`` returns what to stop (or None). Returns losses, model, references."""
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=ACC, cpu=True)
    model = TinyMLP(seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(4)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * ACC * 4, 6, generator=g),
                                          torch.randn(STEPS * ACC * 4, 3, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if scaler is not None:
        optimizer.scaler = scaler
        optimizer._accelerate_step_called = False
        optimizer._optimizer_original_step_method = optimizer.optimizer.step
        optimizer._optimizer_patched_step_method = accelerate.optimizer.patch_optimizer_step(
            optimizer, optimizer.optimizer.step)
    names = {id(p): n for n, p in model.named_parameters()}
    ref = {"unreduced": [], "reduced": [], "losses": []}
    optimizer.optimizer.register_step_pre_hook(
        lambda o, a, k: ref["reduced"].append({names[id(p)]: p.grad.clone() for p in o.param_groups[0]["params"]}))
    running = start(accelerator, model, optimizer) if start is not None else None
    try:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                ref["losses"].append(loss.detach().clone())
                accelerator.backward(loss if scaler is None else scaler.scale(loss))
                if accelerator.sync_gradients:
                    ref["unreduced"].append({n: p.grad.clone() for n, p in model.named_parameters()})
                    if scaler is None:
                        accelerator.clip_grad_norm_(model.parameters(), 0.1)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        if running is not None:
            running.stop()
    return model, optimizer, ref


def _check_values(out, ref, steps):
    rows = rows_of(out, "weight_grad")
    assert sorted({int(r["step"]) for r in rows}) == list(range(steps))
    clipped = 0
    for step in range(steps):
        for name, grad in ref["unreduced"][step].items():
            row = find_row(rows, step=step, module_name=name, scope="unreduced")
            assert row["micro_step"] == str(ACC)
            assert_row_matches(row, numpy_stats(grad))
            used = ref["reduced"][step][name]
            assert_row_matches(find_row(rows, step=step, module_name=name, scope="reduced"), numpy_stats(used))
            clipped += not torch.equal(grad, used)
    assert clipped


def test_plain_api_hooks_the_wrapped_optimizer(tmp_path):
    out = tmp_path / "out"
    monitors = []

    def start(accelerator, model, optimizer):
        mon = TrainerMonitorV2({"output_dir": str(out), "monitors": MONITORS})
        mon.start(model, optimizer, grad_acc_steps=accelerator.gradient_accumulation_steps)
        monitors.append(mon)
        return mon

    model, optimizer, ref = _train(start)
    mon = monitors[0]
    # 12 AcceleratedOptimizer.step() calls, 6 real steps: 6 monitor steps.
    assert mon.current_step == STEPS and mon.optimizer_steps == STEPS
    _check_values(out, ref, STEPS)
    # stop() left the wrapper and the wrapped optimizer as they were.
    assert "step" not in vars(optimizer) and "__getstate__" not in vars(optimizer)
    assert len(optimizer.optimizer._optimizer_step_post_hooks) == 0
    plain_model, _, plain = _train()
    assert torch.equal(torch.stack(ref["losses"]), torch.stack(plain["losses"]))
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)


def test_accelerate_monitor_follows_sync_steps_and_says_skips_once(tmp_path, caplog):
    out = tmp_path / "out"
    helpers = []

    def start(accelerator, model, optimizer):
        helper = AccelerateMonitor({"output_dir": str(out), "monitors": MONITORS}, accelerator, model, optimizer)
        helpers.append(helper)
        return helper

    model, optimizer, ref = _train(start)
    assert helpers[0].monitor is None and "step" not in vars(optimizer) and "__getstate__" not in vars(optimizer)
    _check_values(out, ref, STEPS)

    # A gradient scaler that finds inf skips the update: the step still counts, said once.
    out2 = tmp_path / "out2"

    class InfScaler(torch.amp.GradScaler):
        def unscale_(self, optimizer):
            for group in optimizer.param_groups:
                group["params"][0].grad.fill_(float("inf"))
            return super().unscale_(optimizer)

    def start_skip(accelerator, model, optimizer):
        helper = AccelerateMonitor({"output_dir": str(out2), "monitors": {"weight_grad": {"enabled": True}}},
                                   accelerator, model, optimizer)
        helpers.append(helper)
        return helper

    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        _train(start_skip, scaler=InfScaler("cpu", init_scale=1.0))
    skips = [r for r in caplog.records if "without an optimizer update" in r.getMessage()]
    assert len(skips) == 1
    rows = rows_of(out2, "weight_grad")
    assert sorted({int(r["step"]) for r in rows}) == list(range(STEPS))
    assert not [r for r in rows if r["scope"] == "reduced"]


def test_accelerate_monitor_needs_the_prepared_optimizer(tmp_path):
    accelerator = accelerate.Accelerator(cpu=True)
    model = TinyMLP()
    with pytest.raises(Exception, match="AcceleratedOptimizer"):
        AccelerateMonitor({"output_dir": str(tmp_path)}, accelerator, model,
                          torch.optim.SGD(model.parameters(), lr=0.1))


def test_accelerate_monitor_under_the_fsdp2_plugin_two_processes(tmp_path):
    """Accelerate's FSDP plugin (fsdp_version=2), 2 gloo ranks: 'unreduced' is each rank's
    accumulated local gradient (a replica's), 'reduced' this rank's shard of the clipped
    rank mean, 'param'/'optimizer' the shards of the weights and moments, under the
    model's own names. See accelerate_fsdp_worker.py."""
    from pathlib import Path

    from support import run_torchrun
    from support.shards import assert_shards_make_up

    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(Path(__file__).with_name("accelerate_fsdp_worker.py"), out, timeout=300)
    refs = [torch.load(out / f"ref_rank{r}.pt", weights_only=False) for r in range(2)]
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    steps = 3
    for r in range(2):
        assert refs[r]["identical"] is True and refs[r]["warnings"] == []
        assert refs[r]["seen"] == [1, 2, 3]  # one monitor step per synchronised step
        rows = rows_of(out, "weight_grad", r)
        assert {x["module_name"] for x in rows} == set(names)
        assert {x["module_name"] for x in rows_of(out, "param", r)} == set(names)
        assert {x["module_name"] for x in rows_of(out, "optimizer", r)} == {
            f"{n}.{k}" for n in names for k in ("exp_avg", "exp_avg_sq")}
        assert {x["module_name"] for x in rows_of(out, "module", r)} >= {"fc1.input.0", "fc1.output.0"}
        for step in range(steps):
            for name in names:
                row = find_row(rows, step=step, module_name=name, scope="unreduced")
                assert row["micro_step"] == "2"
                assert_row_matches(row, numpy_stats(refs[r]["acc"][step][name]), rtol=1e-4, atol=1e-7)

    def shards(monitor, step, name, scope):
        return [[x for x in rows_of(out, monitor, r) if x["step"] == str(step) and x["module_name"] == name
                 and x["scope"] == scope] for r in range(2)]

    clipped = 0
    for step in range(steps):
        for name in names:
            assert_shards_make_up(shards("weight_grad", step, name, "reduced"), refs[0]["used"][step][name],
                                  1e-4, 1e-8, (step, name))
            after = refs[0]["after"][step]
            assert_shards_make_up(shards("param", step, name, "param_updated"), after[name], 1e-5, 1e-9, (step, name))
            for key in ("exp_avg", "exp_avg_sq"):
                assert_shards_make_up(shards("optimizer", step, f"{name}.{key}", key), after[f"{name}.{key}"],
                                      1e-5, 1e-12, (step, name, key))
        used_norm = sum(float(t.pow(2).sum()) for t in refs[0]["used"][step].values()) ** 0.5
        clipped += abs(used_norm - 0.1) < 1e-5  # clipped to max_norm 0.1
    assert clipped, "clip_grad_norm_ must clip, or 'reduced' after clipping cannot be told apart"
    # sync_each_batch=True: FSDP2 reduce-scatters each micro-batch; the accumulated local
    # gradient never exists: no accumulated 'unreduced' row, said once; 'reduced' unaffected.
    for r in range(2):
        said = [m for m in refs[r]["each_batch_warnings"] if "reduce-scattered the gradient" in m]
        assert len(said) == 1 and refs[r]["each_batch_warnings"] == said, refs[r]["each_batch_warnings"]
        rows = rows_of(out / "each_batch", "weight_grad", r)
        assert not [x for x in rows if x["scope"] == "unreduced"]
        assert {x["step"] for x in rows if x["scope"] == "reduced"} == {"0", "1", "2"}


def test_accelerate_hooks_added_and_removed_after_start_lose_no_row(tmp_path, caplog):
    """accelerate's ``add_hook_to_module`` (device placement and offloading put their hooks on
    modules this way) wraps fc1's forward after ``start()``, around the forward it finds, the
    monitor's; ``remove_hook_from_module`` puts that one back. Both between steps: fc1's rows
    are there at every step, once each, nothing is said at WARNING (nothing was missed), the
    training is bit-identical to an unmonitored copy's with the same hooks, and after
    ``stop()`` fc1 has neither a forward of its own nor a hook."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    calls = []

    class Counting(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(module)
            return args, kwargs

    model, ref = TinyMLP(), TinyMLP()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"module": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(4)]
    wanted = []
    with caplog.at_level(logging.INFO, logger="msprobe.monitor_v2"):
        for step, (x, y) in enumerate(batches):
            for m in (model, ref):
                if step == 1:
                    add_hook_to_module(m.fc1, Counting())
                elif step == 3:
                    remove_hook_from_module(m.fc1)
            wanted.append(torch.nn.functional.linear(x, ref.fc1.weight.detach(), ref.fc1.bias.detach()))
            for m, o in ((model, opt), (ref, ref_opt)):
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
        mon.stop()
    assert len(calls) == 2 * 2, "the hook ran at steps 1 and 2, in both models"
    assert mon.errors.count == 0
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert "forward" not in vars(model.fc1) and not model.fc1._forward_hooks and not model.fc1._forward_pre_hooks
    rows = rows_of(tmp_path, "module")
    for step, (x, _) in enumerate(batches):
        assert_row_matches(find_row(rows, step=step, module_name="fc1.input.0", scope="forward"), numpy_stats(x))
        assert_row_matches(find_row(rows, step=step, module_name="fc1.output.0", scope="forward"),
                           numpy_stats(wanted[step]))
