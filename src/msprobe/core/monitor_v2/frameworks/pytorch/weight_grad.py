"""``weight_grad``: parameter gradients, ``unreduced`` during backward and ``reduced``
right before the optimizer's update.

``unreduced`` with ``monitor_mbs_grad=false``: a post-accumulate-grad hook reads the
accumulated gradient after the announced last micro-batch (and after every later one, if
a step runs more backward passes than announced), so the row holds the whole local
gradient of the step while the statistics are computed once per step, not once per
micro-batch. A parameter that got fewer gradients than announced is read right before
the optimizer step instead (logged once).

``unreduced`` with ``monitor_mbs_grad=true``: a tensor hook sees the gradient of one
backward pass before it is accumulated into ``.grad``, i.e. that micro-batch's own
gradient (all uses of a shared parameter already summed).

Under DDP these hooks run before the bucket's all-reduce; under FSDP the hooks go on the
unsharded gradient before the reduce-scatter (see ``stacks/fsdp.py``). A training stack that
keeps local gradients in its own buffers (DeepSpeed, Megatron-Core) installs its own
capture instead, or says why the value cannot be captured exactly (``stacks/``).

``reduced`` is what the session's training stack reports at the optimizer step:
``param.grad`` for plain torch/DDP/FSDP, the stack's reduced buffers otherwise.

Batched ``unreduced`` reads (plain torch in one process, or chunks that are, or are inside
the wrapper an integration names, torch DDPs writing ``.grad`` only at the pass's end, see
``_ddp_writes_at_end``; accumulated
gradients of at most ``GROUP_MAX_NUMEL`` elements; a larger one is read in its hook, where
it is still in the caches): the post-accumulate hook only notes the parameter, and one callback queued
on the autograd engine reads the whole backward pass's gradients at once when that pass
ends (one call of the statistics kernel instead of one per parameter). Nothing holds a
gradient in between: the note is the parameter's own record, and ``.grad`` is read in the
callback. Between a parameter's accumulation and the end of the same backward pass
nothing of plain torch modifies its ``.grad`` (each leaf accumulates once per pass, and
clipping, unscaling or a manual all-reduce run after ``backward()`` returns); what could
is read at once instead: a parameter with another post-accumulate hook (an optimizer
step in backward), a backward under compiled autograd, and every gradient under a
data-parallel wrapper that writes ``.grad`` during backward (DDP with a bucket view, which
all-reduces ``.grad`` in place, or ``static_graph``; apex's or another ``*DataParallel``),
FSDP, or a training stack of its own, and whenever more than one process trains with
chunks that are not such DDPs (a DDP wrapper may sit around the model given to
``start()``, or be made after it: checked again at each backward pass).
"""

import functools
import itertools
import logging
import operator
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ... import native
from ...backend import DATA_PARALLEL_WRAPPER
from ...config import resolve_micro_batches
from ...monitor import ContainedHook, Monitor, weight_grad_rows
from ...logonce import LogOnce
from ...patching import remove_all
from ...rows import REDUCED, UNREDUCED, WEIGHT_GRAD
from ...stats import GROUP_MAX_NUMEL, Record
from ...param_table import ParamInfo
from .session import TorchSession, world_size
from .stacks.fsdp import FlatSegment, fsdp2_params
from .stacks import UnreducedCapture
from .stacks.base import TrainingStack
from .stats import StatPlan

logger = logging.getLogger("msprobe.monitor_v2")


