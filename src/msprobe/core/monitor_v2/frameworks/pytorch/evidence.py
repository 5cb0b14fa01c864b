"""The pre-update gradient check of ``alert.dump`` / ``alert.stop_on_nonfinite``, PyTorch.

The CSV alert sees a step only after ``optimizer.step()`` has applied its update; the
evidence must be taken before. Only when one of those fields is set, the optimizer
pre-step hook computes one "any non-finite" flag over the gradients the optimizer is
about to apply (``torch._foreach_norm`` per device, one ``isfinite().all()``: one host
sync per optimizer step, the cost of these fields, docs/configuration.md). A flag that
says non-finite is confirmed per tensor (a norm can overflow where no element does).
What is dumped, in which order, and the files: ``evidence.GradientGuardBase``. The root
module's inputs are held by weak references from a forward pre-hook on each root: no
copy, no longer lifetime than the training gives them.
"""

from typing import Any, Dict, IO, List, Tuple

import torch

from ...evidence import GradientGuardBase
from .stats import outside_training_modes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class GradientGuard(GradientGuardBase):
    TENSOR_FILE = "tensors.pt"

    def attach(self) -> None:
        if self.settings.dump_max_bytes is None:
            return
        for vpp, root in enumerate(self.session.roots):
            hook = self.errors.wrap("alert.dump input hook",
                                    lambda _m, args, kwargs, vpp=vpp: self._on_forward(vpp, args, kwargs))
            self._handles.append(root.register_forward_pre_hook(hook, with_kwargs=True))

    def _training_forward(self) -> bool:
        return torch.is_grad_enabled()

    def _is_tensor(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def _nonfinite_positions(self, items: List[Tuple[Any, Any]]) -> List[int]:
        return nonfinite_positions([g for _, g in items])

    def _describe(self, t: Any) -> Tuple[Any, int, List[int], str]:
        t = _local(t.detach())
        return t, t.numel() * t.element_size(), list(t.shape), str(t.dtype).replace("torch.", "")

    @outside_training_modes
    def _copy(self, t: Any) -> Any:
        return t.to("cpu", copy=True)

    def _save(self, payload: Dict[str, Any], fh: IO[bytes]) -> None:
        torch.save(payload, fh)


@outside_training_modes
def nonfinite_positions(grads: List[torch.Tensor]) -> List[int]:
    """Indices of the gradients with a NaN or Inf element. One host sync per device when
    every gradient is finite; one more to find which ones when not. Like the statistics
    engine's work, outside the training's dispatch modes (a user's mode around the
    optimizer step never sees it)."""
    by_device: Dict[Any, List[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(_local(g).device, []).append(_local(g))
    suspect = False
    for local in by_device.values():
        if any(g.layout != torch.strided for g in local):  # sparse gradients: checked one by one
            suspect = True
            break
        dense = [g for g in local if g.numel()]
        if not dense:
            continue
        norms = torch._foreach_norm(dense)
        if not bool(torch.isfinite(torch.stack([n.float() for n in norms])).all()):
            suspect = True
            break
    if not suspect:
        return []
    flags = []
    for g in grads:
        g = _local(g)
        if g.layout != torch.strided:
            g = g.coalesce().values() if g.is_sparse else g.to_dense()
        flags.append(bool(torch.isfinite(g).all()) if g.numel() else True)
    return [i for i, ok in enumerate(flags) if not ok]
