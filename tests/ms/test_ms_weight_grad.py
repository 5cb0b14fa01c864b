"""MindSpore weight_grad: ``unreduced`` per micro-batch and accumulated, ``reduced`` = the
gradients passed to ``optimizer(grads)``, also inside ``nn.TrainOneStepCell``.

References come from an unmonitored twin network (same weights, same data, same
updates) differentiated with its own ``value_and_grad``, and from NumPy copies of the
gradients the test hands to the optimizer."""

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import assert_row_matches, find_row, rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, grads_np, ms, mse, nn, np, np_stats, ops  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
RTOL, ATOL = 1e-5, 1e-7


def train(tmp_path, wg_cfg, steps=2, acc=2, transform=None, start_kwargs=None):
    """Train a monitored MLP and an unmonitored twin in lockstep with SGD.

    Returns (out_dir, per-step list of per-micro-batch reference grads, per-step grads
    passed to the optimizer, per-step raw accumulated grads)."""
    net, ref = MLP(), MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    ref_opt = nn.SGD(ref.trainable_params(), learning_rate=0.1)
    assert [p.name for p in opt.parameters] == NAMES
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    ref_grad_fn = ms.value_and_grad(mse(ref), None, ref_opt.parameters)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"weight_grad": dict(wg_cfg, enabled=True)}},
                           fr="mindspore")
    mon.start(model=net, optimizer=opt, **(start_kwargs or {}))
    data = batches(steps * acc)
    micro_refs, passed, raw = [], [], []
    for s in range(steps):
        micro = data[s * acc:(s + 1) * acc]
        ref_grads = [grads_np(ref_grad_fn(ms.Tensor(x), ms.Tensor(y))[1]) for x, y in micro]
        micro_refs.append(ref_grads)
        ref_total = tuple(ms.Tensor(sum(g[i] for g in ref_grads)) for i in range(len(NAMES)))
        total = None
        for x, y in micro:
            _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
            total = g if total is None else tuple(a + b for a, b in zip(total, g))
        raw.append(grads_np(total))
        if transform is not None:
            total, ref_total = transform(total), transform(ref_total)
        passed.append(grads_np(total))
        opt(total)
        ref_opt(ref_total)
    mon.stop()
    return out, micro_refs, passed, raw


def test_unreduced_per_micro_batch_and_reduced_sum(tmp_path):
    out, micro_refs, passed, _ = train(tmp_path, {"monitor_mbs_grad": True}, start_kwargs={"grad_acc_steps": 2})
    rows = rows_of(out, "weight_grad")
    assert len(rows) == 2 * len(NAMES) * 3  # steps x params x (2 unreduced + 1 reduced)
    for s in range(2):
        for i, name in enumerate(NAMES):
            for mb in (1, 2):
                row = find_row(rows, step=s, module_name=name, scope="unreduced", micro_step=mb)
                assert row["vpp_stage"] == "0"
                assert_row_matches(row, np_stats(micro_refs[s][mb - 1][i]), RTOL, ATOL)
            reduced = find_row(rows, step=s, module_name=name, scope="reduced")
            assert reduced["micro_step"] == "2"
            assert_row_matches(reduced, np_stats(passed[s][i]), RTOL, ATOL)
            # the twin's sum and the gradients passed agree: the monitor changed nothing
            np.testing.assert_allclose(passed[s][i], micro_refs[s][0][i] + micro_refs[s][1][i], rtol=1e-5, atol=1e-7)


def test_unreduced_accumulated_is_the_sum_of_micro_batches(tmp_path):
    out, micro_refs, passed, _ = train(tmp_path, {"monitor_mbs_grad": False}, start_kwargs={"grad_acc_steps": 2})
    rows = rows_of(out, "weight_grad")
    assert len(rows) == 2 * len(NAMES) * 2
    for s in range(2):
        for i, name in enumerate(NAMES):
            unreduced = find_row(rows, step=s, module_name=name, scope="unreduced")
            assert unreduced["micro_step"] == "2"
            assert_row_matches(unreduced, np_stats(micro_refs[s][0][i] + micro_refs[s][1][i]), RTOL, ATOL)
            reduced = find_row(rows, step=s, module_name=name, scope="reduced")
            assert reduced["micro_step"] == "2"
            assert_row_matches(reduced, np_stats(passed[s][i]), RTOL, ATOL)


def test_single_micro_batch_row_is_not_changed_by_later_use_of_the_gradient(tmp_path):
    """One micro-batch and nothing announced: the accumulated row (which the monitor
    may hold by reference until the step ends) is that micro-batch's gradient, read
    after the optimizer update that used it."""
    out, micro_refs, passed, _ = train(tmp_path, {}, steps=3, acc=1)
    rows = rows_of(out, "weight_grad")
    for s in range(3):
        for i, name in enumerate(NAMES):
            for scope in ("unreduced", "reduced"):
                row = find_row(rows, step=s, module_name=name, scope=scope)
                assert row["micro_step"] == "1"
                assert_row_matches(row, np_stats(micro_refs[s][0][i]), RTOL, ATOL)


