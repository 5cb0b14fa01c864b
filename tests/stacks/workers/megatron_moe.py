"""Worker for tests/stacks/test_megatron_moe.py, run by torchrun with 2 gloo ranks on the CPU.

    megatron_moe.py OUT_DIR

Builds a small Megatron-Core GPTModel with MoE layers (4 experts, top-2, ``SequentialMLP``
experts, the ``allgather`` dispatcher; TP=PP=EP=1) under the CPU shim, and trains it two
steps twice from the same seed: with the ``moe`` monitor and without it. Each rank feeds
its own tokens. Saved to ``<OUT_DIR>/ref_rank<r>.pt``: the routing maps ``TopKRouter``
returned in each step (captured by a forward hook of this script, copies), the losses and
final parameters of both runs, and the monitor's log records.
"""

import logging
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_cpu_shim  # noqa: E402
from support.worker import finish  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 64, 8, 2, 2


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))


def build():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=4, moe_router_topk=2,
                            moe_token_dispatcher_type="allgather", moe_ffn_hidden_size=32, add_bias_linear=False)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False),
                    vocab_size=VOCAB, max_sequence_length=SEQ)


def train(model, rank, out_dir=None):
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = None
    if out_dir is not None:
        mon = TrainerMonitorV2({"output_dir": out_dir, "monitors": {"moe": {"enabled": True}}})
        mon.start(model=model, optimizer=opt)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.stop()
    return losses, mon


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    megatron_cpu_shim.install()
    from megatron.core import parallel_state as ps
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 names it only where Transformer Engine imports
        moe_utils.te_general_gemm = None
    ps.initialize_model_parallel(1, 1)
    model = build()
    twin = build()  # the same seeds: the same weights (a Megatron model holds process groups: no deepcopy)
    maps = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.router"):
            module.register_forward_hook(
                lambda m, a, o, name=name: maps.setdefault(name, []).append(o[1].detach().clone()))
    capture = LogCapture()
    logging.getLogger("msprobe.monitor_v2").addHandler(capture)
    losses, mon = train(model, rank, out_dir)
    losses_off, _ = train(twin, rank)
    torch.save({"maps": maps, "losses": losses, "losses_off": losses_off,
                "params": [p.detach().clone() for p in model.parameters()],
                "params_off": [p.detach().clone() for p in twin.parameters()],
                "errors": mon.errors.count, "logs": capture.records},
               os.path.join(out_dir, f"ref_rank{rank}.pt"))
    finish()


if __name__ == "__main__":
    main()