class GradSource:
    """A tensor whose gradient is read for ``unreduced`` rows, and the rows it yields:
    ``(vpp_stage, name, segment)``; ``segment`` None means the whole gradient."""

    __slots__ = ("index", "rows", "plain_param", "reduces", "key", "slot")

    def __init__(self, index: int, rows: Sequence[Tuple[int, str, Optional[FlatSegment]]],
                 plain_param: Optional[torch.Tensor] = None,
                 reduces: Optional[Callable[[], bool]] = None) -> None:
        self.index = index
        self.rows = list(rows)
        self.plain_param = plain_param  # set when the monitored tensor is the optimizer's parameter
        # FSDP2: whether the running backward pass reduce-scatters this gradient (and frees
        # the unsharded one), i.e. whether it is not kept for accumulation
        self.reduces = reduces
        # the row key of a whole-tensor source's accumulated row, built once (batched reads)
        vpp, name, _ = self.rows[0]
        self.key = (vpp, name, UNREDUCED, None)
        self.slot = (index, 0, 0)  # its accumulated row's place in WeightGradMonitor._unreduced


class WeightGradMonitor(Monitor):
    name = WEIGHT_GRAD
    needs_optimizer = True
    session: TorchSession  # reads the training stack and FSDP's layouts, beyond backend.Session

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.micro_batches = resolve_micro_batches(self.settings, self.context)
        self.per_micro_batch = self.settings.get("monitor_mbs_grad")
        self._handles: List = []
        self._hooked: Set[int] = set()
        session = self.session
        self._once = LogOnce()
        self._notes: Any = None  # the extension's NoteState, where batched hooks note in C
        self._grad_note: Any = None  # the extension's GradNote type
        self._slow_note: Optional["_BatchedGradHook"] = None  # what their GradNotes call otherwise
        self._reset()
        self.sources: List[GradSource] = []
        self._adapter_sources: Dict[int, GradSource] = {}
        table = session.table
        # set below where the whole backward pass's gradients may be read at its end
        self._batched = False
        self._batch_site = self.errors.wrap("weight_grad unreduced batch", self._read_batch)
        self._deferred_site = self.errors.wrap("weight_grad unreduced batch", self._read_deferred)
        capture = session.stack.unreduced_capture(table, self.per_micro_batch, self.micro_batches)
        if capture is not None:
            self._attach_capture(capture)
            return
        self._ddps = _ddp_wrappers(session)  # whose flags each pass checks again (more than one process)
        self._batched = not self.per_micro_batch and _batchable(session, self._ddps)
        ext = native.extension() if self._batched else None
        if ext is not None:
            self._grad_note = ext.GradNote
            self._notes = ext.NoteState(_graph_task_id)
            self._notes.micro_batches = self.micro_batches
            self._sync_notes()
        infos = table.model_params() or [i for i in table.optimizer_params() if i.param.requires_grad]
        for info in infos:
            if id(info.param) in session.fsdp_managed:
                continue
            self._hook_tensor(info.param, GradSource(info.index, [(info.vpp_stage, info.name, None)], info.param))
        for vpp, layout in session.flat_layouts.values():
            rows = [(vpp, seg.name, seg) for seg in layout.unsharded]
            self._hook_tensor(layout.flat_param, GradSource(len(table.params) + len(self.sources), rows))
        for vpp, module in session.fsdp2_modules:
            hook = functools.partial(self._hook_fsdp2_unsharded, module)
            self._handles.append(module.register_forward_hook(
                self.errors.wrap("weight_grad FSDP2 forward hook", lambda *_, h=hook: h())))

    def _attach_capture(self, capture: UnreducedCapture) -> None:
        """A training stack that keeps local gradients elsewhere captures them itself."""
        if capture.not_observable is not None:
            logger.warning("monitor_v2 weight_grad: no 'unreduced' rows are written: %s. Logged once.",
                           capture.not_observable)
            return
        site = "weight_grad unreduced hook"
        on_accumulated = self._on_accumulated_value
        if capture.stable_in_pass and not self.per_micro_batch and _ENGINE is not None and hasattr(
                _ENGINE, "queue_callback"):
            on_accumulated = self._on_accumulated_deferred
        self._handles.extend(capture.install(
            self.errors.wrap(site, lambda info, grad: self._on_micro_batch_grad(self._adapter_source(info), grad)),
            self.errors.wrap(site, lambda info, grad: on_accumulated(self._adapter_source(info), grad)),
        ))

    def _adapter_source(self, info: ParamInfo) -> GradSource:
        source = self._adapter_sources.get(info.index)
        if source is None:
            source = GradSource(info.index, [(info.vpp_stage, info.name, None)])
            self._adapter_sources[info.index] = source
            self.sources.append(source)
        return source

    def _hook_tensor(self, tensor: torch.Tensor, source: GradSource) -> None:
        self.sources.append(source)
        self._hooked.add(id(tensor))
        site = "weight_grad unreduced hook"
        if self.per_micro_batch:
            hook = functools.partial(self._on_micro_batch_grad, source)
            self._handles.append(tensor.register_hook(self.errors.wrap(site, hook)))
        else:
            # A gradient larger than a group's member is read in its own hook: nothing would
            # batch it (every engine reduces it alone), and on the CPU it is still in the
            # caches there, where the end of the pass reads it from memory again (GPT-sized
            # tensors: 12.1 -> 9.8 ms a step for weight_grad).
            if (self._batched and source.plain_param is tensor and len(source.rows) == 1
                    and tensor.numel() <= GROUP_MAX_NUMEL):
                if self._notes is not None:  # one Python hook for all of them, called with the source
                    if self._slow_note is None:
                        self._slow_note = _BatchedGradHook(self, None, site)
                    hook: Callable[[torch.Tensor], None] = self._grad_note(
                        self, source, source.index, self._notes, self._slow_note)
                else:
                    hook = _BatchedGradHook(self, source, site)
                self._handles.append(tensor.register_post_accumulate_grad_hook(hook))
                if self._notes is not None:
                    # the dict it sits in: its size says whether another hook may change
                    # .grad, without reading the tensor's attribute in every pass
                    hooks = getattr(tensor, "_post_accumulate_grad_hooks", None)
                    if isinstance(hooks, dict) and any(h is hook for h in hooks.values()):
                        hook.hooks = hooks
                return
            hook = functools.partial(self._on_accumulated_grad, source)
            self._handles.append(tensor.register_post_accumulate_grad_hook(self.errors.wrap(site, hook)))

    def _hook_fsdp2_unsharded(self, module: torch.nn.Module) -> None:
        # _unsharded_param exists once the module has run forward; hook each one once.
        reduces = _fsdp2_reduces(module)
        for sharded, unsharded in fsdp2_params(module):
            if unsharded is None or id(unsharded) in self._hooked:
                continue
            info = self.session.table.info(sharded)
            self._hook_tensor(unsharded, GradSource(info.index, [(info.vpp_stage, info.name, None)],
                                                    reduces=reduces))

    # ------------------------------------------------------------------ hooks
    def _reset(self) -> None:
        self._passes: Dict[int, int] = {}  # source index -> backward passes that reached it
        self._unreduced: Dict[Tuple[int, int, int], Record] = {}  # (source index, micro step, row)
        self._reduced: List[Record] = []
        self._reduced_early: Set[int] = set()  # FSDP2 sources reduce-scattered before the last pass
        # batched reads: sources whose gradient the running backward pass accumulated, and
        # the graph task whose end reads them (-1: no read queued)
        self._pending: List[GradSource] = []
        # a training stack's accumulated values (stable until the pass ends), and how each is read
        self._deferred: List[Tuple[GradSource, Any]] = []
        self._queued_task = -1
        # the backward pass whose hooks last ran, and whether it runs under compiled autograd
        self._checked_task = -2
        self._task_compiled = False
        self._sync_notes()

    def _sync_notes(self) -> None:
        """Hand the step's pass counts and pending list to the extension's notes, disarmed
        (the next hook of a pass runs in Python and arms them again)."""
        notes = self._notes
        if notes is not None:
            notes.task = -1
            notes.passes = self._passes
            notes.pending = self._pending

    def begin_step(self, step: int, active: bool) -> None:
        super().begin_step(step, active)
        self._reset()

    def _count_pass(self, source: GradSource) -> int:
        n = self._passes.get(source.index, 0) + 1
        self._passes[source.index] = n
        return n

    def _record(self, source: GradSource, grad: torch.Tensor, micro_step: int) -> None:
        engine = self.session.engine
        rows = source.rows
        if len(rows) == 1:
            vpp, name, seg = rows[0]
            self._unreduced[(source.index, micro_step, 0)] = engine.record(
                grad if seg is None else seg.view(grad), self.plan, vpp, name, UNREDUCED, micro_step or None)
            return
        # an FSDP1 flat gradient: the views of its parameters in one read
        tensors = [grad if seg is None else seg.view(grad) for _, _, seg in rows]
        keys = [(vpp, name, UNREDUCED, micro_step or None) for vpp, name, _ in rows]
        for k, rec in enumerate(engine.record_many(tensors, self.plan, keys)):
            self._unreduced[(source.index, micro_step, k)] = rec

    def _on_micro_batch_grad(self, source: GradSource, grad: torch.Tensor) -> None:
        if self.active:
            self._record(source, grad, self._count_pass(source))

    def _on_accumulated_grad(self, source: GradSource, tensor: torch.Tensor) -> None:
        self._on_accumulated_value(source, tensor.grad)

    def _on_accumulated_value(self, source: GradSource, grad: Any) -> None:
        """``grad``: the local gradient accumulated over this step's passes so far."""
        if not self.active:
            return
        n = self._count_pass(source)
        if source.reduces is not None and n < self.micro_batches and source.reduces():
            self._reduced_early.add(source.index)
        if n >= self.micro_batches and grad is not None:
            if source.index in self._reduced_early:
                self._warn_reduced_early(source)
                return
            if callable(grad):  # built only for the row that is recorded
                grad = grad()
            self._record(source, grad, 0)

    def _on_accumulated_deferred(self, source: GradSource, grad: Any) -> None:
        """``_on_accumulated_value`` for a training stack whose accumulated value stays as
        it is until the backward pass ends (``UnreducedCapture.stable_in_pass``): noted,
        and read with the pass's others in one batch when the pass ends."""
        if not self.active:
            return
        if self._count_pass(source) < self.micro_batches or grad is None:
            return
        task = _graph_task_id()
        if task < 0 or _in_compiled_autograd():  # no pass to wait for (or hooks run at trace time)
            self._record(source, grad() if callable(grad) else grad, 0)
            return
        if self._queued_task != task:
            self._queued_task = task
            _ENGINE.queue_callback(self._deferred_site)
        self._deferred.append((source, grad))

    def _read_deferred(self) -> None:
        """At the end of a backward pass: the stack's values its hooks noted, in one batch."""
        self._queued_task = -1
        deferred, self._deferred = self._deferred, []
        values = [grad() if callable(grad) else grad for _, grad in deferred]
        found = [(source, value) for (source, _), value in zip(deferred, values) if value is not None]
        if not found:
            return
        records = self.session.engine.record_many([v for _, v in found], self.plan, [s.key for s, _ in found])
        self._unreduced.update(zip((s.slot for s, _ in found), records))

    def _on_accumulated_grad_batched(self, source: GradSource, tensor: torch.Tensor) -> None:
        """``_on_accumulated_grad`` for a plain parameter, read at the end of the pass."""
        n = self._passes.get(source.index, 0) + 1
        self._passes[source.index] = n
        task = _graph_task_id()
        if self._checked_task != task:  # once per backward pass: what holds for all its hooks
            self._checked_task = task
            self._task_compiled = _in_compiled_autograd()
            if self._batched and task >= 0 and _multi_process() and not _all_write_at_end(self._ddps):
                # A data-parallel wrapper around the model given to start() (or one made
                # after it) would all-reduce .grad during backward: from now on, read in
                # the hook. Chunks that are torch DDPs writing .grad only at the pass's end
                # keep the batch (their flags are read again here: _set_static_graph()).
                self._batched = False
                self._sync_notes()
                logger.info("monitor_v2 weight_grad: %d processes train: 'unreduced' gradients are read in each "
                            "parameter's hook, not in one batch per backward pass", world_size())
        # compiled autograd runs hooks at trace time
        batched = self._batched and task >= 0 and not self._task_compiled
        if batched:
            if self._queued_task != task:  # queued in every pass (a pass that reads nothing ends at once)
                self._queued_task = task
                _ENGINE.queue_callback(self._batch_site)
            if self._notes is not None:  # the rest of this pass's hooks note in C (GradNote)
                self._notes.task = task
        if n < self.micro_batches:
            return
        # Another post-accumulate hook may change .grad before the pass ends (an optimizer
        # step in backward zeroes it).
        hooks = getattr(tensor, "_post_accumulate_grad_hooks", None)
        if not batched or hooks is None or len(hooks) > 1:
            if tensor.grad is not None:
                self._record(source, tensor.grad, 0)
            return
        self._pending.append(source)

    def _read_batch(self) -> None:
        """At the end of a backward pass: the gradients its hooks noted, in one batch."""
        self._queued_task = -1
        pending, self._pending = self._pending, []
        notes = self._notes
        if notes is not None:
            self._sync_notes()
            self.errors.busy += notes.busy  # the notes' own time, counted as the hooks' is
            notes.busy = 0.0
        # lists of references, not of pairs: a pass over thousands of parameters allocates
        # no tuple per parameter (each would be one more object for the collector)
        grads = list(map(_grad_of, map(_param_of, pending)))
        if any(map(operator.is_, grads, itertools.repeat(None))):
            dropped = [source for source, grad in zip(pending, grads) if grad is None]
            self._once.warning(
                "batch-dropped",
                "monitor_v2 weight_grad: at step %d the gradient of %d parameter(s) (e.g. %s) was set to None "
                "after it was accumulated and before its backward pass ended (by a hook of the user's code); "
                "their 'unreduced' rows of that pass are not written. Logged once.",
                self.step, len(dropped), dropped[0].rows[0][1])
            pending = [source for source, grad in zip(pending, grads) if grad is not None]
            grads = [grad for grad in grads if grad is not None]
        if not grads:
            return
        records = self.session.engine.record_many(grads, self.plan, list(map(_key_of, pending)))
        self._unreduced.update(zip(map(_slot_of, pending), records))

    def _read_batch_late(self) -> None:
        """Notes whose end-of-pass read never ran (the backward pass raised, or an engine
        that runs no callbacks): read now, later than their pass, and said once."""
        late = self._pending or [source for source, _ in self._deferred]
        if not late:
            self._queued_task = -1
            return
        self._once.warning(
            "batch-late",
            "monitor_v2 weight_grad: at step %d the end of a backward pass was not seen (it raised, or the "
            "autograd engine ran no end-of-pass callback); the 'unreduced' rows of %d parameter(s) (e.g. %s) "
            "are read at the optimizer step instead, after anything done to the gradients since. Logged once.",
            self.step, len(late), late[0].rows[0][1])
        if self._deferred:
            self._read_deferred()
        else:
            self._read_batch()

    def _warn_reduced_early(self, source: GradSource) -> None:
        self._once.warning(
            "reduced-early",
            "monitor_v2 weight_grad: at step %d FSDP2 reduce-scattered the gradient of '%s' (and others) "
            "before the last of the %d micro-batches (gradient sync on for every micro-batch: no "
            "set_requires_gradient_sync(False), or Accelerate's sync_each_batch=True), so the accumulated "
            "local gradient of the step never exists: no accumulated 'unreduced' rows are written for such "
            "parameters; monitor_mbs_grad=true gives each micro-batch's exact row. Logged once.",
            self.step, source.rows[0][1], self.micro_batches)

    # --------------------------------------------------------- optimizer step
    def before_optimizer_step(self) -> None:
        if not self.active:
            return
        if self._pending or self._deferred or self._queued_task >= 0:
            self._read_batch_late()
        if not self.per_micro_batch:
            self._read_short_sources()
        # Read again, never reused from 'unreduced': code that edits gradients through
        # ``.data`` or from C++ (clipping, unscaling) does not move the version counter.
        tensors, keys = self.session.reduced_grad_tensors(REDUCED)
        self._reduced = self.session.engine.record_many(tensors, self.plan, keys)

    def _read_short_sources(self) -> None:
        if self.micro_batches <= 1:  # every pass that reached a source was its last: none is short
            return
        short = [
            s for s in self.sources
            if 0 < self._passes.get(s.index, 0) < self.micro_batches and s.slot not in self._unreduced
        ]
        if not short:
            return
        self._once.warning(
            "short",
            "monitor_v2 weight_grad: at step %d, %d parameter(s) (e.g. %s) got gradients in fewer "
            "backward passes than the %d announced by grad_acc_steps/micro_batch_number; their "
            "'unreduced' rows are read right before optimizer.step() (after any data-parallel "
            "reduction; not at all for FSDP-sharded parameters). Logged once.",
            self.step, len(short), short[0].rows[0][1], self.micro_batches,
        )
        for s in short:
            if s.plain_param is not None and s.plain_param.grad is not None:
                self._record(s, s.plain_param.grad, 0)

    def collect(self) -> List[Record]:
        if self._pending or self._deferred or self._queued_task >= 0:
            self._read_batch_late()
        records = weight_grad_rows(self._unreduced, self._reduced, self._passes, self.micro_batches)
        self._reset()
        return records

    def detach(self) -> None:
        remove_all(self._handles)
        self._hooked.clear()


