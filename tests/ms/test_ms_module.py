"""MindSpore ``module`` monitor: forward inputs/outputs and backward
``grad_input``/``grad_output`` of Cells, against values computed with NumPy from the
weights and the input (``loss = sum(out)``, so the last layer's ``grad_output`` is all
ones), plus tags, targets, aggregation of repeated calls, model chunks, and what
``stop()`` leaves behind."""

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import assert_row_matches, find_row, rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, ms, mse, nn, np, np_stats, relu_np, weights_of  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


def mlp_reference(w, x):
    """Every tensor the module monitor should see for ``sum(MLP(x))``, by NumPy."""
    x = x.astype(np.float64)
    z1 = x @ w["fc1.weight"].T + w["fc1.bias"]
    h = relu_np(z1)
    out = h @ w["fc2.weight"].T + w["fc2.bias"]
    d_out = np.ones_like(out)
    d_h = d_out @ w["fc2.weight"]
    d_z1 = d_h * (z1 > 0)
    d_x = d_z1 @ w["fc1.weight"]
    return {
        "MLP.input.0": x, "MLP.output.0": out,
        "fc1.input.0": x, "fc1.output.0": z1,
        "act.input.0": z1, "act.output.0": h,
        "fc2.input.0": h, "fc2.output.0": out,
        "MLP.grad_output.0": d_out, "MLP.grad_input.0": d_x,
        "fc2.grad_output.0": d_out, "fc2.grad_input.0": d_h,
        "act.grad_output.0": d_h, "act.grad_input.0": d_z1,
        "fc1.grad_output.0": d_z1, "fc1.grad_input.0": d_x,
    }


def run_mlp(tmp_path, module_cfg, steps=2):
    net = MLP()
    w = weights_of(net)
    # gradients with respect to the input too, so that fc1 and the root have a grad_input
    grad_fn = ms.value_and_grad(lambda x: net(x).sum(), 0, net.trainable_params())
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": module_cfg}}, fr="mindspore")
    mon.start(model=net)
    xs = [x for x, _ in batches(steps)]
    for x in xs:
        assert np.abs(x.astype(np.float64) @ w["fc1.weight"].T + w["fc1.bias"]).min() > 1e-4  # no ReLU kink
        grad_fn(ms.Tensor(x))
        mon.step()
    mon.stop()
    return out, w, xs


def test_forward_and_backward_rows_match_numpy(tmp_path):
    out, w, xs = run_mlp(tmp_path, {"enabled": True})
    rows = rows_of(out, "module")
    for s, x in enumerate(xs):
        want = mlp_reference(w, x)
        got = {r["module_name"]: r for r in rows if r["step"] == str(s)}
        assert sorted(got) == sorted(want), f"step {s}: tags differ"
        for tag, a in want.items():
            row = got[tag]
            kind = tag.split(".")[-2]
            assert row["scope"] == ("forward" if kind in ("input", "output") else "backward"), row
            assert row["vpp_stage"] == "0" and "micro_step" not in row
            assert_row_matches(row, np_stats(a), RTOL, ATOL)
    assert np.all(mlp_reference(w, xs[0])["fc2.grad_output.0"] == 1)


def test_targets_substring_match(tmp_path):
    out, w, xs = run_mlp(tmp_path, {"enabled": True, "targets": ["fc"]}, steps=1)
    rows = rows_of(out, "module")
    want = {k: v for k, v in mlp_reference(w, xs[0]).items() if k.startswith("fc")}
    assert sorted(r["module_name"] for r in rows) == sorted(want)
    for r in rows:
        assert_row_matches(r, np_stats(want[r["module_name"]]), RTOL, ATOL)


def test_ops_subset_gives_only_those_columns(tmp_path):
    out, w, xs = run_mlp(tmp_path, {"enabled": True, "targets": ["fc2"], "ops": ["norm", "max"]}, steps=1)
    path = out / "rank_0" / "module_step0-0.csv"
    assert path.read_text().splitlines()[0] == "vpp_stage,step,module_name,scope,max,norm"
    want = mlp_reference(w, xs[0])
    for r in rows_of(out, "module"):
        assert_row_matches(r, np_stats(want[r["module_name"]]), RTOL, ATOL)


