"""``cc``: statistics of the tensors passed to and returned by ``torch.distributed``
collectives and point-to-point ops.

Every communication function is replaced, in both ``torch.distributed`` and
``torch.distributed.distributed_c10d``, by a wrapper that calls the original and records
statistics of its tensor arguments: ``pre`` (inputs before the call, with
``cc_pre_hook``) and ``post`` (outputs once they hold the result). ``stop()`` puts the
original function objects back (identity, not a copy).

What is and is not seen:

- Calls through the module attributes, from user code, FSDP2, DDP comm hooks and other
  libraries, are seen. A reference taken before ``start()`` (``from torch.distributed
  import all_reduce``) keeps calling the original and is not seen: start the monitor
  early, before such imports run.
- Deprecated names that forward to their 2.13 replacements (``all_gather_into_tensor``
  calls ``all_gather_single``) are recorded once, under the name the caller used.
- DDP's built-in gradient all-reduce runs in C++ and is invisible to Python; register
  a Python comm hook to see it (``enable_ddp_comm_visibility``).
- Functional collectives (``torch.distributed._functional_collectives``, used by
  DTensor redistribution, expert-parallel all-to-all, async TP) are C++ ops and are not
  seen.
- What is not seen is said: every process group numbers its collectives
  (``ProcessGroup._get_sequence_number_for_group()``; on gloo in torch 2.13 it moves by
  one for each collective, functional ones included, and for each send or receive). At
  the end of a written step, a group whose number moved more than it moved inside the
  wrapped calls ran collectives the monitor did not see: said at WARNING, once for each
  group, with the count, the group's ranks and the likely sources. ``barrier`` and
  ``monitored_barrier`` are wrapped to be counted as seen (no tensor to record).

``async_op=True``: the post statistics are computed in a callback of the work's
future, i.e. when the result is ready, so the training code is never made to wait
earlier than it would. On CUDA that callback runs on a pool stream; an event recorded
there after the statistics (``engine.mark_stream``) makes the step's copy wait for them
on the device. A work that offers no future (gloo's point-to-point and
reduce-scatter works) is handed to the caller inside a ``dist.Work`` stand-in that
records when it is waited on (or when ``step()`` finds it completed).

Tags: ``<op>.<pre|post>.<index>@<file.py>[<line>]`` where ``index`` counts the
tensors of that direction and the call site is the innermost frame outside torch and
this package (see ``cc_base.py`` for what every framework shares).
"""

import inspect
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...cc_base import CC_OPS, CommMonitorBase
from ...patching import Patch

NAMESPACES = ("torch.distributed", "torch.distributed.distributed_c10d")
# collectives with no tensor to record: wrapped so that they count as seen
BARRIERS = ("barrier", "monitored_barrier")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _nothing() -> None:
    pass


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _p2p_tensors(ops: Sequence[Any], want_send: Optional[bool]) -> List[torch.Tensor]:
    """Tensors of a ``batch_isend_irecv`` list: sends (True), receives (False)."""
    out = []
    for op in ops or ():
        is_send = getattr(op.op, "__name__", "") in ("isend", "send")
        if want_send is None or is_send == want_send:
            out.append(op.tensor)
    return out


def _align_p2p_ops(args: Tuple, kwargs: Dict[str, Any]) -> List[Tuple[Any, Callable]]:
    """``batch_isend_irecv`` tells sends from receives by identity (``op.op is isend``).
    A ``P2POp`` made before ``start()`` holds the original ``isend``; while the monitor
    runs, the name points to the wrapper. Point such ops at the current function for the
    call; returns what to put back."""
    ops = kwargs.get("p2p_op_list", args[0] if args else None)
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    swapped = []
    for p2p_op in ops or ():
        fn = getattr(p2p_op, "op", None)
        current = getattr(c10d, getattr(fn, "__name__", ""), None)
        if current is not None and current is not fn and getattr(current, "__msprobe_original__", None) is fn:
            swapped.append((p2p_op, fn))
            p2p_op.op = current
    return swapped


