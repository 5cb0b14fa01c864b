"""Per-expert statistics of grouped experts (issue 49 item 3, ``experts.py``).

transformers 5.x MoE models built from a config (Qwen3-MoE, Mixtral, GPT-OSS: experts as
3-D parameters under ``mlp.experts``) train a few steps with ``weight_grad``, ``param``
and ``optimizer``; an unmonitored copy trains beside them with the same data and gives
the reference tensors (gradients, parameters before and after the update, Adam's
moments). Every grouped tensor's own row, its ``.expert_norms`` row and (when asked) its
``.expert.<e>`` rows are checked against NumPy on copies of those tensors, on the three
reading paths of the engine (the one-pass C kernel: host records; ATen only: CPU tensor
records; the accelerator path's seam: device records); the training is bit-identical.
A GPT-OSS expert that its router never picks (a large negative router bias) is counted
in ``zeros`` of its gradient's ``expert_norms``."""

import copy
import math

import numpy as np
import pytest
import torch

from support import assert_row_matches, find_row, numpy_stats, rows_of
from support.extras import require
from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.config import load_config
from msprobe.core.monitor_v2.errors import ConfigError
from msprobe.core.monitor_v2.experts import ExpertRule
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

transformers = require("transformers", "the per-expert rows are checked on transformers 5 MoE models built from a config")

OPS = ["min", "max", "mean", "norm", "nans", "zeros"]
VOCAB, SEQ, STEPS = 64, 12, 3
COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=32)


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=32, moe_intermediate_size=8, head_dim=8, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[], **COMMON))
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=8, head_dim=8, num_local_experts=4, num_experts_per_tok=2, **COMMON))
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=8, head_dim=8,
        layer_types=["full_attention"] * 2, **COMMON))
    with torch.no_grad():  # expert 3 of layer 0 never wins a token
        model.model.layers[0].mlp.router.bias[3] = -1e4
    return model


@pytest.fixture(params=["native", "aten", "accel"])
def stats_path(request, monkeypatch):
    """The engine's three ways to read: host records (the C kernel), CPU tensor records
    (ATen), device records (the accelerator path's CPU seam)."""
    monkeypatch.delenv("MSPROBE_MONITOR_ACCEL_ON_CPU", raising=False)
    if request.param == "aten":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    elif request.param == "accel":
        monkeypatch.setenv("MSPROBE_MONITOR_ACCEL_ON_CPU", "1")
    else:
        monkeypatch.delenv(native.ENV_SWITCH, raising=False)
        assert native.load() is not None, "the one-pass kernel did not build: is a C compiler (gcc) installed?"
    return request.param


def train(family, monitors, write_config, steps=STEPS):
    """Train the monitored model and an unmonitored copy; per step the copy's gradients,
    parameters before/after the update and Adam states (clones), and whether the two
    trained the same."""
    model = build(family)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    mon = TrainerMonitorV2(write_config({"monitors": monitors}))
    mon.start(model=model, optimizer=opt)
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        ref(input_ids=ids, labels=ids).loss.backward()
        named = dict(ref.named_parameters())
        step = {"grad": {n: p.grad.clone() for n, p in named.items() if p.grad is not None},
                "before": {n: p.detach().clone() for n, p in named.items()}}
        ref_opt.step()
        step["after"] = {n: p.detach().clone() for n, p in named.items()}
        step["exp_avg"] = {n: ref_opt.state[p]["exp_avg"].clone() for n, p in named.items() if p in ref_opt.state}
        ref_opt.zero_grad()
        seen.append(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), f"the monitor changed the training: {n}"
    return seen


def norms_stats(t: torch.Tensor):
    """The expected ``expert_norms`` row: NumPy over the per-expert norms of a copy."""
    a = t.detach().to(torch.float64).numpy().copy().reshape(t.shape[0], -1)
    norms = np.sqrt((a * a).sum(axis=1))
    return {"min": float(norms.min()), "max": float(norms.max()), "mean": float(norms.mean()),
            "norm": float(np.sqrt((norms * norms).sum())), "nans": int(np.isnan(norms).sum()),
            "zeros": int((norms == 0).sum())}


