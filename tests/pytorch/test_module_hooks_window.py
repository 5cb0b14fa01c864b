"""The module monitor's forward hooks come off the modules where the next written step
is at least four steps away: a module with any forward hook takes PyTorch's slow call
path (about 5 us per call even for a hook that returns at once), so those steps run the
model as it is without the monitor. Put back, they run where they ran among the module's
other hooks. Compiled code does not see hooks added or removed after it was compiled, so
they go back on before Dynamo compiles anything, and stay on.

Each case runs in a fresh interpreter: whether Dynamo compiled anything must not depend
on which tests ran before in this process."""

import json
import subprocess
import sys

from support import assert_row_matches, find_row, numpy_stats, rows_of
from support.launch import worker_env

SCRIPT = r"""
import copy, json, sys
import torch
from support import TinyMLP, loss_fn, make_batches
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

mode = sys.argv[2]
if mode == "compiled-before":  # Dynamo compiled other code before start()
    torch.compile(lambda t: t * 2, backend="eager")(torch.ones(2))
from torch._dynamo.callback import callback_handler  # the compile-start callbacks the monitor may add
callbacks_before = len(callback_handler.start_callbacks)
model = TinyMLP()
ref = TinyMLP()  # trained alike without the monitor: the monitored training must be the same to the bit
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if mode == "broken-register":  # fc2 has a forward of its own (a library's wrapper): it is hooked, not wrapped
    for m in (model, ref):
        m.fc2.forward = m.fc2.forward
mon = TrainerMonitorV2({"output_dir": sys.argv[1], "step_interval": int(sys.argv[3]),
                        "monitors": {"module": {"enabled": True, "targets": []}}})
mon.start(model=model, optimizer=opt)
if mode == "user-hook":  # registered after start(): it doubles fc1's input, after the monitor's pre-hook
    for m in (model, ref):
        m.fc1.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
seen = []
for step, (x, y) in enumerate(make_batches(6)):
    # how many of the monitor's observers each module has: its forward hooks, or its forward
    # wrapped (the monitor's CallWrapper, which counts for a pre-hook and a forward hook)
    hooks = {name: len(m._forward_hooks) + len(m._forward_pre_hooks) +
             2 * (type(vars(m).get("forward")).__name__ == "CallWrapper") for name, m in model.named_modules()}
    with torch.no_grad():  # the reference: an unmonitored copy with this step's weights
        want = copy.deepcopy(model).fc1(x)
    assert not copy.deepcopy(model).fc1._forward_hooks, "copies never carry the monitor's hooks"
    if mode == "compile-later" and step == 1:  # compiled on a step that is not written
        compiled = torch.compile(model, backend="eager")
    if mode == "broken-register" and step == 1:  # putting the hooks back on step 5 raises: contained
        def refuse(*args, **kwargs):
            raise RuntimeError("this module takes no more hooks")
        model.fc2.register_forward_pre_hook = refuse
    run = compiled if mode == "compile-later" and step >= 1 else model
    loss_fn(run, x, y).backward()
    opt.step()
    opt.zero_grad()
    mon.step()
    loss_fn(ref, x, y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    seen.append({"hooks": hooks, "fc1_output": want.tolist(), "x": x.tolist()})
mon.stop()
after = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + ("forward" in vars(m))
            + ("_replicate_for_data_parallel" in vars(m)) for m in model.modules())
same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
print(json.dumps({"steps": seen, "after_stop": after, "training_unchanged": same,
                  "callbacks_left": len(callback_handler.start_callbacks) - callbacks_before}))
"""


def _run(tmp_path, mode, interval=5):
    out = tmp_path / f"{mode}-{interval}"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), mode, str(interval)], env=worker_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # in every case: training as without the monitor, and stop() leaves no hook of its own
    # (the user's hook stays) and no callback
    users = {"user-hook": 1, "broken-register": 1}.get(mode, 0)  # the user's hook, fc2's own forward
    assert result["training_unchanged"] and result["after_stop"] == users and result["callbacks_left"] == 0, result
    result["stderr"] = proc.stderr
    return result, str(out)


def test_hooks_are_off_the_modules_between_written_steps_far_apart(tmp_path):
    """step_interval 5: steps 0 and 5 are written; from step 1 the next four steps are not,
    so the hooks come off there (taking them off and on costs about three steps' worth)."""
    import torch

    result, out = _run(tmp_path, "eager")
    steps = result["steps"]
    for step in (0, 5):  # every module (the root too) is hooked
        assert min(steps[step]["hooks"].values()) >= 2, steps[step]
    for step in (1, 2, 3, 4):
        assert set(steps[step]["hooks"].values()) == {0}, (step, steps[step]["hooks"])
    assert result["after_stop"] == 0
    rows = rows_of(out, "module")
    assert {int(r["step"]) for r in rows} == {0, 5}
    for step in (0, 5):
        want = numpy_stats(torch.tensor(steps[step]["fc1_output"]))
        assert_row_matches(find_row(rows, step=step, module_name="fc1.output.0", scope="forward"), want)


