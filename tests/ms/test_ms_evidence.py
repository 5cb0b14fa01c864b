"""MindSpore (PyNative) incident evidence: a NaN written into one weight before step K.
``alert.dump`` keeps ``tensors.npz`` as it was before ``optimizer(grads)``, and a replay in
a fresh Cell gives the same non-finite positions and finite values; ``stop_on_nonfinite``
raises from the optimizer's pre-hook and the parameters stay bit-identical;
``anomalies.jsonl`` is written."""

import json

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support.ms_helpers import MLP, batches, ms, mse, nn, np  # noqa: E402

from msprobe.core.monitor_v2.errors import NonFiniteGradientError  # noqa: E402
from msprobe.core.monitor_v2.evidence import load_dump  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

K = 2


def train(tmp_path, alert, steps=4):
    net = MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "alert": alert,
                            "monitors": {"weight_grad": {"enabled": True}}}, fr="mindspore")
    mon.start(model=net, optimizer=opt)
    seen = {}
    data = batches(steps)
    try:
        for s, (x, y) in enumerate(data):
            if s == K:
                w = net.fc2.weight.asnumpy().copy()
                w[0, 0] = np.nan
                net.fc2.weight.set_data(ms.Tensor(w))
            xt = ms.Tensor(x)  # alive until the optimizer step: the dump keeps it (weak reference)
            _, grads = grad_fn(xt, ms.Tensor(y))
            if s == K:
                seen["before"] = {n: p.asnumpy().copy() for n, p in net.parameters_and_names()}
                seen["grads"] = [g.asnumpy().copy() for g in grads]
                try:
                    opt(grads)
                except NonFiniteGradientError as exc:
                    seen["error"] = exc
                    seen["after"] = {n: p.asnumpy().copy() for n, p in net.parameters_and_names()}
                    break
            else:
                opt(grads)
    finally:
        mon.stop()
    return seen, data


def same(a, b):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_array_equal(a[np.isfinite(a)], b[np.isfinite(b)])


def test_dump_replays_the_failing_step(tmp_path):
    seen, data = train(tmp_path, {"dump": True})
    dump = load_dump(str(tmp_path / "out" / "rank_0" / f"dump_step{K}"))
    assert dump["manifest"]["step"] == K and dump["manifest"]["skipped"] == []
    names = [n for n, _ in MLP().parameters_and_names()]
    for i, name in enumerate(names):
        same(dump["params"][name], seen["before"][name])
        same(dump["grads"][name], seen["grads"][i])
    fresh = MLP(seed=5)
    for name, p in fresh.parameters_and_names():
        p.set_data(ms.Tensor(dump["params"][name]))
    (call,) = dump["calls"]
    x = call["args"][0]
    np.testing.assert_array_equal(x, data[K][0])
    fresh_opt = nn.SGD(fresh.trainable_params(), learning_rate=0.1)
    _, grads = ms.value_and_grad(mse(fresh), None, fresh_opt.parameters)(ms.Tensor(x), ms.Tensor(data[K][1]))
    for name, g in zip(names, grads):
        same(g.asnumpy(), dump["grads"][name])
    lines = [json.loads(x) for x in (tmp_path / "out" / "rank_0" / "anomalies.jsonl").read_text().splitlines()]
    assert lines[0]["first"] and lines[0]["step"] == K and lines[0]["monitor"] == "weight_grad"


def test_stop_on_nonfinite_keeps_the_parameters(tmp_path):
    seen, _ = train(tmp_path, {"stop_on_nonfinite": True})
    err = seen["error"]
    assert err.step == K and err.dump is None and "fc1.weight" in err.names
    for name, value in seen["before"].items():
        same(seen["after"][name], value)
