"""``summary``/``anomalies`` find what goes wrong with MoE routers, on real runs of tiny
transformers 5.x models: an injected dead expert (a router bias or DeepSeek-V3's
``e_score_correction_bias`` that keeps one expert from ever winning), an injected routing
collapse (one expert's bias so large that every token's distribution is on it), and a
healthy run that says nothing. Findings name the router and make ``anomalies`` exit 1;
their numbers are checked against the CSV rows read with the csv module (MaxVio, CV)."""

import csv
import io
import json
import math
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from support.extras import require
from msprobe.core.monitor_v2.analysis.cli import main
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

transformers = require("transformers", "the MoE findings are tested on runs of transformers 5.x MoE models")

VOCAB = 64


def gpt_oss(experts: int = 8) -> torch.nn.Module:
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=128,
                                    layer_types=["full_attention"] * 2)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.weight.normal_(0, 0.2)
    return model


def train(model: torch.nn.Module, out, steps: int = 4, tokens: int = 64) -> None:
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"moe": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (2, tokens // 2))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert mon.errors.count == 0


def anomalies(out, *flags: str) -> Dict[str, Any]:
    stdout, stderr = io.StringIO(), io.StringIO()
    code = main(["anomalies", str(out), "--json", *flags], out=stdout, err=stderr)
    doc = json.loads(stdout.getvalue())
    assert doc["exit_code"] == code
    return doc


def counts_rows(out) -> List[Dict[str, str]]:
    rows: List[Dict[str, str]] = []
    for path in sorted((out / "rank_0").glob("moe_step*.csv")):
        with open(path, newline="") as f:
            rows += [r for r in csv.DictReader(f) if r["module_name"].endswith(".tokens_per_expert")]
    return rows


def test_injected_dead_expert_and_collapse_found(tmp_path):
    model = gpt_oss()
    with torch.no_grad():
        model.model.layers[0].mlp.router.bias[3] = -1e4  # expert 3 of layer 0 never wins
        model.model.layers[1].mlp.router.bias[0] = 1e4  # every token's distribution on expert 0 of layer 1
    train(model, tmp_path / "out")
    doc = anomalies(tmp_path / "out")
    assert doc["exit_code"] == 1 and doc["anomalies_found"]
    items = doc["moe"]["items"]
    by = {(i["kind"], i["router"]) for i in items}
    assert ("dead experts", "model.layers.0.mlp.router") in by
    assert ("routing collapse", "model.layers.1.mlp.router") in by
    assert ("load imbalance", "model.layers.1.mlp.router") in by
    assert not any(i["router"] == "model.layers.0.mlp.router" and i["kind"] != "dead experts" for i in items)
    dead = next(i for i in items if i["kind"] == "dead experts")
    assert dead["step"] == 0 and dead["steps"] == 4 and dead["value"] == 1
    # the numbers the findings give, from the rows read with the csv module
    rows = counts_rows(tmp_path / "out")
    layer1 = [r for r in rows if r["module_name"] == "model.layers.1.mlp.router.tokens_per_expert"]
    first = layer1[0]
    mean, mx, norm = float(first["mean"]), float(first["max"]), float(first["norm"])
    assert mx == 64.0 and mean * 8 == 128.0  # every token picked expert 0; 64 tokens x top-2
    imbalance = next(i for i in items if i["kind"] == "load imbalance")
    assert math.isclose(imbalance["value"], mx / mean - 1, rel_tol=1e-6)
    cv = math.sqrt(max(norm * norm / 8 - mean * mean, 0)) / mean
    assert f"CV {cv:.3g}" in imbalance["detail"]
    text = io.StringIO()
    assert main(["summary", str(tmp_path / "out")], out=text, err=io.StringIO()) == 0
    assert "moe routing:" in text.getvalue() and "model.layers.0.mlp.router" in text.getvalue()


def test_deepseek_v3_correction_bias_dead_expert(tmp_path):
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=2, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=128)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        gate.weight.normal_(0, 0.2)
        gate.e_score_correction_bias[5] = -1e4
    train(model, tmp_path / "out", steps=3)
    items = anomalies(tmp_path / "out")["moe"]["items"]
    dead = [i for i in items if i["kind"] == "dead experts"]
    assert [(i["router"], i["value"], i["steps"]) for i in dead] == [("model.layers.1.mlp.gate", 1, 3)]
    # --moe-steps: one more written step than the run has, nothing
    assert not [i for i in anomalies(tmp_path / "out", "--moe-steps", "4")["moe"]["items"]
                if i["kind"] == "dead experts"]


def test_healthy_run_says_nothing(tmp_path):
    train(gpt_oss(), tmp_path / "out", tokens=128)
    doc = anomalies(tmp_path / "out")
    assert doc["moe"]["items"] == [] and doc["exit_code"] == 0
    text = io.StringIO()
    main(["summary", str(tmp_path / "out")], out=text, err=io.StringIO())
    assert "moe routing:       none" in text.getvalue()


def test_near_duplicate_experts_and_logit_growth(tmp_path):
    model = gpt_oss()
    router = model.model.layers[0].mlp.router
    with torch.no_grad():
        router.weight[1] = router.weight[2]  # two experts with the same router row
    train(model, tmp_path / "out", steps=2)
    items = anomalies(tmp_path / "out")["moe"]["items"]
    dup = [i for i in items if i["kind"] == "near-duplicate experts"]
    assert [i["router"] for i in dup] == ["model.layers.0.mlp.router"] and dup[0]["value"] >= 0.99
    # logit growth: the router weight scaled 100x between the steps
    model = gpt_oss()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = tmp_path / "grow"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"moe": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    for step in range(2):
        x = torch.randint(0, VOCAB, (2, 32))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.router.weight.mul_(100.0)
    mon.stop()
    grown = [i for i in anomalies(out)["moe"]["items"] if i["kind"] == "logit growth"]
    assert {i["router"] for i in grown} == {"model.layers.0.mlp.router", "model.layers.1.mlp.router"}


