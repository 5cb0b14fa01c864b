"""The ``moe`` monitor on real transformers 5.x MoE models built from tiny configs (no
download): Mixtral, Qwen3-MoE (softmax routers), DeepSeek-V3 (sigmoid, group-limited, shared
experts) and GPT-OSS (router with a bias). Every row is checked against NumPy over the router
outputs and weights the test captures itself (a forward hook of its own, copies); training is
bit-identical with and without the monitor; two micro-batches per step are one row;
recomputed forwards (gradient checkpointing) are not counted; evaluation passes are kept
apart; no op that reads a value back (``item``, ``nonzero``, ``bincount``) is added by the
monitor under the accelerator seam."""

import copy
import csv
import io
import json
import logging
import math
from collections import Counter
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch

from support import rows_of
from support.extras import require
from support.modes import OpRecorder, SeenByTheEngine
from msprobe.core.monitor_v2.frameworks.pytorch.stats import ACCEL_ON_CPU_ENV
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

transformers = require("transformers", "the moe monitor is tested on transformers 5.x MoE models built from config")

VOCAB = 64
MICRO = 2  # micro-batches per step


def mixtral():
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.MixtralForCausalLM(cfg), "model.layers.{}.mlp.gate", [0, 1], "softmax"


def qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                      num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=64)
    return transformers.Qwen3MoeForCausalLM(cfg), "model.layers.{}.mlp.gate", [0, 1], "softmax"


def deepseek_v3():
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # its router weight starts at zeros: rows that say something
        model.model.layers[1].mlp.gate.weight.normal_(0, 0.2)
    return model, "model.layers.{}.mlp.gate", [1], "sigmoid"


def gpt_oss():
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
                                    num_experts_per_tok=2, max_position_embeddings=64,
                                    layer_types=["full_attention"] * 2)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.weight.normal_(0, 0.2)
    return model, "model.layers.{}.mlp.router", [0, 1], "softmax"


MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3, "gpt_oss": gpt_oss}


def batches(steps: int, seed: int = 1, tokens: int = 16) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, tokens // 2), generator=g) for _ in range(steps * MICRO)]


class Capture:
    """The test's own view of each router: its outputs in training forwards (copies), and
    its weight as each step starts."""

    def __init__(self, model: torch.nn.Module, names: List[str]) -> None:
        self.modules = {n: model.get_submodule(n) for n in names}
        self.calls: Dict[str, List[Tuple[np.ndarray, np.ndarray]]] = {n: [] for n in names}
        self.weights: Dict[str, np.ndarray] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module, args, output):
            if torch._C._current_autograd_node() is not None:
                return  # recomputation
            logits, _, indices = output
            self.calls[name].append((logits.detach().double().numpy().copy(), indices.detach().numpy().copy()))
        return hook

    def start_step(self) -> None:
        for n in self.calls:
            self.calls[n] = []
        self.weights = {n: m.weight.detach().double().numpy().copy() for n, m in self.modules.items()}

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def run(model: torch.nn.Module, data: List[torch.Tensor], config: Any = None, capture: Capture = None,
        checkpointing: bool = False):
    """Train ``len(data) / MICRO`` steps; with ``capture``, the NumPy expectation of each step."""
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = None
    if config is not None:
        mon = TrainerMonitorV2(config)
        mon.start(model=model, optimizer=opt)
    losses, expected = [], []
    for step in range(len(data) // MICRO):
        if capture is not None:
            capture.start_step()
        for i in range(MICRO):
            x = data[step * MICRO + i]
            loss = model(input_ids=x, labels=x).loss / MICRO
            loss.backward()
            losses.append(loss.detach().clone())
        if capture is not None:
            expected.append({n: (list(capture.calls[n]), capture.weights[n]) for n in capture.calls})
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.stop()
    return mon, losses, expected


def stats(a: np.ndarray) -> Dict[str, float]:
    a = np.asarray(a, dtype=np.float64).ravel()
    return {"min": a.min(), "max": a.max(), "mean": a.mean(), "norm": math.sqrt((a * a).sum()),
            "nans": int(np.isnan(a).sum()), "zeros": int((a == 0).sum())}


def expected_rows(calls: List[Tuple[np.ndarray, np.ndarray]], weight: np.ndarray, experts: int,
                  score: str) -> Dict[str, Dict[str, float]]:
    logits = np.concatenate([c[0].reshape(-1, experts) for c in calls])
    indices = np.concatenate([c[1].reshape(-1) for c in calls])
    if score == "sigmoid":
        s = 1 / (1 + np.exp(-logits))
        p = s / s.sum(-1, keepdims=True)
    else:
        e = np.exp(logits - logits.max(-1, keepdims=True))
        p = e / e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(p > 0, p * np.log(p), 0).sum(-1)
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True))).ravel()
    unit = weight / np.linalg.norm(weight, axis=1, keepdims=True)
    cos = (unit @ unit.T)[np.triu_indices(experts, 1)]
    return {"tokens_per_expert": stats(np.bincount(indices, minlength=experts)), "token_entropy": stats(entropy),
            "logits": stats(logits), "lse": stats(lse), "weight_cosine": stats(cos)}


