"""Worker for tests/stacks/test_deepspeed.py, run by torchrun with 2 gloo ranks on the CPU.

    deepspeed_train.py OUT_DIR CONFIG [CONFIG ...]      CONFIG = z<stage>-<fp32|bf16>-gas<n>

For each CONFIG, the same model is trained twice through ``deepspeed.initialize``
(``engine.backward(loss); engine.step()`` per micro-batch, AdamW with ``torch_adam``):
once with two monitors (``monitor_mbs_grad`` false, with weight_grad, optimizer and param;
``monitor_mbs_grad`` true, with weight_grad and module) and once without. Each rank saves to
``OUT_DIR/<CONFIG>/ref_rank<r>.pt`` the independent references the test compares the
rows with:

- ``mb``: each micro-batch's local gradient, from ``torch.autograd.grad`` on a plain torch
  replica whose parameters are copied from the engine's model at the start of each step
  (same dtype, same inputs, same 1/gas loss scaling);
- ``acc``: the local accumulated gradient, summed as the stack sums it (fp32 buffer for
  BF16_Optimizer, the gradient dtype otherwise), ``mean``: the rank average of ``acc``
  in fp64 (gathered from both ranks);
- ``masters``/``exp_avg``/``exp_avg_sq``: a plain ``torch.optim.AdamW`` on fp32 copies of
  the initial weights, stepped with ``mean`` clipped to the global norm ``CLIP``;
- ``ds``: the masters and moments after each step through DeepSpeed's public
  ``safe_get_full_fp32_param``/``safe_get_full_optimizer_state`` (ZeRO-1/2/3);
- ``full_grad``: the reduced gradient of each step, whole, through DeepSpeed's public
  ``safe_get_full_grad`` after the last micro-batch's ``engine.backward`` (before
  ``engine.step()`` applies it; a collective under ZeRO-3, called in the unmonitored run
  too); ``params_before``: the engine's parameters, whole, at the start of each step;
  ``torch_state``: ZeRO-0 fp32 only, the torch optimizer's moments after each step;
- ``grad_norm``: ``engine.get_global_grad_norm()``; ``identical``: the monitored run's
  losses and parameters equal the unmonitored run's bit for bit; ``restored``: ``stop()``
  left the engine as it was; ``warnings``: what the monitor logged.
"""

import logging
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

STEPS = 3
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01
CLIP = 1.0  # DeepSpeed's default, explicit: with gas 1 the gradients of this model exceed it


class Net(torch.nn.Module):
    """103 parameters: under ZeRO-1/2 rank 0's partition holds part of fc1.weight only,
    rank 1 the rest of it and every other parameter; under ZeRO-3 each is split."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def ds_config(stage: int, dtype: str, gas: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WD, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": CLIP,
        "steps_per_print": 10 ** 9,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
        if stage == 1:  # DeepSpeed builds its BF16_Optimizer for ZeRO-1 with fp32 accumulation
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def micro_batches(rank: int, dtype: torch.dtype, gas: int):
    g = torch.Generator().manual_seed(1000 + rank)
    return [[(torch.randn(4, 6, generator=g).to(dtype), torch.randn(4, 3, generator=g).to(dtype))
             for _ in range(gas)] for _ in range(STEPS)]


def full_params(engine, stage: int):
    """The model's parameters, whole (a collective under ZeRO-3)."""
    params = list(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}
    return {n: p.detach().clone() for n, p in params}


def full_masters(engine, stage: int):
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in engine.module.named_parameters():
        m = safe_get_full_fp32_param(p)
        out[n] = (m if m is not None else p).detach().float().clone()
    return out


def full_grads(engine):
    """The reduced gradients, whole, as DeepSpeed's public API assembles them."""
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().float().clone() for n, p in engine.module.named_parameters()}


def torch_moments(engine):
    """ZeRO-0 fp32: engine.optimizer is the torch optimizer, its state keyed by parameter."""
    if not isinstance(engine.optimizer, torch.optim.Optimizer):
        return None
    state = engine.optimizer.state
    return {f"{n}.{k}": state[p][k].detach().clone() for n, p in engine.module.named_parameters()
            for k in ("exp_avg", "exp_avg_sq")}


