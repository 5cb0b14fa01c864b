"""Real training runs for the tests of ``msprobe-monitor compare``.

``train_gpt(out_dir, ...)`` trains a tiny GPT-style decoder (4 pre-LayerNorm blocks) on
the CPU for ``STEPS`` steps with every monitor that has rows on one process (module,
weight_grad, optimizer, param), every step written, and logs the loss through
``mon.log_scalars`` where the monitor has it; ``train_gpt`` returns the (step, loss, grad
norm) triples, which ``write_loss_log`` writes as ``compare --loss-log`` reads them. Options:

- ``bf16``: the forward under ``torch.autocast("cpu", torch.bfloat16)`` (the stand-in of
  a run on other hardware: every matmul in another precision);
- ``init_seed`` / ``data_seed``: the seeds of the weights and of the data (another run of
  the reference setting, as ``--baseline REF2``: the tests give it other seeds, a noise far
  above rounding);
- ``defect_layer`` / ``defect_step``: from that step on, the output of that module is
  multiplied by ``DEFECT_SCALE`` (a forward hook): the injected defect.
"""

from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STEPS = 6
N_LAYER, D_MODEL, N_HEAD, VOCAB, SEQ, BATCH = 4, 32, 2, 64, 16, 4
DEFECT_SCALE = 1.01


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, N_HEAD, d // N_HEAD).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.proj = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(D_MODEL)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(D_MODEL)
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batches(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (BATCH, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        yield seq[:, :-1], seq[:, 1:]


def train_gpt(out_dir: Path, bf16: bool = False, data_seed: int = 1, init_seed: int = 0,
              defect_layer: Optional[str] = None, defect_step: int = 3, monitor: bool = True) -> list:
    """Train; return [(step, loss, global grad norm)] as floats."""
    torch.manual_seed(init_seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = {"step": 0}
    if defect_layer is not None:
        def scale(module, inputs, output):
            return output * DEFECT_SCALE if state["step"] >= defect_step else output

        model.get_submodule(defect_layer).register_forward_hook(scale)
    mon = None
    if monitor:
        mon = TrainerMonitorV2({
            "output_dir": str(out_dir),
            "monitors": {
                "module": {"enabled": True},
                "weight_grad": {"enabled": True},
                "optimizer": {"enabled": True},
                "param": {"enabled": True},
            },
        })
        mon.start(model=model, optimizer=opt)
    losses = []
    for step, (x, y) in enumerate(batches(data_seed, STEPS)):
        state["step"] = step
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
        with ctx:
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        if mon is not None and hasattr(mon, "log_scalars"):
            mon.log_scalars(step, loss=loss.detach(), grad_norm=grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append((step, float(loss.detach()), float(grad_norm)))
    if mon is not None:
        mon.stop()
    return losses


def write_loss_log(path: Path, losses: list) -> Path:
    with open(path, "w") as fh:
        for step, loss, gnorm in losses:
            fh.write(f"{step} {loss!r} {gnorm!r}\n")
    return path
