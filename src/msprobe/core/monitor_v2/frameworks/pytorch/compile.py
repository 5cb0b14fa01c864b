"""``torch.compile`` and the module hooks.

A module hook met while Dynamo traces a compiled model breaks the graph there and runs
eagerly on the real tensors (``eager_hook``); under ``fullgraph=True`` (or
``error_on_graph_break``) the graph may not break, and the hook does nothing inside the
compiled code (said once). Code compiled before ``start()`` does not see hooks added
later: ``warn_if_already_compiled`` says so. The private Dynamo APIs used here are read
defensively: in a torch version without them the hooks still run, only slower or with
more recompilations.
"""

import logging
import sys
from time import perf_counter
from typing import Any, Callable, Optional, Set

import torch

from ...logonce import warn_once
from ...monitor import ContainedHook

logger = logging.getLogger("msprobe.monitor_v2")

_compiler = getattr(torch, "compiler", None)
_compiler_disable = getattr(_compiler, "disable", None)
_is_compiling = getattr(_compiler, "is_compiling", None)
_skipped_codes: Set[Any] = set()  # the code objects of the hooks made here, each skipped once
_UNKNOWN = object()


def _skip_frame_and_callees(code: Any) -> None:
    """Dynamo never compiles a frame of ``code`` nor the frames it calls (private API of
    torch >= 2.5; without it, Dynamo may recompile the hook until its limit: slower, but
    rows and training are the same)."""
    eval_frame = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    try:
        from torch._dynamo.types import FrameAction, FrameExecStrategy  # type: ignore
        eval_frame.set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except Exception:  # noqa: BLE001 - an optimisation only
        pass


def _graph_breaks_allowed() -> bool:
    """Whether the code Dynamo is tracing now may break its graph (not under
    ``fullgraph=True`` or ``error_on_graph_break``). Dynamo runs this function while
    tracing and takes its result as a constant (``assume_constant_result``)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator  # private; absent: allowed

        tx = InstructionTranslator.current_tx()
        allowed = not (getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
    except Exception:  # noqa: BLE001 - another torch version: break the graph as usual
        return True
    if not allowed:
        _warn_once_fullgraph()
    return allowed


_graph_breaks_allowed._dynamo_marked_constant = True  # torch._dynamo.assume_constant_result


def _warn_once_fullgraph() -> None:
    # process-wide: compiled code outlives a monitor
    warn_once("fullgraph", "monitor_v2 module: a model compiled with fullgraph=True (or error_on_graph_break) "
              "cannot run the monitor's hooks inside its graph: modules inside it are not recorded. Logged once.")


def eager_hook(body: Any, owner: Any = None) -> Any:
    """A module hook that Dynamo does not trace: where the hook is met while compiling,
    the graph breaks and the hook runs eagerly on the real tensors (traced, its reads of
    the monitor's state would become guards, and the compiled code would be recompiled at
    every change until the recompile limit). Where the graph may not break
    (``fullgraph=True``), the hook does nothing inside the compiled code.

    ``owner``: a monitor whose ``active`` is read first when the hook runs eagerly, so
    that on a step that is not written the hook returns before any other call (the
    containment wrapper, its timing, the body): a model with a thousand modules calls
    two thousand of these per forward pass. Inside a trace the attribute is not read.
    A ``ContainedHook`` body of ``owner`` is run as its ``__call__`` would run it (gate,
    timing, containment), from this hook's own frame: one call fewer per hook."""
    if _compiler_disable is None or _is_compiling is None:
        if owner is None:
            return body

        def gated(*args: Any, **kwargs: Any) -> None:
            if owner.active:
                body(*args, **kwargs)
            return None

        return gated
    disabled = _compiler_disable(body)
    if isinstance(body, ContainedHook) and body.monitor is owner:
        return _skipped(_contained_hook(body, disabled))

    def hook(*args: Any, **kwargs: Any) -> None:
        if _is_compiling():
            if _graph_breaks_allowed():
                disabled(*args, **kwargs)
            return None
        if owner is None or owner.active:
            body(*args, **kwargs)
        return None

    return _skipped(hook)


def _contained_hook(body: ContainedHook, disabled: Any) -> Any:
    """``eager_hook`` of a ``ContainedHook``: ``ContainedHook.__call__`` inlined."""
    monitor, run, site = body.monitor, body.run, body.site

    def contained(*args: Any) -> None:
        if _is_compiling():
            if _graph_breaks_allowed():
                disabled(*args)
            return None
        if not monitor.active:
            return None
        errors = monitor.errors
        start = perf_counter()
        try:
            run(*args)
        except Exception as exc:  # noqa: BLE001 - containment is the point
            errors.report(site, exc)
        errors.busy += perf_counter() - start
        return None  # a hook that returns a value could replace a tensor

    return contained


def _skipped(hook: Any) -> Any:
    """``hook``, its code skipped by Dynamo as a top-level frame. After a graph break,
    Dynamo would compile such a hook as a frame of its own, once per closure (each
    hook's cells are new guards) until the recompile limit. All hooks of one kind share
    their code object: skipping it (and what it calls) as a top-level frame runs it
    eagerly there, while a trace that inlines it still takes its compiling branch."""
    code = hook.__code__
    if code not in _skipped_codes:
        _skip_frame_and_callees(code)
        _skipped_codes.add(code)
    return hook


def compiled_anything() -> bool:
    """Whether Dynamo compiled a frame since the process started or ``torch._dynamo.reset()``
    (private; unknown counts as yes)."""
    if "torch._dynamo" not in sys.modules:
        return False
    convert_frame = getattr(getattr(torch, "_dynamo", None), "convert_frame", None)
    compiled = getattr(getattr(convert_frame, "input_codes", None), "seen_ids", _UNKNOWN)
    return compiled is _UNKNOWN or bool(compiled)


def on_next_compile(fn: Callable[[], None]) -> Optional[Callable[[], None]]:
    """Call ``fn()`` once when Dynamo next starts to compile a frame (before it traces
    anything), and return the function that cancels it; None where this torch has no
    such callback (private ``torch._dynamo.callback``)."""
    try:
        from torch._dynamo.callback import callback_handler  # type: ignore
    except Exception:  # noqa: BLE001 - another torch version
        return None
    if not (hasattr(callback_handler, "register_start_callback") and
            hasattr(callback_handler, "remove_start_callback")):
        return None

    def cancel() -> None:
        try:
            callback_handler.remove_start_callback(started)
        except ValueError:  # already removed
            pass

    def started(_args: Any) -> None:
        cancel()
        fn()

    callback_handler.register_start_callback(started)
    return cancel


def warn_if_already_compiled() -> None:
    if not compiled_anything():
        return
    logger.warning(
        "monitor_v2 module: torch.compile already compiled code in this process before start(). If it compiled "
        "this model, the compiled code does not see the hooks added now (Dynamo does not guard on module hooks, "
        "torch._dynamo.config.skip_nnmodule_hook_guards): modules inside it are not recorded. Start the monitor "
        "before the first call of the compiled model, or call torch._dynamo.reset() before start().")