def with_zeros(t: torch.Tensor):
    out = numpy_stats(t)
    out["zeros"] = int((t.detach().numpy() == 0).sum())
    return out


def grouped(seen):
    return sorted(n for n, t in seen[0]["before"].items() if t.dim() == 3)


def test_default_rule():
    rule = ExpertRule(None)
    assert rule.matches("model.layers.0.mlp.experts.gate_up_proj", 3)
    assert rule.matches("0:layers.1.moe.experts.w1", 3)  # TorchTitan, a chunk list
    assert not rule.matches("model.layers.0.mlp.experts.gate_up_proj_bias", 2)
    assert not rule.matches("model.layers.0.mlp.experts.0.w1.weight", 2)  # transformers 4.x: per expert already
    assert not rule.matches("model.layers.0.mlp.gate.weight", 2)
    assert not rule.matches("model.layers.0.attn.qkv", 3)


@pytest.mark.parametrize("bad, why", [
    ({"expert_params": "experts"}, "must be a list of regular expressions"),
    ({"expert_params": ["experts("]}, "must be a regular expression"),
    ({"per_expert": "yes"}, "must be"),
])
def test_config_errors(bad, why):
    with pytest.raises(ConfigError) as exc:
        load_config({"monitors": {"param": {"enabled": True, **bad}}})
    field = next(iter(bad))
    assert f"'monitors.param.{field}" in str(exc.value) and why in str(exc.value)


def test_qwen3_moe_rows_against_numpy(stats_path, write_config, tmp_path):
    mons = {m: {"enabled": True, "ops": OPS} for m in ("weight_grad", "param", "optimizer")}
    mons["module"] = {"enabled": False}
    seen = train("qwen3_moe", mons, write_config)
    out = tmp_path / "out"
    names = grouped(seen)
    assert names == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj",
                     "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"]
    wg, pr, opt = rows_of(out, "weight_grad"), rows_of(out, "param"), rows_of(out, "optimizer")
    for step, ref in enumerate(seen):
        for name in names:
            g = ref["grad"][name]
            for scope in ("unreduced", "reduced"):
                assert_row_matches(find_row(wg, step=str(step), module_name=name, scope=scope), with_zeros(g), 1e-5)
                row = find_row(wg, step=str(step), module_name=name + ".expert_norms", scope=scope)
                assert_row_matches(row, norms_stats(g), 1e-5)
                assert int(row["zeros"]) == norms_stats(g)["zeros"]
            for scope, key in (("param_origin", "before"), ("param_updated", "after")):
                assert_row_matches(find_row(pr, step=str(step), module_name=name, scope=scope),
                                   with_zeros(ref[key][name]), 1e-5)
                assert_row_matches(find_row(pr, step=str(step), module_name=name + ".expert_norms", scope=scope),
                                   norms_stats(ref[key][name]), 1e-5)
            state = ref["exp_avg"][name]
            assert_row_matches(find_row(opt, step=str(step), module_name=name + ".exp_avg", scope="exp_avg"),
                               with_zeros(state), 1e-5, 1e-9)
            assert_row_matches(find_row(opt, step=str(step), module_name=name + ".exp_avg.expert_norms",
                                        scope="exp_avg"), norms_stats(state), 1e-5, 1e-9)
    # only the grouped tensors get them; no per-expert rows unless asked
    extra = {r["module_name"] for r in wg + pr + opt if r["module_name"].endswith(".expert_norms")}
    bases = {n[: -len(".expert_norms")] for n in extra}
    assert bases == set(names) | {f"{n}.{s}" for n in names for s in ("exp_avg", "exp_avg_sq")}
    assert not any(".expert." in r["module_name"] for r in wg + pr + opt)


