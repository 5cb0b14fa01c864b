"""Worker for test_torchtitan.py, run by torchrun with 2 gloo ranks:

    torchtitan_worker.py OUT_DIR MODEL...        (MODEL: llama3, deepseek_v3)

For each model, TorchTitan 0.3.0's real ``Trainer`` (with the CPU shims of
``torchtitan_shims.py``) trains the model's debug config twice in this process on the same
random-token batches, with TorchTitan's own ``Trainer.train()``: first without the
monitor, then with it, wired as docs/integrations.md shows (``MonitoredTrainer``: a
``Trainer`` whose ``train_step`` ends with ``mon.step()``):

    mon = TrainerMonitorV2(cfg)            # "patch_optimizer_step": false, every monitor on
    mon.start(model=trainer.model_parts, optimizer=trainer.optimizers,
              grad_acc_steps=trainer.gradient_accumulation_steps)
    trainer.train()

llama3 runs on FSDP2 over the 2 ranks, deepseek_v3 on FSDP2 with expert parallel 2, both
with TorchTitan's defaults: selective activation checkpointing, ``ChunkedLossWrapper`` (8
chunks, 8 backward passes through ``lm_head`` per micro-batch), fused AdamW, clipping at
1.0; 2 steps of 2 micro-batches. llama3's ``weight_grad`` keeps its default
(``monitor_mbs_grad`` false, what a user starts with); deepseek_v3's has
``monitor_mbs_grad`` true, the rows per micro-batch that FSDP2 allows (it reduce-scatters
at every micro-batch: the step's accumulated local gradient never exists).

The monitored run reads references outside the monitor, from TorchTitan's own tensors:
``full_tensor()`` of each DTensor, statistics in float64 with NumPy on a copy
(``support.numpy_stats``), for the parameters ``References.READ`` selects:

- ``mb_grad[s][m][name]``: what micro-batch m added to the reduced gradient (``.grad``
  after it minus before it; FSDP2 reduce-scatters with SUM and TorchTitan divides the loss
  by the global token count, so it is the sum over the ranks of their local micro-batch
  gradients, or for an expert-parallel tensor the two ranks' halves side by side);
- ``reduced[s][name]``: ``.grad`` in a step pre-hook of ``trainer.optimizers``, after
  TorchTitan's clipping, right before the update;
- ``origin[s]``/``updated[s]``: the parameters before and after ``optimizers.step()``;
- ``moments[s][name][key]``: ``exp_avg``/``exp_avg_sq`` in
  ``trainer.optimizers.optimizers[i].state`` after the update;
- ``pred[s][m]``/``pred_grad[s][m]``: what ``ChunkedLossWrapper`` receives, the final
  ``norm``'s output, and the gradient the loss sends back to it;
- ``logits[s][m]``, ``logits_grad[s][m]``, ``lm_head_grad[s][m]``: this rank's logits of
  the micro-batch, their gradient and its local ``lm_head.weight`` gradient (the 8 chunks
  together), computed again in float64 from ``pred``, the full ``lm_head.weight``, the
  labels and the global token count (TorchTitan's loss: cross entropy summed, divided by
  the global token count).

Each rank saves ``OUT_DIR/MODEL/ref_rank<r>.pt``: the references, the parameters' row
names, the losses of both runs and whether the parameters ended bit-identical, the
monitor's WARNING lines and the hooks the model and the optimizers carry after ``stop()``
that the unmonitored Trainer does not carry after training. A monitored run that raises
is saved too (``error``, once both ranks got there), and the worker exits there.
"""

import logging
import os
import sys
import traceback
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import torchtitan_shims as shims

shims.install()

from torchtitan.trainer import Trainer  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402
from support import numpy_stats  # noqa: E402

STEPS, GRAD_ACC, LOCAL_BATCH, SEQ_LEN = 2, 2, 2, 32
EXPERT_PARALLEL = {"llama3": 1, "deepseek_v3": 2}
MONITOR_MBS_GRAD = {"llama3": False, "deepseek_v3": True}
Stats = Dict[str, float]


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it), in float64, a copy."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().to(torch.float64).clone()


def row_name(name: str) -> str:
    """A parameter's name as its rows carry it: model chunk 0, checkpoint wrappers left out."""
    return "0:" + name.replace("._checkpoint_wrapped_module", "")


class WarningLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def hook_census(model_parts, optimizers) -> Dict[str, Any]:
    """Every hook and instance-level ``forward`` on the model's modules and parameters, the
    optimizers, and torch's global module and optimizer hooks."""
    from torch.nn.modules import module as module_globals
    from torch.optim import optimizer as optimizer_globals

    census: Dict[str, Any] = {}
    for i, part in enumerate(model_parts):
        for name, module in part.named_modules():
            census[f"{i}:{name}"] = (
                len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks),
                len(module._backward_pre_hooks), "forward" in module.__dict__,
            )
        for name, p in part.named_parameters():
            census[f"{i}:{name}:post_accumulate"] = len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    for j, opt in enumerate([optimizers, *optimizers.optimizers]):
        census[f"optimizer{j}"] = (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))
    census["global optimizer hooks"] = (len(optimizer_globals._global_optimizer_pre_hooks),
                                        len(optimizer_globals._global_optimizer_post_hooks))
    census["global module hooks"] = (len(module_globals._global_forward_hooks),
                                     len(module_globals._global_forward_pre_hooks),
                                     len(module_globals._global_backward_hooks),
                                     len(module_globals._global_backward_pre_hooks))
    return census


class References:
    """The monitored run's reads of TorchTitan's tensors (see the module docstring), for the
    parameters in ``READ``: every kind both models have (embedding, attention, norms, dense
    and shared-expert FFN, router, 3-D routed experts, lm_head) without the cost of all."""

    READ = ("0:tok_embeddings.", "0:layers.0.", "0:layers.1.", "0:norm.", "0:lm_head.")
    PER_MICRO_BATCH = ("mb_grad", "pred", "pred_grad", "logits", "logits_grad", "lm_head_grad")
    PER_STEP = ("reduced", "origin", "updated", "moments", "expert_norms")

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.params = {row_name(name): p for name, p in trainer.model_parts[0].named_parameters()
                       if row_name(name).startswith(self.READ)}
        self.names_of = {id(p): name for name, p in self.params.items()}
        self.lm_head_weight = trainer.model_parts[0].lm_head.weight
        self.step = -1
        self.seen_grads: Dict[str, torch.Tensor] = {}
        self.losses: List[float] = []
        for key in self.PER_MICRO_BATCH + self.PER_STEP:
            setattr(self, key, [])
        self.handles: List[Any] = []
        self._install()

    def begin_step(self) -> None:
        self.step += 1
        self.seen_grads = {}
        for key in self.PER_MICRO_BATCH:
            getattr(self, key).append([])

    def _after_micro_batch(self) -> None:
        added: Dict[str, Stats] = {}
        for name, p in self.params.items():
            if p.grad is None:
                continue
            g = full(p.grad)
            before = self.seen_grads.get(name)
            added[name] = numpy_stats(g if before is None else g - before)
            self.seen_grads[name] = g
        self.mb_grad[self.step].append(added)

    def _lm_head_again(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor) -> None:
        """The micro-batch's logits, their gradient and this rank's lm_head gradient in float64."""
        weight = full(self.lm_head_weight)
        h = full(pred).flatten(0, 1)
        logits = h @ weight.T
        d_logits = torch.softmax(logits, dim=-1)
        d_logits[torch.arange(len(d_logits)), labels.flatten()] -= 1.0
        d_logits /= float(global_valid_tokens)
        grad = d_logits.T @ h
        self.logits[self.step].append(numpy_stats(logits))
        self.logits_grad[self.step].append(numpy_stats(d_logits))
        self.lm_head_grad[self.step].append(numpy_stats(grad))

    def _install(self) -> None:
        trainer = self.trainer
        forward_backward = trainer.forward_backward_step
        loss_fn = trainer.loss_fn

        def forward_backward_then_read(**kwargs):
            loss = forward_backward(**kwargs)
            self.losses.append(float(loss.detach()))
            self._after_micro_batch()
            return loss

        def loss_reading_its_input(pred, labels, global_valid_tokens, *args, **kwargs):
            assert not (labels < 0).any(), "random tokens: no ignored label"
            self.pred[self.step].append(numpy_stats(full(pred)))
            self._lm_head_again(pred, labels, global_valid_tokens)
            slot = self.pred_grad[self.step]
            pred.register_hook(lambda g: slot.append(numpy_stats(full(g))))
            return loss_fn(pred, labels, global_valid_tokens, *args, **kwargs)

        trainer.forward_backward_step = forward_backward_then_read
        trainer.loss_fn = loss_reading_its_input

        def before_update(optimizer, args, kwargs):
            self.reduced.append({n: numpy_stats(full(p.grad)) for n, p in self.params.items() if p.grad is not None})
            # the routed experts' per-expert gradient norms (3-D tensors [E, ...]), all experts
            self.expert_norms.append({n: full(p.grad).flatten(1).norm(dim=1).tolist() for n, p in self.params.items()
                                      if p.grad is not None and p.dim() == 3})
            self.origin.append({n: numpy_stats(full(p)) for n, p in self.params.items()})

        def after_update(optimizer, args, kwargs):
            self.updated.append({n: numpy_stats(full(p)) for n, p in self.params.items()})
            moments: Dict[str, Dict[str, Stats]] = {}
            for inner in trainer.optimizers.optimizers:
                for p, state in inner.state.items():
                    if id(p) in self.names_of:
                        moments[self.names_of[id(p)]] = {key: numpy_stats(full(state[key]))
                                                          for key in ("exp_avg", "exp_avg_sq")}
            self.moments.append(moments)

        # on the container, before the monitor starts; TorchTitan's own pre-hook there (MoE
        # load balancing) only changes buffers, so the order changes nothing that is read
        self.handles = [trainer.optimizers.register_step_pre_hook(before_update),
                        trainer.optimizers.register_step_post_hook(after_update)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def saved(self) -> Dict[str, Any]:
        return {key: getattr(self, key) for key in self.PER_MICRO_BATCH + self.PER_STEP + ("losses",)}


class Losses:
    """The loss of every micro-batch as ``forward_backward_step`` returns it."""

    def __init__(self, trainer: Trainer) -> None:
        self.values: List[float] = []
        forward_backward = trainer.forward_backward_step

        def forward_backward_keeping_loss(**kwargs):
            loss = forward_backward(**kwargs)
            self.values.append(float(loss.detach()))
            return loss

        trainer.forward_backward_step = forward_backward_keeping_loss


class MonitoredTrainer(Trainer):
    """docs/integrations.md's wiring: TorchTitan's own ``train()``, the monitor's step ended
    after each ``train_step`` (``monitor`` None: the unmonitored run). ``before_step`` is the
    test's (the references' step counter)."""

    monitor = None
    before_step = None

    def train_step(self, data_iterator):
        if self.before_step is not None:
            self.before_step()
        super().train_step(data_iterator)
        if self.monitor is not None:
            self.monitor.step()


def build(model: str, dump: str) -> MonitoredTrainer:
    config = shims.cpu_config(model, dump_folder=dump, steps=STEPS, seq_len=SEQ_LEN, local_batch_size=LOCAL_BATCH,
                              grad_acc_steps=GRAD_ACC, data_parallel=2, expert_parallel=EXPERT_PARALLEL[model])
    trainer = MonitoredTrainer(config)
    shims.force_sum_reductions(trainer.model_parts)
    return trainer


def agree(ok: bool) -> bool:
    """True on every rank where every rank got here without an error."""
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag) == 0