class Shared(nn.Cell):
    """The same Dense called twice per forward pass (weight sharing)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(3, 3)
        rng = np.random.default_rng(5)
        self.fc.weight.set_data(ms.Tensor(rng.standard_normal((3, 3)).astype(np.float32)))
        self.fc.bias.set_data(ms.Tensor(rng.standard_normal(3).astype(np.float32)))

    def construct(self, x):
        return self.fc(self.fc(x))


def test_a_cell_called_twice_gives_one_aggregated_row_per_tag(tmp_path):
    net = Shared()
    W, b = net.fc.weight.asnumpy().astype(np.float64), net.fc.bias.asnumpy().astype(np.float64)
    x = np.random.default_rng(6).standard_normal((4, 3)).astype(np.float32)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": {"targets": ["fc"]}}}, fr="ms")
    mon.start(model=net)
    ms.grad(lambda x: net(x).sum(), 0)(ms.Tensor(x))
    mon.step()
    mon.stop()
    x64 = x.astype(np.float64)
    y1 = x64 @ W.T + b
    y2 = y1 @ W.T + b
    g2 = np.ones_like(y2)  # grad of the 2nd call's output
    g1 = g2 @ W  # grad of the 1st call's output = grad_input of the 2nd call
    g0 = g1 @ W  # grad_input of the 1st call
    want = {
        "fc.input.0": np.concatenate([x64, y1]), "fc.output.0": np.concatenate([y1, y2]),
        "fc.grad_output.0": np.concatenate([g2, g1]), "fc.grad_input.0": np.concatenate([g1, g0]),
    }
    rows = rows_of(out, "module")
    assert sorted(r["module_name"] for r in rows) == sorted(want)
    for tag, a in want.items():
        assert_row_matches(find_row(rows, module_name=tag), np_stats(a), RTOL, ATOL)


def test_model_chunks_are_prefixed_with_their_index(tmp_path):
    a, b = MLP(seed=0), MLP(seed=3)
    wa, wb = weights_of(a), weights_of(b)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": {"targets": ["fc2"]}}}, fr="ms")
    mon.start(model=[a, b])
    x = batches(1)[0][0]
    ms.grad(lambda x: b(a(x)[:, :1].broadcast_to((5, 4))).sum(), None, a.trainable_params() + b.trainable_params())(
        ms.Tensor(x))
    mon.step()
    mon.stop()
    rows = rows_of(out, "module")
    tags = sorted(r["module_name"] for r in rows)
    assert tags == sorted(f"{i}:fc2.{k}" for i in (0, 1) for k in ("input.0", "output.0", "grad_input.0", "grad_output.0"))
    for r in rows:
        assert r["vpp_stage"] == r["module_name"][0]
    # forward values of chunk 0's fc2 from NumPy
    h = relu_np(x.astype(np.float64) @ wa["fc1.weight"].T + wa["fc1.bias"])
    assert_row_matches(find_row(rows, module_name="0:fc2.output.0"),
                       np_stats(h @ wa["fc2.weight"].T + wa["fc2.bias"]), RTOL, ATOL)
    x1 = np.broadcast_to((h @ wa["fc2.weight"].T + wa["fc2.bias"])[:, :1], (5, 4))
    h1 = relu_np(x1 @ wb["fc1.weight"].T + wb["fc1.bias"])
    assert_row_matches(find_row(rows, module_name="1:fc2.input.0"), np_stats(h1), RTOL, ATOL)


class Affine(nn.Cell):
    def construct(self, x, scale=None, shift=None):
        return x * scale + shift


def test_keyword_argument_tensors_are_inputs_too(tmp_path):
    """Spec: ``idx`` counts the tensors in order, positional arguments, then keyword
    arguments: ``cell(x, scale=s, shift=b)`` has inputs 0 (x), 1 (s) and 2 (b)."""
    cell = Affine()
    rng = np.random.default_rng(9)
    x, sc, sh = (rng.standard_normal(6).astype(np.float32) for _ in range(3))
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": {}}}, fr="ms")
    mon.start(model=cell)
    y = cell(ms.Tensor(x), scale=ms.Tensor(sc), shift=ms.Tensor(sh))
    mon.step()
    mon.stop()
    np.testing.assert_allclose(y.asnumpy(), x * sc + sh, rtol=1e-6)
    rows = rows_of(out, "module")
    want = {"Affine.input.0": x, "Affine.input.1": sc, "Affine.input.2": sh,
            "Affine.output.0": x.astype(np.float64) * sc + sh}
    assert sorted(r["module_name"] for r in rows) == sorted(want)
    for tag, a in want.items():
        assert_row_matches(find_row(rows, module_name=tag), np_stats(a), RTOL, ATOL)


def hook_counts(net, opt):
    counts = {}
    for name, cell in list(net.cells_and_names()) + [("<optimizer>", opt)]:
        for attr in ("_lazy_forward_pre_hook", "_lazy_forward_hook", "_lazy_backward_hook", "_lazy_backward_pre_hook"):
            hooks = getattr(cell, attr, None)
            counts[(name, attr)] = len(hooks) if hooks else 0
    for p in net.trainable_params():
        counts[(p.name, "param")] = len(p.hooks())
    return counts


def test_stop_removes_every_hook_and_training_is_bit_identical(tmp_path):
    """All monitors on: losses and parameters equal bit for bit those of an unmonitored
    twin; after ``stop()`` no hook of the monitor is left on cells, optimizer or
    parameters."""
    net, ref = MLP(), MLP()
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    ref_opt = nn.Adam(ref.trainable_params(), learning_rate=0.01)
    empty = hook_counts(net, opt)
    assert not any(empty.values())
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    ref_grad_fn = ms.value_and_grad(mse(ref), None, ref_opt.parameters)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": {
        "module": {"enabled": True}, "weight_grad": {"enabled": True, "monitor_mbs_grad": True},
        "optimizer": {"enabled": True}, "param": {"enabled": True}}}, fr="ms")
    mon.start(model=net, optimizer=opt)
    assert any(hook_counts(net, opt).values())
    for x, y in batches(3):
        loss, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
        ref_loss, ref_g = ref_grad_fn(ms.Tensor(x), ms.Tensor(y))
        assert loss.asnumpy().tobytes() == ref_loss.asnumpy().tobytes()
        opt(g)
        ref_opt(ref_g)
    mon.stop()
    assert hook_counts(net, opt) == empty
    for name, a in weights_of(net).items():
        assert a.tobytes() == weights_of(ref)[name].tobytes(), name
    mon.stop()  # twice is harmless
