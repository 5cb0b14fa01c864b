"""MindSpore (issue 20), as in PyTorch: a Cell returning ``{"logits": y}`` on one call and
``{"aux": a, "logits": y}`` on the next writes ``output.logits`` both times; complex
tensors give the statistics of their magnitudes and bool ones of 0/1 on both engine
paths; a tensor MindSpore cannot reduce here (float8 on the CPU) loses only its own row,
said once; a second thread calling the network while the main thread is inside its
training call is its own (evaluation) pass. Checked against NumPy."""

import logging
import threading

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import assert_row_matches, find_row, rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, ms, mse, nn, np, np_stats, relu_np, weights_of  # noqa: E402

from msprobe.core.monitor_v2.frameworks.mindspore.stats import MsStatsEngine  # noqa: E402
from msprobe.core.monitor_v2.stats import StatPlan, merge_records  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

ALL = StatPlan.from_ops(["min", "max", "mean", "norm", "nans"])


@pytest.mark.parametrize("read_host", [True, False], ids=["host, in place", "device primitives"])
def test_complex_bool_and_unreducible_tensors_on_both_paths(read_host, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    engine = MsStatsEngine(read_host=read_host)
    c = np.array([3 + 4j, -2.0, 1j], dtype=np.complex64)
    b = np.array([True, False, True, True])
    f8 = ms.Tensor(np.zeros(4, np.uint8), dtype=ms.float8_e4m3fn)
    recs = [engine.record(ms.Tensor(c), ALL, 0, "c", "s"), engine.record(ms.Tensor(b), ALL, 0, "b", "s"),
            engine.record(f8, ALL, 0, "f8", "s"), engine.record(f8, ALL, 0, "f8 again", "s")]
    engine.to_host(recs)
    rows = {r.name: r for r in merge_records(0, recs)}
    assert set(rows) == {"c", "b"}
    for name, want in (("c", np_stats(np.abs(c))), ("b", np_stats(b.astype(np.float64)))):
        assert_row_matches({op: str(rows[name].stat.value(op)) for op in want}, want, rtol=1e-6)
    said = [r.getMessage() for r in caplog.records if "cannot reduce" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("monitor_v2: f8 is a Float8E4M3FN tensor"), said


class Keyed(nn.Cell):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.calls = 0

    def construct(self, x):
        y = self.mlp(x)
        self.calls += 1
        if self.calls % 2:
            return {"logits": y}
        return {"aux": y * 3.0, "logits": y}


def test_dict_outputs_are_named_by_key(tmp_path):
    net = Keyed()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)

    def loss_of(x, y):
        out = net(x)
        return ((out["logits"] - y) ** 2).mean()

    grad_fn = ms.value_and_grad(loss_of, None, opt.parameters)
    out_dir = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out_dir), "monitors": {"module": {"enabled": True,
                                                                             "targets": ["Keyed"]}}}, fr="mindspore")
    mon.start(model=net, optimizer=opt)
    seen = []
    for x, y in batches(4):
        w = weights_of(net)
        h = relu_np(x.astype(np.float64) @ w["mlp.fc1.weight"].T + w["mlp.fc1.bias"])
        seen.append(h @ w["mlp.fc2.weight"].T + w["mlp.fc2.bias"])
        _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
        opt(g)
    mon.stop()
    rows = rows_of(out_dir, "module")
    names = {r["module_name"] for r in rows if r["scope"] == "forward" and ".output" in r["module_name"]}
    assert names == {"Keyed.output.logits", "Keyed.output.aux"}, names
    for s, logits in enumerate(seen):
        assert_row_matches(find_row(rows, step=s, module_name="Keyed.output.logits", scope="forward"),
                           np_stats(logits), rtol=1e-5, atol=1e-6)
        aux = [r for r in rows if r["step"] == str(s) and r["module_name"] == "Keyed.output.aux"]
        if s % 2:
            assert_row_matches(aux[0], np_stats(logits * 3.0), rtol=1e-5, atol=1e-6)
        else:
            assert aux == []


class WithFloat8(nn.Cell):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def construct(self, x):
        y = self.mlp(x)
        return y, ms.Tensor(np.zeros(3, np.uint8), dtype=ms.float8_e4m3fn), y * 2.0


def test_an_unreducible_output_loses_only_its_row(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    net = WithFloat8()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
    grad_fn = ms.value_and_grad(lambda x, y: ((net(x)[0] - y) ** 2).mean(), None, opt.parameters)
    out_dir = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out_dir), "monitors": {"module": {"enabled": True}}}, fr="mindspore")
    mon.start(model=net, optimizer=opt)
    seen = []
    for x, y in batches(3):
        w = weights_of(net)
        h = relu_np(x.astype(np.float64) @ w["mlp.fc1.weight"].T + w["mlp.fc1.bias"])
        seen.append(h @ w["mlp.fc2.weight"].T + w["mlp.fc2.bias"])
        _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
        opt(g)
    mon.stop()
    rows = rows_of(out_dir, "module")
    for s, want in enumerate(seen):
        assert_row_matches(find_row(rows, step=s, module_name="WithFloat8.output.0", scope="forward"),
                           np_stats(want), rtol=1e-5, atol=1e-6)
        assert_row_matches(find_row(rows, step=s, module_name="WithFloat8.output.2", scope="forward"),
                           np_stats(want * 2), rtol=1e-5, atol=1e-6)
        assert find_row(rows, step=s, module_name="mlp.fc1.output.0", scope="forward")
    assert not [r for r in rows if r["module_name"] == "WithFloat8.output.1"]
    said = [r.getMessage() for r in caplog.records if "cannot reduce" in r.getMessage()]
    assert len(said) == 1 and "WithFloat8.output.1" in said[0], said


def test_a_second_thread_calling_the_network_mid_pass_is_its_own_pass(tmp_path):
    net = MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    out_dir = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out_dir), "monitors": {"module": {"enabled": True}}}, fr="mindspore")
    mon.start(model=net, optimizer=opt)
    main = threading.current_thread()
    go, done = threading.Event(), threading.Event()
    eval_x = np.linspace(-3, 3, 28, dtype=np.float32).reshape(7, 4)
    steps = batches(3)

    def evaluator():
        for _ in steps:
            go.wait()
            go.clear()
            net(ms.Tensor(eval_x))  # a plain call: no gradient recorded
            done.set()

    def hook(cell, inputs, *rest):  # the main thread, inside its training call: the other thread runs a whole call
        if threading.current_thread() is main:
            go.set()
            assert done.wait(60)
            done.clear()

    worker = threading.Thread(target=evaluator)
    worker.start()
    net.fc1.register_forward_hook(hook)
    seen = []
    for x, y in steps:
        seen.append(x)
        _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
        opt(g)
    worker.join(60)
    mon.stop()
    rows = rows_of(out_dir, "module")
    for s, x in enumerate(seen):
        assert_row_matches(find_row(rows, step=s, module_name="MLP.input.0", scope="forward"), np_stats(x))
        assert_row_matches(find_row(rows, step=s, module_name="MLP.input.0", scope="eval_forward"), np_stats(eval_x))
