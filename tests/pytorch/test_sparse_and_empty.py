"""Sparse gradients and empty parameters (issue 12).

- ``nn.Embedding(sparse=True)`` gives sparse COO gradients (with repeated rows when an
  index is looked up twice). ``weight_grad`` writes the statistics of the dense gradient
  they stand for, implicit zeros included, checked against NumPy on
  ``grad.to_dense()`` of an unmonitored twin model trained identically.
- A parameter with no elements has rows in ``weight_grad``, ``optimizer`` and ``param``:
  ``nan`` min/max/mean, 0 norm and NaNs.
- A failing site logs one short line, not PyTorch's multi-kilobyte dispatch message.
"""

import copy
import logging
import math

import pytest
import torch

from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.monitor import ContainedErrors
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

from support import assert_row_matches, find_row, numpy_stats, rows_of

LOGGER = "msprobe.monitor_v2"
EMPTY_ROW = {"min": "nan", "max": "nan", "mean": "nan", "norm": "0", "nans": "0"}


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


class SparseModel(torch.nn.Module):
    def __init__(self, with_dense: bool = True):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(50, 6, sparse=True)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(50, 6, generator=g))
        self.fc = torch.nn.Linear(6, 2) if with_dense else None
        self.empty = torch.nn.Parameter(torch.zeros(0)) if with_dense else None

    def forward(self, idx):
        h = self.emb(idx)
        if self.fc is None:
            return h.square().sum()
        return self.fc(h).square().mean() + self.empty.sum()


BATCHES = [torch.tensor([[1, 2, 2, 7], [5, 1, 7, 7]]), torch.tensor([[3, 3, 3, 0], [9, 0, 4, 4]]),
           torch.tensor([[49, 1, 2, 8], [8, 8, 8, 8]])]


def _train(model, opt, mon=None, capture=None):
    for step, idx in enumerate(BATCHES):
        model(idx).backward()
        if capture is not None:
            capture.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.stop()


def _check_grads(out, grads, scopes):
    rows = rows_of(out, "weight_grad")
    for step, per_step in enumerate(grads):
        for name, grad in per_step.items():
            dense = grad.to_dense() if grad.is_sparse else grad
            for scope in scopes:
                row = find_row(rows, step=step, module_name=name, scope=scope)
                if dense.numel() == 0:
                    assert {op: row[op] for op in EMPTY_ROW} == EMPTY_ROW
                else:
                    assert_row_matches(row, numpy_stats(dense))


@pytest.mark.parametrize("path", ["native", "aten"])
@pytest.mark.parametrize("mbs", [False, True], ids=["accumulated", "per-micro-batch"])
def test_sparse_embedding_with_sgd(tmp_path, monkeypatch, path, mbs):
    if path == "aten":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    model = SparseModel()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {
        "weight_grad": {"enabled": True, "monitor_mbs_grad": mbs}, "param": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    assert (mon._session.engine._native is None) == (path == "aten")
    _train(model, opt, mon)
    grads = []
    _train(twin, twin_opt, capture=grads)
    assert all(grads[s]["emb.weight"].is_sparse for s in range(len(BATCHES)))
    _check_grads(tmp_path, grads, ["unreduced", "reduced"])
    # implicit zeros count: 50 rows, at most 6 touched per step, so 0 is within [min, max]
    for row in rows_of(tmp_path, "weight_grad"):
        if row["module_name"] == "emb.weight":
            assert float(row["min"]) <= 0.0 <= float(row["max"])
    # training is bit-identical with the monitor
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n


def test_sparse_embedding_with_sparse_adam(tmp_path, caplog):
    model = SparseModel(with_dense=False)
    twin = copy.deepcopy(model)
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.05)
    twin_opt = torch.optim.SparseAdam(twin.parameters(), lr=0.05)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {
        "weight_grad": {"enabled": True}, "optimizer": {"enabled": True}, "param": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    _train(model, opt, mon)
    grads = []
    _train(twin, twin_opt, capture=grads)
    _check_grads(tmp_path, grads, ["unreduced", "reduced"])
    final = rows_of(tmp_path, "optimizer")
    last = len(BATCHES) - 1
    for state in ("exp_avg", "exp_avg_sq"):
        row = find_row(final, step=last, module_name=f"emb.weight.{state}", scope=state)
        assert_row_matches(row, numpy_stats(twin_opt.state[twin.emb.weight][state]))
    row = find_row(rows_of(tmp_path, "param"), step=last, module_name="emb.weight", scope="param_updated")
    assert_row_matches(row, numpy_stats(twin.emb.weight))
    assert not [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.ERROR]


def test_empty_parameter_has_rows_everywhere(tmp_path):
    model = SparseModel()
    model.emb.sparse = False  # Adam takes dense gradients
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {
        "weight_grad": {"enabled": True}, "optimizer": {"enabled": True}, "param": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    _train(model, opt, mon)
    expected = {
        "weight_grad": [("empty", "unreduced"), ("empty", "reduced")],
        "optimizer": [("empty.exp_avg", "exp_avg"), ("empty.exp_avg_sq", "exp_avg_sq")],
        "param": [("empty", "param_origin"), ("empty", "param_updated")],
    }
    for monitor, keys in expected.items():
        rows = rows_of(tmp_path, monitor)
        for step in range(len(BATCHES)):
            for name, scope in keys:
                row = find_row(rows, step=step, module_name=name, scope=scope)
                assert {op: row[op] for op in EMPTY_ROW} == EMPTY_ROW, (monitor, row)
        # every parameter has the same number of rows in each monitor
        per_param = {}
        for r in rows:
            base = r["module_name"].split(".exp_avg")[0]
            per_param[base] = per_param.get(base, 0) + 1
        assert len(set(per_param.values())) == 1, (monitor, per_param)


def test_a_failing_site_logs_one_short_line(caplog):
    """A real PyTorch dispatch error (its message lists every backend: kilobytes)."""
    errors = ContainedErrors()
    sparse = torch.zeros(4).to_sparse()
    with pytest.raises(NotImplementedError) as info:
        torch.aminmax(sparse)
    assert len(str(info.value)) > 2000
    hook = errors.wrap("weight_grad unreduced hook", lambda: torch.aminmax(sparse))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        hook()
        hook()
    logged = [r for r in caplog.records if r.name == LOGGER]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR
    text = logged[0].getMessage()
    assert len(text) < 700 and "\n" not in text
    assert "NotImplementedError" in text and "aminmax" in text and "weight_grad unreduced hook" in text
    assert logged[0].exc_info is None  # the traceback is at DEBUG
    assert errors.count == 2
    assert math.isfinite(errors.busy)
