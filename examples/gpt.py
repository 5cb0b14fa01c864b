"""A small GPT-style decoder in plain PyTorch, and deterministic synthetic training data.

Used by ``train_gpt.py`` (the main-job demo) and meant to be reused by benchmarks:
put this folder on ``sys.path`` and ``from gpt import GPT, GPTConfig, synthetic_batches``.

Model: token + learned position embedding, ``n_layer`` pre-LayerNorm blocks (causal
multi-head self-attention through ``scaled_dot_product_attention(is_causal=True)``,
then a GELU MLP, each with a residual connection), a final LayerNorm and an LM head
whose weight is tied to the token embedding.

Data: every sequence is an arithmetic progression ``x[t+1] = (x[t] + stride) % vocab``
with a random start and a per-sequence stride drawn from ``strides``; each token is
replaced by a uniformly random one with probability ``noise``. The model can learn the
rule (successor lookup plus the stride, inferred in context), so the loss goes down
from about ``ln(vocab_size)`` towards the noise floor.
"""

import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "synthetic_tokens", "synthetic_batches"]


@dataclass
class GPTConfig:
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    vocab_size: int = 512
    block_size: int = 64  # maximum context length
    dropout: float = 0.0
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "block_size", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Decoder-only language model. ``forward(idx, targets=None)`` returns the logits
    ``(batch, time, vocab)`` and, when ``targets`` is given, the mean cross-entropy."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying: one parameter, two uses
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of distinct parameters' elements (the tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


# ------------------------------------------------------------------ synthetic data
def synthetic_tokens(
    n_seqs: int,
    seq_len: int,
    vocab_size: int,
    generator: torch.Generator,
    strides: Sequence[int] = (1, 2, 3),
    noise: float = 0.1,
) -> torch.Tensor:
    """``(n_seqs, seq_len)`` int64 tokens: noisy arithmetic progressions mod ``vocab_size``
    (see the module docstring). Deterministic for a given ``generator`` state."""
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise!r}")
    start = torch.randint(0, vocab_size, (n_seqs, 1), generator=generator)
    stride_table = torch.tensor(list(strides), dtype=torch.long)
    stride = stride_table[torch.randint(0, len(stride_table), (n_seqs, 1), generator=generator)]
    seqs = (start + stride * torch.arange(seq_len).unsqueeze(0)) % vocab_size
    flip = torch.rand(n_seqs, seq_len, generator=generator) < noise
    random_tokens = torch.randint(0, vocab_size, (n_seqs, seq_len), generator=generator)
    return torch.where(flip, random_tokens, seqs)


def synthetic_batches(
    cfg: GPTConfig,
    batch_size: int,
    seed: int = 0,
    strides: Sequence[int] = (1, 2, 3),
    noise: float = 0.1,
    device: Optional[torch.device] = None,
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Endless, deterministic stream of ``(inputs, targets)`` batches of shape
    ``(batch_size, block_size)``; targets are the inputs shifted by one token. The same
    ``seed`` always yields the same stream, independent of the global RNG."""
    g = torch.Generator().manual_seed(seed)
    while True:
        seqs = synthetic_tokens(batch_size, cfg.block_size + 1, cfg.vocab_size, g, strides, noise)
        if device is not None:
            seqs = seqs.to(device)
        yield seqs[:, :-1], seqs[:, 1:]
