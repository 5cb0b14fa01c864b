"""Worker for tests/distributed/test_fsdp2_tensor_parallel_merge.py, run by torchrun with
4 gloo ranks on a 2-D ``DeviceMesh`` (dp=2, tp=2).

    fsdp2_tensor_parallel.py OUT_DIR

Three runs in one launch: FSDP2 + tensor parallel (``OUT_DIR/mon``, ``ref_rank<r>.pt``),
FSDP2 hybrid sharding (``OUT_DIR/hsdp``, ``hsdp_rank<r>.pt``; see ``hsdp``) and tensor
parallelism alone over the 4 ranks (``OUT_DIR/tp``, ``tp_rank<r>.pt``).

The model: ``emb`` and ``head`` plain (FSDP2-sharded over dp only), ``fc1`` column- and
``fc2`` row-parallel (``parallelize_module`` over tp), then ``fully_shard`` over dp;
shapes chosen so that some shards are uneven. Each dp rank trains on its own data (the
two tp ranks of a dp rank on the same data), AdamW, the weight_grad, param and
optimizer monitors on. Every rank saves ``ref_rank<r>.pt``, per step, computed outside
the monitor:

- ``param``: every parameter's ``full_tensor()`` right before ``optimizer.step()``;
- ``grad``: every reduced gradient's ``full_tensor()`` at the same point;
- ``exp_avg``: every AdamW ``exp_avg`` ``full_tensor()`` after the step;
- ``local``: this dp rank's own (unreduced) gradient of the whole tensor, from
  ``torch.autograd.grad`` on an unmonitored, unsharded twin whose parameters are set from
  the full parameters at the start of the step;
- ``act``: the twin's activations around ``fc1`` and ``fc2`` and their gradients, by the
  module row they correspond to (the module monitor is on too).
"""

import os
import sys

import torch
import torch.distributed as dist

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STEPS = 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(6, 5)  # dp shards of 3 and 2 rows
        self.fc1 = torch.nn.Linear(5, 12)  # column parallel: 6 rows per tp rank, 3 per dp shard
        self.fc2 = torch.nn.Linear(12, 7)  # row parallel: 6 columns per tp rank; dp shards of 4 and 3 rows
        self.head = torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.head(self.fc2(torch.relu(self.fc1(self.emb(x)))))


def batches(dp_rank: int):
    g = torch.Generator().manual_seed(100 + dp_rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(STEPS)]


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def fsdp2_tp(out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_coordinate()
    torch.manual_seed(0)
    model = Net()
    twin = Net()
    twin.load_state_dict(model.state_dict())
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model.fc1, mesh=mesh["dp"])
    fully_shard(model.fc2, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    refs = train(model, twin, dp_rank, os.path.join(out_dir, "mon"))
    torch.save({"dp_rank": dp_rank, "tp_rank": tp_rank, "steps": refs},
               os.path.join(out_dir, f"ref_rank{dist.get_rank()}.pt"))


def hsdp(out_dir: str) -> None:
    """FSDP2 hybrid sharding on a (dp_replicate=2, dp_shard=2) mesh: shards within a
    replicate group, replicas across; every rank is its own data-parallel rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(0)
    model = Net()
    twin = Net()
    twin.load_state_dict(model.state_dict())
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    refs = train(model, twin, dist.get_rank(), os.path.join(out_dir, "hsdp"))
    torch.save({"coordinate": list(mesh.get_coordinate()), "steps": refs},
               os.path.join(out_dir, f"hsdp_rank{dist.get_rank()}.pt"))


def tensor_parallel_only(out_dir: str) -> None:
    """Tensor parallelism alone on a 1-D ``("tp",)`` mesh of the 4 ranks: no data
    parallelism (every rank trains on the same data), ``emb`` and ``head`` plain tensors
    replicated on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Net()
    twin = Net()
    twin.load_state_dict(model.state_dict())
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    refs = train(model, twin, 0, os.path.join(out_dir, "tp"))
    torch.save({"tp_rank": mesh.get_coordinate()[0], "steps": refs},
               os.path.join(out_dir, f"tp_rank{dist.get_rank()}.pt"))


def train(model, twin, dp_rank: int, output_dir: str):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2({
        "output_dir": output_dir,
        "monitors": {"weight_grad": {"enabled": True}, "param": {"enabled": True},
                     "optimizer": {"enabled": True}, "module": {"enabled": True}},
    })
    mon.start(model=model, optimizer=opt)
    names = [n for n, _ in twin.named_parameters()]
    refs = []
    for x, y in batches(dp_rank):
        params = {n: full(p) for n, p in model.named_parameters()}
        with torch.no_grad():
            for n, p in twin.named_parameters():
                p.copy_(params[n])
        # the twin's forward by hand, to have its activations and their gradients
        h0 = twin.emb(x)
        h1 = twin.fc1(h0)
        a = torch.relu(h1)
        h2 = twin.fc2(a)
        loss = torch.nn.functional.mse_loss(twin.head(h2), y)
        *local, g_h1, g_a, g_h2 = torch.autograd.grad(loss, list(twin.parameters()) + [h1, a, h2])
        act = {"fc1.input.0": h0, "fc1.output.0": h1, "fc2.input.0": a, "fc2.output.0": h2,
               "fc1.grad_output.0": g_h1, "fc2.grad_input.0": g_a, "fc2.grad_output.0": g_h2}
        loss_of(model, x, y).backward()
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        exp_avg = {n: full(opt.state[p]["exp_avg"]) for n, p in model.named_parameters()}
        opt.zero_grad()
        refs.append({"param": params, "grad": grads, "exp_avg": exp_avg,
                     "local": {n: g.detach().clone() for n, g in zip(names, local)},
                     "act": {n: t.detach().clone() for n, t in act.items()}})
    mon.stop()
    return refs


if __name__ == "__main__":
    dist.init_process_group("gloo")
    fsdp2_tp(sys.argv[1])
    hsdp(sys.argv[1])
    tensor_parallel_only(sys.argv[1])
    from support import finish

    finish()