def check(row: Dict[str, str], want: Dict[str, float], what: str, rtol: float = 2e-5) -> None:
    for op, value in want.items():
        got = float(row[op])
        if op in ("nans", "zeros"):
            if what.endswith("tokens_per_expert") or op == "nans":
                assert got == value, f"{what} {op}: {got} != {value}"
            continue
        assert math.isclose(got, value, rel_tol=rtol, abs_tol=2e-6), f"{what} {op}: {got} != {value}"


def config(out, **moe) -> Dict[str, Any]:
    return {"output_dir": str(out), "monitors": {"moe": {"enabled": True, **moe}}}


@pytest.mark.parametrize("name", list(MODELS))
def test_rows_against_numpy_and_training_bit_identical(tmp_path, name):
    torch.manual_seed(0)
    model, pattern, layers, score = MODELS[name]()
    twin = copy.deepcopy(model)
    routers = [pattern.format(i) for i in layers]
    data = batches(3)
    capture = Capture(model, routers)
    mon, losses, expected = run(model, data, config(tmp_path / "out", per_expert=True), capture)
    capture.close()
    _, losses_off, _ = run(twin, data)
    assert mon.errors.count == 0
    assert all(torch.equal(a, b) for a, b in zip(losses, losses_off))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))

    got = rows_of(tmp_path / "out", "moe")
    assert {r["scope"] for r in got} == {"routing", "router_weight"}
    layout = json.loads((tmp_path / "out" / "rank_0" / "layout.json").read_text())["moe"]
    experts = model.get_submodule(routers[0]).weight.shape[0]
    for router in routers:
        assert layout[router] == {"num_experts": experts, "top_k": 2, "score": score,
                                  "experts": router.rpartition(".")[0] + ".experts"}
    counts = list(csv.DictReader(open(next((tmp_path / "out" / "rank_0").glob("moe_counts_step1-*.csv")))))
    for step, per_router in enumerate(expected):
        for router, (calls, weight) in per_router.items():
            assert len(calls) == MICRO  # one row below holds both micro-batches
            want = expected_rows(calls, weight, experts, score)
            for kind, values in want.items():
                rows = [r for r in got if r["step"] == str(step) and r["module_name"] == f"{router}.{kind}"]
                assert len(rows) == 1, (router, kind, step)
                check(rows[0], values, f"{name} step {step} {router}.{kind}")
            indices = np.concatenate([c[1].reshape(-1) for c in calls])
            if step == 1:
                row = next(r for r in counts if r["module_name"] == f"{router}.tokens_per_expert")
                assert [int(c) for c in row["counts"].split(";")] == np.bincount(indices, minlength=experts).tolist()