def monitor_config(output_dir: str, model: str) -> Dict[str, Any]:
    monitors: Dict[str, Dict[str, Any]] = {
        name: {"enabled": True} for name in ("module", "weight_grad", "optimizer", "param", "cc")}
    if MONITOR_MBS_GRAD[model]:
        monitors["weight_grad"]["monitor_mbs_grad"] = True
    if EXPERT_PARALLEL[model] > 1:  # the MoE model: its routers' raw counts for merge's global loads
        monitors["moe"] = {"enabled": True, "per_expert": True}
    return {"output_dir": output_dir, "patch_optimizer_step": False, "monitors": monitors}


class RoutedExperts:
    """The expert ids each MoE router of the model chose, per step and micro-batch, from a
    forward hook of the test's own on the router (``TokenChoiceTopKRouter`` returns the
    scores, then the ``[tokens, top_k]`` expert ids); the forwards selective activation
    checkpointing recomputes inside the backward pass are not the training's and are not
    kept. ``counts[s][router]``: NumPy's count of each expert over the step's
    micro-batches, on this rank."""

    def __init__(self, trainer: Trainer) -> None:
        self.num_experts: Dict[str, int] = {}
        self.ids: Dict[str, List[List[Any]]] = {}
        self.handles = []
        self.step = -1
        for name, module in trainer.model_parts[0].named_modules():
            if type(module).__name__ == "TokenChoiceTopKRouter":
                tag = row_name(name)
                self.num_experts[tag] = int(module.num_experts)
                self.ids[tag] = []
                self.handles.append(module.register_forward_hook(
                    lambda m, args, out, tag=tag: self._keep(tag, out)))

    def begin_step(self) -> None:
        self.step += 1
        for per_step in self.ids.values():
            per_step.append([])

    def _keep(self, tag: str, out: Any) -> None:
        if torch._C._current_autograd_node() is not None:
            return  # recomputed in the backward pass
        ids = out[1]
        ids = ids.to_local() if hasattr(ids, "to_local") else ids
        self.ids[tag][self.step].append(ids.detach().cpu().numpy().copy())

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def saved(self) -> Dict[str, Any]:
        import numpy as np

        return {"router_calls": {tag: [len(calls) for calls in steps] for tag, steps in self.ids.items()},
                "router_counts": [{tag: np.bincount(np.concatenate([c.ravel() for c in steps[s]]),
                                                    minlength=self.num_experts[tag]).tolist()
                                   for tag, steps in self.ids.items() if steps[s]}
                                  for s in range(self.step + 1)]}


