"""The same two-layer MLP trained in PyTorch and in MindSpore (same initial weights,
data, loss and Adam hyper-parameters, 2 steps of 2 micro-batches) with module,
weight_grad, optimizer and param on: both back ends write the same files, headers and
row keys, and the same values within fp32 tolerance.

Both root classes are called ``TwoLayer`` (the root module is named after its class);
the attribute names fc1/act/fc2 make the parameter and module names equal."""

import csv

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")
torch = pytest.importorskip("torch")

from support.ms_helpers import init_arrays, ms, nn, np  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

STEPS, ACC = 2, 2
LR, BETAS, EPS = 0.01, (0.9, 0.999), 1e-8
RTOL = 1e-4  # relative; the absolute tolerance is relative to the row's norm (see below)
OPS = ("min", "max", "mean", "norm", "nans")


def data():
    rng = np.random.default_rng(11)
    return [(rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32))
            for _ in range(STEPS * ACC)]


def config(out):
    return {"output_dir": str(out), "monitors": {
        "module": {"enabled": True},
        "weight_grad": {"enabled": True, "monitor_mbs_grad": True},
        "optimizer": {"enabled": True},
        "param": {"enabled": True}}}


def run_torch(out, init):
    class TwoLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(4, 6)
            self.act = torch.nn.ReLU()
            self.fc2 = torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    model = TwoLayer()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(init[name].copy()))
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=BETAS, eps=EPS)
    mon = TrainerMonitorV2(config(out), fr="pytorch")
    mon.start(model=model, optimizer=opt, grad_acc_steps=ACC)
    batches = data()
    for s in range(STEPS):
        for x, y in batches[s * ACC:(s + 1) * ACC]:
            torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.stop()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def run_mindspore(out, init):
    class TwoLayer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Dense(4, 6)
            self.act = nn.ReLU()
            self.fc2 = nn.Dense(6, 3)

        def construct(self, x):
            return self.fc2(self.act(self.fc1(x)))

    net = TwoLayer()
    for name, p in net.parameters_and_names():
        p.set_data(ms.Tensor(init[name].copy()))
    opt = nn.Adam(net.trainable_params(), learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
    grad_fn = ms.value_and_grad(lambda x, y: ((net(x) - y) ** 2).mean(), None, opt.parameters)
    mon = TrainerMonitorV2(config(out), fr="mindspore")
    mon.start(model=net, optimizer=opt, grad_acc_steps=ACC)
    batches = data()
    for s in range(STEPS):
        total = None
        for x, y in batches[s * ACC:(s + 1) * ACC]:
            _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
            total = g if total is None else tuple(a + b for a, b in zip(total, g))
        opt(total)
    mon.stop()
    return {n: p.asnumpy().copy() for n, p in net.parameters_and_names()}


def read(out):
    files = {}
    for p in sorted((out / "rank_0").glob("*.csv")):
        with open(p, newline="") as f:
            reader = csv.reader(f)
            header = next(reader)
            files[p.name] = (header, [dict(zip(header, r)) for r in reader])
    return files


def key(row):
    return (row["vpp_stage"], row["step"], row["module_name"], row["scope"], row.get("micro_step"))


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    init = init_arrays(seed=4)
    pt_out, ms_out = tmp_path_factory.mktemp("pt"), tmp_path_factory.mktemp("ms")
    pt_params = run_torch(pt_out, init)
    ms_params = run_mindspore(ms_out, init)
    return read(pt_out), read(ms_out), pt_params, ms_params


def test_same_training(both):
    """Sanity: the two trainings are the same computation (final parameters agree)."""
    _, _, pt_params, ms_params = both
    assert sorted(pt_params) == sorted(ms_params)
    for name in pt_params:
        np.testing.assert_allclose(ms_params[name], pt_params[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_same_files_and_headers(both):
    pt, ms_files, _, _ = both
    assert sorted(pt) == sorted(ms_files)
    assert sorted(pt) == sorted(f"{m}_step{s}-{s}.csv" for m in ("module", "weight_grad", "optimizer", "param")
                                for s in range(STEPS))
    for name in pt:
        assert pt[name][0] == ms_files[name][0], name


@pytest.mark.parametrize("monitor", ["module", "weight_grad", "optimizer", "param"])
def test_same_keys_and_values(both, monitor):
    pt, ms_files, _, _ = both
    for s in range(STEPS):
        name = f"{monitor}_step{s}-{s}.csv"
        pt_rows = {key(r): r for r in pt[name][1]}
        ms_rows = {key(r): r for r in ms_files[name][1]}
        assert len(pt_rows) == len(pt[name][1]) and len(ms_rows) == len(ms_files[name][1]), "duplicate keys"
        only_pt = sorted(set(pt_rows) - set(ms_rows))
        only_ms = sorted(set(ms_rows) - set(pt_rows))
        assert not only_pt and not only_ms, f"{name}: rows only in PyTorch {only_pt}, only in MindSpore {only_ms}"
        for k, pr in pt_rows.items():
            mr = ms_rows[k]
            # min/max/mean are bounded by the norm: values near 0 (a mean of mixed signs)
            # are compared with an absolute tolerance scaled to the tensor
            atol = 1e-6 * float(pr["norm"])
            for op in OPS:
                if op == "nans":
                    assert pr[op] == mr[op], (name, k, op)
                    continue
                a, b = float(pr[op]), float(mr[op])
                assert np.isclose(b, a, rtol=RTOL, atol=atol), f"{name} {k} {op}: PyTorch {a}, MindSpore {b}"