def ops_seen_by_a_mode(model: torch.nn.Module, data: List[torch.Tensor], config: Any = None) -> List[List[str]]:
    """The ATen ops a user's dispatch mode entered around each whole step (forward,
    backward, the optimizer's step) saw, with the monitor of ``config`` or without one."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = TrainerMonitorV2(config) if config is not None else None
    if mon is not None:
        mon.start(model=model, optimizer=opt)
    seen = []
    for step in range(len(data) // MICRO):
        with OpRecorder() as mode:
            for x in data[step * MICRO:(step + 1) * MICRO]:
                (model(input_ids=x, labels=x).loss / MICRO).backward()
            opt.step()
            opt.zero_grad()
        seen.append(mode.ops)
    if mon is not None:
        mon.stop()
        assert mon.errors.count == 0
    return seen


def test_a_dispatch_mode_around_training_sees_nothing_of_the_moe_and_expert_reads(tmp_path):
    """The routers' counts, entropy and cosines, and the grouped experts' per-expert reads
    (weight_grad, param, optimizer), run outside the training's dispatch modes."""
    torch.manual_seed(0)
    model, pattern, layers, _ = qwen3_moe()
    twin = copy.deepcopy(model)
    data = batches(2)
    on = {"enabled": True}
    cfg = {"output_dir": str(tmp_path / "out"),
           "monitors": {"moe": on, "weight_grad": on, "param": on, "optimizer": on}}
    watched = ops_seen_by_a_mode(model, data, cfg)
    plain = ops_seen_by_a_mode(twin, data)
    assert plain and plain[0]
    for step, (a, b) in enumerate(zip(plain, watched)):
        assert b == a, (step, sorted((Counter(b) - Counter(a)).items())[:10])
    # the monitors did read: routing rows and per-expert rows of every step
    assert {r["step"] for r in rows_of(tmp_path / "out", "moe")} == {"0", "1"}
    assert any(r["module_name"].endswith(".expert_norms") for r in rows_of(tmp_path / "out", "weight_grad"))


def test_recomputed_forwards_are_not_counted(tmp_path):
    """Gradient checkpointing runs each layer's forward again in the backward pass: the
    counts are the same as without it."""
    torch.manual_seed(0)
    model, pattern, _, _ = mixtral()
    twin = copy.deepcopy(model)
    data = batches(1)
    run(model, data, config(tmp_path / "plain"))
    run(twin, data, config(tmp_path / "ckpt"), checkpointing=True)
    plain = {r["module_name"]: r for r in rows_of(tmp_path / "plain", "moe") if r["scope"] == "routing"}
    ckpt = {r["module_name"]: r for r in rows_of(tmp_path / "ckpt", "moe") if r["scope"] == "routing"}
    assert plain.keys() == ckpt.keys() and plain
    for name, row in plain.items():
        assert row["mean"] == ckpt[name]["mean"] and row["norm"] == ckpt[name]["norm"], name


@pytest.mark.parametrize("eval_routing", [False, True])
def test_evaluation_passes_apart(tmp_path, eval_routing):
    torch.manual_seed(0)
    model, pattern, _, _ = mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMonitorV2(config(tmp_path / "out", eval_routing=eval_routing))
    mon.start(model=model, optimizer=opt)
    x = batches(1, tokens=16)[0]
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.cat([x, x], 1))  # 32 tokens: twice the training pass's
    model.train()
    opt.step()
    mon.stop()
    got = rows_of(tmp_path / "out", "moe")
    train = [r for r in got if r["scope"] == "routing" and r["module_name"].endswith("tokens_per_expert")]
    assert [float(r["mean"]) * 4 / 2 for r in train] == [16.0, 16.0]  # E * mean / k = tokens
    evaluation = [r for r in got if r["scope"] == "eval_routing" and r["module_name"].endswith("tokens_per_expert")]
    assert [float(r["mean"]) * 4 / 2 for r in evaluation] == ([32.0, 32.0] if eval_routing else [])


