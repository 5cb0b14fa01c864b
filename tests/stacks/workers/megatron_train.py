"""Worker for tests/stacks/test_megatron.py, run by torchrun with 2 gloo ranks on the CPU.

    megatron_train.py OUT_DIR

Trains a small Megatron-Core GPTModel (TP=PP=1, DP=2) with Megatron's
``DistributedDataParallel`` and ``get_megatron_optimizer`` in four configurations
(fp32 / bf16 with ``Float16Module``, without / with the distributed optimizer), each
three times: without the monitor, with it (``monitor_mbs_grad`` false; module monitor
on) and with it (``monitor_mbs_grad`` true); plus fp32 with ``overlap_grad_reduce``,
with the monitor only; plus the distributed optimizer with its private range map
hidden while ``start()`` runs (a version that moved it), and once more given as a list
of model chunks. 3 steps of 2 micro-batches each, ``no_sync()`` on the first.

The references are taken by this script, not by the monitor, and saved per run to
``<OUT_DIR>/<config>-<run>/ref_rank<r>.pt``:
- ``main_grad`` clones after every backward pass (the local accumulation; a micro-batch's
  own gradient is the difference of two clones) and after ``finish_grad_sync()``;
- this rank's slice of each parameter (distributed optimizer), from Megatron's own range map;
- the grad norm that ``optimizer.step()`` returns;
- the fp32 master (or fp32 parameter) of each parameter before and after the step, and
  the Adam moments after it, looked up through ``param.main_param`` or by storage address;
- the final parameters and losses (bit-identical with and without the monitor);
- the monitor's own log records (no error, no per-layer warning).

The CPU shim (benchmarks/megatron_cpu_shim.py) is installed before Megatron runs.
"""

import contextlib
import logging
import os
import sys
import warnings

warnings.filterwarnings("ignore")  # Megatron's "Transformer Engine and Apex are not installed"
# The CPU shim lives with benchmarks/megatron_overhead.py, which uses it too and may not
# import from tests/; the tests may import from benchmarks/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_cpu_shim  # noqa: E402

STEPS, ACC = 3, 2
VOCAB, SEQ, BATCH = 64, 8, 2
CONFIGS = {  # name: (bf16, distributed optimizer, overlap_grad_reduce)
    "fp32": (False, False, False),
    "fp32-distopt": (False, True, False),
    "bf16": (True, False, False),
    "bf16-distopt": (True, True, False),
    # The reduction starts inside the last backward pass: its main_grad clones race with
    # it, so the test compares with the "fp32" run (same seeds, data and arithmetic).
    "fp32-overlap": (False, False, True),
}


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))


def build(bf16: bool, distopt: bool, overlap: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                   max_sequence_length=SEQ)
    model = Float16Module(cfg, gpt) if bf16 else gpt
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
                                            use_distributed_optimizer=distopt)
    ddp = DistributedDataParallel(cfg, ddp_cfg, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, bf16=bf16, use_distributed_optimizer=distopt, clip_grad=1.0),
        [ddp])
    return gpt, ddp, opt