def test_reduced_is_what_the_optimizer_receives(tmp_path):
    """Gradients changed between backward and ``optimizer(grads)`` (clipped, scaled)
    show in ``reduced`` and not in ``unreduced``."""

    def clip_and_scale(grads):
        clipped = ops.clip_by_global_norm(grads, 0.05)
        return (clipped[0], clipped[1] * 3.0, clipped[2], clipped[3])

    out, micro_refs, passed, raw = train(tmp_path, {}, steps=2, acc=2, transform=clip_and_scale,
                                         start_kwargs={"grad_acc_steps": 2})
    rows = rows_of(out, "weight_grad")
    for s in range(2):
        for i, name in enumerate(NAMES):
            assert not np.allclose(raw[s][i], passed[s][i])
            assert_row_matches(find_row(rows, step=s, module_name=name, scope="unreduced"),
                               np_stats(raw[s][i]), RTOL, ATOL)
            assert_row_matches(find_row(rows, step=s, module_name=name, scope="reduced"),
                               np_stats(passed[s][i]), RTOL, ATOL)


def test_train_one_step_cell(tmp_path):
    """``nn.TrainOneStepCell(nn.WithLossCell(net, loss), opt)``: ``unreduced`` is the
    backward's gradient, ``reduced`` the gradients the cell passes to the optimizer
    (caught by the test's own forward pre-hook on the optimizer)."""
    net, ref = MLP(), MLP()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    ref_opt = nn.Momentum(ref.trainable_params(), learning_rate=0.05, momentum=0.9)
    loss = nn.MSELoss()
    ref_grad_fn = ms.value_and_grad(lambda x, y: loss(ref(x), y), None, ref_opt.parameters)
    train_cell = nn.TrainOneStepCell(nn.WithLossCell(net, loss), opt)
    train_cell.set_train()
    seen = []
    handle = opt.register_forward_pre_hook(lambda cell, inputs: seen.append(grads_np(inputs[0])))
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True}}}, fr="ms")
    mon.start(model=net, optimizer=opt)
    refs = []
    for x, y in batches(3):
        _, g = ref_grad_fn(ms.Tensor(x), ms.Tensor(y))
        refs.append(grads_np(g))
        ref_opt(g)
        train_cell(ms.Tensor(x), ms.Tensor(y))
    mon.stop()
    handle.remove()
    assert len(seen) == 3
    rows = rows_of(out, "weight_grad")
    assert len(rows) == 3 * len(NAMES) * 2
    for s in range(3):
        for i, name in enumerate(NAMES):
            np.testing.assert_allclose(seen[s][i], refs[s][i], rtol=1e-5, atol=1e-7)
            unreduced = find_row(rows, step=s, module_name=name, scope="unreduced")
            assert unreduced["micro_step"] == "1"
            assert_row_matches(unreduced, np_stats(refs[s][i]), RTOL, ATOL)
            reduced = find_row(rows, step=s, module_name=name, scope="reduced")
            assert reduced["micro_step"] == "1"
            assert_row_matches(reduced, np_stats(seen[s][i]), RTOL, ATOL)


@pytest.mark.parametrize("acc", [1, 2])
def test_unreduced_is_the_backward_gradient_even_if_changed_in_place_later(tmp_path, acc):
    """The training code scales each micro-batch's gradients in place (``g[:] = g / acc``,
    a Tensor setitem, which MindSpore applies in place) after backward and before the
    next backward / ``optimizer(grads)``. ``unreduced`` is the gradient the backward
    produced (summed over the micro-batches); ``reduced`` what the optimizer got.
    (PyTorch's counterpart: tests/pytorch/test_weight_grad.py
    test_reduced_sees_gradients_changed_after_backward.)"""
    net = MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True}}}, fr="ms")
    mon.start(model=net, optimizer=opt, grad_acc_steps=acc)
    raw, total = None, None
    for x, y in batches(acc):
        _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
        r = grads_np(g)
        raw = r if raw is None else [a + b for a, b in zip(raw, r)]
        for t in g:
            t[:] = t * (0.5 / acc)
        np.testing.assert_allclose(g[0].asnumpy(), r[0] * (0.5 / acc), rtol=1e-6)  # really in place
        total = g if total is None else tuple(a + b for a, b in zip(total, g))
    passed = grads_np(total)
    opt(total)
    mon.stop()
    rows = rows_of(out, "weight_grad")
    for i, name in enumerate(NAMES):
        unreduced = find_row(rows, module_name=name, scope="unreduced")
        assert unreduced["micro_step"] == str(acc)
        assert_row_matches(unreduced, np_stats(raw[i]), RTOL, ATOL)
        assert_row_matches(find_row(rows, module_name=name, scope="reduced"), np_stats(passed[i]), RTOL, ATOL)
