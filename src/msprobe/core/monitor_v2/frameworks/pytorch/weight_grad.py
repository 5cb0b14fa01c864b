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

Micro-batches, not backward passes. A micro-batch may run several backward passes (a
loss split into parts, TorchTitan's ``ChunkedLossWrapper``: eight passes per micro-batch
that reach only ``lm_head``). A training forward of a model chunk (its forward pre-hook:
grad enabled, not a recomputation inside backward, not a framework's internal pass)
marks where a micro-batch may begin; a parameter's backward pass starts its next
micro-batch when the parameter has been counted in fewer micro-batches than its chunk
has begun forwards in this step, else it belongs to the micro-batch it last saw
(``_count_pass``). One backward pass per forward is counted as before; pipelined
schedules that run several forwards before their backwards count one micro-batch per
pass. Without any forward of the chunk in a step each pass counts, and where that gives
more than the announced count the monitor cannot tell: said once (``_step_micro_batches``).

A parameter a micro-batch reaches in several passes (``_split``) has no single hook call
holding that micro-batch's gradient. With ``monitor_mbs_grad=false`` the accumulated
gradient is read again after each pass of the last micro-batch (the last read is the
whole). With ``monitor_mbs_grad=true``: where the gradient the passes accumulate into was
empty when the micro-batch began (the first micro-batch after ``zero_grad()``, or FSDP2's
unsharded gradient after a reduce-scatter), a post-accumulate hook reads it after each pass;
otherwise the monitor sums that micro-batch's passes in a buffer of its own (one
gradient-sized tensor, held until the micro-batch ends: ``_sums``), the only way to the
micro-batch's gradient alone, since no statistic but the mean of a sum follows from the
statistics of its parts. A micro-batch whose earlier passes were neither kept nor summed
(the first one in which the parameter is found split while its gradient held earlier
micro-batches; FSDP2 reduce-scattering between two passes of one micro-batch) writes no
row for it, said once.

Under DDP these hooks run before the bucket's all-reduce; under FSDP the hooks go on the
unsharded gradient before the reduce-scatter (see ``stacks/fsdp.py``). A training stack that
keeps local gradients in its own buffers (DeepSpeed, Megatron-Core) installs its own
capture instead, or says why the value cannot be captured exactly (``stacks/``).

``reduced`` is what the session's training stack reports at the optimizer step:
``param.grad`` for plain torch/DDP/FSDP, the stack's reduced buffers otherwise.

Batched ``unreduced`` reads (plain torch in one process, or chunks that are, or are inside
the wrapper an integration names, torch DDPs writing ``.grad`` only at the pass's end, see
``_ddp_writes_at_end``; on the CPU accumulated
gradients of at most ``GROUP_MAX_NUMEL`` elements, a larger one being read in its hook, where
it is still in the caches; on accelerators, and under the engine's CPU test seam, gradients of
every size: the fused kernel reads them all in two launches): the post-accumulate hook only notes
the parameter, and one callback queued
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
from ...experts import ExpertReads
from ...monitor import ContainedHook, Monitor, weight_grad_rows
from ...logonce import LogOnce
from ...patching import remove_all
from ...rows import REDUCED, UNREDUCED, WEIGHT_GRAD
from ...stats import GROUP_MAX_NUMEL, Record
from ...param_table import Added, ParamInfo
from .compile import eager_hook
from .copies import ModuleHooks
from .passes import internal_pass
from .session import TorchSession, world_size
from .stacks.fsdp import FlatSegment, fsdp2_params
from .stacks import UnreducedCapture
from .stacks.base import TrainingStack
from .stats import StatPlan, outside_training_modes

logger = logging.getLogger("msprobe.monitor_v2")


class GradSource:
    """A tensor whose gradient is read for ``unreduced`` rows, and the rows it yields:
    ``(vpp_stage, name, segment)``; ``segment`` None means the whole gradient."""

    __slots__ = ("index", "rows", "plain_param", "reduces", "key", "slot", "chunk", "tensor", "records")

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
        self.chunk = vpp  # the model chunk whose forwards mark its micro-batches
        self.tensor: Optional[torch.Tensor] = None  # the tensor its hooks are on (None: a stack's capture)
        # the records one read of it gives (more than its rows for a grouped-expert tensor: experts.py)
        self.records = len(self.rows)


