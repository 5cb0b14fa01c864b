"""The framework-independent part of the ``cc`` monitor.

A framework subclass says which functions to replace (``patch_targets``), which tensors
of a call are its inputs and results (``call_tensors``), whether a call is asynchronous
and how to learn that it completed (``when_done``); this class does the rest, the same
way for every framework: replacing and restoring the functions (identity restored),
recording ``pre``/``post`` statistics, the ``cc_codeline`` filter, ``cc_log_only``
stacks, and ``module_ranks``.

Tags: ``<op>.<pre|post>.<index>@<file.py>[<line>]``; the call site is the innermost
frame outside the framework and this package.

Collectives it does not see: where the framework numbers the collectives of a process
group (``group_sequence``), each written step compares how far every group's number
moved with how far it moved inside the calls that went through the wrappers; the rest
ran past the monitor (C++ callers, functional collectives, a function taken before
``start()``) and is said at WARNING, once for each group, with the count, the group's
ranks and the likely sources (``unseen_sources``).
"""

import functools
import inspect
import logging
import os
import sys
import threading
import traceback
from time import perf_counter
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from . import rows
from .checks import Fields, check_bool, check_codelines, check_rank_list
from .logonce import LogOnce
from .monitor import Monitor, short_error
from .patching import Patch, remove_all, replace_attribute
from .safe_fs import append_bytes
from .stats import Record, StatPlan
from .structure import flatten_tensors

logger = logging.getLogger("msprobe.monitor_v2")

CONFIG_FIELDS: Fields = {
    "cc_codeline": (check_codelines, ()),
    "cc_log_only": (check_bool, False),
    "cc_pre_hook": (check_bool, False),
    "module_ranks": (check_rank_list, ()),
}

# The torch.distributed API (which mindspore.mint.distributed mirrors): op name ->
# (argument names holding inputs, argument names holding results).
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
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def frames(start: Any):
    f = start
    while f is not None:
        yield f
        f = f.f_back


def call_site(frame: Any, skip_dirs: Sequence[str]) -> str:
    for f in frames(frame):
        fn = f.f_code.co_filename
        if not fn.startswith(_OWN_DIR) and not any(fn.startswith(d) for d in skip_dirs):
            return rows.call_site(os.path.basename(fn), f.f_lineno)
    return "?"


def _replaced_after_start(owner: Any, attr: str) -> None:
    logger.warning("monitor_v2 cc: %s.%s was replaced by someone else after start(); left as it is "
                   "(the monitor's wrapper, if still referenced, no longer records)",
                   getattr(owner, "__name__", owner), attr)


class Call:
    __slots__ = ("op", "site", "results", "is_async")

    def __init__(self, op: str, site: str, results: List[Any], is_async: bool) -> None:
        self.op, self.site, self.results, self.is_async = op, site, results, is_async