class _BatchedGradHook(ContainedHook):
    """The post-accumulate hook of a batched source (``_on_accumulated_grad_batched``): it
    runs for every parameter in every backward pass, and returns before any work on a
    step that is not written. Without a ``source`` it is the one hook the extension's
    ``GradNote`` hooks call as ``hook(source, tensor)`` outside their armed case."""

    __slots__ = ("source",)

    def __init__(self, monitor: "WeightGradMonitor", source: Optional[GradSource], site: str) -> None:
        super().__init__(monitor, site)
        self.source = source

    def run(self, *args: Any) -> None:
        source = self.source
        if source is None:
            source, tensor = args
        else:
            (tensor,) = args
        self.monitor._on_accumulated_grad_batched(source, tensor)


_ENGINE = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
# the batch's reads over its sources, each one C-level pass (thousands of parameters)
_param_of = operator.attrgetter("plain_param")
_grad_of = operator.attrgetter("grad")
_key_of = operator.attrgetter("key")
_slot_of = operator.attrgetter("slot")
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _in_compiled_autograd() -> bool:
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")  # imported only once used
    return bool(compiled is not None and getattr(compiled, "in_compiled_autograd_region", False))


def _multi_process() -> bool:
    return world_size() > 1


def _batchable(session: TorchSession, ddps: Sequence[torch.nn.Module]) -> bool:
    """Whether nothing but the user's own code can modify a parameter's ``.grad`` between
    its accumulation and the end of the backward pass (see the module doc). Unknown
    wrappers and missing engine features say no: the per-parameter read stays."""
    if _ENGINE is None or not hasattr(_ENGINE, "queue_callback") or type(session.stack) is not TrainingStack:
        return False
    if session.flat_layouts or session.fsdp2_modules or session.fsdp_managed:
        return False
    if "horovod.torch" in sys.modules:  # its hooks all-reduce .grad in place during backward
        return False
    # More than one process: a DDP wrapper may sit around the model given to start(),
    # unless the chunks given are torch DDPs themselves, or inside the one a framework
    # named (``ddps``: ``_ddp_wrappers(session)``).
    if _multi_process() and not _all_write_at_end(ddps):
        return False
    composable = getattr(getattr(torch.distributed, "_composable_state", None), "_module_state_mapping", None)
    for chunk in session.chunks:
        for module in chunk.modules():
            # torch DDP that writes .grad in place during backward, apex's and other wrappers
            # named so; replicate()/fully_shard() state
            if any("DataParallel" in cls.__name__ for cls in type(module).__mro__) and not _ddp_writes_at_end(module):
                return False
            if composable is not None and module in composable:
                return False
    return True


