"""The pre-update gradient check of ``alert.dump`` / ``alert.stop_on_nonfinite``, MindSpore
(PyNative).

The optimizer Cell's forward pre-hook (``MsSession.install_step_hooks``) sees the
gradients it was called with, before the update. Only when one of those fields is set,
one ``isfinite().all()`` per gradient is stacked into one vector and read once: one host
sync per optimizer step. The dump goes into ``tensors.npz`` (numpy; a dtype numpy cannot
store, such as bfloat16, is stored as float32 and the manifest keeps the original
dtype). The root Cells' inputs are held by weak references from a forward pre-hook
(positional inputs only: MindSpore's pre-hooks do not see keyword arguments).
"""

import io
from typing import Any, Dict, IO, List, Tuple

import mindspore as ms
import numpy as np
from mindspore import ops

from ...evidence import GradientGuardBase


class GradientGuard(GradientGuardBase):
    TENSOR_FILE = "tensors.npz"

    def attach(self) -> None:
        if self.settings.dump_max_bytes is None:
            return
        for vpp, root in enumerate(self.session.roots):
            hook = self.errors.wrap("alert.dump input hook",
                                    lambda _cell, inputs, vpp=vpp: self._on_forward(vpp, inputs, {}))
            self._handles.append(root.register_forward_pre_hook(hook))

    def _is_tensor(self, value: Any) -> bool:
        return isinstance(value, ms.Tensor)

    def _nonfinite_positions(self, items: List[Tuple[Any, Any]]) -> List[int]:
        flags = ops.stack([ops.isfinite(g).all() if g.size else ms.Tensor(True) for _, g in items]).asnumpy()
        return [i for i, ok in enumerate(flags.tolist()) if not ok]

    def _describe(self, t: Any) -> Tuple[Any, int, List[int], str]:
        return t, int(t.size) * int(t.itemsize), list(t.shape), str(t.dtype)

    def _copy(self, t: Any) -> Any:
        value = t.asnumpy()
        if value.dtype.kind not in "biufc":  # bfloat16 and other non-numpy dtypes
            value = t.astype(ms.float32).asnumpy()
        return value.copy()

    def _save(self, payload: Dict[str, Any], fh: IO[bytes]) -> None:
        buf = io.BytesIO()
        np.savez(buf, **payload)
        fh.write(buf.getvalue())