class _NotifyingWork(dist.Work):
    """Stands in for a ``Work`` that offers no future: the same object to the caller
    (a ``dist.Work``), which runs ``done`` once when the work is waited on, or when
    ``step()`` finds it completed."""

    def __init__(self, inner: Any, done: Callable[[], None]) -> None:
        super().__init__()
        self._inner = inner
        self._done = done
        self._notified = False

    def _notify(self) -> None:
        if not self._notified:
            self._notified = True
            self._done()

    def notify_if_completed(self) -> bool:
        if self._notified:
            return True
        try:
            finished = self._inner.is_completed()
        except Exception:  # noqa: BLE001
            finished = False
        if finished:
            self._notify()
        return finished

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._inner.wait(*args, **kwargs)
        self._notify()
        return result

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def get_future(self) -> Any:
        return self._inner.get_future()


def _is_fake(pg_map_entry: Any) -> bool:
    """Whether ``_world.pg_map``'s entry of a group names the ``fake`` backend."""
    return bool(pg_map_entry) and str(pg_map_entry[0]) == "fake"


def _ddp_without_comm_hook(chunks: Sequence[Any]) -> bool:
    """Whether a ``DistributedDataParallel`` in ``chunks`` reduces through its C++
    reducer (no Python comm hook registered)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    for chunk in chunks:
        modules = chunk.modules() if isinstance(chunk, torch.nn.Module) else ()
        for m in modules:
            if isinstance(m, ddp) and not getattr(m, "_comm_hooks", None):
                return True
    return False


def _dtensor_mesh_dims(params: Sequence[Any]) -> int:
    """The most mesh dimensions of a DTensor parameter in ``params`` (0: none is a DTensor)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return 0
    return max((p.device_mesh.ndim for p in params if isinstance(p, dtensor)), default=0)


