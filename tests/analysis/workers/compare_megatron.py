"""Worker for tests/analysis/test_compare_layouts.py, run by torchrun with 2 gloo ranks on the CPU.

    compare_megatron.py OUT_DIR

Trains the same tiny Megatron-Core GPTModel (2 layers, hidden 64, fp32, CPU initialisation:
the full weights drawn from one seed, then split, so every layout starts from the same
model) on the same data twice, with the monitor on (weight_grad, param, optimizer,
module), in one launch (``parallel_state`` destroyed and initialised again between runs):

- ``dp2``: TP=1 x DP=2; data-parallel rank j trains on batch j of each step, one
  micro-batch; Megatron's DDP averages the two ranks' gradients;
- ``tp2``: TP=2 x DP=1; both tensor-parallel ranks train on batches 0 and 1 as two
  micro-batches of one step (Megatron's schedule divides each loss by their number).

So both runs take the same update from the mean gradient of the same two batches. Each
step's loss (the mean over the two batches: all-reduced over the data-parallel group) and
the gradient norm ``optimizer.step()`` returns are written with ``mon.log_scalars``.
"""

import os
import sys
import warnings

warnings.filterwarnings("ignore")  # Megatron's "Transformer Engine and Apex are not installed"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_cpu_shim  # noqa: E402

STEPS = 3
VOCAB, SEQ, MBS, HIDDEN, LAYERS = 64, 8, 2, 64, 2
CONFIGS = {"dp2": 1, "tp2": 2}  # name: tensor-parallel size (the rest is data parallel)
LOSSES = []  # each micro-batch's loss as the loss function computed it (before the schedule scales it)


def build(tp: int):
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
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                   max_sequence_length=SEQ, pre_process=True, post_process=True,
                   share_embeddings_and_output_weights=False)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False)
    model = DistributedDataParallel(cfg, ddp_cfg, gpt)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), [model])
    return model, opt


def batch(step: int, j: int):
    g = torch.Generator().manual_seed(1000 * step + j)
    return torch.randint(0, VOCAB, (MBS, SEQ), generator=g), torch.randint(0, VOCAB, (MBS, SEQ), generator=g)


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    mask = torch.ones(MBS, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()
    out = model(tokens, position_ids, mask, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        LOSSES.append(loss.detach().clone())
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def train(config: str, out_dir: str) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    tp = CONFIGS[config]
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, 1)
    model, opt = build(tp)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    acc = 2 // dp_size  # the two batches: one per data-parallel rank, or both as micro-batches
    monitors = {"weight_grad": {"enabled": True}, "optimizer": {"enabled": True}, "param": {"enabled": True},
                "module": {"enabled": True}}
    mon = TrainerMonitorV2({"output_dir": os.path.join(out_dir, config), "async_write": False, "monitors": monitors})
    mon.start(model=model, optimizer=opt, grad_acc_steps=acc)
    forward_backward = get_forward_backward_func()
    for step in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        data = [batch(step, j) for j in range(2)][dp_rank * acc:(dp_rank + 1) * acc]
        LOSSES.clear()
        forward_backward(forward_step_func=forward_step, data_iterator=iter(data), model=model,
                         num_microbatches=acc, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        loss = torch.stack(LOSSES).sum()
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        _, grad_norm, _ = opt.step()  # ends the monitor's step (patched)
        mon.log_scalars(step, loss=loss / 2, grad_norm=grad_norm)
    mon.stop()


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    megatron_cpu_shim.install()
    torch.cuda.synchronize = lambda *a, **k: None  # the schedules synchronise the (absent) GPU
    from megatron.core import parallel_state as ps

    for config in CONFIGS:
        train(config, out_dir)
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
    from support import finish

    finish()