def micro_batch(step: int, mb: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * mb + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()
    return tokens, position_ids, mask, labels


def inner_optimizers(opt):
    return list(getattr(opt, "chained_optimizers", [opt]))


def shard_ranges(opt, gpt):
    """Distributed optimizer: this rank's slice of each flattened parameter (absent where
    this rank holds none of it)."""
    out = {}
    for inner in inner_optimizers(opt):
        if not hasattr(inner, "_get_model_param_range_map"):
            continue
        for name, p in gpt.named_parameters():
            try:
                r = inner._get_model_param_range_map(p)["param"]
            except KeyError:
                continue
            out[name] = (r.start, r.end)
    return out


def masters_and_state(opt, gpt, ranges):
    """Per parameter name: (fp32 master or fp32 parameter (slice), Adam state dict)."""
    states = {}
    for inner in inner_optimizers(opt):
        for key, st in inner.optimizer.state.items():
            states[(key.data_ptr(), key.numel())] = st
    out = {}
    for name, p in gpt.named_parameters():
        master = getattr(p, "main_param", None)  # set by Megatron's mixed-precision optimizers
        if master is None:
            if ranges and name not in ranges:
                continue
            master = p.detach().view(-1)[ranges[name][0]:ranges[name][1]] if ranges else p.detach()
        st = states.get((master.data_ptr(), master.numel()), {})
        out[name] = (master.detach().clone(), {k: v.clone() for k, v in st.items() if k != "step"})
    return out


def train(config: str, run: str, out_dir: str):
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    bf16, distopt, overlap = CONFIGS[config]
    rank = dist.get_rank()
    gpt, ddp, opt = build(bf16, distopt, overlap)
    run_dir = os.path.join(out_dir, f"{config}-{run}")
    mon = None
    capture = LogCapture()
    logger = logging.getLogger("msprobe.monitor_v2")
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    if run != "plain":
        monitors = {
            "weight_grad": {"enabled": True, "monitor_mbs_grad": run == "mbs"},
            "optimizer": {"enabled": True},
            "param": {"enabled": True},
        }
        if run == "acc":
            monitors["module"] = {"enabled": True}
        if run == "broken":  # the end-of-pass read of main_grad raises: see below
            monitors = {"weight_grad": {"enabled": True}}
        mon = TrainerMonitorV2({"output_dir": run_dir, "async_write": False, "monitors": monitors})
        before_start = {"optimizer": set(vars(opt)), "ddp": set(vars(ddp))}
        if run == "moved":  # a Megatron version without the private range map, while start() reads it
            inner = opt.chained_optimizers[0]

            def moved(param):
                raise AttributeError("'DistributedOptimizer' object has no attribute '_get_model_param_range_map'")

            inner._get_model_param_range_map = moved
            mon.start(model=ddp, optimizer=opt, grad_acc_steps=ACC)
            del inner._get_model_param_range_map
        else:  # "chunks": the model as a list of (one) model chunks, as with virtual pipelining
            mon.start(model=[ddp] if run == "chunks" else ddp, optimizer=opt, grad_acc_steps=ACC)
        if run == "broken":
            # The statistics engine fails inside backward() only, where the batch of main_grads
            # is read (an autograd-engine callback); the reduced rows at the step still work.
            engine = mon._session.engine
            record_many = engine.record_many

            def failing_inside_backward(*args, **kwargs):
                if torch._C._current_graph_task_id() >= 0:
                    raise RuntimeError("statistics engine broke inside backward")
                return record_many(*args, **kwargs)

            engine.record_many = failing_inside_backward
    ref = {"steps": [], "losses": [], "deferred_reads": []}
    if mon is not None:  # how many accumulated main_grads each end-of-pass batch read
        wg = next(m for m in mon.monitors if m.name == "weight_grad")
        read = wg._deferred_site
        wg._deferred_site = lambda: (ref["deferred_reads"].append(len(wg._deferred)), read())
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        acc = []
        for mb in range(ACC):
            tokens, pos, mask, labels = micro_batch(step, mb, rank)
            # as Megatron's schedules do: no reduction before the last micro-batch
            with ddp.no_sync() if mb < ACC - 1 else contextlib.nullcontext():
                loss = ddp(tokens, pos, mask, labels=labels).float().mean() / ACC
                loss.backward()
            ref["losses"].append(loss.detach().clone())
            acc.append({n: p.main_grad.detach().clone() for n, p in gpt.named_parameters()})
        ddp.finish_grad_sync()
        synced = {n: p.main_grad.detach().clone() for n, p in gpt.named_parameters()}
        ranges = shard_ranges(opt, gpt) if distopt else {}
        before = masters_and_state(opt, gpt, ranges)
        ok, grad_norm, _ = opt.step()
        after = masters_and_state(opt, gpt, ranges)
        ref["steps"].append({"acc": acc, "synced": synced, "ranges": ranges, "grad_norm": float(grad_norm),
                             "ok": ok, "before": {n: m for n, (m, _) in before.items()},
                             "after": {n: m for n, (m, _) in after.items()},
                             "state": {n: st for n, (_, st) in after.items()}})
    if mon is not None:
        mon.stop()
        # stop() removed every instance-level wrapper it installed
        ref["restored"] = before_start == {"optimizer": set(vars(opt)), "ddp": set(vars(ddp))}
    logger.removeHandler(capture)
    ref["final"] = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    ref["names"] = [n for n, _ in gpt.named_parameters()]
    ref["modules"] = [n for n, _ in gpt.named_modules()]
    ref["logs"] = capture.records
    ref["optimizer_types"] = [type(o).__name__ for o in [opt] + inner_optimizers(opt)]
    os.makedirs(run_dir, exist_ok=True)
    torch.save(ref, os.path.join(run_dir, f"ref_rank{rank}.pt"))


def main() -> None:
    out_dir = sys.argv[1]
    configs = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CONFIGS)
    dist.init_process_group("gloo")
    megatron_cpu_shim.install()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    for config in configs:
        for run in ("acc", "mbs") if CONFIGS[config][2] else ("plain", "acc", "mbs"):
            train(config, run, out_dir)
    if "fp32" in configs:
        train("fp32", "broken", out_dir)
    if "fp32-distopt" in configs:
        train("fp32-distopt", "moved", out_dir)
        train("fp32-distopt", "chunks", out_dir)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from support import finish

    finish()
