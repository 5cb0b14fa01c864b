"""``layout.json``'s ``dtypes``: under bf16 autocast (test_module's tiny GPT, AdamW) the
module rows of autocast's bf16 ops are ``bfloat16``, those of fp32 ops (LayerNorm,
softmax's callers) ``float32``, and the parameters ``float32``; checked against the
dtypes an unmonitored copy of the model shows its own forward hooks, and every row the
CSV files hold has its dtype."""

import json

import pytest
import torch

from support import rows_of
from test_module import TinyGPT, make_data

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

ROOT = "TinyGPT"


def _reference_dtypes(data):
    """``{row name: dtype}`` of every module's single-tensor first input and output, seen
    by plain forward hooks on an unmonitored model under the same autocast."""
    model = TinyGPT(ckpt=None, inplace=False)
    seen = {}

    def hook(name):
        def forward_hook(module, args, output):
            tag = name or ROOT
            if args and isinstance(args[0], torch.Tensor):
                seen.setdefault(f"{tag}.input.0", str(args[0].dtype).replace("torch.", ""))
            if isinstance(output, torch.Tensor):
                seen.setdefault(f"{tag}.output.0", str(output.dtype).replace("torch.", ""))
        return forward_hook

    for name, module in model.named_modules():
        module.register_forward_hook(hook(name))
    idx, tgt = data[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, targets=tgt)
    return seen


@pytest.mark.parametrize("async_write", [None, False], ids=["writer-thread", "sync"])
def test_dtypes_under_bf16_autocast(write_config, tmp_path, async_write):
    cfg = {"monitors": {"module": {"enabled": True}, "weight_grad": {"enabled": True},
                        "param": {"enabled": True}, "optimizer": {"enabled": True}}}
    if async_write is not None:
        cfg["async_write"] = async_write
    mon = TrainerMonitorV2(write_config(cfg))
    model = TinyGPT(ckpt=None, inplace=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon.start(model=model, optimizer=opt)
    data = make_data(3)
    for idx, tgt in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, targets=tgt).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    out = tmp_path / "out"
    doc = json.loads((out / "rank_0" / "layout.json").read_text())
    dtypes = doc["dtypes"]
    # parameters: fp32 under autocast, named as their rows
    params = {n for n, _ in model.named_parameters()}
    assert params - {"head.lm_head.weight"} <= set(dtypes)  # the tied weight is one parameter
    assert all(dtypes[n] == "float32" for n in params if n in dtypes)
    for monitor in ("weight_grad", "param"):
        assert {r["module_name"] for r in rows_of(out, monitor)} <= set(dtypes)
    # module rows: every row written has its dtype
    module_rows = {r["module_name"] for r in rows_of(out, "module")}
    assert module_rows and module_rows <= set(dtypes), sorted(module_rows - set(dtypes))[:5]
    # against the dtypes the unmonitored model's own hooks see
    reference = _reference_dtypes(data)
    checked = 0
    for name, dtype in reference.items():
        if name in module_rows:
            assert dtypes[name] == dtype, (name, dtypes[name], dtype)
            checked += 1
    assert checked > 20
    # autocast's bf16 and fp32 ops both present, their gradients in the same dtype
    assert dtypes["blocks.0.mlp.fc.output.0"] == dtypes["blocks.0.mlp.fc.grad_output.0"] == "bfloat16"
    assert dtypes["blocks.0.ln1.output.0"] == dtypes["blocks.0.ln1.grad_output.0"] == "float32"
    assert dtypes["blocks.0.mlp.fc.input.0"] == "float32"  # LayerNorm's output, cast inside the Linear
    assert dtypes["blocks.0.mlp.fc.grad_input.0"] == "float32"  # the gradient of that fp32 input


def test_dtypes_without_autocast_and_without_module_monitor(write_config, tmp_path):
    """fp32 and a bf16 parameter; no module monitor: the parameters' dtypes only."""
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 4), "b": torch.nn.Linear(4, 1).to(torch.bfloat16)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.start(model=model, optimizer=opt)
    for _ in range(2):
        (model["a"](torch.ones(2, 3)).sum() + model["b"](torch.ones(2, 4, dtype=torch.bfloat16)).float().sum()).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    doc = json.loads((tmp_path / "out" / "rank_0" / "layout.json").read_text())
    assert doc["dtypes"] == {"a.weight": "float32", "a.bias": "float32",
                             "b.weight": "bfloat16", "b.bias": "bfloat16"}