class WeightGradMonitor(Monitor):
    name = WEIGHT_GRAD
    needs_optimizer = True
    session: TorchSession  # reads the training stack and FSDP's layouts, beyond backend.Session

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.micro_batches = resolve_micro_batches(self.settings, self.context)
        self.per_micro_batch = self.settings.get("monitor_mbs_grad")
        self.experts = ExpertReads(self.session, self.settings, self.name)
        self._handles: List = []
        self._hooked: Set[int] = set()
        session = self.session
        self._once = LogOnce()
        self._notes: Any = None  # the extension's NoteState, where batched hooks note in C
        self._grad_note: Any = None  # the extension's GradNote type
        self._slow_note: Optional["_BatchedGradHook"] = None  # what their GradNotes call otherwise
        self.declared = _count_declared(self.settings, self.context)
        # kept across steps: sources a micro-batch reached in several backward passes, and
        # those of them whose earlier passes' gradient did not outlive the next pass (FSDP2
        # reduce-scattering after each), whose micro-batches the monitor sums itself
        self._split: Set[int] = set()
        self._summed: Set[int] = set()
        self._post_hooked: Set[int] = set()  # split sources given a post-accumulate hook
        self._reset()
        # each chunk's training forwards mark where its micro-batches begin (_count_pass)
        chunk_hooks = ModuleHooks()  # copies and pickles of the chunks leave them out
        self._handles.append(chunk_hooks)
        for c, chunk in enumerate(session.chunks):
            chunk_hooks.forward_pre(chunk, eager_hook(_MicroBatchStart(self, c, chunk), self), with_kwargs=True)
        self.sources: List[GradSource] = []
        self._adapter_sources: Dict[int, GradSource] = {}
        table = session.table
        # set below where the whole backward pass's gradients may be read at its end
        self._batched = False
        self._batch_site = self.errors.wrap("weight_grad unreduced batch", self._read_batch)
        self._deferred_site = self.errors.wrap("weight_grad unreduced batch", self._read_deferred)
        capture = session.stack.unreduced_capture(table, self.per_micro_batch, self.micro_batches)
        self._captured = capture is not None  # the stack's own hooks, not the parameters'
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
        self._hook_params()
        for vpp, layout in session.flat_layouts.values():
            rows = [(vpp, seg.name, seg) for seg in layout.unsharded]
            self._hook_tensor(layout.flat_param, GradSource(len(table.params) + len(self.sources), rows))
        for vpp, module in session.fsdp2_modules:
            hook = functools.partial(self._hook_fsdp2_unsharded, module)
            self._handles.append(module.register_forward_hook(
                self.errors.wrap("weight_grad FSDP2 forward hook", lambda *_, h=hook: h())))

    def _hook_params(self) -> None:
        """The hooks of every parameter that trains and has none yet: the model chunks'
        (the optimizer's where no parameter of the model trains), FSDP's left to their own
        hooks."""
        session = self.session
        table = session.table
        infos = table.model_params() or [i for i in table.optimizer_params() if i.param.requires_grad]
        hooked, managed = self._hooked, session.fsdp_managed
        for info in infos:
            p = info.param
            if id(p) in hooked or id(p) in managed:
                continue
            self._hook_tensor(p, GradSource(info.index, [(info.vpp_stage, info.name, None)], p))

    def on_added(self, added: Added) -> None:
        """Parameters found after ``start()`` (the session's ``find_added``, at the beginning
        of a written step): those that train get their hooks now, as at ``attach()``, so their
        ``unreduced`` rows begin with this step (a parameter unfrozen since ``start()`` too).
        The ``reduced`` rows read the session's table at each step. A stack with its own
        capture has no hooks on parameters: the session said that it does not monitor them."""
        if added.params:
            self.experts.refresh()
        if added.params and not self._captured:
            self._hook_params()

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
        source.tensor = tensor
        self.sources.append(source)
        self._hooked.add(id(tensor))
        site = "weight_grad unreduced hook"
        if self.per_micro_batch:
            hook = functools.partial(self._on_micro_batch_grad, source)
            self._handles.append(tensor.register_hook(self.errors.wrap(site, hook)))
        else:
            # On the CPU a gradient larger than a group's member is read in its own hook:
            # nothing would batch it (the CPU engines reduce it alone), and it is still in
            # the caches there, where the end of the pass reads it from memory again
            # (GPT-sized tensors: 12.1 -> 9.8 ms a step for weight_grad). On an
            # accelerator every size is read at the pass's end: the fused kernel reads the
            # whole pass's gradients in two launches, where each hook would cost two.
            if (self._batched and source.plain_param is tensor and len(source.rows) == 1
                    and (tensor.numel() <= GROUP_MAX_NUMEL or not self.session.engine.on_host(tensor.device))
                    and source.rows[0][1] not in self.experts.params):
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
        # source index -> micro-batches of this step that reached it (_count_pass); the
        # extension's notes count in the same dict
        self._micro_counts: Dict[int, int] = {}
        self._unreduced: Dict[Tuple[int, int, int], Record] = {}  # (source index, micro step, row)
        self._reduced: List[Record] = []
        self._reduced_early: Set[int] = set()  # FSDP2 sources reduce-scattered before their last pass
        self._reduced_after: Set[int] = set()  # FSDP2 sources whose last pass so far reduce-scattered
        # batched reads: sources whose gradient the running backward pass accumulated, and
        # the graph task whose end reads them (-1: no read queued)
        self._pending: List[GradSource] = []
        # a training stack's accumulated values (stable until the pass ends), and how each is read
        self._deferred: List[Tuple[GradSource, Any]] = []
        self._queued_task = -1
        # the backward pass whose hooks last ran, and whether it runs under compiled autograd
        self._checked_task = -2
        self._task_compiled = False
        self._task_regular = False
        chunks = len(self.session.chunks)
        self._forwards = [0] * chunks  # training forwards of each model chunk begun in this step
        self._top = [0] * chunks  # an upper bound of the micro-batch counts of the chunk's sources
        # monitor_mbs_grad=true, split sources: the micro-batch whose row a post-accumulate
        # hook reads, the sums kept by the monitor (source, micro-batch, sum), the sources
        # whose accumulated gradient was empty when their current micro-batch began, and
        # the (source, micro-batch) rows not written
        self._read_after: Dict[int, int] = {}
        self._sums: Dict[int, Tuple[GradSource, int, torch.Tensor]] = {}
        self._empty_at_start: Set[int] = set()
        self._dropped: Set[Tuple[int, int]] = set()
        self._sync_notes()

    def _sync_notes(self) -> None:
        """Hand the step's micro-batch counts and pending list to the extension's notes,
        disarmed (the next hook of a pass runs in Python and arms them again)."""
        notes = self._notes
        if notes is not None:
            notes.task = -1
            notes.passes = self._micro_counts
            notes.pending = self._pending

    def begin_step(self, step: int, active: bool) -> None:
        super().begin_step(step, active)
        self._reset()

    def _micro_batch_starts(self, chunk: int) -> None:
        """A training forward of model chunk ``chunk`` begins (``_MicroBatchStart``)."""
        self._forwards[chunk] += 1
        if self._sums:  # the micro-batches the monitor summed for this chunk are over
            self._close_sums(chunk)

    def _chunk_forwards(self, chunk: int) -> int:
        forwards = self._forwards
        return forwards[chunk] if 0 <= chunk < len(forwards) else 0

    def _count_pass(self, source: GradSource) -> Tuple[int, bool]:
        """The micro-batch (1-based) a backward pass reaching ``source`` belongs to, and
        whether the pass begins it. A new micro-batch while the source has been counted
        in fewer micro-batches than its chunk has begun training forwards (one pass per
        forward, as before; pipelined forwards ahead of their backwards), or where no
        forward of its chunk was seen (every pass counts); otherwise the pass is a further
        part of the micro-batch the source last saw (a chunked or split loss)."""
        index = source.index
        n = self._micro_counts.get(index, 0)
        forwards = self._chunk_forwards(source.chunk)
        if n and forwards and n >= forwards:
            return n, False
        n += 1
        self._micro_counts[index] = n
        top = self._top
        if 0 <= source.chunk < len(top) and n > top[source.chunk]:
            top[source.chunk] = n
        return n, True

    def _regular_pass(self) -> bool:
        """Whether the backward pass now beginning starts a new micro-batch for every
        source it can reach (each chunk with forwards has begun one since its sources were
        last counted): the extension's notes, which count every pass, may then count it."""
        return all(f == 0 or f > t for f, t in zip(self._forwards, self._top))

    def _record(self, source: GradSource, grad: torch.Tensor, micro_step: int) -> None:
        engine = self.session.engine
        rows = source.rows
        if len(rows) == 1 and rows[0][1] in self.experts.params and rows[0][2] is None:
            # a grouped-expert gradient: read per expert, its own row and expert_norms (experts.py)
            vpp, name, _ = rows[0]
            read = self.experts.record_many(engine, [grad], self.plan, [(vpp, name, UNREDUCED, micro_step or None)])
            source.records = max(source.records, len(read))
            for k, rec in enumerate(read):
                self._unreduced[(source.index, micro_step, k)] = rec
            return
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

    def _drop(self, source: GradSource, micro_step: int) -> None:
        """No row of ``source`` for ``micro_step`` (0: its accumulated row)."""
        for k in range(source.records):
            self._unreduced.pop((source.index, micro_step, k), None)

    def _on_micro_batch_grad(self, source: GradSource, grad: torch.Tensor) -> None:
        """``grad``: one backward pass's gradient, before it is accumulated."""
        if not self.active:
            return
        k, begins = self._count_pass(source)
        index = source.index
        tensor = source.tensor
        if begins:
            if index in self._sums:  # its previous micro-batch's sum, if no forward closed it
                self._close_sum(index)
            self._read_after.pop(index, None)
            # whether what the passes accumulate into holds nothing of earlier micro-batches
            empty = tensor is not None and tensor.grad is None
            if index not in self._split:  # one pass per micro-batch so far: this is its gradient
                self._record(source, grad, k)
                if empty:
                    self._empty_at_start.add(index)
                else:
                    self._empty_at_start.discard(index)
            elif empty and index not in self._summed:
                self._read_after[index] = k  # its post-accumulate hook reads the whole
                self._ensure_post_hook(source)
            else:
                self._sums[index] = (source, k, _start_sum(grad))
            return
        # a further pass within micro-batch k
        if index in self._sums:
            _add_to_sum(self._sums[index][2], grad)
            return
        if (index, k) in self._dropped:
            return
        if self._read_after.get(index) == k:
            if tensor is not None and tensor.grad is None:
                # the earlier passes' gradient was reduce-scattered or freed between passes
                self._lost_between_passes(source, k)
            return
        # the first further pass seen: this parameter takes several passes per micro-batch
        self._split.add(index)
        if index in self._empty_at_start and tensor is not None and tensor.grad is not None:
            self._read_after[index] = k
            self._ensure_post_hook(source)
            return
        if index in self._empty_at_start:  # what the first pass accumulated is gone already
            self._lost_between_passes(source, k)
            return
        self._drop(source, k)
        self._dropped.add((index, k))
        self._once.warning(
            "split-first",
            "monitor_v2 weight_grad: at step %d micro-batch %d reached '%s' in more than one backward pass "
            "(a loss split into parts, e.g. a chunked loss), and its first pass's gradient was neither kept nor "
            "accumulated into an empty gradient (the gradient already held earlier micro-batches), so that "
            "micro-batch's own gradient cannot be told apart: its 'unreduced' row is not written. From its next "
            "micro-batch on the monitor sums the passes of each micro-batch itself (one gradient-sized buffer "
            "while the micro-batch runs). Logged once.", self.step, k, source.rows[0][1])

    def _lost_between_passes(self, source: GradSource, micro_step: int) -> None:
        index = source.index
        self._read_after.pop(index, None)
        self._summed.add(index)
        self._drop(source, micro_step)
        self._dropped.add((index, micro_step))
        self._once.warning(
            "split-lost",
            "monitor_v2 weight_grad: at step %d the gradient of '%s' accumulated over the earlier backward passes "
            "of micro-batch %d was reduce-scattered or freed before the micro-batch's next pass (FSDP2 with "
            "gradient sync on for each pass of a split or chunked loss), so that micro-batch's local gradient never "
            "exists: its 'unreduced' row is not written. From its next micro-batch on the monitor sums the passes "
            "of each micro-batch itself (one gradient-sized buffer while the micro-batch runs). Logged once.",
            self.step, source.rows[0][1], micro_step)

    def _ensure_post_hook(self, source: GradSource) -> None:
        """A post-accumulate hook on a split source's tensor, put on the first time it is
        needed (inside the pre-hook of a pass: it runs after that pass's accumulation)."""
        if source.index in self._post_hooked or source.tensor is None:
            return
        self._post_hooked.add(source.index)
        hook = functools.partial(self._on_split_accumulated, source)
        self._handles.append(source.tensor.register_post_accumulate_grad_hook(
            self.errors.wrap("weight_grad unreduced hook", hook)))

    def _on_split_accumulated(self, source: GradSource, tensor: torch.Tensor) -> None:
        """After a pass of a micro-batch whose row is read from the accumulated gradient:
        the micro-batch's passes so far (the last read is the whole)."""
        if not self.active:
            return
        k = self._read_after.get(source.index)
        if k is not None and tensor.grad is not None:
            self._record(source, tensor.grad, k)

    def _close_sum(self, index: int) -> None:
        source, k, total = self._sums.pop(index)
        self._record(source, total, k)

    def _close_sums(self, chunk: Optional[int] = None) -> None:
        """The rows of the micro-batches summed by the monitor that are over: those of
        ``chunk``'s sources (a forward of it begins), or all."""
        for index in [i for i, (s, _, _) in self._sums.items() if chunk is None or s.chunk == chunk]:
            self._close_sum(index)

    def _on_accumulated_grad(self, source: GradSource, tensor: torch.Tensor) -> None:
        self._on_accumulated_value(source, tensor.grad)

    def _on_accumulated_value(self, source: GradSource, grad: Any) -> None:
        """``grad``: the local gradient accumulated over this step's passes so far."""
        if not self.active:
            return
        n, _ = self._count_pass(source)
        index = source.index
        if source.reduces is not None:
            # FSDP2: a pass after one that reduce-scattered (and freed the unsharded
            # gradient) accumulates from nothing: the step's whole never exists
            if index in self._reduced_after and index not in self._reduced_early:
                self._reduced_early.add(index)
                self._drop(source, 0)
            if source.reduces():
                self._reduced_after.add(index)
        if n >= self.micro_batches and grad is not None:
            if index in self._reduced_early:
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
        if self._count_pass(source)[0] < self.micro_batches or grad is None:
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
        if self.experts.params:  # grouped experts read per expert
            for source, value in found:
                if source.rows[0][1] in self.experts.params:
                    self._record(source, value, 0)
            found = [(s, v) for s, v in found if s.rows[0][1] not in self.experts.params]
        if not found:
            return
        records = self.session.engine.record_many([v for _, v in found], self.plan, [s.key for s, _ in found])
        self._unreduced.update(zip((s.slot for s, _ in found), records))

    def _on_accumulated_grad_batched(self, source: GradSource, tensor: torch.Tensor) -> None:
        """``_on_accumulated_grad`` for a plain parameter, read at the end of the pass."""
        task = _graph_task_id()
        if self._checked_task != task:  # once per backward pass: what holds for all its hooks
            self._checked_task = task
            self._task_compiled = _in_compiled_autograd()
            # a further pass of a micro-batch (a chunked loss) is counted in Python: the
            # notes count every pass as a new micro-batch
            self._task_regular = self._regular_pass()
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
            if self._notes is not None and self._task_regular:  # the rest of this pass's hooks note in C
                self._notes.task = task
                # the notes count each source once more, to at most its chunk's forwards
                top = self._top
                for c, forwards in enumerate(self._forwards):
                    if forwards:
                        top[c] = forwards
        n, _ = self._count_pass(source)
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
            "after a backward pass that was not the step's last to reach it (gradient sync on for every "
            "micro-batch of the %d announced: no set_requires_gradient_sync(False), or Accelerate's "
            "sync_each_batch=True; or on for each pass of a loss split into several backward passes), so the "
            "accumulated local gradient of the step never exists: no accumulated 'unreduced' rows are written "
            "for such parameters; monitor_mbs_grad=true gives each micro-batch's exact row. Logged once.",
            self.step, source.rows[0][1], self.micro_batches)

    # --------------------------------------------------------- optimizer step
    def before_optimizer_step(self) -> None:
        if not self.active:
            return
        if self._pending or self._deferred or self._queued_task >= 0:
            self._read_batch_late()
        if self._sums:  # the last micro-batch is over
            self._close_sums()
        if not self.per_micro_batch:
            self._read_short_sources()
        # Read again, never reused from 'unreduced': code that edits gradients through
        # ``.data`` or from C++ (clipping, unscaling) does not move the version counter.
        tensors, keys = self.session.reduced_grad_tensors(REDUCED)
        self._reduced = self.experts.record_many(self.session.engine, tensors, self.plan, keys)

    def _read_short_sources(self) -> None:
        if self.micro_batches <= 1:  # every pass that reached a source was its last: none is short
            return
        short = [
            s for s in self.sources
            if 0 < self._micro_counts.get(s.index, 0) < self.micro_batches and s.slot not in self._unreduced
        ]
        if not short:
            return
        self._once.warning(
            "short",
            "monitor_v2 weight_grad: at step %d, %d parameter(s) (e.g. %s) got gradients in fewer "
            "backward passes than the %d micro-batches announced by grad_acc_steps/micro_batch_number "
            "(the passes between two training forwards of the model chunk count as one); their "
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
        if self._sums:  # no optimizer step was seen: the micro-batches are over anyway
            self._close_sums()
        # the step's micro-batch count, passed as the announced one (no per-source counts)
        records = weight_grad_rows(self._unreduced, self._reduced, {}, self._step_micro_batches())
        self._reset()
        return records

    def _step_micro_batches(self) -> int:
        """What the accumulated and ``reduced`` rows carry: the most micro-batches any
        parameter saw (the announced count where no pass ran). A parameter whose chunk ran
        no training forward in the step was counted by backward passes; where it got more
        than the announced count the monitor cannot tell which passes belong to which
        micro-batch: said once, and a declared count is taken at its word."""
        counts = self._micro_counts
        announced = self.micro_batches
        if not counts:
            return announced
        unseen = [s for s in self.sources
                  if counts.get(s.index, 0) > announced and not self._chunk_forwards(s.chunk)]
        if not unseen:
            return max(counts.values())
        most = max(unseen, key=lambda s: counts[s.index])
        if self.declared:
            what = f"the {announced} micro-batch(es) declared by grad_acc_steps/micro_batch_number"
            label = f"the accumulated and 'reduced' rows carry the declared {announced}"
        else:
            what = "the 1 micro-batch assumed (neither grad_acc_steps nor micro_batch_number was given)"
            label = "the accumulated and 'reduced' rows carry the number of backward passes"
        self._once.warning(
            "ungrouped",
            "monitor_v2 weight_grad: at step %d, '%s' got %d backward passes (%d parameter(s) got more passes "
            "than micro-batches), more than %s, and no training forward of their model chunk (the model given to "
            "start()) was seen in the step, so the monitor cannot tell which backward passes belong to which "
            "micro-batch: %s, and monitor_mbs_grad rows are numbered by backward pass (each holds one pass's "
            "gradient); the accumulated 'unreduced' row still holds the whole local gradient. Call the model given "
            "to start() for each micro-batch, or declare the count. Logged once.",
            self.step, most.rows[0][1], counts[most.index], len(unseen), what, label)
        unseen_ids = {s.index for s in unseen}
        return max(announced if self.declared and index in unseen_ids else n for index, n in counts.items())

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


class _MicroBatchStart(ContainedHook):
    """Forward pre-hook of model chunk ``index``: a training forward of it begins, where
    a micro-batch may begin (``WeightGradMonitor._count_pass``). Forwards that train
    nothing are not counted: without grad (evaluation, generation), a recomputation inside
    backward (activation checkpointing), a framework's internal pass (``passes.py``),
    a ``DataParallel`` replica's call (the replica carries its original's hooks)."""

    __slots__ = ("index", "chunk_id")

    def __init__(self, monitor: "WeightGradMonitor", index: int, chunk: torch.nn.Module) -> None:
        super().__init__(monitor, "weight_grad micro-batch start")
        self.index = index
        self.chunk_id = id(chunk)  # not the module: the hook sits in the module's own dictionary

    def run(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if id(module) != self.chunk_id or not torch.is_grad_enabled() or _graph_task_id() >= 0:
            return
        if internal_pass(args, kwargs) is None:
            self.monitor._micro_batch_starts(self.index)


# The monitor's sums run with the training's dispatch modes set aside, as the engine's
# statistics do (a mode active around backward would record them as the model's ops).
@outside_training_modes
def _start_sum(grad: torch.Tensor) -> torch.Tensor:
    """A micro-batch's sum, the monitor's own tensor, from its first pass's gradient."""
    with torch.no_grad():
        return grad.detach().clone()


@outside_training_modes
def _add_to_sum(total: torch.Tensor, grad: torch.Tensor) -> None:
    with torch.no_grad():
        total.add_(grad.detach())


def _count_declared(settings: Any, context: Any) -> bool:
    """Whether the micro-batch count was given (config, ``start()``, or the training
    stack's own, such as DeepSpeed's), rather than assumed to be 1."""
    keys = ("micro_batch_number", "grad_acc_steps")
    return any(settings.options.get(k) is not None for k in keys) or any(context.get(k) is not None for k in keys)


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
