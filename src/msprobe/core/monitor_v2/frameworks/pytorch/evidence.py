"""The pre-update gradient check of ``alert.dump`` / ``alert.stop_on_nonfinite``.

The CSV alert sees a step only after ``optimizer.step()`` has applied its update; the
evidence must be taken before. Only when one of those fields is set, the optimizer
pre-step hook computes one "any non-finite" flag over the gradients the optimizer is
about to apply (``torch._foreach_norm`` per device, one ``isfinite().all()``, one host
sync per optimizer step: the cost of these fields, docs/configuration.md). A flag that
says non-finite is confirmed per tensor (a norm can overflow where no element does).

On the first non-finite step: the parameters whose gradient is non-finite and their
gradients, then the root module's inputs of that step, then the other parameters and
gradients are copied to the CPU, as far as ``max_bytes`` allows; the files are written
by a thread of their own (never on the training step; ``stop_on_nonfinite`` waits for
them, the job is ending). The inputs are held by weak references from a forward
pre-hook on each root module: no copy, no longer lifetime than the training gives them.
"""

import logging
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ... import evidence
from ...config import AlertSettings
from ...errors import NonFiniteGradientError
from ...monitor import ContainedErrors
from .session import TorchSession

logger = logging.getLogger("msprobe.monitor_v2")