class CommMonitor(CommMonitorBase):
    framework_dirs = (_TORCH_DIR,)
    counted_only = BARRIERS

    def attach(self) -> None:
        self._pending_works: List[_NotifyingWork] = []
        self._group_at: Dict[int, int] = {}
        self._backends: Dict[Any, Tuple[Any, ...]] = {}  # process group -> its backends
        super().attach()

    def distributed_rank(self) -> Optional[int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return None

    def patch_targets(self):
        for name in NAMESPACES:
            module = sys.modules[name]
            for op in (*CC_OPS, *BARRIERS):
                yield module, op, op

    # ------------------------------------------- collectives the monitor does not see
    def known_groups(self) -> List[Any]:
        """Every process group this rank belongs to (``_world.pg_map``: the default group,
        ``new_group``'s, a ``DeviceMesh``'s), else the default group alone; not a group on
        the ``fake`` backend (it communicates nothing: TorchTitan gives one to each mesh
        dimension of degree 1)."""
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        world = getattr(c10d, "_world", None)
        pg_map = getattr(world, "pg_map", None)
        if pg_map:
            return [g for g, entry in list(pg_map.items()) if not _is_fake(entry)]
        default = c10d.GroupMember.WORLD
        return [default] if default is not None else []

    def group_of_call(self, op, original, args, kwargs):
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        if op == "batch_isend_irecv":
            p2p_ops = kwargs.get("p2p_op_list", args[0] if args else None) or ()
            group = getattr(p2p_ops[0], "group", None) if p2p_ops else None
        elif "group" in kwargs:
            group = kwargs["group"]
        else:
            # the position of 'group' in the signature (found once per function): a
            # full bind costs ~10 us a call
            at = self._group_at.get(id(original))
            if at is None:
                names = list(inspect.signature(original).parameters)
                at = self._group_at[id(original)] = names.index("group") if "group" in names else -1
            group = args[at] if 0 <= at < len(args) else None
        if group is None:
            return c10d.GroupMember.WORLD
        if isinstance(group, str):  # a group name
            return c10d._resolve_process_group(group)
        return group if isinstance(group, dist.ProcessGroup) else None

    def group_sequence(self, group):
        """The sum of the numbers of the group's backends (one per device type: a
        ``cpu:gloo,cuda:nccl`` group numbers its gloo and its NCCL collectives apart);
        ``None`` for a group on the ``fake`` backend."""
        backends = self._backends.get(group)
        if backends is None:
            c10d = sys.modules["torch.distributed.distributed_c10d"]
            if _is_fake(getattr(getattr(c10d, "_world", None), "pg_map", {}).get(group)):
                backends = ()
            else:
                found: Dict[int, Any] = {}
                for device in group._device_types:
                    backend = group._get_backend(device)
                    found.setdefault(id(backend), backend)
                backends = tuple(found.values())
            self._backends[group] = backends
        if not backends:
            return None
        return sum(int(b._get_sequence_number_for_group()) for b in backends)

    def group_label(self, group):
        ranks = dist.get_process_group_ranks(group)
        desc = getattr(group, "group_desc", "") or ""
        return f"{ranks}" + (f" ('{desc}')" if desc and desc != "undefined" else "")

    def unseen_sources(self) -> str:
        functional = ("functional collectives (torch.distributed._functional_collectives, C++ ops: DTensor "
                      "redistribution under tensor parallel, expert-parallel all-to-all, async TP, full_tensor() "
                      "and gradient-norm reductions of DTensors)")
        reducer = "DDP's C++ reducer without a Python comm hook (enable_ddp_comm_visibility makes it visible)"
        others = "ProcessGroup methods called directly, a torch.distributed function taken before start()"
        table = getattr(self.session, "table", None)
        mesh_dims = _dtensor_mesh_dims([i.param for i in table.params]) if table is not None else 0
        here, rest = [], []
        if mesh_dims:
            here.append(f"the model has DTensor parameters on a {mesh_dims}-D device mesh: {functional}")
        else:
            rest.append(functional)
        if _ddp_without_comm_hook(getattr(self.session, "chunks", ())):
            here.append(f"the model is wrapped in DistributedDataParallel: {reducer}")
        else:
            rest.append(reducer)
        rest.append(others)
        return "; ".join(here) + ("; else " if here else "") + ", ".join(rest)

    def call_tensors(self, op, original, args, kwargs):
        bound = self.bind(original, args, kwargs)
        is_async = bool(bound.get("async_op", False)) or op in ("isend", "irecv", "batch_isend_irecv")
        if op == "batch_isend_irecv":
            ops = bound.get("p2p_op_list")
            return _p2p_tensors(ops, True), _p2p_tensors(ops, None), is_async
        return (*self.table_tensors(op, bound, _is_tensor), is_async)

    def prepare_call(self, op, args, kwargs):
        if op != "batch_isend_irecv":
            return Patch()
        swapped = _align_p2p_ops(args, kwargs)

        def undo() -> None:
            for p2p_op, previous in swapped:
                p2p_op.op = previous

        return Patch(undo)

    def when_done(self, op, result, callback):
        """Record in a callback of the work's future; a work without a future (gloo p2p,
        gloo reduce_scatter) is handed back inside a stand-in that records on wait()."""
        works = result if isinstance(result, list) else [result]
        mark_stream = self.errors.wrap("cc stream event", getattr(self.session.engine, "mark_stream", _nothing))
        remaining = [len(works)]
        lock = threading.Lock()

        def one_done(_fut: Any = None) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                callback()
                # on CUDA a future's callback runs on a pool stream: the step's copy waits
                # on the device for the statistics just made there
                mark_stream()

        out = []
        for work in works:
            try:
                work.get_future().then(one_done)
                out.append(work)
            except Exception:  # noqa: BLE001 - no future
                notifying = _NotifyingWork(work, one_done)
                with self._lock:
                    self._pending_works.append(notifying)
                out.append(notifying)
        return out if isinstance(result, list) else out[0]

    def poll_pending(self) -> None:
        # Works nobody waited on yet: record those that completed; keep the others.
        with self._lock:
            pending, self._pending_works = self._pending_works, []
        still = [w for w in pending if not w.notify_if_completed()]
        with self._lock:
            self._pending_works[:0] = still


def enable_ddp_comm_visibility(ddp_model: torch.nn.parallel.DistributedDataParallel, process_group: Any = None) -> None:
    """Make DDP's gradient all-reduce visible to the ``cc`` monitor.

    DDP's default reducer calls the collective from C++. This registers PyTorch's own
    ``allreduce_hook`` (divide by the world size, then ``dist.all_reduce``), which does
    what the default reducer does but through the Python API, where ``cc`` sees it.
    A DDP model accepts one comm hook, registered before the first backward pass.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp_model.register_comm_hook(process_group, default_hooks.allreduce_hook)
