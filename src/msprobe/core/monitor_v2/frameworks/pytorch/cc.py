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
  DTensor redistribution) are C++ ops and are not seen.

``async_op=True``: the post statistics are computed in a callback of the work's
future, i.e. when the result is ready, so the training code is never made to wait
earlier than it would. A work that offers no future (gloo's point-to-point and
reduce-scatter works) is handed to the caller inside a ``dist.Work`` stand-in that
records when it is waited on (or when ``step()`` finds it completed).

Tags: ``<op>.<pre|post>.<index>@<file.py>[<line>]`` where ``index`` counts the
tensors of that direction and the call site is the innermost frame outside torch and
this package.
"""

import functools
import inspect
import logging
import os
import sys
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ...monitor import Monitor
from ...stats import Record
from ...structure import flatten_tensors
from .stats import StatPlan

logger = logging.getLogger("msprobe.monitor_v2")

# op name -> (argument names holding inputs, argument names holding results)
CC_OPS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "all_reduce": (("tensor",), ("tensor",)),
    "all_reduce_coalesced": (("tensors",), ("tensors",)),
    "all_gather": (("tensor",), ("tensor_list",)),
    "all_gather_coalesced": (("input_tensor_list",), ("output_tensor_lists",)),
    "all_gather_into_tensor": (("input_tensor",), ("output_tensor",)),
    "all_gather_single": (("input_tensor",), ("output_tensor",)),
    "_all_gather_base": (("input_tensor",), ("output_tensor",)),
    "reduce_scatter": (("input_list",), ("output",)),
    "reduce_scatter_tensor": (("input",), ("output",)),
    "reduce_scatter_single": (("input",), ("output",)),
    "_reduce_scatter_base": (("input",), ("output",)),
    "broadcast": (("tensor",), ("tensor",)),
    "reduce": (("tensor",), ("tensor",)),
    "gather": (("tensor",), ("gather_list",)),
    "scatter": (("scatter_list",), ("tensor",)),
    "all_to_all": (("input_tensor_list",), ("output_tensor_list",)),
    "all_to_all_single": (("input",), ("output",)),
    # A send has no result: its post row is the tensor sent, as it was after the call.
    "send": (("tensor",), ("tensor",)),
    "isend": (("tensor",), ("tensor",)),
    "recv": ((), ("tensor",)),
    "irecv": ((), ("tensor",)),
    "batch_isend_irecv": (("p2p_op_list",), ("p2p_op_list",)),
}
NAMESPACES = ("torch.distributed", "torch.distributed.distributed_c10d")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


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


def _frames(start: Any):
    f = start
    while f is not None:
        yield f
        f = f.f_back


def _call_site(frame: Any) -> str:
    for f in _frames(frame):
        fn = f.f_code.co_filename
        if not fn.startswith(_TORCH_DIR) and not fn.startswith(_OWN_DIR):
            return f"{os.path.basename(fn)}[{f.f_lineno}]"
    return "?"


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


class _Patch:
    """One replaced function: where it lives, the original and the wrapper."""

    __slots__ = ("module", "attr", "original", "wrapper")

    def __init__(self, module: Any, attr: str, original: Callable, wrapper: Callable) -> None:
        self.module, self.attr, self.original, self.wrapper = module, attr, original, wrapper


class CommMonitor(Monitor):
    name = "cc"

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.pre = self.settings.get("cc_pre_hook")
        self.log_only = self.settings.get("cc_log_only")
        self.codelines: Tuple[Tuple[str, int], ...] = self.settings.get("cc_codeline")
        self._lock = threading.Lock()
        self._local = threading.local()
        self._records: List[Record] = []
        self._pending_works: List[_NotifyingWork] = []
        self._patches: List[_Patch] = []
        self._seen_stacks: Set[Tuple] = set()
        self._stack_log: Optional[str] = None
        self.enabled = False
        ranks = self.settings.get("module_ranks")
        if not (dist.is_available() and dist.is_initialized()):
            logger.warning("monitor_v2 cc: torch.distributed is not initialized at start(); cc records nothing. "
                           "Call start() after init_process_group().")
            return
        if ranks and dist.get_rank() not in ranks:
            logger.info("monitor_v2 cc: rank %d not in module_ranks %s; cc is off here", dist.get_rank(), list(ranks))
            return
        self.enabled = True
        if self.log_only:
            self._stack_log = os.path.join(self.session.rank_dir, "cc_call_stacks.log")
        self._install()

    # ------------------------------------------------------------------ patching
    def _install(self) -> None:
        modules = [sys.modules[n] for n in NAMESPACES]
        wrappers: Dict[int, Callable] = {}
        for op in CC_OPS:
            for module in modules:
                original = getattr(module, op, None)
                if original is None or not callable(original):
                    continue
                wrapper = wrappers.get(id(original))
                if wrapper is None:
                    wrapper = wrappers[id(original)] = self._wrap(op, original)
                setattr(module, op, wrapper)
                self._patches.append(_Patch(module, op, original, wrapper))

    def _uninstall(self) -> None:
        for patch in reversed(self._patches):
            current = getattr(patch.module, patch.attr, None)
            if current is patch.wrapper:
                setattr(patch.module, patch.attr, patch.original)
            else:
                logger.warning("monitor_v2 cc: %s.%s was replaced by someone else after start(); left as it is "
                               "(the monitor's wrapper, if still referenced, no longer records)",
                               patch.module.__name__, patch.attr)
        self._patches.clear()

    def _wrap(self, op: str, original: Callable) -> Callable:
        signature = inspect.signature(original)
        inputs, outputs = CC_OPS[op]
        monitor = self

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            local = monitor._local
            if not (monitor.active and monitor.enabled) or getattr(local, "depth", 0):
                return original(*args, **kwargs)
            local.depth = 1
            swapped = _align_p2p_ops(args, kwargs) if op == "batch_isend_irecv" else []
            try:
                call = monitor._prepare(op, signature, inputs, outputs, args, kwargs, sys._getframe(1))
                result = original(*args, **kwargs)
                # The collective wrote into tensors without moving their version counters:
                # statistics cached for them (module monitor) are stale now.
                monitor.session.engine.forget()
                if call is not None:
                    result = monitor._finish(call, result)
                return result
            finally:
                local.depth = 0
                for p2p_op, previous in swapped:
                    p2p_op.op = previous

        wrapper.__msprobe_original__ = original  # type: ignore[attr-defined]
        return wrapper

    # ------------------------------------------------------------------ recording
    def _prepare(self, op, signature, inputs, outputs, args, kwargs, frame):
        try:
            if self.codelines and not self._matches_codeline(frame):
                return None
            if self.log_only:
                self._log_stack(op, frame)
                return None
            bound = signature.bind_partial(*args, **kwargs).arguments
            site = _call_site(frame)
            if self.pre:
                for i, t in enumerate(self._tensors(op, bound, inputs, send=True)):
                    self._record(t, f"{op}.pre.{i}@{site}")
            async_op = bool(bound.get("async_op", False)) or op in ("isend", "irecv", "batch_isend_irecv")
            return (op, site, self._tensors(op, bound, outputs, send=None), async_op)
        except Exception as exc:  # noqa: BLE001
            self.errors.report(f"cc {op} (before the call)", exc)
            return None

    def _finish(self, call, result) -> Any:
        """Record the results now, or when the async work completes; returns what the
        caller gets (the work itself, or for works without a future a stand-in that
        records when it is waited on)."""
        op, site, tensors, async_op = call
        try:
            if not async_op or result is None:
                self._record_post(op, site, tensors)
                return result
            works = result if isinstance(result, list) else [result]
            works = self._when_done(works, lambda: self._record_post(op, site, tensors))
            return works if isinstance(result, list) else works[0]
        except Exception as exc:  # noqa: BLE001
            self.errors.report(f"cc {op} (after the call)", exc)
            return result

    def _when_done(self, works: List[Any], callback: Callable[[], None]) -> List[Any]:
        remaining = [len(works)]
        lock = threading.Lock()
        safe = self.errors.wrap("cc async completion", callback)

        def one_done(_fut: Any = None) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                safe()

        out = []
        for work in works:
            try:
                work.get_future().then(one_done)
                out.append(work)
            except Exception:  # noqa: BLE001 - no future (gloo p2p, gloo reduce_scatter)
                notifying = _NotifyingWork(work, one_done)
                with self._lock:
                    self._pending_works.append(notifying)
                out.append(notifying)
        return out

    def _tensors(self, op: str, bound: Dict[str, Any], names: Sequence[str], send: Optional[bool]) -> List[torch.Tensor]:
        if op == "batch_isend_irecv":
            return _p2p_tensors(bound.get("p2p_op_list"), send)
        return flatten_tensors([bound.get(n) for n in names], _is_tensor)

    def _record_post(self, op: str, site: str, tensors: List[torch.Tensor]) -> None:
        for i, t in enumerate(tensors):
            self._record(t, f"{op}.post.{i}@{site}")

    def _record(self, t: torch.Tensor, tag: str) -> None:
        rec = self.session.engine.record(t, self.plan, 0, tag, "comm")
        with self._lock:
            self._records.append(rec)

    def _matches_codeline(self, frame: Any) -> bool:
        for f in _frames(frame):
            fn, line = f.f_code.co_filename, f.f_lineno
            for file, want in self.codelines:
                if line == want and (fn == file or fn.endswith(os.sep + file) or fn.endswith("/" + file)):
                    return True
        return False

    def _log_stack(self, op: str, frame: Any) -> None:
        key = (op,) + tuple((f.f_code.co_filename, f.f_lineno) for f in _frames(frame))
        if key in self._seen_stacks:
            return
        self._seen_stacks.add(key)
        stack = "".join(traceback.format_stack(frame))
        text = f"[cc_log_only] {op} called from {_call_site(frame)} (set cc_codeline to e.g. \"{_call_site(frame)}\"):\n{stack}"
        logger.warning("monitor_v2 %s", text)
        try:
            with open(self._stack_log, "a", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as exc:
            self.errors.report("cc_log_only stack file", exc)

    # ------------------------------------------------------------------ lifecycle
    def collect(self) -> List[Record]:
        # Works nobody waited on yet: record those that completed; keep the others.
        with self._lock:
            pending, self._pending_works = self._pending_works, []
        still = [w for w in pending if not w.notify_if_completed()]
        with self._lock:
            self._pending_works[:0] = still
            records, self._records = self._records, []
        return records

    def detach(self) -> None:
        self.enabled = False
        self._uninstall()


def enable_ddp_comm_visibility(ddp_model: torch.nn.parallel.DistributedDataParallel, process_group: Any = None) -> None:
    """Make DDP's gradient all-reduce visible to the ``cc`` monitor.

    DDP's default reducer calls the collective from C++. This registers PyTorch's own
    ``allreduce_hook`` (divide by the world size, then ``dist.all_reduce``), which does
    what the default reducer does but through the Python API, where ``cc`` sees it.
    A DDP model accepts one comm hook, registered before the first backward pass.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp_model.register_comm_hook(process_group, default_hooks.allreduce_hook)