def _ddp_writes_at_end(module: torch.nn.Module) -> bool:
    """Whether ``module`` is torch's DDP in the configuration whose reducer leaves each
    parameter's ``.grad`` as accumulated until the backward pass ends.

    Without ``gradient_as_bucket_view`` the reducer copies each ready gradient into its
    bucket (divided on the way) and all-reduces the bucket, a buffer of its own; it writes
    the averaged values back into ``.grad`` only in ``finalize_backward``, an end-of-pass
    callback it queues on the autograd engine once the last bucket is ready. The monitor's
    callback is queued earlier, at the pass's first post-accumulate hook (those run inside
    the accumulation, before the reducer's hooks on the same node), and the engine runs
    callbacks in the order they were queued: the batch reads the local gradients. Anything
    that writes ``.grad`` sooner is left out: a bucket view (``.grad`` is the bucket, divided
    and all-reduced in place as its bucket fills), ``static_graph`` (its first iteration's
    delayed all-reduce is queued at the start of backward, before the monitor's callback),
    DDP's own mixed precision, delayed all-reduce parameters and the compiled python
    reducer (which all-reduces in post-accumulate hooks). A missing attribute is a
    feature this torch does not have."""
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return False
    return (getattr(module, "gradient_as_bucket_view", None) is False
            and getattr(module, "static_graph", None) is False
            and getattr(module, "mixed_precision", None) is None
            and not getattr(module, "_delay_all_reduce_params", None)
            and not getattr(module, "_use_python_reducer", False))


