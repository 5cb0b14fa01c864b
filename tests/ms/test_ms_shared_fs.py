"""The MindSpore path goes through the same writer (issue 20): no CSV written through a
link, a linked ``rank_0`` refused at start, modes 0750/0640 whatever the umask, formula
cells escaped and read back unchanged; checked on real PyNative training."""

import csv
import os
import stat

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

import numpy as np  # noqa: E402
from support.ms_helpers import MLP, batches, grads_np, ms, mse, nn, np_stats  # noqa: E402

from msprobe.core.monitor_v2.analysis.reader import CsvFile, Problems, iter_rows  # noqa: E402
from msprobe.core.monitor_v2.errors import UnsafePathError  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

MONITORS = {"weight_grad": {"enabled": True}, "param": {"enabled": True}}


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


def _train(out, cfg, steps, net=None):
    net = net or MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    mon = TrainerMonitorV2(dict(cfg, output_dir=str(out)), fr="mindspore")
    mon.start(model=net, optimizer=opt)
    passed = []
    for x, y in batches(steps):
        _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
        passed.append(grads_np(g))
        opt(g)
    mon.stop()
    return passed


def _rows(path, monitor, a):
    return list(iter_rows(CsvFile(0, monitor, a, a, str(path)), Problems(strict=True)))


@pytest.mark.parametrize("async_write", [False, True], ids=["sync", "async"])
def test_ms_link_at_a_csv_path_is_refused_and_modes_are_fixed(tmp_path, caplog, async_write):
    out = tmp_path / "out"
    secret = tmp_path / "secret"
    secret.write_text("root:$6$hash:::\n")
    secret.chmod(0o600)
    before = secret.read_bytes(), os.stat(secret).st_mtime_ns
    old = os.umask(0)
    try:
        (out / "rank_0").mkdir(parents=True)
        out.chmod(0o750)
        (out / "rank_0").chmod(0o750)
        os.symlink(secret, out / "rank_0" / "param_step1-1.csv")
        passed = _train(out, {"monitors": MONITORS, "async_write": async_write}, steps=3)
    finally:
        os.umask(old)
    assert (secret.read_bytes(), os.stat(secret).st_mtime_ns) == before
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(str(out / "rank_0" / "param_step1-1.csv") in m and "symbolic link" in m for m in warnings), warnings
    assert all("root:$6$" not in m for m in warnings)
    rank = out / "rank_0"
    for s in range(3):
        rows = _rows(rank / f"weight_grad_step{s}-{s}.csv", "weight_grad", s)
        got = {(r.name, r.scope): r.vals for r in rows}
        want = np_stats(passed[s][2])
        row = {"min": got[("fc2.weight", "reduced")]["min"], "max": got[("fc2.weight", "reduced")]["max"]}
        assert row["min"] == pytest.approx(want["min"], rel=1e-6) and row["max"] == pytest.approx(want["max"], rel=1e-6)
    assert [r.step for r in _rows(rank / "param_step2-2.csv", "param", 2)] == [2] * 8
    for f in rank.iterdir():
        if not f.is_symlink():
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o640, f


def test_ms_linked_rank_dir_is_refused_at_start(tmp_path):
    out = tmp_path / "out"
    out.mkdir(mode=0o750)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "rank_0")
    net = MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": MONITORS}, fr="mindspore")
    with pytest.raises(UnsafePathError) as info:
        mon.start(model=net, optimizer=opt)
    assert str(out / "rank_0") in str(info.value) and "symbolic link" in str(info.value)
    mon.stop()
    assert os.listdir(elsewhere) == []


class _Formula(nn.Cell):
    """Cells named like spreadsheet formulas; weights from NumPy."""

    def __init__(self):
        super().__init__()
        self.insert_child_to_cell("=HYPERLINK(x)", nn.Dense(4, 3))
        self.insert_child_to_cell("-neg", nn.Dense(3, 3))
        rng = np.random.default_rng(7)
        for name, p in self.parameters_and_names():
            p.name = name  # insert_child_to_cell leaves the short names; the optimizer needs unique ones
            p.set_data(ms.Tensor((rng.standard_normal(p.shape) - 1.0).astype(np.float32)))

    def construct(self, x):
        for cell in self.cells():
            x = cell(x)
        return x


def test_ms_formula_names_are_escaped_and_read_back(tmp_path):
    out = tmp_path / "out"
    net = _Formula()
    weights = {n: p.asnumpy().astype(np.float64).copy() for n, p in net.parameters_and_names()}
    _train(out, {"monitors": {"param": {"enabled": True}, "module": {}}}, steps=1, net=net)
    path = out / "rank_0" / "param_step0-0.csv"
    with open(path, newline="", encoding="utf-8") as f:
        cells = [row[2] for row in csv.reader(f)][1:]
    assert "'=HYPERLINK(x).weight" in cells and "'-neg.bias" in cells
    assert all(c[:1] not in "=+-@" for c in cells), cells
    rows = _rows(path, "param", 0)
    assert {r.name for r in rows} == set(weights)
    for r in rows:
        if r.scope == "param_origin":
            assert r.vals["min"] == pytest.approx(weights[r.name].min(), rel=1e-6)
            assert r.vals["max"] == pytest.approx(weights[r.name].max(), rel=1e-6)
    assert any(r.vals["min"] < 0 for r in rows)  # negative numbers stay numbers
    module = _rows(out / "rank_0" / "module_step0-0.csv", "module", 0)
    assert {"=HYPERLINK(x).output.0", "-neg.output.0"} <= {r.name for r in module}