def test_routers_from_config_regexes_and_the_name_rule(tmp_path, caplog):
    """A plain Linear gate (transformers 4.x style) found by the name rule counts with the
    configured top_k; a regex selects routers by name and nothing else."""

    class Gated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 4, bias=False)
            self.out = torch.nn.Linear(8, 8)

        def forward(self, x):
            w = torch.softmax(self.gate(x), -1)
            return self.out(x * w.sum(-1, keepdim=True))

    torch.manual_seed(0)
    model = torch.nn.Sequential(Gated(), Gated())
    seen = []
    model[1].gate.register_forward_hook(lambda m, a, o: seen.append(o.detach().double().numpy().copy()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"),
                            "monitors": {"moe": {"enabled": True, "routers": [r"^1\.gate$"], "top_k": 2}}})
    mon.start(model=model, optimizer=opt)
    model(torch.rand(10, 8)).sum().backward()
    opt.step()
    mon.stop()
    got = {r["module_name"]: r for r in rows_of(tmp_path / "out", "moe")}
    assert {n.rpartition(".")[0] for n in got} == {"1.gate"}
    top = np.argsort(-seen[0], axis=-1)[:, :2].ravel()
    check(got["1.gate.tokens_per_expert"], stats(np.bincount(top, minlength=4)), "tokens_per_expert")
    check(got["1.gate.logits"], stats(seen[0]), "logits")


def test_no_value_read_back_in_hooks_under_the_accelerator_seam(tmp_path, monkeypatch):
    """Under the seam (CPU tensors take the accelerator path) the monitor adds no op that
    reads a value back to the host or sizes its output by the values: the same counts of
    such ops with and without it (the model's own experts use some)."""
    monkeypatch.setenv(ACCEL_ON_CPU_ENV, "1")
    syncing = {"_local_scalar_dense", "nonzero", "bincount", "unique", "_unique2", "masked_select", "is_nonzero",
               "equal"}

    class Reads(SeenByTheEngine):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in syncing:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    def train(model, cfg):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = None
        if cfg is not None:
            mon = TrainerMonitorV2(cfg)
            mon.start(model=model, optimizer=opt)
            mon.engine_used = mon._session.engine
        reads = Reads()
        for x in batches(2):
            with reads:
                model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        if mon is not None:
            mon.stop()
        return reads.ops, mon

    torch.manual_seed(0)
    model, *_ = gpt_oss()
    twin = copy.deepcopy(model)
    with_monitor, mon = train(model, config(tmp_path / "out"))
    without, _ = train(twin, None)
    assert mon.errors.count == 0 and mon.engine_used._accel_on_cpu
    assert with_monitor == without
    assert any(r["module_name"].endswith("tokens_per_expert") for r in rows_of(tmp_path / "out", "moe"))


