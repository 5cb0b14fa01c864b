"""MindSpore evaluation passes between training steps.

A plain ``net(x)`` outside ``value_and_grad``/``grad`` (PyNative records no gradient),
with or without ``set_train(False)``, is an evaluation pass: its forward rows go under
scope ``eval_forward`` of the step the monitor is in, never into the training step's
``forward`` rows. A ``recompute()`` block, whose forward first runs without gradient
recording inside the training pass, still counts as training. Every value is checked
against NumPy statistics of the network's weights and inputs.
"""

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import assert_row_matches, find_row, rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, ms, mse, nn, np, np_stats, relu_np, weights_of  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
STEPS = 4


def forward_np(w, x, root="MLP"):
    """Each Cell's output for ``MLP(x)``, by NumPy in fp64 (the root is named by its class)."""
    z1 = x.astype(np.float64) @ w["fc1.weight"].T + w["fc1.bias"]
    h = relu_np(z1)
    return {"fc1.output.0": z1, "act.output.0": h, "fc2.output.0": h @ w["fc2.weight"].T + w["fc2.bias"],
            f"{root}.output.0": h @ w["fc2.weight"].T + w["fc2.bias"]}


def train_with_evaluation(tmp_path, net, set_train):
    """STEPS optimizer steps; after each, an evaluation pass on a batch of another scale."""
    twin = MLP()  # never monitored, never evaluated: the training must not change
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    twin_opt = nn.Adam(twin.trainable_params(), learning_rate=0.01)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    twin_grad_fn = ms.value_and_grad(mse(twin), None, twin_opt.parameters)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": {"enabled": True}}}, fr="mindspore")
    mon.start(model=net, optimizer=opt)
    train_x, eval_x = [], []
    for (x, y), (ex, _) in zip(batches(STEPS), batches(STEPS, seed=7)):
        train_x.append((weights_of(net), x))
        loss, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
        opt(g)  # the monitor's step ends here
        twin_loss, twin_g = twin_grad_fn(ms.Tensor(x), ms.Tensor(y))
        twin_opt(twin_g)
        assert loss.asnumpy().tobytes() == twin_loss.asnumpy().tobytes()
        ex = ex * 100  # evaluation data on another scale
        eval_x.append((weights_of(net), ex))
        if set_train:
            net.set_train(False)
        net(ms.Tensor(ex))
        if set_train:
            net.set_train(True)
    mon.stop()
    for name, a in weights_of(net).items():
        assert a.tobytes() == weights_of(twin)[name].tobytes(), name
    return rows_of(out, "module"), train_x, eval_x


@pytest.mark.parametrize("set_train", [True, False], ids=["set_train(False)", "training flag untouched"])
def test_evaluation_between_steps_is_kept_apart(tmp_path, set_train):
    net = MLP()
    if set_train:
        net.set_train(True)
    rows, train_x, eval_x = train_with_evaluation(tmp_path, net, set_train)
    for s in range(STEPS):
        for tag, a in forward_np(*train_x[s]).items():
            assert_row_matches(find_row(rows, step=s, module_name=tag, scope="forward"), np_stats(a), RTOL, ATOL)
    # the evaluation after step s's update runs in step s + 1 (the last one after the last step)
    for s in range(STEPS - 1):
        for tag, a in forward_np(*eval_x[s]).items():
            assert_row_matches(find_row(rows, step=s + 1, module_name=tag, scope="eval_forward"), np_stats(a),
                               RTOL, ATOL)
    assert not [r for r in rows if r["step"] == "0" and r["scope"] == "eval_forward"]
    assert {r["scope"] for r in rows} == {"forward", "eval_forward", "backward"}


class RecomputedMLP(MLP):
    """``fc2`` under ``recompute()``: PyNative first runs its forward without gradient
    recording, inside the training pass."""

    def __init__(self) -> None:
        super().__init__()
        self.fc2.recompute()


def test_a_recomputed_block_counts_as_training(tmp_path):
    rows, train_x, eval_x = train_with_evaluation(tmp_path, RecomputedMLP(), set_train=False)
    for s in range(STEPS):
        want = forward_np(*train_x[s], root="RecomputedMLP")
        for tag in ("fc1.output.0", "fc2.output.0", "RecomputedMLP.output.0"):
            row = find_row(rows, step=s, module_name=tag, scope="forward")
            for stat in ("min", "max", "mean"):  # the recomputation may add a second, equal call
                assert float(row[stat]) == pytest.approx(np_stats(want[tag])[stat], rel=RTOL, abs=ATOL), (s, tag)
    # the recomputed block's first forward is not an evaluation: step 0 has none, and the
    # evaluation rows hold the evaluation batches alone
    assert not [r for r in rows if r["step"] == "0" and r["scope"] == "eval_forward"]
    for s in range(STEPS - 1):
        want = forward_np(*eval_x[s], root="RecomputedMLP")
        assert_row_matches(find_row(rows, step=s + 1, module_name="fc2.output.0", scope="eval_forward"),
                           np_stats(want["fc2.output.0"]), RTOL, ATOL)


def test_train_one_step_cell_as_the_model(tmp_path):
    """``TrainOneStepCell`` records a gradient only inside its network's call: its whole
    call is still a training pass. The bare network evaluated between steps is called
    outside the model's call, and its rows are evaluation rows."""
    net = MLP()
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    train_net = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": {"enabled": True}}}, fr="mindspore")
    mon.start(model=train_net, optimizer=opt)
    train_x, eval_x = [], []
    for (x, y), (ex, _) in zip(batches(STEPS), batches(STEPS, seed=7)):
        train_x.append((weights_of(net), x))
        train_net(ms.Tensor(x), ms.Tensor(y))  # the monitor's step ends inside, at the optimizer
        eval_x.append((weights_of(net), ex * 100))
        net(ms.Tensor(ex * 100))
    mon.stop()
    rows = rows_of(out, "module")
    fc2 = "network._backbone.fc2.output.0"
    for s in range(STEPS):
        want = forward_np(*train_x[s])["fc2.output.0"]
        assert_row_matches(find_row(rows, step=s, module_name=fc2, scope="forward"), np_stats(want), RTOL, ATOL)
        assert find_row(rows, step=s, module_name="TrainOneStepCell.input.0", scope="forward")
    for s in range(STEPS - 1):
        want = forward_np(*eval_x[s])["fc2.output.0"]
        assert_row_matches(find_row(rows, step=s + 1, module_name=fc2, scope="eval_forward"), np_stats(want),
                           RTOL, ATOL)
    assert not [r for r in rows if r["scope"] == "eval_forward" and not r["module_name"].startswith("network.")]


def test_train_one_step_cell_with_unwritten_steps_between(tmp_path):
    """With step_interval 2 the step ends inside the TrainOneStepCell's call, and the next
    written step begins there too: its remaining rows (the model's output) are still
    training rows."""
    net = MLP()
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    train_net = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "step_interval": 2,
                            "monitors": {"module": {"enabled": True}}}, fr="mindspore")
    mon.start(model=train_net, optimizer=opt)
    for x, y in batches(5):
        train_net(ms.Tensor(x), ms.Tensor(y))
    mon.stop()
    rows = rows_of(out, "module")
    assert {r["step"] for r in rows} == {"0", "2", "4"}
    assert [r for r in rows if r["scope"] == "eval_forward"] == []
    for s in ("2", "4"):
        assert find_row(rows, step=s, module_name="TrainOneStepCell.output.0", scope="forward")
