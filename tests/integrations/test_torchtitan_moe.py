"""The ``moe`` monitor on TorchTitan 0.3.0's own MoE layer (``deepseek_v3`` ``debugmodel``:
``TokenChoiceTopKRouter`` with its ``gate`` Linear, 8 grouped experts, top-3, softmax, shared
experts), run on the CPU as TorchTitan's unit tests run it: the router found by its name,
its logits from ``router.gate``, the counts equal to TorchTitan's own ``tokens_per_expert_E``
buffer and to NumPy over the expert ids the test captures, training bit-identical."""

import copy
import importlib
import math

import numpy as np
import pytest
import torch

from support import rows_of
from support.extras import require

require("torchtitan", "the moe monitor is tested on TorchTitan's own MoE layer")

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


class MoEStack(torch.nn.Module):
    """Two of the debug model's MoE layers, residual: what the test trains."""

    def __init__(self, layers):
        super().__init__()
        self.moes = torch.nn.ModuleList(layers)

    def forward(self, x):
        for moe in self.moes:
            x = x + moe(x)
        return x


def build() -> MoEStack:
    registry = importlib.import_module("torchtitan.models.deepseek_v3.config_registry")
    config = registry.deepseek_v3_debugmodel().model_spec.model
    torch.manual_seed(0)
    model = config.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    return MoEStack([model.layers["1"].moe, model.layers["2"].moe])


def stats(a):
    a = np.asarray(a, dtype=np.float64).ravel()
    return {"min": a.min(), "max": a.max(), "mean": a.mean(), "norm": math.sqrt((a * a).sum())}


def test_torchtitan_router_rows(tmp_path):
    model = build()
    twin = copy.deepcopy(model)
    ids, logits = {}, {}
    for i, moe in enumerate(model.moes):
        moe.router.register_forward_hook(lambda m, a, o, i=i: ids.setdefault(i, []).append(o[1].numpy().copy()))
        moe.router.gate.register_forward_hook(
            lambda m, a, o, i=i: logits.setdefault(i, []).append(o.detach().double().numpy().copy()))
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(2, 16, 256, generator=g) for _ in range(2)]

    def train(m, config=None):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        mon = None
        if config is not None:
            mon = TrainerMonitorV2(config)
            mon.start(model=m, optimizer=opt)
        outs = []
        for x in data:
            for moe in m.moes:
                moe.tokens_per_expert_E.zero_()  # TorchTitan's own counts of this step
            y = m(x)
            y.pow(2).mean().backward()
            outs.append((y.detach().clone(), [moe.tokens_per_expert_E.clone() for moe in m.moes]))
            opt.step()
            opt.zero_grad()
        if mon is not None:
            mon.stop()
        return mon, outs

    out = tmp_path / "out"
    mon, outs = train(model, {"output_dir": str(out), "monitors": {"moe": {"enabled": True}}})
    _, outs_off = train(twin)
    assert mon.errors.count == 0
    assert all(torch.equal(a[0], b[0]) for a, b in zip(outs, outs_off))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    rows = rows_of(out, "moe")
    assert {r["module_name"].rpartition(".")[0] for r in rows} == {"moes.0.router", "moes.1.router"}
    for step, (_, titan_counts) in enumerate(outs):
        for i in range(2):
            got = {r["module_name"].rpartition(".")[2]: r for r in rows
                   if r["step"] == str(step) and r["module_name"].startswith(f"moes.{i}.router.")}
            counts = np.bincount(ids[i][step].ravel(), minlength=8)
            assert counts.tolist() == titan_counts[i].tolist()  # TorchTitan's own buffer
            for op, want in stats(counts).items():
                assert math.isclose(float(got["tokens_per_expert"][op]), want, rel_tol=1e-6), op
            assert int(got["tokens_per_expert"]["zeros"]) == int((counts == 0).sum())
            L = logits[i][step].reshape(-1, 8)
            p = np.exp(L - L.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            for kind, values in (("logits", L), ("token_entropy", -(p * np.log(p)).sum(-1))):
                for op, want in stats(values).items():
                    assert math.isclose(float(got[kind][op]), want, rel_tol=2e-5, abs_tol=1e-6), (kind, op)
    import json
    layout = json.loads((out / "rank_0" / "layout.json").read_text())["moe"]
    assert layout["moes.0.router"] == {"num_experts": 8, "top_k": 3, "score": "softmax",
                                       "experts": "moes.0.routed_experts"}