def test_plot_draws_the_heat_maps(tmp_path):
    require("matplotlib", "plot draws the MoE heat maps with matplotlib")
    model = gpt_oss()
    with torch.no_grad():
        model.model.layers[0].mlp.router.bias[3] = -1e4
    train(model, tmp_path / "out", steps=2)
    report = tmp_path / "report"
    assert main(["plot", str(tmp_path / "out"), "--out", str(report)], out=io.StringIO(), err=io.StringIO()) == 0
    assert (report / "report.html").is_file()
    maps = sorted(p.name for p in report.glob("*_moe_heat_*.png"))
    assert [m.split("_moe_heat_")[1] for m in maps] == ["maxvio.png", "dead.png"]  # numbered in that order
    html = (report / "report.html").read_text()
    assert all(m in html for m in maps) and "MoE routing" in html
    from msprobe.core.monitor_v2.analysis.moe import heat_maps
    from msprobe.core.monitor_v2.analysis.reader import Problems, scan

    routers, steps, vio, dead = heat_maps(scan(str(tmp_path / "out")), 0, Problems())
    rows = counts_rows(tmp_path / "out")
    assert routers == ["model.layers.0.mlp.router", "model.layers.1.mlp.router"] and steps == [0, 1]
    for i, router in enumerate(routers):
        for j, step in enumerate(steps):
            row = next(r for r in rows if r["module_name"] == f"{router}.tokens_per_expert" and r["step"] == str(step))
            assert math.isclose(vio[i][j], float(row["max"]) / float(row["mean"]) - 1, rel_tol=1e-9)
            assert dead[i][j] == float(row["zeros"])
    assert dead[0] == [1.0, 1.0]


def test_experts_without_gradient_from_expert_norms_rows(tmp_path):
    """The dead-expert finding without a router: ``<param>.expert_norms`` rows of a gradient
    scope (the per-expert L2 norms of a grouped expert weight's gradient, written by
    ``weight_grad``) whose ``zeros`` stay > 0. The file is written here in the writer's
    layout; its rows' meaning is the contract with the per-expert rows of issue 49 item 3."""
    from msprobe.core.monitor_v2 import rows as rows_mod

    rank = tmp_path / "out" / "rank_0"
    rank.mkdir(parents=True)
    header = rows_mod.header(rows_mod.ALL_OPS, True)
    lines = [",".join(header)]
    for step in range(4):
        zeros = 1 if step >= 1 else 0  # expert 2 of 4 gets no gradient from step 1 on
        lines.append(f"0,{step},layers.0.mlp.experts.down_proj.expert_norms,reduced,1,0.0,0.5,1.2,2.0,0,{zeros}")
        lines.append(f"0,{step},layers.0.mlp.experts.down_proj,reduced,1,-0.1,0.1,0.0,2.0,0,0")
    (rank / "weight_grad_step0-3.csv").write_text("\n".join(lines) + "\n")
    # read only where layout.json says the model has grouped experts (a 3-D parameter)
    assert "moe" not in anomalies(tmp_path / "out")
    (rank / "layout.json").write_text(json.dumps({"format": "msprobe-monitor-layout", "version": 1, "params": {
        "layers.0.mlp.experts.down_proj": {"shape": [4, 8, 16], "pieces": "unknown"}}}))
    items = anomalies(tmp_path / "out")["moe"]["items"]
    assert [(i["kind"], i["router"], i["step"], i["steps"], i["value"]) for i in items] == [
        ("experts without gradient", "layers.0.mlp.experts.down_proj", 1, 3, 1)]
    assert anomalies(tmp_path / "out", "--moe-steps", "4")["moe"]["items"] == []


def test_grouped_experts_side_by_side(tmp_path):
    """A grouped expert tensor's ``<param>.expert.<e>`` gradient rows (``"per_expert": true``)
    grouped by expert index: ``anomalies`` names each layer's quietest and loudest expert of
    the last step, equal to NumPy over the gradients this test copied before the update."""
    model = gpt_oss()
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": {
        "moe": {"enabled": True}, "module": {"enabled": False},
        "weight_grad": {"enabled": True, "per_expert": True}}})
    mon.start(model=model, optimizer=opt)
    grouped = {n: p for n, p in model.named_parameters() if p.dim() == 3 and ".experts." in n}
    assert len(grouped) == 4
    last = {}
    for _ in range(2):
        x = torch.randint(0, VOCAB, (2, 32))
        model(input_ids=x, labels=x).loss.backward()
        last = {n: p.grad.detach().double().numpy().copy() for n, p in grouped.items()}
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert mon.errors.count == 0
    items = anomalies(tmp_path / "out")["experts"]["items"]
    assert {i["group"] for i in items} == {f"{n}.expert.<e>" for n in grouped}
    for item in items:
        grad = last[item["group"][: -len(".expert.<e>")]]
        norms = np.sqrt((grad.reshape(grad.shape[0], -1) ** 2).sum(1))
        assert item["step"] == 1 and item["experts"] == 8
        assert item["quietest"] == int(norms.argmin()) and item["loudest"] == int(norms.argmax())
        assert np.isclose(item["quietest_norm"], norms.min(), rtol=1e-5)
        assert np.isclose(item["loudest_norm"], norms.max(), rtol=1e-5)
