"""Worker for tests/stacks/test_megatron_ep.py, run by torchrun with 4 gloo ranks on the CPU.

    megatron_ep.py OUT_DIR

Trains a tiny Megatron-Core MoE GPTModel (2 layers, hidden 32, 4 experts, top-2,
``SequentialMLP`` experts, the ``allgather`` token dispatcher, fp32) under expert
parallelism with Megatron's ``DistributedDataParallel``, ``get_megatron_optimizer`` and
its own schedules, with the monitor on (weight_grad, param, optimizer), through
benchmarks/megatron_cpu_shim.py, once per configuration (``CONFIGS``, into
``OUT_DIR/<config>``):

- ``ep``: EP=2 x TP=1 x PP=1 (DP=4 for the dense parameters, expert data parallel 2);
- ``pp-ep``: EP=2 x PP=2 (1F1B; DP=2, each stage one layer, named ``decoder.layers.0``
  locally on both).

The references are this script's own, not the monitor's: at every step, right before
``optimizer.step()``, each parameter's reduced ``main_grad`` and its value, and right
after it Adam's ``exp_avg``, saved by the ranks with expert-data-parallel rank 0 (one
copy of each expert) under the parameter's global name (local expert ``i`` of
expert-parallel rank ``r`` is expert ``r * E_local + i``, layers under their global number) to
``<OUT_DIR>/<config>/full_rank<r>.pt``;
and each router's tokens per expert (its routing map summed, every training micro-batch
of the step), under its local name (``local``) and its global one (``tokens``). The
monitor's ``moe`` monitor runs with ``"per_expert": true``: its sidecar
(``rank_<r>/moe_counts_step<a>-<b>.csv``) is what ``merge`` sums.
"""

import os
import sys
import warnings

warnings.filterwarnings("ignore")  # Megatron's "Transformer Engine and Apex are not installed"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_cpu_shim  # noqa: E402

STEPS, ACC = 2, 2
VOCAB, SEQ, MBS, HIDDEN, LAYERS, EXPERTS, TOPK, EP = 64, 8, 2, 32, 2, 4, 2, 2
CONFIGS = {"ep": 1, "pp-ep": 2}  # name: pipeline-parallel size


def build(pp: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
        ffn_hidden_size=2 * HIDDEN, num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=HIDDEN,
        expert_model_parallel_size=EP, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp, batch_p2p_comm=False, hidden_dropout=0.0, attention_dropout=0.0)
    from megatron.core import parallel_state as ps

    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS),
                   vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                   post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False)
    model = DistributedDataParallel(cfg, ddp_cfg, gpt)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), [model])
    return cfg, model, opt


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    mask = torch.ones(MBS, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()
    out = model(tokens, position_ids, mask, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def global_expert_name(name: str, ep_rank: int, local: int, numbers) -> str:
    """``name`` under the model's layer number (``layer_number - 1``) and, for
    ``...local_experts.<i>....`` of expert-parallel rank ``ep_rank``, the model's expert."""
    for layer, number in numbers.items():
        if name.startswith(layer + "."):
            name = f"{layer.rsplit('.', 1)[0]}.{number - 1}.{name[len(layer) + 1:]}"
            break
    head, sep, tail = name.partition(".local_experts.")
    if not sep:
        return name
    index, _, rest = tail.partition(".")
    return f"{head}.local_experts.{ep_rank * local + int(index)}.{rest}"


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    megatron_cpu_shim.install()
    torch.cuda.synchronize = lambda *a, **k: None
    # Megatron-Core 0.16.1 without Transformer Engine leaves the name te_general_gemm
    # undefined in moe_utils (its import failed) while the router's gating tests it for None
    import megatron.core.transformer.moe.moe_utils as moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    for config, pp in CONFIGS.items():
        train(os.path.join(out_dir, config), pp)


def train(out_dir: str, pp: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    ps.initialize_model_parallel(1, pp, expert_model_parallel_size=EP)
    rank = dist.get_rank()
    cfg, model, opt = build(pp)
    gpt = model.module
    ep_rank = ps.get_expert_model_parallel_rank()
    edp_rank = ps.get_expert_data_parallel_rank()
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    local = EXPERTS // EP
    run_dir = os.path.join(out_dir, "run")
    monitors = {"weight_grad": {"enabled": True, "ops": ["min", "max", "mean", "norm", "nans", "zeros"]},
                "optimizer": {"enabled": True}, "param": {"enabled": True}, "module": {"enabled": False},
                "moe": {"enabled": True, "per_expert": True}}
    mon = TrainerMonitorV2({"output_dir": run_dir, "async_write": False, "monitors": monitors})
    mon.start(model=model, optimizer=opt, grad_acc_steps=ACC)

    routers = {n: m for n, m in gpt.named_modules() if isinstance(m, TopKRouter)}
    numbers = {n: m.layer_number for n, m in gpt.named_modules() if isinstance(m, TransformerLayer)}
    counts = {n: torch.zeros(EXPERTS, dtype=torch.int64) for n in routers}

    def counter(name):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                counts[name] += output[1].sum(dim=0).to(torch.int64)
        return hook

    hooks = [m.register_forward_hook(counter(n)) for n, m in routers.items()]
    params = list(gpt.named_parameters())
    names = {id(p): global_expert_name(n, ep_rank, local, numbers) for n, p in params}
    is_expert = {id(p): not getattr(p, "allreduce", True) for _, p in params}
    keep_dense, keep_expert = dp_rank == 0, edp_rank == 0
    full = {"grad": [], "param": [], "exp_avg": [], "tokens": [], "local": []}
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    forward_backward = get_forward_backward_func()
    for step in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        for c in counts.values():
            c.zero_()
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        data = [(torch.randint(0, VOCAB, (MBS, SEQ), generator=g), torch.randint(0, VOCAB, (MBS, SEQ), generator=g))
                for _ in range(ACC)]
        forward_backward(forward_step_func=forward_step, data_iterator=iter(data), model=model,
                         num_microbatches=ACC, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        kept = [(n, p) for n, p in params if (keep_expert if is_expert[id(p)] else keep_dense)]
        full["grad"].append({names[id(p)]: p.main_grad.detach().clone() for _, p in kept})
        full["param"].append({names[id(p)]: p.detach().clone() for _, p in kept})
        opt.step()
        states = {}
        for o in inner:
            for group in o.param_groups:
                for p in group["params"]:
                    if id(p) in names and p in o.state:
                        states[id(p)] = o.state[p]["exp_avg"].detach().clone()
        full["exp_avg"].append({names[id(p)]: states[id(p)] for _, p in kept if id(p) in states})
        full["local"].append({n: c.clone() for n, c in counts.items()})
        full["tokens"].append({global_expert_name(n, ep_rank, local, numbers): c.clone() for n, c in counts.items()})
    mon.stop()
    for h in hooks:
        h.remove()
    meta = {"ep": (ep_rank, EP), "edp": (edp_rank, ps.get_expert_data_parallel_world_size()),
            "dp": (dp_rank, ps.get_data_parallel_world_size(with_context_parallel=True)),
            "routers": sorted(routers), "pp": (ps.get_pipeline_model_parallel_rank(), pp),
            "global_routers": sorted(global_expert_name(n, ep_rank, local, numbers) for n in routers)}
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"full": full, "meta": meta}, os.path.join(out_dir, f"full_rank{rank}.pt"))
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
    from support import finish

    finish()