def public_state(engine):
    """fp32 masters and Adam moments after a step, whole, through DeepSpeed's public API
    (collectives; None where it offers none: ZeRO-0)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for n, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p)
        if master is None:
            return None
        out[n] = master.detach().float().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{n}.{key}"] = safe_get_full_optimizer_state(p, key).detach().float().clone()
    return out


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def train(config: str, out_dir: str, monitored: bool):
    stage, dtype_name, gas = config.split("-")
    stage, gas = int(stage[1:]), int(gas[3:])
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config(stage, dtype_name, gas))
    names = [n for n, _ in engine.module.named_parameters()]
    replica = Net().to(dtype)
    kind = type(engine.optimizer).__name__
    acc_dtype = torch.float32 if kind == "BF16_Optimizer" else dtype
    masters = {n: t.clone().requires_grad_(True) for n, t in full_masters(engine, stage).items()}
    ref_opt = torch.optim.AdamW([masters[n] for n in names], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    monitors, capture = [], Capture()
    if monitored:
        logging.getLogger("msprobe.monitor_v2").addHandler(capture)
        for mbs in (False, True):
            mons = {"weight_grad": {"enabled": True, "monitor_mbs_grad": mbs}}
            if mbs:
                mons["module"] = {"enabled": True, "targets": []}
            else:
                mons.update({"optimizer": {"enabled": True}, "param": {"enabled": True}})
            mon = TrainerMonitorV2({"output_dir": os.path.join(out_dir, "mbs" if mbs else "acc"),
                                    "monitors": mons}, fr="pytorch")
            mon.start(model=engine, optimizer=optimizer)
            monitors.append(mon)

    ref = {"names": names, "kind": kind, "mb": [], "acc": [], "mean": [], "grad_norm": [],
           "masters_before": [], "masters_after": [], "exp_avg": [], "exp_avg_sq": [], "ds": [],
           "full_grad": [], "params_before": [], "torch_state": []}
    losses = []
    for step, batches in enumerate(micro_batches(rank, dtype, gas)):
        before = full_params(engine, stage)
        ref["params_before"].append({n: t.float() for n, t in before.items()})
        replica.load_state_dict(before)
        ref["masters_before"].append({n: masters[n].detach().clone() for n in names})
        mb_grads = []
        for i, (x, y) in enumerate(batches):
            loss_ref = torch.nn.functional.mse_loss(replica(x), y) / gas
            grads = torch.autograd.grad(loss_ref, list(replica.parameters()))
            mb_grads.append({n: g.detach().clone() for n, g in zip(names, grads)})
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            if i == gas - 1:  # the boundary: reduced, not yet applied
                ref["full_grad"].append(full_grads(engine))
            engine.step()
            losses.append(loss.detach().float().clone())
        acc = {}
        for n in names:
            total = None
            for g in mb_grads:
                total = g[n].to(acc_dtype) if total is None else total + g[n].to(acc_dtype)
            acc[n] = total
        gathered = [None, None]
        dist.all_gather_object(gathered, {n: t.double() for n, t in acc.items()})
        mean = {n: (gathered[0][n] + gathered[1][n]) / 2 for n in names}
        # DeepSpeed clips inside its step (after the monitor read 'reduced'), by the global norm
        total = sum(float((m * m).sum()) for m in mean.values()) ** 0.5
        scale = CLIP / (total + 1e-6) if total + 1e-6 > CLIP else 1.0
        for n in names:
            masters[n].grad = (mean[n] * scale).float().reshape(masters[n].shape)
        ref_opt.step()
        ref_opt.zero_grad()
        ref["mb"].append(mb_grads)
        ref["acc"].append(acc)
        ref["mean"].append(mean)
        norm = engine.get_global_grad_norm()
        ref["grad_norm"].append(None if norm is None else float(norm))
        ref["masters_after"].append({n: masters[n].detach().clone() for n in names})
        ref["ds"].append(public_state(engine))
        ref["torch_state"].append(torch_moments(engine))
        ref["exp_avg"].append({n: ref_opt.state[masters[n]]["exp_avg"].clone() for n in names})
        ref["exp_avg_sq"].append({n: ref_opt.state[masters[n]]["exp_avg_sq"].clone() for n in names})

    restored = True
    for mon in reversed(monitors):
        mon.stop()
    if monitored:
        restored = not {"_take_model_step", "step", "__getstate__"} & set(vars(engine))
        logging.getLogger("msprobe.monitor_v2").removeHandler(capture)
    ref["warnings"] = capture.messages
    ref["restored"] = restored
    final = {"losses": losses, "params": full_params(engine, stage), "masters": full_masters(engine, stage)}
    if hasattr(engine, "destroy"):
        engine.destroy()
    return ref, final


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def main() -> None:
    out_root, configs = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for config in configs:
        out_dir = os.path.join(out_root, config)
        os.makedirs(out_dir, exist_ok=True)
        ref, with_monitor = train(config, out_dir, monitored=True)
        _, without = train(config, out_dir, monitored=False)
        ref["identical"] = same(with_monitor, without)
        torch.save(ref, os.path.join(out_dir, f"ref_rank{rank}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
    from support import finish

    finish()