MAX_INPUTS_PER_STEP = 256  # weak references kept per step (long accumulation loops)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GradientGuard:
    def __init__(self, session: TorchSession, settings: AlertSettings, rank: int, rank_dir: str,
                 errors: ContainedErrors) -> None:
        self.session = session
        self.settings = settings
        self.rank = rank
        self.rank_dir = rank_dir
        self.errors = errors
        self.dumped: Optional[str] = None  # the dump directory, once taken
        self._inputs: List[Tuple[int, int, Any, "weakref.ref[torch.Tensor]"]] = []  # vpp, call, arg/kwarg, ref
        self._calls = 0
        self._handles: List[Any] = []
        self._thread: Optional[threading.Thread] = None

    # ----------------------------------------------------------- root inputs
    def attach(self) -> None:
        if self.settings.dump_max_bytes is None:
            return
        for vpp, root in enumerate(self.session.roots):
            hook = self.errors.wrap("alert.dump input hook",
                                    lambda _m, args, kwargs, vpp=vpp: self._on_forward(vpp, args, kwargs))
            self._handles.append(root.register_forward_pre_hook(hook, with_kwargs=True))

    def _on_forward(self, vpp: int, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if self.dumped is not None or not torch.is_grad_enabled():  # evaluation passes are not the step's
            return
        call = self._calls
        self._calls += 1
        for where, value in [(i, a) for i, a in enumerate(args)] + [(k, v) for k, v in kwargs.items()]:
            if isinstance(value, torch.Tensor) and len(self._inputs) < MAX_INPUTS_PER_STEP:
                self._inputs.append((vpp, call, where, weakref.ref(value)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def close(self) -> None:
        """Wait for the dump's files (``stop()``)."""
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------- pre-step check
    def check(self, step: int) -> None:
        """In the optimizer pre-step hook. Raises ``NonFiniteGradientError`` (with
        ``stop_on_nonfinite``) so that the update is not applied."""
        try:
            if self.dumped is not None and not self.settings.stop_on_nonfinite:
                return  # dumped once; nothing more to do, no more syncs
            items = [(info, g) for info, g in self.session.reduced_grads() if g is not None]
            bad = _nonfinite_positions(items)
            if not bad:
                return
            names = [items[i][0].name for i in bad]
            where = self.dumped
            if where is None and self.settings.dump_max_bytes is not None:
                where = self._dump(step, items, bad)
            if self.settings.stop_on_nonfinite:
                self.close()
                raise NonFiniteGradientError(step, len(bad), len(items), names, where)
        finally:
            self._inputs = []
            self._calls = 0

    def _dump(self, step: int, items: List[Tuple[Any, torch.Tensor]], bad: List[int]) -> str:
        budget = self.settings.dump_max_bytes
        used = 0
        entries: List[Dict[str, Any]] = []
        skipped: List[Dict[str, Any]] = []
        payload: Dict[str, torch.Tensor] = {}

        def take(name: str, kind: str, t: Optional[torch.Tensor], extra: Dict[str, Any]) -> None:
            nonlocal used
            if t is None:
                skipped.append({"name": name, "kind": kind, "bytes": 0, "why": "no longer alive", **extra})
                return
            t = _local(t.detach())
            size = _nbytes(t)
            if used + size > budget:
                skipped.append({"name": name, "kind": kind, "bytes": size, **extra,
                                "why": f"over the byte budget (max_bytes {budget}, {used} used)"})
                return
            used += size
            payload[evidence.payload_key(kind, name)] = t.to("cpu", copy=True)
            entries.append({"name": name, "kind": kind, "file": "tensors.pt", "shape": list(t.shape),
                            "dtype": str(t.dtype).replace("torch.", ""), "bytes": size, **extra})

        def take_param(info: Any, grad: torch.Tensor) -> None:
            take(info.name, evidence.PARAM, info.param, {})
            take(info.name, evidence.GRAD, grad, {})

        for i in bad:
            take_param(*items[i])
        multi = len(self.session.roots) > 1
        for vpp, call, arg, ref in self._inputs:
            label = f"args.{arg}" if isinstance(arg, int) else f"kwargs.{arg}"
            name = (f"{vpp}:" if multi else "") + f"call{call}.{label}"
            pos = {"arg": arg} if isinstance(arg, int) else {"kwarg": arg}
            take(name, evidence.INPUT, ref(), {"call": {"vpp_stage": vpp, "call": call, **pos}})
        bad_set = set(bad)
        for i, item in enumerate(items):
            if i not in bad_set:
                take_param(*item)
        manifest = {"step": step, "rank": self.rank,
                    "reason": f"{len(bad)} of {len(items)} gradient(s) non-finite before optimizer.step()",
                    "max_bytes": budget, "bytes": used, "tensors": entries, "skipped": skipped}
        directory = evidence.dump_dir_name(step)
        self.dumped = f"{self.rank_dir}/{directory}"
        self._thread = threading.Thread(target=self._write, args=(step, manifest, payload),
                                        name="msprobe-monitor-dump")
        self._thread.start()
        return self.dumped

    def _write(self, step: int, manifest: Dict[str, Any], payload: Dict[str, torch.Tensor]) -> None:
        try:
            path = evidence.write_dump(self.rank_dir, step, manifest, payload, "tensors.pt",
                                       lambda obj, fh: torch.save(obj, fh))
        except Exception as exc:  # noqa: BLE001 - evidence must never break training
            logger.error("monitor_v2: rank %d could not write the dump of step %d: %r", self.rank, step, exc)
            return
        logger.warning("monitor_v2 alert: rank %d step %d: gradients non-finite before the update; "
                       "%d tensor(s) (%d bytes, %d skipped) dumped to %s", self.rank, step,
                       len(manifest["tensors"]), manifest["bytes"], len(manifest["skipped"]), path)


def _nonfinite_positions(items: List[Tuple[Any, torch.Tensor]]) -> List[int]:
    """Indices of the gradients with a NaN or Inf element. One host sync per device when
    every gradient is finite; one more to find which ones when not."""
    by_device: Dict[Any, List[int]] = {}
    for i, (_, g) in enumerate(items):
        by_device.setdefault(_local(g).device, []).append(i)
    suspect = False
    for indices in by_device.values():
        grads = [_local(items[i][1]) for i in indices]
        if any(g.layout != torch.strided for g in grads):  # sparse gradients: checked one by one
            suspect = True
            break
        dense = [g for g in grads if g.numel()]
        if not dense:
            continue
        norms = torch._foreach_norm(dense)
        if not bool(torch.isfinite(torch.stack([n.float() for n in norms])).all()):
            suspect = True
            break
    if not suspect:
        return []
    flags = []
    for _, g in items:
        g = _local(g)
        if g.layout != torch.strided:
            g = g.coalesce().values() if g.is_sparse else g.to_dense()
        flags.append(torch.isfinite(g).all() if g.numel() else torch.tensor(True, device=g.device))
    return [i for i, ok in enumerate(torch.stack([f.cpu() for f in flags]).tolist()) if not ok]