def test_mixtral_per_expert_rows(write_config, tmp_path):
    mons = {"weight_grad": {"enabled": True, "ops": OPS, "per_expert": True},
            "param": {"enabled": True, "per_expert": True}, "module": {"enabled": False}}
    seen = train("mixtral", mons, write_config, steps=2)
    out = tmp_path / "out"
    names = grouped(seen)
    assert len(names) == 4
    wg, pr = rows_of(out, "weight_grad"), rows_of(out, "param")
    for step, ref in enumerate(seen):
        for name in names:
            g = ref["grad"][name]
            assert_row_matches(find_row(wg, step=str(step), module_name=name, scope="reduced"), with_zeros(g))
            for e in range(g.shape[0]):
                assert_row_matches(find_row(wg, step=str(step), module_name=f"{name}.expert.{e}", scope="unreduced"),
                                   with_zeros(g[e]))
                assert_row_matches(find_row(pr, step=str(step), module_name=f"{name}.expert.{e}",
                                            scope="param_updated"), numpy_stats(ref["after"][name][e]))
            assert_row_matches(find_row(wg, step=str(step), module_name=name + ".expert_norms", scope="reduced"),
                               norms_stats(g))


def test_gpt_oss_dead_expert_counted_in_zeros(write_config, tmp_path):
    """Expert 3 of layer 0 never gets a token: its gradient slices are zero, and the
    gradient's ``expert_norms`` rows count it in ``zeros`` (with any other expert that got no
    token in the step, as the reference says); the biases, named by ``expert_params``, are
    read per expert too."""
    pattern = r"experts\.(gate_up_proj|down_proj)(_bias)?$"
    mons = {"weight_grad": {"enabled": True, "ops": OPS, "expert_params": [pattern]}, "module": {"enabled": False}}
    seen = train("gpt_oss", mons, write_config, steps=2)
    wg = rows_of(tmp_path / "out", "weight_grad")
    for step, ref in enumerate(seen):
        for layer in (0, 1):
            for part in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                name = f"model.layers.{layer}.mlp.experts.{part}"
                g = ref["grad"][name]
                want = norms_stats(g)
                if layer == 0:
                    assert float(g[3].abs().max()) == 0.0 and want["zeros"] >= 1
                for scope in ("unreduced", "reduced"):
                    row = find_row(wg, step=str(step), module_name=name + ".expert_norms", scope=scope)
                    assert int(row["zeros"]) == want["zeros"]
                    assert_row_matches(row, want)
                    if want["zeros"]:
                        assert float(row["min"]) == 0.0


class _Launches:
    """The engine's ATen calls that compute (views and selects left out), counted; imported
    with the support module only where torch is."""

    VIEWS = {"select", "slice", "view", "alias", "_reshape_alias", "unbind", "as_strided", "detach", "reshape",
             "expand", "_unsafe_view", "split", "lift_fresh"}

    @staticmethod
    def mode():
        from support.modes import SeenByTheEngine

        class Count(SeenByTheEngine):
            def __init__(self):
                super().__init__()
                self.ops = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name not in _Launches.VIEWS:
                    self.ops.append(name)
                return func(*args, **(kwargs or {}))

        return Count()


