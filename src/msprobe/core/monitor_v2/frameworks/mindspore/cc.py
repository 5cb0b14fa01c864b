"""``cc`` for MindSpore: the communication functions MindSpore exposes to Python.

Wrapped (and restored by ``stop()``):

- ``mindspore.mint.distributed`` (torch-like, results written into argument tensors),
  in both the package and its ``distributed`` module; tagged with the bare op name, as
  the same call in PyTorch;
- ``mindspore.communication.comm_func`` (functional: results are return values),
  tagged ``comm_func.<op>``;
- the ``ops`` communication primitives (``AllReduce``, ``AllGather``, ``Broadcast``,
  ``ReduceScatter``, ``AlltoAll``, ``Send``, ``Receive``) through their class's
  ``__call__``, which is how ``nn.DistributedGradReducer`` and Cells call them in
  PyNative mode. ``pre`` rows are the primitive's inputs, ``post`` rows its outputs.

Asynchronous calls (``async_op=True``): MindSpore's handles offer no completion
callback, so the caller gets the handle inside a stand-in whose ``wait()`` records the
results as soon as they are ready; a handle nobody waited on is read when the step ends.
"""

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import mindspore as ms

from ...cc_base import CC_OPS, CommMonitorBase
from ...structure import flatten_tensors

# mint.distributed mirrors torch.distributed, argument names included.
MINT_OPS = {op: CC_OPS[op] for op in (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "isend", "recv", "irecv")}
# comm_func: functional ops; inputs are these arguments, results the return value.
FUNC_OPS: Dict[str, Tuple[str, ...]] = {
    "all_reduce": ("tensor",),
    "all_gather_into_tensor": ("tensor",),
    "reduce_scatter_tensor": ("tensor",),
    "broadcast": ("tensor",),
    "reduce": ("tensor",),
    "gather_into_tensor": ("tensor",),
    "scatter_tensor": ("tensor",),
    "send": ("tensor",),
    "isend": ("tensor",),
    "recv": ("tensor",),
    "irecv": ("tensor",),
    "all_to_all_single_with_output_shape": ("tensor",),
    "all_to_all_with_output_shape": ("input_tensor_list",),
}
PRIMITIVES = ("AllReduce", "AllGather", "Broadcast", "ReduceScatter", "AlltoAll", "Send", "Receive")

_MS_DIR = os.path.dirname(ms.__file__) + os.sep


def _is_tensor(x: Any) -> bool:
    return isinstance(x, ms.Tensor)


class _Once:
    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self._fn()


class _RecordingHandle:
    """Stands in for an async communication handle: ``wait()`` waits, then records."""

    def __init__(self, inner: Any, notify: _Once) -> None:
        self._inner = inner
        self._notify = notify

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._inner.wait(*args, **kwargs)
        self._notify()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _is_handle(x: Any) -> bool:
    return callable(getattr(x, "wait", None)) and not isinstance(x, ms.Tensor)


class MsCommMonitor(CommMonitorBase):
    framework_dirs = (_MS_DIR,)

    def attach(self) -> None:
        self._pending: List[_Once] = []
        self._kinds: Dict[str, str] = {}
        super().attach()

    def distributed_rank(self) -> Optional[int]:
        try:
            from mindspore.communication import GlobalComm, get_rank

            return get_rank() if GlobalComm.INITED else None
        except Exception:  # noqa: BLE001
            return None

    def patch_targets(self):
        # Each API is optional: older MindSpore releases lack mint.distributed or comm_func.
        import importlib

        from mindspore import ops

        for name in ("mindspore.mint.distributed", "mindspore.mint.distributed.distributed"):
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for op in MINT_OPS:
                yield module, op, op  # the torch.distributed names: same tags as PyTorch
        try:
            comm_func = importlib.import_module("mindspore.communication.comm_func")
        except ImportError:
            comm_func = None
        if comm_func is not None:
            for op in FUNC_OPS:
                yield comm_func, op, f"comm_func.{op}"
        for name in PRIMITIVES:
            cls = getattr(ops, name, None)
            if isinstance(cls, type):
                yield cls, "__call__", name

    def call_tensors(self, op, original, args, kwargs):
        if op in MINT_OPS:
            bound = self.bind(original, args, kwargs)
            is_async = bool(bound.get("async_op", False)) or op in ("isend", "irecv")
            return (*self.table_tensors(op, bound, _is_tensor), is_async)
        if op.startswith("comm_func."):
            bound = self.bind(original, args, kwargs)
            names = FUNC_OPS[op[10:]]
            is_async = bool(bound.get("async_op", False)) or op in ("comm_func.isend", "comm_func.irecv")
            return flatten_tensors([bound.get(n) for n in names], _is_tensor), [], is_async
        # a primitive's __call__(self, *inputs)
        return flatten_tensors(list(args[1:]) + list(kwargs.values()), _is_tensor), [], False

    def result_tensors(self, op, result, results):
        if op in MINT_OPS:
            return results
        return flatten_tensors(result, _is_tensor)

    def when_done(self, op, result, callback):
        notify = _Once(callback)
        with self._lock:
            self._pending.append(notify)
        if isinstance(result, tuple):  # comm_func: (output, handle)
            return tuple(_RecordingHandle(x, notify) if _is_handle(x) else x for x in result)
        return _RecordingHandle(result, notify) if _is_handle(result) else result

    def poll_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for notify in pending:
            notify()
