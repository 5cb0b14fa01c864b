"""MindSpore: a Cell returning a dict is named by key, as in PyTorch (issue 20): a Cell
returning ``{"logits": y}`` on one call and ``{"aux": a, "logits": y}`` on the next
writes ``output.logits`` both times, checked against NumPy."""

import pytest

pytest.importorskip("mindspore")

from conftest import assert_row_matches, find_row, rows_of  # noqa: E402
from ms_helpers import MLP, batches, ms, nn, np, np_stats, relu_np, weights_of  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402


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
