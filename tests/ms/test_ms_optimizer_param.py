"""MindSpore ``optimizer`` and ``param`` monitors.

optimizer: the Adam family's first/second moments are reported as
``<param>.exp_avg`` / ``<param>.exp_avg_sq`` whatever the MindSpore attribute is called
(``nn.Adam`` ``moment1``/``moment2``, ``nn.AdamWeightDecay`` ``moments1``/``moments2``,
``mint.optim.AdamW`` ``exp_avg``/``exp_avg_sq``); ``nn.Momentum``'s ``moments`` is
reported as PyTorch's ``momentum_buffer``. Values are compared with NumPy copies of the state read right after
each ``optimizer(grads)``.

param: ``param_origin`` / ``param_updated`` against NumPy copies taken right before and
right after ``optimizer(grads)``.
"""

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import assert_row_matches, find_row, rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, ms, mse, nn, np, np_stats, ops, weights_of  # noqa: E402
from mindspore import mint  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
RTOL, ATOL = 1e-5, 1e-8


class CpuMintAdamW(mint.optim.AdamW):
    """``mint.optim.AdamW`` whose update runs on the CPU: MindSpore 2.10 registers its
    ``AdamW`` kernel for Ascend only ("The kernel AdamW unregistered" on CPU). The
    optimizer object, its ``exp_avg``/``exp_avg_sq`` ``ParameterTuple`` s and the way it
    is called are mint's own; only ``construct`` is the textbook AdamW in ``ops``."""

    def construct(self, gradients):
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        self._t = getattr(self, "_t", 0) + 1
        bc1, bc2 = 1 - beta1 ** self._t, 1 - beta2 ** self._t
        for p, g, m, v in zip(self.parameters, gradients, self.exp_avg, self.exp_avg_sq):
            ops.assign(p, p * (1 - lr * wd))
            ops.assign(m, m * beta1 + g * (1 - beta1))
            ops.assign(v, v * beta2 + g * g * (1 - beta2))
            ops.assign(p, p - (m / bc1) / ((v / bc2).sqrt() + eps) * lr)
        return True


OPTIMIZERS = {
    # name: (factory, {attribute holding the state: reported state name})
    "nn.Adam": (lambda ps: nn.Adam(ps, learning_rate=0.01), {"moment1": "exp_avg", "moment2": "exp_avg_sq"}),
    "nn.AdamWeightDecay": (lambda ps: nn.AdamWeightDecay(ps, learning_rate=0.01, weight_decay=0.1),
                           {"moments1": "exp_avg", "moments2": "exp_avg_sq"}),
    "mint.optim.AdamW": (lambda ps: CpuMintAdamW(ps, lr=0.01), {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}),
    "nn.Momentum": (lambda ps: nn.Momentum(ps, learning_rate=0.05, momentum=0.9), {"moments": "momentum_buffer"}),
}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_optimizer_state_and_params(tmp_path, kind):
    factory, states = OPTIMIZERS[kind]
    net = MLP()
    opt = factory(net.trainable_params())
    assert isinstance(opt, mint.optim.AdamW) == (kind == "mint.optim.AdamW")
    for attr in states:  # the state really lives where the test reads it
        assert isinstance(getattr(opt, attr), ms.ParameterTuple), attr
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out),
                            "monitors": {"optimizer": {"enabled": True}, "param": {"enabled": True}}}, fr="mindspore")
    mon.start(model=net, optimizer=opt)
    before, after, state_after = [], [], []
    for x, y in batches(2):
        _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
        before.append(weights_of(net))
        opt(grads)
        after.append(weights_of(net))
        state_after.append({attr: [t.asnumpy().copy() for t in getattr(opt, attr)] for attr in states})
    mon.stop()

    assert sorted(p.name for p in (tmp_path / "out" / "rank_0").iterdir()) == ["layout.json",
        "optimizer_step0-0.csv", "optimizer_step1-1.csv", "param_step0-0.csv", "param_step1-1.csv"]
    opt_rows = rows_of(out, "optimizer")
    assert len(opt_rows) == 2 * len(NAMES) * len(states)
    assert {r["scope"] for r in opt_rows} == set(states.values())
    param_rows = rows_of(out, "param")
    assert len(param_rows) == 2 * len(NAMES) * 2
    for s in range(2):
        assert not np.allclose(state_after[s][next(iter(states))][0], 0)  # the state did move
        for i, name in enumerate(NAMES):
            for attr, reported in states.items():
                row = find_row(opt_rows, step=s, module_name=f"{name}.{reported}")
                assert row["scope"] == reported and row["vpp_stage"] == "0"
                assert "micro_step" not in row
                assert_row_matches(row, np_stats(state_after[s][attr][i]), RTOL, ATOL)
            assert not np.array_equal(before[s][name], after[s][name])
            assert_row_matches(find_row(param_rows, step=s, module_name=name, scope="param_origin"),
                               np_stats(before[s][name]), RTOL, ATOL)
            assert_row_matches(find_row(param_rows, step=s, module_name=name, scope="param_updated"),
                               np_stats(after[s][name]), RTOL, ATOL)


def test_adam_moments_are_the_textbook_moments(tmp_path):
    """The rows of nn.Adam after one step are (1 - beta1) g and (1 - beta2) g^2 of the
    gradient passed (a check of the names' meaning independent of MindSpore's state)."""
    net = MLP()
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01, beta1=0.8, beta2=0.95)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"optimizer": {"enabled": True}}}, fr="ms")
    mon.start(model=net, optimizer=opt)
    x, y = batches(1)[0]
    _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
    g = [t.asnumpy().astype(np.float64) for t in grads]
    opt(grads)
    mon.stop()
    rows = rows_of(out, "optimizer")
    for i, name in enumerate(NAMES):
        assert_row_matches(find_row(rows, module_name=f"{name}.exp_avg"), np_stats(0.2 * g[i]), 1e-5, 1e-8)
        assert_row_matches(find_row(rows, module_name=f"{name}.exp_avg_sq"), np_stats(0.05 * g[i] ** 2), 1e-5, 1e-10)


def test_mv_distribution_and_param_distribution_false_write_nothing(tmp_path):
    net = MLP()
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {
        "optimizer": {"enabled": True, "mv_distribution": False},
        "param": {"enabled": True, "param_distribution": False},
        "weight_grad": {"enabled": True}}}, fr="ms")
    mon.start(model=net, optimizer=opt)
    for x, y in batches(2):
        opt(grad_fn(ms.Tensor(x), ms.Tensor(y))[1])
    mon.stop()
    assert rows_of(out, "optimizer") == [] and rows_of(out, "param") == []
    assert len(rows_of(out, "weight_grad")) == 2 * len(NAMES) * 2
