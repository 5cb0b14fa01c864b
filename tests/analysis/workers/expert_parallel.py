"""Worker for tests/analysis/test_merge_moe.py, run by torchrun with 2 gloo ranks.

    expert_parallel.py OUT_DIR

A tiny mixture of experts with grouped experts under expert parallelism as torch's own
DTensor says it (TorchTitan's way): ``experts.w`` is one ``[E, O, I]`` parameter, E = 4,
sharded ``Shard(0)`` over a 1-D ``DeviceMesh`` named ``ep`` (rank r holds experts
``2r, 2r + 1``), a dense ``head`` beside it. Each rank routes its own tokens to its local
experts by a fixed rule (token t to local expert ``t % 2``), except that global expert 3
(rank 1's local expert 1) never gets a token: its gradient is zero. Trained with Adam and
the monitor on (``weight_grad``, ``param``, ``optimizer``, ``"per_expert": true``).

The references are the worker's own: each step, the full (all experts) gradient, value
before and after the update and ``exp_avg`` of ``experts.w`` (``full_tensor()``), saved by
rank 0 to ``OUT_DIR/ref.pt``.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

E, O, I, STEPS = 4, 3, 5, 2


class Experts(torch.nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        torch.manual_seed(0)
        full = torch.randn(E, O, I)
        self.w = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))


class Moe(torch.nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.experts = Experts(mesh)
        torch.manual_seed(1)
        self.head = torch.nn.Linear(O, 1)
        # frozen: the ranks see different tokens and nothing here all-reduces a dense gradient
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        local = self.experts.w.to_local()  # [2, O, I]: this rank's experts
        choice = torch.arange(x.shape[0]) % 2
        if rank == 1:
            choice = torch.zeros_like(choice)  # local expert 1 (global 3) gets no token
        out = torch.einsum("ti,toi->to", x, local[choice])
        return self.head(out)


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    model = Moe(mesh)
    opt = torch.optim.Adam([model.experts.w], lr=1e-2, foreach=False)
    ops = ["min", "max", "mean", "norm", "nans", "zeros"]
    monitors = {m: {"enabled": True, "ops": ops, "per_expert": True} for m in ("weight_grad", "param", "optimizer")}
    monitors["module"] = {"enabled": False}
    mon = TrainerMonitorV2({"output_dir": os.path.join(out_dir, "run"), "async_write": False, "monitors": monitors})
    mon.start(model=model, optimizer=opt)
    ref = []
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(STEPS):
        x = torch.randn(6, I, generator=g)
        model(x, rank).pow(2).mean().backward()
        w = model.experts.w
        step = {"grad": w.grad.full_tensor(), "before": w.detach().full_tensor()}
        opt.step()
        step["after"] = w.detach().full_tensor()
        step["exp_avg"] = opt.state[w]["exp_avg"].full_tensor()
        opt.zero_grad()
        ref.append(step)
    mon.stop()
    if rank == 0:
        torch.save(ref, os.path.join(out_dir, "ref.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from support import finish

    finish()
