"""Test-only shims that let TorchTitan 0.3.0's real ``Trainer`` train on the CPU with gloo
(as the project's platform notes measured them, section "TorchTitan 0.3.0, transformers
5.x and TRL 1.16 on CPU"); none of them is part of the product.

- ``install()``: TorchTitan picks "cuda" where no accelerator is present: the
  ``device_type``/``device_module`` its modules copied become the CPU's
  (``CpuDeviceModule``: ``torch.cpu`` plus what TorchTitan's memory monitor asks of a
  device module). FlexAttention has no backward on the CPU: its compiled call becomes
  ``dense_flex_attention``, the same softmax(q k^T * scale) v under the ``BlockMask``'s
  own ``mask_mod``, and the block mask is made eagerly instead of through
  ``torch.compile``. torch 2.13 has no ``torch.distributed.set_timeout``, which
  ``Trainer.train()`` calls (``set_pg_timeouts``) after its first step: a no-op here.
- ``cpu_config(model, ...)``: the model's own debug config (``llama3_debugmodel``,
  ``deepseek_v3_debugmodel``, with their selective activation checkpointing,
  ``ChunkedLossWrapper``, fused AdamW and clipping) with what the CPU needs: fp32
  parameters (FSDP2's mixed precision defaults to bf16 parameters), the
  ``partial_dtensor`` SPMD backend (the default ``spmd_types`` one fails on torch 2.13),
  a fixed seed, CUDA graphs, validation and checkpoints off, and random-token data
  (``RandomTokenDataLoader``, ``StandInTokenizer``: the tokenizer and the ``c4_test``
  assets are not in the wheel).
- ``force_sum_reductions(model_parts)``: gloo has no PREMUL_SUM, which FSDP2 picks for
  TorchTitan's divide factor 1.0; FSDP2's own ``set_force_sum_reduction_for_comms`` makes
  it a SUM (the divide by 1.0 after it is skipped: the same values).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Tuple

import torch

import torchtitan.trainer  # noqa: F401 - every module that copies the device names, loaded first
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common import attention as titan_attention
from torchtitan.trainer import Trainer

DEBUG_CONFIGS = {
    "llama3": ("torchtitan.models.llama3.config_registry", "llama3_debugmodel"),
    "deepseek_v3": ("torchtitan.models.deepseek_v3.config_registry", "deepseek_v3_debugmodel"),
}


# ------------------------------------------------------------------------ device
class CpuDeviceModule:
    """``torch.cpu`` with the calls TorchTitan's memory monitor makes on its device module
    (name, properties, memory statistics: the CPU has no caching allocator to report)."""

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        import os
        import types

        return types.SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: Any = None) -> Dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


CPU_DEVICE_MODULE = CpuDeviceModule()


def _use_cpu_device() -> None:
    import sys

    import torchtitan.models.deepseek_v3.config_registry  # noqa: F401 - loads the MoE token dispatcher
    import torchtitan.models.llama3.config_registry  # noqa: F401

    # ``from torchtitan.tools.utils import device_type`` copies the name into each module
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = CPU_DEVICE_MODULE


# --------------------------------------------------------------------- attention
def dense_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """FlexAttention's maths without its kernel: the mask is the ``BlockMask``'s own
    ``mask_mod`` at every (batch, head, query, key) position. ``q``, ``k``, ``v`` are
    ``(B, heads, L, head_dim)``; returns ``(out, AuxOutput)`` as the compiled call does."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    assert score_mod is None, "the stand-in has no score_mod (TorchTitan's decoders pass none)"
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[-2]
    if enable_gqa and k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    mask = create_mask(block_mask.mask_mod, batch, None, q_len, kv_len, device=q.device)  # (B, 1, L, S)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(head_dim))
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, AuxOutput(lse=lse if return_aux is not None and return_aux.lse else None)


def _eager_block_mask(*args, **kwargs):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(*args, **kwargs)


def install() -> None:
    """The shims every TorchTitan Trainer of this process needs on the CPU (idempotent)."""
    _use_cpu_device()
    titan_attention.FlexAttention.compiled_flex_attn = staticmethod(dense_flex_attention)
    titan_attention._compiled_create_block_mask = _eager_block_mask
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None


# --------------------------------------------------------------------------- data
class StandInTokenizer(BaseTokenizer):
    """The tokenizer the Trainer builds (its assets are not in the wheel): ids only."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, **_: Any) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos_id = 0

    def encode(self, *args, **kwargs) -> List[int]:
        raise NotImplementedError("the random-token data loader needs no text")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("the random-token data loader needs no text")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class RandomTokenDataLoader(BaseDataLoader):
    """Rows of random token ids, each two documents (positions restart at 0 where the
    second begins, so the document mask matters), the labels the next tokens; seeded by
    the data-parallel rank, so that two Trainers of one process see the same batches."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 2048
        seed: int = 1234

    def __init__(self, config: Config, *, dp_rank: int, seq_len: int, local_batch_size: int, **_: Any) -> None:
        self.vocab_size, self.seq_len, self.batch = config.vocab_size, seq_len, local_batch_size
        self.seed = config.seed + 1000 * dp_rank

    def __iter__(self) -> Iterator[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            tokens = torch.randint(0, self.vocab_size, (self.batch, self.seq_len + 1), generator=g)
            first = int(torch.randint(self.seq_len // 4, 3 * self.seq_len // 4, (), generator=g))
            positions = torch.cat([torch.arange(first), torch.arange(self.seq_len - first)]).expand(self.batch, -1)
            yield {"input": tokens[:, :-1], "positions": positions.clone()}, tokens[:, 1:]

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        pass


# ------------------------------------------------------------------------- config
def cpu_config(model: str, *, dump_folder: str, steps: int, seq_len: int, local_batch_size: int,
               grad_acc_steps: int, data_parallel: int, expert_parallel: int = 1) -> Trainer.Config:
    """``model``'s TorchTitan debug config as the CPU runs it (see the module docstring)."""
    import importlib

    module, function = DEBUG_CONFIGS[model]
    config: Trainer.Config = getattr(importlib.import_module(module), function)()
    vocab = config.model_spec.model.vocab_size
    config.dump_folder = dump_folder
    config.tokenizer = StandInTokenizer.Config(vocab_size=vocab)
    config.dataloader = RandomTokenDataLoader.Config(vocab_size=vocab)
    config.training = dataclasses.replace(
        config.training, steps=steps, seq_len=seq_len, local_batch_size=local_batch_size,
        global_batch_size=local_batch_size * data_parallel * grad_acc_steps,
        mixed_precision_param="float32", disable_cuda_graphs=True,
    )
    config.parallelism = dataclasses.replace(
        config.parallelism, spmd_backend="partial_dtensor", data_parallel_shard_degree=data_parallel,
        expert_parallel_degree=expert_parallel,
    )
    config.debug.seed = 0  # the same initial weights in every Trainer of the process
    config.checkpoint.enable = False
    config.validator.enable = False
    config.metrics.log_freq = 1
    return config


def force_sum_reductions(model_parts) -> None:
    """FSDP2 reduce-scatters as SUM instead of PREMUL_SUM(1.0), which gloo lacks."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