def run(out_dir: str, model: str) -> bool:
    """Both runs of ``model``; False where the monitored one raised."""
    rank = int(os.environ["RANK"])  # the first Trainer initialises the process group
    plain = build(model, os.path.join(out_dir, "plain_dump"))
    plain_losses = Losses(plain)
    plain.train()
    plain_params = {n: full(p) for n, p in plain.model_parts[0].named_parameters()}
    # what the same Trainer carries after training without the monitor (FSDP2 adds hooks
    # of its own at its first forward): the monitored one must carry no more after stop()
    unmonitored_hooks = hook_census(plain.model_parts, plain.optimizers)
    plain.close()

    trainer = build(model, os.path.join(out_dir, "dump"))
    refs = References(trainer)
    routed = RoutedExperts(trainer)
    lines = WarningLines()
    logging.getLogger("msprobe").addHandler(lines)

    def before_step() -> None:
        refs.begin_step()
        routed.begin_step()

    trainer.before_step = before_step
    mon = TrainerMonitorV2(monitor_config(os.path.join(out_dir, "mon"), model))
    error = None
    try:
        mon.start(model=trainer.model_parts, optimizer=trainer.optimizers,
                  grad_acc_steps=trainer.gradient_accumulation_steps)
        trainer.monitor = mon
        trainer.train()
    except Exception:  # noqa: BLE001 - the test reports it, with the rows written before it
        error = traceback.format_exc()
    mon.stop()
    logging.getLogger("msprobe").removeHandler(lines)
    refs.remove()
    routed.remove()
    left = hook_census(trainer.model_parts, trainer.optimizers)
    saved = {"model": model, "rank": rank, "error": error, "warnings": lines.lines,
             "left_after_stop": {k: (unmonitored_hooks.get(k), v) for k, v in left.items()
                                 if unmonitored_hooks.get(k) != v},
             "names": [row_name(n) for n, _ in trainer.model_parts[0].named_parameters()],
             "ndims": {row_name(n): p.dim() for n, p in trainer.model_parts[0].named_parameters()},
             "read": list(refs.params), "grad_acc": trainer.gradient_accumulation_steps,
             "monitor_mbs_grad": MONITOR_MBS_GRAD[model], "plain_losses": plain_losses.values,
             **refs.saved(), **routed.saved()}
    ok = agree(error is None)
    if ok:
        params = {n: full(p) for n, p in trainer.model_parts[0].named_parameters()}
        saved["identical"] = all(torch.equal(params[n], plain_params[n]) for n in plain_params)
    torch.save(saved, os.path.join(out_dir, f"ref_rank{rank}.pt"))
    if ok:
        trainer.close()
    return ok


def main(out_dir: str, models: List[str]) -> None:
    for model in models:
        os.makedirs(os.path.join(out_dir, model), exist_ok=True)
        if not run(os.path.join(out_dir, model), model):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # the ranks may disagree on the collectives left: no teardown


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    from support import finish

    finish()
