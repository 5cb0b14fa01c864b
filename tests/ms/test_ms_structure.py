"""MindSpore: ``"structure": true`` lists Cell names exactly as ``targets`` matches them
(every listed name, used as a target, produces rows of exactly the Cells that
``msprobe-monitor struct`` says it selects) and parameter names as the rows carry them."""

import io
import json

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import rows_of  # noqa: E402
from support.ms_helpers import batches, ms, mse, nn, np  # noqa: E402

from msprobe.core.monitor_v2.analysis.cli import main  # noqa: E402
from msprobe.core.monitor_v2.model_structure import read_structure  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

KINDS = (".input.", ".output.", ".grad_input.", ".grad_output.")


class Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Dense(4, 4)
        self.act = nn.ReLU()

    def construct(self, x):
        return self.act(self.fc(x)) + x


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.CellList([Block(), Block()])  # never called itself
        self.head = nn.SequentialCell([nn.Dense(4, 4), nn.Tanh(), nn.Dense(4, 3)])
        self.frozen = nn.Dense(4, 4)
        for p in self.frozen.trainable_params():
            p.requires_grad = False

    def construct(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x + self.frozen(x))


def module_of(row_name: str) -> str:
    for kind in KINDS:
        if kind in row_name:
            return row_name.rsplit(kind, 1)[0]
    raise AssertionError(row_name)


def train(out, extra=None):
    ms.set_seed(0)
    net = Net()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    cfg = {"output_dir": str(out), "structure": True}
    cfg.update(extra or {})
    mon = TrainerMonitorV2(cfg, fr="ms")
    mon.start(model=net, optimizer=opt)
    (x, y), = batches(1)
    _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
    opt(g)
    mon.stop()
    return read_structure(str(out / "rank_0" / "structure.txt"))


def struct_json(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(["struct"] + [str(a) for a in argv] + ["--json"], out=out, err=err)
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


def test_listed_cell_and_parameter_names_are_those_of_the_rows(tmp_path):
    out = tmp_path / "all"
    s = train(out, {"monitors": {"module": {}, "weight_grad": {"enabled": True}}})
    assert s.framework == "mindspore"
    names = [m.name for m in s.modules]
    assert names[0] == "Net" and "blocks.0.fc" in names and "head.2" in names
    assert [m.name for m in s.modules if m.container] == ["blocks"]
    with_rows = {module_of(r["module_name"]) for r in rows_of(out, "module")}
    assert with_rows == {m.name for m in s.modules if not m.container}
    assert {p.name for p in s.params if not p.trainable} == {"frozen.weight", "frozen.bias"}
    assert {p.name for p in s.params if p.trainable} == {r["module_name"] for r in rows_of(out, "weight_grad")}
    assert {p.name: p.shape for p in s.params}["head.2.weight"] == (3, 4)
    assert all(p.dtype == "Float32" for p in s.params)


def test_each_listed_name_as_a_target(tmp_path):
    listing = tmp_path / "listing"
    s = train(listing)
    for entry in s.modules:
        out = tmp_path / f"t_{entry.name}"
        train(out, {"monitors": {"module": {"targets": [entry.name]}}})
        got = {module_of(r["module_name"]) for r in rows_of(out, "module")}
        data = struct_json(listing, "--targets", entry.name)
        assert got == set(data["selected_with_rows"]), entry.name
        assert entry.name in data["selected"]