class CommMonitorBase(Monitor):
    name = rows.CC
    framework_dirs: Sequence[str] = ()

    # ------------------------------------------------------------ framework hooks
    def distributed_rank(self) -> Optional[int]:
        """This process's rank, or None when the framework's communication is not initialized."""
        raise NotImplementedError

    def patch_targets(self) -> Iterable[Tuple[Any, str, str]]:
        """``(owner, attribute, op name)`` of every function (or class ``__call__``) to wrap."""
        raise NotImplementedError

    def call_tensors(self, op: str, original: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Tuple[List[Any], List[Any], bool]:
        """``(inputs, results, is_async)`` of a call, before it runs; ``results`` may hold
        tensors written in place, or be filled later by ``result_tensors``."""
        raise NotImplementedError

    def result_tensors(self, op: str, result: Any, results: List[Any]) -> List[Any]:
        """Tensors to record after the call (default: those named before the call)."""
        return results

    def when_done(self, op: str, result: Any, callback: Callable[[], None]) -> Any:
        """Arrange ``callback`` for when an asynchronous ``result`` completes; returns what
        the caller receives (``result`` or a stand-in for it)."""
        callback()
        return result

    def prepare_call(self, op: str, args: Tuple, kwargs: Dict[str, Any]) -> Patch:
        """Adjust a call before it runs; returns the patch removed once it ran (default: nothing)."""
        return Patch()

    def poll_pending(self) -> None:
        """Record asynchronous calls found complete at the end of a step (default: none)."""

    # Collectives that run past the wrappers. A framework that numbers the collectives of
    # a process group implements these; the default counts nothing.
    counted_only: Tuple[str, ...] = ()  # ops wrapped to be counted as seen, never recorded (barriers)

    def known_groups(self) -> List[Any]:
        """The process groups whose collectives can be counted (default: none)."""
        return []

    def group_of_call(self, op: str, original: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
        """The process group a call runs on, or None when it cannot be told."""
        return None

    def group_sequence(self, group: Any) -> Optional[int]:
        """How many collectives ``group`` has run so far, or None when it cannot be read."""
        return None

    def group_label(self, group: Any) -> str:
        """How a warning names ``group`` (its ranks)."""
        return repr(group)

    def unseen_sources(self) -> str:
        """The likely sources of collectives that ran past the wrappers, for the warning."""
        return "calls made outside the wrapped functions"

    # ------------------------------------------------------------- for subclasses
    def bind(self, original: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """The call's arguments by parameter name (signatures cached per function)."""
        sig = self._signatures.get(id(original))
        if sig is None:
            sig = self._signatures[id(original)] = inspect.signature(original)
        return sig.bind_partial(*args, **kwargs).arguments

    def table_tensors(self, op: str, bound: Dict[str, Any], is_tensor: Callable[[Any], bool]) -> Tuple[List[Any], List[Any]]:
        """Inputs and results of a torch.distributed-style call, from ``CC_OPS``."""
        inputs, outputs = CC_OPS[op]
        return (flatten_tensors([bound.get(n) for n in inputs], is_tensor),
                flatten_tensors([bound.get(n) for n in outputs], is_tensor))

    # ------------------------------------------------------------------ lifecycle
    def attach(self) -> None:
        self._signatures: Dict[int, inspect.Signature] = {}
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.pre = self.settings.get("cc_pre_hook")
        self.log_only = self.settings.get("cc_log_only")
        self.codelines: Tuple[Tuple[str, int], ...] = self.settings.get("cc_codeline")
        self._lock = threading.Lock()
        self._local = threading.local()
        self._records: List[Record] = []
        self._in_flight = 0  # asynchronous calls whose 'post' rows are not recorded yet
        self._once = LogOnce()
        self._patches: List[Patch] = []
        self._seen_stacks: Set[Tuple] = set()
        self._stack_log: Optional[str] = None
        # this written step: each group's sequence number at its beginning, and how far it
        # moved inside the wrapped calls (None: nothing counted this step)
        self._sequence_start: Optional[Dict[Any, int]] = None
        self._seen_moves: Dict[Any, int] = {}
        self._uncounted: Dict[str, str] = {}  # groups whose number cannot be read: label -> why
        self._unreadable: Set[Any] = set()  # those groups, not read again
        self.enabled = False
        rank = self.distributed_rank()
        if rank is None:
            logger.warning("monitor_v2 cc: the distributed environment is not initialized at start(); cc "
                           "records nothing. Call start() after the process group is initialized.")
            return
        ranks = self.settings.get("module_ranks")
        if ranks and rank not in ranks:
            logger.info("monitor_v2 cc: rank %d not in module_ranks %s; cc is off here", rank, list(ranks))
            return
        self.enabled = True
        if self.log_only:
            self._stack_log = os.path.join(self.session.rank_dir, "cc_call_stacks.log")
        wrappers: Dict[int, Callable] = {}
        for owner, attr, op in self.patch_targets():
            original = getattr(owner, attr, None)
            if original is None or not callable(original):
                continue
            wrapper = wrappers.get(id(original))
            if wrapper is None:
                wrapper = wrappers[id(original)] = self._wrap(op, original)
            self._patches.append(replace_attribute(owner, attr, wrapper, if_replaced=functools.partial(
                _replaced_after_start, owner, attr)))

    def detach(self) -> None:
        self.enabled = False
        remove_all(self._patches)
        self._sequence_start = None

    def begin_step(self, step: int, active: bool) -> None:
        super().begin_step(step, active)
        self._sequence_start = None
        if not (active and self.enabled):
            return
        try:
            start: Dict[Any, int] = {}
            for group in self.known_groups():
                seq = self._read_sequence(group)
                if seq is not None:
                    start[group] = seq
            with self._lock:
                self._seen_moves = {}
                self._sequence_start = start
        except Exception as exc:  # noqa: BLE001
            self.errors.report("cc counting collectives (step begin)", exc)

    def collect(self) -> List[Record]:
        if self.active and self.enabled and self._sequence_start is not None:
            try:
                self._say_unseen()
            except Exception as exc:  # noqa: BLE001
                self.errors.report("cc counting collectives (step end)", exc)
        self.poll_pending()
        with self._lock:
            records, self._records = self._records, []
            in_flight = self._in_flight
        if in_flight and self.active:
            self._once.warning(
                "in-flight",
                "monitor_v2 cc: %d asynchronous communication call(s) had not completed when step %d "
                "ended; their 'post' rows are written with the step in which they complete. Logged once.",
                in_flight, self.step)
        return records

    # ------------------------------------------------------------------ the wrapper
    def _wrap(self, op: str, original: Callable) -> Callable:
        monitor = self

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            local = monitor._local
            # depth: an op implemented with another patched op is recorded once, as called
            if not (monitor.active and monitor.enabled) or getattr(local, "depth", 0):
                return original(*args, **kwargs)
            local.depth = 1
            # seen, nothing to record: a barrier, or the monitor's own collective (the
            # ranks agreeing on a config edit between steps) that is not the training's
            if op in monitor.counted_only or monitor._own_call(sys._getframe(1)):
                mark = monitor._mark(op, original, args, kwargs)
                try:
                    return original(*args, **kwargs)
                finally:
                    local.depth = 0
                    monitor._moved(mark)
            adjusted = monitor.prepare_call(op, args, kwargs)
            mark = None
            try:
                call = monitor._before(op, original, args, kwargs, sys._getframe(1))
                mark = monitor._mark(op, original, args, kwargs)
                result = original(*args, **kwargs)
                # Collectives write into tensors without moving their version counters:
                # statistics cached for them (module monitor) are stale now.
                monitor.session.engine.forget()
                if call is not None:
                    result = monitor._after(call, result)
                return result
            finally:
                local.depth = 0
                monitor._moved(mark)
                adjusted.remove()

        wrapper.__msprobe_original__ = original  # type: ignore[attr-defined]
        return wrapper

    def _before(self, op: str, original: Callable, args: Tuple, kwargs: Dict[str, Any], frame: Any) -> Optional[Call]:
        start = perf_counter()
        try:
            if self.codelines and not self._matches_codeline(frame):
                return None
            if self.log_only:
                self._log_stack(op, frame)
                return None
            inputs, results, is_async = self.call_tensors(op, original, args, kwargs)
            site = call_site(frame, self.framework_dirs)
            if self.pre:
                for i, t in enumerate(inputs):
                    self._record(t, rows.cc_row(op, rows.PRE, i, site))
            return Call(op, site, results, is_async)
        except Exception as exc:  # noqa: BLE001
            self.errors.report(f"cc {op} (before the call)", exc)
            return None
        finally:
            self.errors.busy += perf_counter() - start

    def _after(self, call: Call, result: Any) -> Any:
        start = perf_counter()
        try:
            tensors = self.result_tensors(call.op, result, call.results)

            def record() -> None:
                for i, t in enumerate(tensors):
                    self._record(t, rows.cc_row(call.op, rows.POST, i, call.site))

            if not call.is_async or result is None:
                record()
                return result

            def record_when_done() -> None:
                try:
                    record()
                finally:
                    with self._lock:
                        self._in_flight -= 1

            with self._lock:
                self._in_flight += 1
            return self.when_done(call.op, result, self.errors.wrap("cc async completion", record_when_done))
        except Exception as exc:  # noqa: BLE001
            self.errors.report(f"cc {call.op} (after the call)", exc)
            return result
        finally:
            self.errors.busy += perf_counter() - start

    def _own_call(self, frame: Any) -> bool:
        """Whether the first caller outside the framework is this package."""
        for f in frames(frame):
            fn = f.f_code.co_filename
            if fn.startswith(_OWN_DIR):
                return True
            if not any(fn.startswith(d) for d in self.framework_dirs):
                return False
        return False

    # ------------------------------------------------------ collectives not seen
    def _read_sequence(self, group: Any) -> Optional[int]:
        if group in self._unreadable:
            return None
        try:
            return self.group_sequence(group)
        except Exception as exc:  # noqa: BLE001 - said once, with the others, at the step's end
            self._unreadable.add(group)
            self._uncounted.setdefault(self._label(group), short_error(exc))
            return None

    def _say_uncounted(self) -> None:
        new = {label: why for label, why in list(self._uncounted.items())
               if self._once.first(("uncounted", label))}
        if new:
            logger.warning(
                "monitor_v2 cc: cannot count the collectives of process group(s) %s: collectives that run there "
                "past the cc monitor (C++ callers, functional collectives) are not said. Logged once.",
                "; ".join(f"{label} ({why})" for label, why in new.items()))

    def _label(self, group: Any) -> str:
        try:
            return self.group_label(group)
        except Exception:  # noqa: BLE001
            return repr(group)

    def _mark(self, op: str, original: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Optional[Tuple[Any, int]]:
        """Before a wrapped call of a written step: its group and that group's number."""
        if self._sequence_start is None:
            return None
        start = perf_counter()
        try:
            group = self.group_of_call(op, original, args, kwargs)
            seq = None if group is None else self._read_sequence(group)
            return None if seq is None else (group, seq)
        except Exception as exc:  # noqa: BLE001
            self.errors.report(f"cc counting {op}", exc)
            return None
        finally:
            self.errors.busy += perf_counter() - start

    def _moved(self, mark: Optional[Tuple[Any, int]]) -> None:
        """After the call: how far its group's number moved inside it was seen."""
        if mark is None:
            return
        start = perf_counter()
        try:
            group, before = mark
            after = self._read_sequence(group)
            if after is not None and after > before:
                with self._lock:
                    self._seen_moves[group] = self._seen_moves.get(group, 0) + after - before
        except Exception as exc:  # noqa: BLE001
            self.errors.report("cc counting a call", exc)
        finally:
            self.errors.busy += perf_counter() - start

    def _say_unseen(self) -> None:
        """At the end of a written step: the collectives each group ran past the wrappers,
        said once for each group (at the first step where it has some)."""
        with self._lock:
            start, self._sequence_start = self._sequence_start or {}, None
            seen, self._seen_moves = self._seen_moves, {}
        groups = list(start)
        groups += [g for g in self.known_groups() if g not in start]
        unseen: List[Tuple[str, int]] = []
        new = False
        for group in groups:
            now = self._read_sequence(group)
            if now is None:
                continue
            # a group made during the step started at 0
            count = now - start.get(group, 0) - seen.get(group, 0)
            if count <= 0:
                continue
            label = self._label(group)
            unseen.append((label, count))
            new = self._once.first(("unseen", label)) or new
        self._say_uncounted()
        if not new:
            return
        total = sum(c for _, c in unseen)
        where = "; ".join(f"{c} on process group {label}" for label, c in unseen)
        logger.warning(
            "monitor_v2 cc: step %d: %d collective(s) ran that the cc monitor did not see (%s). Likely sources: "
            "%s. Their tensors are not in the cc rows. Logged once for each process group.",
            self.step, total, where, self.unseen_sources())

    def _record(self, t: Any, tag: str) -> None:
        rec = self.session.engine.record(t, self.plan, 0, tag, rows.COMM)
        with self._lock:
            self._records.append(rec)

    def _matches_codeline(self, frame: Any) -> bool:
        for f in frames(frame):
            fn, line = f.f_code.co_filename, f.f_lineno
            for file, want in self.codelines:
                if line == want and (fn == file or fn.endswith(os.sep + file) or fn.endswith("/" + file)):
                    return True
        return False

    def _log_stack(self, op: str, frame: Any) -> None:
        key = (op,) + tuple((f.f_code.co_filename, f.f_lineno) for f in frames(frame))
        if key in self._seen_stacks:
            return
        self._seen_stacks.add(key)
        site = call_site(frame, self.framework_dirs)
        stack = "".join(traceback.format_stack(frame))
        text = f"[cc_log_only] {op} called from {site} (to keep only this call: \"cc_codeline\": [\"{site}\"]):\n{stack}"
        logger.warning("monitor_v2 %s", text)
        try:
            # never through a link, never blocking
            append_bytes(self._stack_log, (text + "\n").encode("utf-8", errors="backslashreplace"))
        except OSError as exc:
            self.errors.report("cc_log_only stack file", exc)