def test_accelerator_path_reads_along_the_expert_dimension(monkeypatch):
    """Under the accelerator path's CPU seam a grouped tensor costs the same ATen calls
    whatever its expert count (reductions over the ``[E, n]`` view, not a read per
    expert), and the values agree with NumPy once moved to the host."""
    from msprobe.core.monitor_v2.experts import ExpertReads
    from msprobe.core.monitor_v2.frameworks.pytorch.experts import device_expert_records, expert_norm_record
    from msprobe.core.monitor_v2.frameworks.pytorch.stats import TorchStatsEngine
    from msprobe.core.monitor_v2.monitor import MonitorSettings
    from msprobe.core.monitor_v2.param_table import ParamTable
    from msprobe.core.monitor_v2.stats import StatPlan, merge_records

    monkeypatch.setenv("MSPROBE_MONITOR_ACCEL_ON_CPU", "1")
    engine = TorchStatsEngine()
    plan = StatPlan.from_ops(OPS)
    counts = {}
    for experts in (4, 32):
        torch.manual_seed(experts)
        w = torch.nn.Parameter(torch.randn(experts, 6, 5))
        with torch.no_grad():
            w[1] = 0.0
        module = torch.nn.Module()
        module.experts = torch.nn.Module()
        module.experts.w = w

        class Session:
            table = ParamTable([list(module.named_parameters())], False)
            expert_norm_vector = staticmethod(lambda t, recs, p, key: expert_norm_record(engine, t, recs, p, key))
            expert_device_records = staticmethod(lambda t, p, keys: device_expert_records(engine, t, p, keys))

        reads = ExpertReads(Session(), MonitorSettings("param", True, options={"expert_params": None}), "param")
        assert reads.params == {"experts.w": 3}
        reads.record_many(engine, [w], plan, [(0, "experts.w", "param_origin", None)])  # the engine's first-use setup
        count = _Launches.mode()
        with count:
            records = reads.record_many(engine, [w], plan, [(0, "experts.w", "param_origin", None)])
        counts[experts] = sorted(count.ops)
        ready = engine.to_host(records)
        if ready is not None:
            ready()
        rows = {r.name: r for r in merge_records(0, records)}
        want, got = with_zeros(w.detach()), rows["experts.w"]
        assert got.numel == w.numel() and got.zeros == want["zeros"]
        assert math.isclose(got.value("norm"), want["norm"], rel_tol=1e-6)
        assert math.isclose(got.value("min"), want["min"]) and math.isclose(got.value("max"), want["max"])
        norms = rows["experts.w.expert_norms"]
        want = norms_stats(w.detach())
        assert norms.numel == experts and norms.zeros == 1 == want["zeros"]
        for op in ("min", "max", "mean", "norm"):
            assert math.isclose(norms.value(op), want[op], rel_tol=1e-6, abs_tol=1e-12), op
    assert counts[4] == counts[32] and len(counts[4]) < 20, counts


def test_a_grouped_tensor_read_flat_is_said_once(caplog):
    """A grouped-expert parameter whose tensor comes as a flat piece (FSDP1's views of a flat
    shard) cannot be cut per expert: its own row stays, no per-expert row, one WARNING."""
    from msprobe.core.monitor_v2.experts import ExpertReads
    from msprobe.core.monitor_v2.frameworks.pytorch.stats import TorchStatsEngine
    from msprobe.core.monitor_v2.monitor import MonitorSettings
    from msprobe.core.monitor_v2.param_table import ParamTable
    from msprobe.core.monitor_v2.stats import StatPlan, merge_records

    module = torch.nn.Module()
    module.experts = torch.nn.Module()
    module.experts.w = torch.nn.Parameter(torch.randn(4, 3, 2))

    class Session:
        table = ParamTable([list(module.named_parameters())], False)
        expert_norm_vector = staticmethod(lambda *a: None)  # not reached: nothing is split

    engine = TorchStatsEngine()
    reads = ExpertReads(Session(), MonitorSettings("param", True, options={"expert_params": None}), "param")
    flat = module.experts.w.detach().reshape(-1)[:10]
    with caplog.at_level("WARNING", logger="msprobe.monitor_v2"):
        for _ in range(2):
            records = reads.record_many(engine, [flat], StatPlan.from_ops(OPS), [(0, "experts.w", "param_origin", None)])
            engine.to_host(records)
    assert [r.name for r in merge_records(0, records)] == ["experts.w"]
    said = [r.getMessage() for r in caplog.records if "grouped-expert parameter" in r.getMessage()]
    assert len(said) == 1 and "'experts.w'" in said[0] and "[10]" in said[0], said
