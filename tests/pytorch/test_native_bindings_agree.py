"""A real training written three ways: with the kernel's CPython extension (C records,
merging and row formatting), with its ctypes binding (Python records, merging and
formatting), and without the kernel (ATen). The first two write the same bytes; the
third the same rows to fp32 rounding, checked against NumPy on the real gradients."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from msprobe.core.monitor_v2 import native

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")

TRAIN = r"""
import json, sys, torch
from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(inplace=True), torch.nn.LayerNorm(16),
                            torch.nn.Linear(16, 3))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
monitors = {"module": {"enabled": True, "targets": []}, "weight_grad": {"enabled": True},
            "optimizer": {"enabled": True}, "param": {"enabled": True}}
mon = TrainerMonitorV2({"output_dir": sys.argv[1], "monitors": monitors})
mon.start(model=model, optimizer=opt)
g = torch.Generator().manual_seed(1)
grads = {}
for step in range(3):
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if step == 2:
        grads = {n: p.grad.double().numpy().tolist() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
mon.stop()
k = native.load()
print(json.dumps({"kernel": None if k is None else ("extension" if k.ext is not None else "ctypes"),
                  "grads": grads}))
"""


def _train(tmp_path, name: str, switch: str):
    out = tmp_path / name
    env = {**os.environ, "PYTHONPATH": SRC, native.ENV_SWITCH: switch}
    res = subprocess.run([sys.executable, "-c", TRAIN, str(out)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    files = {p.name: p.read_bytes() for p in sorted((out / "rank_0").glob("*.csv"))}
    return json.loads(res.stdout.splitlines()[-1]), files


def test_the_extension_and_the_ctypes_binding_write_the_same_bytes_and_aten_the_same_rows(tmp_path):
    ext_info, ext_files = _train(tmp_path, "extension", "1")
    ctypes_info, ctypes_files = _train(tmp_path, "ctypes", "ctypes")
    aten_info, aten_files = _train(tmp_path, "aten", "0")
    assert (ext_info["kernel"], ctypes_info["kernel"], aten_info["kernel"]) == ("extension", "ctypes", None)
    assert sorted(ext_files) == sorted(ctypes_files) == sorted(aten_files)
    assert {n[:n.index("_")] for n in ext_files} >= {"module", "weight", "optimizer", "param"}
    for name in ext_files:
        assert ext_files[name] == ctypes_files[name], name
    # ATen: the same rows, values to fp32 rounding
    for name in ext_files:
        ext_rows = list(csv.reader(ext_files[name].decode().splitlines()))
        aten_rows = list(csv.reader(aten_files[name].decode().splitlines()))
        assert [r[:4] for r in ext_rows] == [r[:4] for r in aten_rows], name
        for a, b in zip(ext_rows[1:], aten_rows[1:]):
            for x, y in zip(a[4:], b[4:]):
                if x != y:
                    assert float(x) == pytest.approx(float(y), rel=1e-5, abs=1e-7), (name, a[:4], x, y)
    # and the written gradients are NumPy's on the real ones
    wg = "weight_grad_step2-2.csv"
    rows = {(r["module_name"], r["scope"], r["step"]): r for r in csv.DictReader(ext_files[wg].decode().splitlines())}
    for param, grad in ext_info["grads"].items():
        g = np.asarray(grad)
        row = rows[(param, "reduced", "2")]
        assert float(row["norm"]) == pytest.approx(float(np.linalg.norm(g)), rel=1e-6)
        assert float(row["max"]) == pytest.approx(float(g.max()), rel=1e-6)
        assert float(row["min"]) == pytest.approx(float(g.min()), rel=1e-6)
