"""Worker for tests/stacks/test_megatron_parallel.py, run by torchrun with 4 gloo ranks on the CPU.

    megatron_parallel.py OUT_DIR [CONFIG,...]

Trains a tiny Megatron-Core GPTModel (4 layers, hidden 64, fp32) with Megatron's
``DistributedDataParallel``, ``get_megatron_optimizer`` and its own schedules
(``get_forward_backward_func``, which calls ``finalize_model_grads``) under model
parallelism, with the monitor on (weight_grad, param, optimizer, module), in one launch:
``parallel_state`` is destroyed and initialised again for each configuration (``CONFIGS``):

- ``tp``: TP=2 x DP=2 (``forward_backward_no_pipelining``), the model given as one chunk;
- ``pp``: PP=2 x DP=2, 1F1B (``forward_backward_pipelining_without_interleaving``);
- ``vpp``: interleaved PP=2 with 2 model chunks per rank x DP=2, the model given as the
  list of chunks (names ``0:...``/``1:...``);

each without and with the distributed optimizer. ``STEPS`` steps of ``ACC`` micro-batches.

The references are taken by this script, not by the monitor: at every step, right before
``optimizer.step()``, every parameter's reduced ``main_grad`` and its fp32 value, and
right after it the Adam ``exp_avg``, assembled into the FULL tensor (distributed-optimizer
slices summed over the data-parallel group, tensor-parallel shards gathered along
``partition_dim``), saved by the ranks with tp and dp rank 0 under the parameter's global
name (its ``TransformerLayer``'s ``layer_number - 1``, no chunk prefix) to
``<OUT_DIR>/<config>/full_rank<r>.pt``. Every rank saves what it read of Megatron's layout
(``meta_rank<r>.pt``): its coordinates and each chunk's layer numbers.
"""

import logging
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")  # Megatron's "Transformer Engine and Apex are not installed"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_cpu_shim  # noqa: E402

STEPS, ACC = 2, 2
VOCAB, SEQ, MBS, HIDDEN, LAYERS = 64, 8, 2, 64, 4
CONFIGS = {  # name: (tp, pp, vpp (chunks per rank, None: not interleaved), distributed optimizer)
    "tp": (2, 1, None, False),
    "tp-distopt": (2, 1, None, True),
    "pp": (1, 2, None, False),
    "pp-distopt": (1, 2, None, True),
    "vpp": (1, 2, 2, False),
    "vpp-distopt": (1, 2, 2, True),
}


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))


def build(tp: int, pp: int, vpp, distopt: bool):
    from megatron.core import parallel_state as ps
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
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32, batch_p2p_comm=False,
        hidden_dropout=0.0, attention_dropout=0.0)
    chunks = []
    for v in range(vpp or 1):
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v)
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                       max_sequence_length=SEQ, pre_process=pre, post_process=post,
                       share_embeddings_and_output_weights=False, vp_stage=v if vpp else None)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=distopt)
        chunks.append(DistributedDataParallel(cfg, ddp_cfg, gpt))
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=distopt, clip_grad=1.0), chunks)
    return cfg, chunks, opt