def _all_write_at_end(ddps: Sequence[torch.nn.Module]) -> bool:
    """``ddps`` (``_ddp_wrappers``) vouch for the chunks: there are some, and each writes
    ``.grad`` only when the backward pass ends."""
    return bool(ddps) and all(map(_ddp_writes_at_end, ddps))


def _ddp_wrappers(session: TorchSession) -> List[torch.nn.Module]:
    """The torch DDPs that every chunk given to ``start()`` is, or is inside (the wrapper
    an integration named); empty where some chunk is neither. Where all of them write
    ``.grad`` only when the backward pass ends (``_ddp_writes_at_end``, asked at each
    pass), no other data-parallel wrapper can sit around the chunks."""
    chunks = session.chunks
    if chunks and all(isinstance(c, torch.nn.parallel.DistributedDataParallel) for c in chunks):
        return list(chunks)
    outer = session.context.get(DATA_PARALLEL_WRAPPER)
    if not chunks or not isinstance(outer, torch.nn.parallel.DistributedDataParallel):
        return []
    inside = {id(m) for m in outer.modules()}
    return [outer] if all(id(chunk) in inside for chunk in chunks) else []


def _fsdp2_reduces(module: torch.nn.Module) -> Optional[Callable[[], bool]]:
    """Whether ``module``'s FSDP2 parameter groups reduce-scatter in the running backward
    pass (``set_requires_gradient_sync`` sets their ``reduce_grads``); None where this
    torch keeps no such flag (nothing is then assumed)."""
    try:
        state = module._get_fsdp_state()
    except AttributeError:
        return None
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    if not groups or not all(hasattr(g, "reduce_grads") for g in groups):
        return None
    return lambda: any(g.reduce_grads for g in groups)