def test_hooks_stay_on_across_a_short_gap(tmp_path):
    result, out = _run(tmp_path, "eager", interval=2)
    for step in range(6):
        assert min(result["steps"][step]["hooks"].values()) >= 2, (step, result["steps"][step]["hooks"])
    assert {int(r["step"]) for r in rows_of(out, "module")} == {0, 2, 4}


def test_after_dynamo_compiled_anything_the_hooks_stay_on(tmp_path):
    result, out = _run(tmp_path, "compiled-before")
    for step in range(6):
        assert min(result["steps"][step]["hooks"].values()) >= 2, (step, result["steps"][step]["hooks"])
    assert result["after_stop"] == 0
    assert {int(r["step"]) for r in rows_of(out, "module")} == {0, 5}


def test_a_model_compiled_while_the_hooks_are_off_gets_them_back_before_it_is_traced(tmp_path):
    """Compiled on step 1 (not written): the hooks go back on when Dynamo starts, so the
    compiled model runs them (graph breaks at each module), and step 5's rows are there."""
    import torch

    result, out = _run(tmp_path, "compile-later")
    assert set(result["steps"][1]["hooks"].values()) == {0}, "off until the compile starts"
    assert min(result["steps"][3]["hooks"].values()) >= 2, "and on from then on"
    rows = rows_of(out, "module")
    assert {int(r["step"]) for r in rows} == {0, 5}
    want = numpy_stats(torch.tensor(result["steps"][5]["fc1_output"]))
    assert_row_matches(find_row(rows, step=5, module_name="fc1.output.0", scope="forward"), want)


def test_hooks_put_back_run_where_they_ran_among_the_modules_other_hooks(tmp_path):
    """A pre-hook the user registers after start() doubles fc1's input. fc1 had no hook at
    start(), so the monitor wrapped its forward; the first call with the user's hook (step 0)
    puts the monitor's hooks on fc1 first, where they would have been, and that call's input
    row is what its forward received (the monitor sees the hook only then). The hooks are
    off on steps 1 to 4 and back on step 5 in the same place, before the user's, so step 5's
    input row is the input the model was given."""
    import torch

    result, out = _run(tmp_path, "user-hook")
    assert result["steps"][1]["hooks"]["fc1"] == 1, "the user's hook alone on a step that is not written"
    assert result["steps"][5]["hooks"]["fc1"] == 3, "the monitor's two hooks and the user's"
    rows = rows_of(out, "module")
    x0, x5 = (torch.tensor(result["steps"][step]["x"]) for step in (0, 5))
    assert_row_matches(find_row(rows, step=0, module_name="fc1.input.0", scope="forward"), numpy_stats(x0 * 2))
    assert_row_matches(find_row(rows, step=5, module_name="fc1.input.0", scope="forward"), numpy_stats(x5))
    # the model's own hooks (a chunk is hooked, never wrapped) ran as before: its input is the batch
    for step, x in ((0, x0), (5, x5)):
        assert_row_matches(find_row(rows, step=step, module_name="TinyMLP.input.0", scope="forward"), numpy_stats(x))


def test_restore_order_puts_a_hook_back_in_its_place_and_keeps_what_changed_meanwhile():
    import torch

    from msprobe.core.monitor_v2.frameworks.pytorch.copies import hook_order, restore_order

    ran = []
    m = torch.nn.Identity()
    mark = lambda tag: (lambda module, args: ran.append(tag))  # noqa: E731
    first = m.register_forward_pre_hook(mark("first"))
    ours = m.register_forward_pre_hook(mark("ours"))
    gone = m.register_forward_pre_hook(mark("gone"))
    m.register_forward_pre_hook(mark("last"))
    order = hook_order(m)
    ours.remove()
    gone.remove()  # removed while ours was off: stays removed
    m.register_forward_pre_hook(mark("new"))  # appended meanwhile: after the hooks that were there
    m.register_forward_pre_hook(mark("front"), prepend=True)  # prepended meanwhile: first
    again = m.register_forward_pre_hook(mark("ours"))
    restore_order(m, order, {ours.id: again.id})
    m(torch.ones(1))
    assert ran == ["front", "first", "ours", "last", "new"]
    assert first.id in m._forward_pre_hooks


def test_an_error_putting_the_hooks_back_is_contained_and_said_once(tmp_path):
    """A module whose ``register_forward_pre_hook`` raises when the hooks go back on (step
    5): the error is logged once, training goes on unchanged, and the other modules' rows
    of that step are written."""
    result, out = _run(tmp_path, "broken-register")
    said = [line for line in result["stderr"].splitlines() if "module hooks on or off between steps" in line]
    assert len(said) == 1 and "takes no more hooks" in said[0], result["stderr"][-2000:]
    rows = rows_of(out, "module")
    assert {int(r["step"]) for r in rows} == {0, 5}
    assert any(r["module_name"] == "fc1.input.0" and int(r["step"]) == 5 for r in rows)
