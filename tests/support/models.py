"""Tiny real models and data for the tests: deterministic weights and batches."""

import torch


class TinyMLP(torch.nn.Module):
    """Two linear layers and an in-place ReLU; deterministic weights from ``seed``."""

    def __init__(self, d_in: int = 6, d_hidden: int = 10, d_out: int = 3, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.act = torch.nn.ReLU(inplace=True)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def make_batches(n: int, batch: int = 4, d_in: int = 6, d_out: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)) for _ in range(n)]


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)