def micro_batches(step: int, dp_rank: int):
    out = []
    for mb in range(ACC):
        g = torch.Generator().manual_seed(1000 * step + 10 * mb + dp_rank)
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        out.append((tokens, labels))
    return out


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    mask = torch.ones(MBS, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()
    out = model(tokens, position_ids, mask, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def layer_numbers(gpt):
    """{local module name: layer_number} of the chunk's TransformerLayers, read off the modules."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return {n: m.layer_number for n, m in gpt.named_modules() if isinstance(m, TransformerLayer)}


def global_name(name: str, numbers) -> str:
    """The parameter's name with the model's 0-based layer number (the worker's own renaming)."""
    for local, number in numbers.items():
        if name.startswith(local + "."):
            path = local.rsplit(".", 1)[0]
            return f"{path}.{number - 1}.{name[len(local) + 1:]}"
    return name


def full_tensor(local: torch.Tensor, p, ranges, name: str, dp_group, tp_group, tp_size: int,
                whole_local: bool = False) -> torch.Tensor:
    """The whole tensor from this rank's part: distributed-optimizer slices (``ranges``:
    the slice this rank holds, absent: none; ``whole_local``: ``local`` is the whole
    tp-local tensor, valid in that slice) summed over dp, then tp shards gathered."""
    if ranges is not None:
        buf = torch.zeros(p.numel(), dtype=torch.float32)
        if name in ranges:
            start, end = ranges[name]
            part = local.detach().float().reshape(-1)
            buf[start:end] = part[start:end] if whole_local else part
        dist.all_reduce(buf, group=dp_group)
        whole = buf.view(p.shape)
    else:
        whole = local.detach().float().clone().view(p.shape)
    if getattr(p, "tensor_model_parallel", False) and tp_size > 1:
        parts = [torch.empty_like(whole) for _ in range(tp_size)]
        dist.all_gather(parts, whole.contiguous(), group=tp_group)
        whole = torch.cat(parts, dim=p.partition_dim)
    return whole


def train(config: str, out_dir: str) -> float:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    tp, pp, vpp, distopt = CONFIGS[config]
    started = time.time()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    rank = dist.get_rank()
    cfg, chunks, opt = build(tp, pp, vpp, distopt)
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    tp_group = ps.get_tensor_model_parallel_group()
    dp_rank, tp_rank = ps.get_data_parallel_rank(with_context_parallel=True), ps.get_tensor_model_parallel_rank()
    run_dir = os.path.join(out_dir, config)
    capture = LogCapture()
    logger = logging.getLogger("msprobe.monitor_v2")
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    monitors = {"weight_grad": {"enabled": True}, "optimizer": {"enabled": True}, "param": {"enabled": True},
                "module": {"enabled": True}}
    mon = TrainerMonitorV2({"output_dir": run_dir, "async_write": False, "monitors": monitors})
    mon.start(model=chunks if vpp else chunks[0], optimizer=opt, grad_acc_steps=ACC)

    gpts = [c.module for c in chunks]
    # The module rows of a column-parallel output and a row-parallel input (both this
    # rank's part over tp): the worker's own hooks keep every call's local tensor.
    calls = {"decoder.layers.0.mlp.linear_fc1.output.0": [], "decoder.layers.0.self_attention.linear_proj.input.0": []}
    layer0 = gpts[0].decoder.layers[0]
    hooks = [
        layer0.mlp.linear_fc1.register_forward_hook(
            lambda m, a, out: calls["decoder.layers.0.mlp.linear_fc1.output.0"][-1].append(out[0].detach().clone())),
        layer0.self_attention.linear_proj.register_forward_pre_hook(
            lambda m, a: calls["decoder.layers.0.self_attention.linear_proj.input.0"][-1].append(a[0].detach().clone())),
    ]
    numbers = [layer_numbers(g) for g in gpts]
    params = [(v, n, p) for v, g in enumerate(gpts) for n, p in g.named_parameters()]
    names = {id(p): global_name(n, numbers[v]) for v, n, p in params}
    inner = [o for o in getattr(opt, "chained_optimizers", [opt])]
    ranges, shards = None, {}
    if distopt:  # this rank's slice of each parameter, from Megatron's own range map
        ranges = {}
        for o in inner:
            for mg, sg in zip(o.model_fp32_groups, o.shard_fp32_groups):
                for p, shard in zip(mg, sg):
                    r = o._get_model_param_range_map(p)["param"]
                    ranges[names[id(p)]] = (r.start, r.end)
                    shards[id(p)] = (o.optimizer, shard)
    else:
        for o in inner:
            for group in o.optimizer.param_groups:
                for p in group["params"]:
                    shards[id(p)] = (o.optimizer, p)
    keep = tp_rank == 0 and dp_rank == 0
    full = {"grad": [], "param": [], "exp_avg": []}
    forward_backward = get_forward_backward_func()
    for step in range(STEPS):
        for c in chunks:
            c.zero_grad_buffer()
        opt.zero_grad()
        data = micro_batches(step, dp_rank)
        for seen in calls.values():
            seen.append([])
        iters = [iter(data) for _ in chunks] if vpp else iter(data)
        forward_backward(forward_step_func=forward_step, data_iterator=iters, model=chunks if vpp else chunks[0],
                         num_microbatches=ACC, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        grads, values = {}, {}
        for _, _, p in params:
            name = names[id(p)]
            # under the distributed optimizer only this rank's slice of main_grad is reduced
            grads[name] = full_tensor(p.main_grad, p, ranges, name, dp_group, tp_group, tp, whole_local=True)
            # the fp32 value the optimizer updates: the parameter itself, or this rank's master slice
            master = shards[id(p)][1] if ranges is not None and id(p) in shards else p
            values[name] = full_tensor(master, p, ranges, name, dp_group, tp_group, tp)
        opt.step()
        moments = {}
        for _, _, p in params:
            name = names[id(p)]
            held = shards.get(id(p))
            st = held[0].state.get(held[1], {}) if held is not None else {}
            local = st.get("exp_avg", torch.zeros(0)) if held is not None else torch.zeros(0)
            moments[name] = full_tensor(local, p, ranges, name, dp_group, tp_group, tp)
        if keep:
            full["grad"].append(grads)
            full["param"].append(values)
            full["exp_avg"].append(moments)
    mon.stop()
    logger.removeHandler(capture)
    for h in hooks:
        h.remove()
    modules = {}  # row name: per step, every element of every call over the tp group (a flat tensor)
    for row, per_step in calls.items():
        modules[row] = []
        for seen in per_step:
            local = torch.cat([t.reshape(-1) for t in seen])
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local, group=tp_group)
            modules[row].append(torch.cat(parts))
    os.makedirs(run_dir, exist_ok=True)
    if keep:
        torch.save(full, os.path.join(run_dir, f"full_rank{rank}.pt"))
    meta = {
        "coords": {"tp": (tp_rank, ps.get_tensor_model_parallel_world_size()),
                   "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
                   "dp": (dp_rank, ps.get_data_parallel_world_size(with_context_parallel=True))},
        "layer_numbers": numbers,
        "local_names": [[n for n, _ in g.named_parameters()] for g in gpts],
        "global_names": [names[id(p)] for _, _, p in params],
        "logs": capture.records,
        "modules": modules if tp_rank == 0 and ps.is_pipeline_first_stage() else {},
    }
    torch.save(meta, os.path.join(run_dir, f"meta_rank{rank}.pt"))
    return time.time() - started


def edge_layouts(out_dir: str) -> None:
    """What the layout says of parameters it cannot describe, and without parallel_state:
    a plain module whose parameters carry Megatron's attributes by hand (TP=2 x DP=2),
    given to the adapter directly; then the same after ``destroy_model_parallel()``."""
    from megatron.core import parallel_state as ps
    from msprobe.core.monitor_v2 import layout as lay
    from msprobe.core.monitor_v2.frameworks.pytorch.stacks.megatron import MegatronStack
    from msprobe.core.monitor_v2.param_table import ParamTable

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 1)
    m = torch.nn.Module()
    attrs = {
        "column": {"tensor_model_parallel": True, "partition_dim": 1, "partition_stride": 1},
        "strided": {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 2},
        "expert": {"allreduce": False},
        "norm": {"sequence_parallel": True},
    }
    for name, marks in attrs.items():
        p = torch.nn.Parameter(torch.zeros(4, 3))
        for k, v in marks.items():
            setattr(p, k, v)
        m.register_parameter(name, p)
    docs = {}
    for when in ("initialized", "destroyed"):
        table = ParamTable([list(m.named_parameters())], False)
        doc = lay.new_document("pytorch", "megatron", dist.get_rank(), dist.get_world_size())
        MegatronStack([m], None).layout(table, doc)
        docs[when] = doc
        ps.destroy_model_parallel()
    torch.save(docs, os.path.join(out_dir, f"edge_rank{dist.get_rank()}.pt"))


def main() -> None:
    out_dir = sys.argv[1]
    configs = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CONFIGS)
    dist.init_process_group("gloo")
    megatron_cpu_shim.install()
    torch.cuda.synchronize = lambda *a, **k: None  # the schedules synchronise the (absent) GPU
    from megatron.core import parallel_state as ps

    times = {}
    for config in configs:
        times[config] = train(config, out_dir)
    if len(sys.argv) <= 2:
        edge_layouts(out_dir)
    ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "times.txt"), "w") as fh:
            fh.write("".join(f"{c} {t:.1f}\n" for c, t in times.items()))


if __name__ == "__main__":
    main()
    from support import finish

    finish()