def test_a_router_without_observable_logits_is_said_once(tmp_path, caplog):
    """An index-only router (a routing function that returns expert ids): counted, and its
    missing logits said once at WARNING."""

    class IdsRouter(torch.nn.Module):
        num_experts = 4

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, x):
            return torch.topk(torch.nn.functional.linear(x, self.weight).softmax(-1), 2, dim=-1).indices

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = IdsRouter()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            self.router(x)
            return self.lin(x)

    model = Block()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(config(tmp_path / "out"))
    mon.start(model=model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        for _ in range(2):
            model(torch.rand(6, 8)).sum().backward()
            opt.step()
    mon.stop()
    said = [r for r in caplog.records if "not observable" in r.getMessage()]
    assert len(said) == 1 and "router" in said[0].getMessage()
    got = rows_of(tmp_path / "out", "moe")
    kinds = {r["module_name"].rpartition(".")[2] for r in got}
    assert "tokens_per_expert" in kinds and "logits" not in kinds
    assert all(float(r["mean"]) == 3.0 for r in got if r["module_name"].endswith("tokens_per_expert"))


def test_structure_lists_routers_and_dashboard_keys(tmp_path):
    """structure.txt and ``struct`` name the routers found; the dashboards' per-router
    MaxVio, CV and dead-expert keys agree with the raw counts (the sidecar, NumPy)."""
    from msprobe.core.monitor_v2.analysis.cli import main
    from msprobe.core.monitor_v2.config import load_config
    from msprobe.core.monitor_v2.sinks import Aggregates
    from msprobe.core.monitor_v2.stats import Row, Stat

    torch.manual_seed(0)
    model, pattern, layers, _ = qwen3_moe()
    out = tmp_path / "out"
    cfg = config(out, per_expert=True)
    cfg["structure"] = True
    run(model, batches(1), cfg)
    text = (out / "rank_0" / "structure.txt").read_text()
    routers = [pattern.format(i) for i in layers]
    noted = [line.split("\t")[1] for line in text.splitlines() if "moe router" in line]
    assert noted == routers
    printed = io.StringIO()
    assert main(["struct", str(out)], out=printed, err=io.StringIO()) == 0
    assert "MOE ROUTERS" in printed.getvalue() and all(r in printed.getvalue() for r in routers)

    settings = load_config({"sinks": {"tensorboard": {"enabled": True}}, "monitors": {"moe": {"enabled": True}}})
    merged = []
    for r in rows_of(out, "moe"):
        n = 8 if r["module_name"].endswith("tokens_per_expert") else 1
        mean, norm = float(r["mean"]), float(r["norm"])
        merged.append(Row(0, 0, r["module_name"], r["scope"], None,
                          Stat(n, float(r["min"]), float(r["max"]), mean * n, norm * norm, 0, int(r["zeros"]))))
    keys = Aggregates(settings.sinks, {"moe": settings.monitors["moe"].ops}).metrics(0, [("moe", merged)])
    with open(next((out / "rank_0").glob("moe_counts_*.csv")), newline="") as f:
        for row in csv.DictReader(f):
            c = np.array([int(v) for v in row["counts"].split(";")], dtype=np.float64)
            router = row["module_name"].rpartition(".")[0]
            assert math.isclose(keys[f"moe/routing/{router}/maxvio"], c.max() / c.mean() - 1, rel_tol=1e-6)
            assert math.isclose(keys[f"moe/routing/{router}/cv"], c.std() / c.mean(), rel_tol=1e-5)
            assert keys[f"moe/routing/{router}/dead_experts"] == float((c == 0).sum())


def test_routing_map_and_count_vector_signatures(tmp_path, caplog):
    """The name rule's other signatures: a router returning a bool ``[T, E]`` routing map
    (Megatron-Core's ``TopKRouter``: probabilities and the map, its logits computed by a
    function: not observable, said once) and a gate returning a ready ``[E]`` count vector
    (DeepSpeed's ``TopKGate``: ``(l_aux, combine, dispatch, exp_counts)``, logits from its
    ``wg`` Linear)."""
    E, C = 4, 3

    class MapRouter(torch.nn.Module):
        topk = 2

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(E, 8))

        def forward(self, x):
            logits = torch.nn.functional.linear(x, self.weight)
            top = torch.topk(logits, 2, dim=-1).indices
            routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
            return logits.softmax(-1) * routing_map, routing_map

    class DsGate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wg = torch.nn.Linear(8, E, bias=False)

        def forward(self, x):
            logits = self.wg(x)
            first = logits.argmax(-1)
            mask = torch.nn.functional.one_hot(first, E)
            dispatch = mask.bool().unsqueeze(-1).expand(-1, E, C)
            return logits.sum() * 0, dispatch.float(), dispatch, mask.sum(0)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = MapRouter()
            self.gate = DsGate()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            probs, _ = self.router(x)
            l_aux = self.gate(x)[0]
            return self.lin(x) * probs.sum(-1, keepdim=True) + l_aux

    torch.manual_seed(0)
    model = Layer()
    maps, gate_logits = [], []
    model.router.register_forward_hook(lambda m, a, o: maps.append(o[1].numpy().copy()))
    model.gate.wg.register_forward_hook(lambda m, a, o: gate_logits.append(o.detach().double().numpy().copy()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(config(tmp_path / "out"))
    mon.start(model=model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        model(torch.rand(10, 8)).sum().backward()
        opt.step()
    mon.stop()
    assert mon.errors.count == 0
    # stop() took every hook of its own off: the test's own are left
    assert [len(m._forward_hooks) for m in (model, model.router, model.gate, model.gate.wg)] == [0, 1, 0, 1]
    assert not model._forward_pre_hooks and not model._forward_hooks_always_called
    got = {r["module_name"]: r for r in rows_of(tmp_path / "out", "moe")}
    check(got["router.tokens_per_expert"], stats(maps[0].sum(0)), "router.tokens_per_expert")
    assert "router.logits" not in got
    assert [r.getMessage() for r in caplog.records if "not observable" in r.getMessage()][0].count("router") >= 1
    check(got["gate.tokens_per_expert"], stats(np.bincount(gate_logits[0].argmax(-1), minlength=E)),
          "gate.tokens_per_expert")
    check(got["gate.logits"], stats(gate_logits[0]), "gate.logits")


def test_a_gate_that_is_no_router_is_left_alone(tmp_path, caplog):
    """A module named like a router (a gated block's ``gate`` Linear) whose output holds no
    expert indices, map or counts, with no top_k known: not a router, said once, no rows."""

    class Gated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 8)
            self.up = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.sigmoid(self.gate(x)) * self.up(x)

    model = torch.nn.Sequential(Gated(), Gated())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(config(tmp_path / "out"))
    mon.start(model=model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        for _ in range(2):
            model(torch.rand(4, 8)).sum().backward()
            opt.step()
    mon.stop()
    said = [r.getMessage() for r in caplog.records if "named like a router" in r.getMessage()]
    assert len(said) == 2 and {s.split(" ")[2] for s in said} == {"0.gate", "1.gate"}
    assert not list((tmp_path / "out" / "rank_0").glob("moe_*.csv"))


def test_fsdp2_router_weight_read_whole_in_its_forward(tmp_path):
    """Under FSDP2 the router weight is a shard between steps and whole inside the forward:
    weight_cosine is read in the router's first call of the step, without a collective, and
    step 0's rows equal an unsharded twin's (checked against NumPy above)."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    store = tempfile.mktemp(dir=tmp_path)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, pattern, _, _ = mixtral()
        twin = copy.deepcopy(model)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert type(model.model.layers[0].mlp.gate.weight).__name__ == "DTensor"
        data = batches(1)
        mon, _, _ = run(model, data, config(tmp_path / "fsdp"))
    finally:
        dist.destroy_process_group()
    run(twin, data, config(tmp_path / "plain"))
    assert mon.errors.count == 0
    sharded = {(r["module_name"], r["scope"]): r for r in rows_of(tmp_path / "fsdp", "moe")}
    plain = {(r["module_name"], r["scope"]): r for r in rows_of(tmp_path / "plain", "moe")}
    assert sharded.keys() == plain.keys() and any(k[0].endswith("weight_cosine") for k in plain)
    for key, row in plain.items():
        for op in ("min", "max", "mean", "norm", "zeros"):
            assert math.isclose(float(sharded[key][op]), float(row[op]), rel_tol=1e-5, abs_tol=1e-6), (key, op)


@pytest.mark.parametrize("field, value, says", [
    ("routers", ["layers.(0"], "must be a regular expression"),
    ("routers", "gate", "must be a list of strings"),
    ("per_expert", "yes", "must be true or false"),
    ("eval_routing", 1, "must be true or false"),
    ("top_k", 0, "must be an integer >= 1"),
    ("score", "tanh", "allowed: softmax, sigmoid"),
    ("expert", True, "unknown field 'monitors.moe.expert'"),
])
def test_bad_moe_config_names_field_value_and_what_is_allowed(field, value, says):
    from msprobe.core.monitor_v2.config import load_config
    from msprobe.core.monitor_v2.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config({"monitors": {"moe": {"enabled": True, field: value}}})
    assert f"monitors.moe.{field}" in str(err.value) and says in str(err.value)
    assert err.value.field.startswith(f"monitors.moe.{field}")


def test_moe_file_always_has_zeros():
    from msprobe.core.monitor_v2.config import load_config

    assert load_config({"monitors": {"moe": {"enabled": True, "ops": ["max", "mean"]}}}).monitors["moe"].ops == (
        "max", "mean", "zeros")
