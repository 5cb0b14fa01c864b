"""What the trainer and the monitors call on a framework back end, as ``typing.Protocol``s.

A back end (``frameworks/pytorch/``, ``frameworks/mindspore/``) has a ``Session`` class
built by ``start()`` from the model chunks and the optimizer; the session holds the
``ParamTable`` (names), a ``StatsEngine`` (statistics on the device) and the optimizer
step hooks. PyTorch's session also holds a ``TrainingStack``: where plain torch, FSDP,
DeepSpeed or Megatron-Core keep gradients, fp32 masters and optimizer state. The stack
takes the table, never the session, so neither module imports the other.

Tensors are ``Any`` here: this module, like the rest of the core, imports no framework.
These protocols live in the core, not under ``frameworks/``, because the core's
monitors are what consume them (and the core does not import ``frameworks/``).
"""

from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple, \
    runtime_checkable

from .model_structure import Structure
from .param_table import ParamInfo, ParamTable
from .patching import Patch
from .stats import Record, StatPlan

# (vpp_stage, row name, scope, micro step): what a record is filed under
RecordKey = Tuple[int, str, str, Optional[int]]
# (parameter, tensor read for it): gradients, values the optimizer updates
ParamTensors = List[Tuple[ParamInfo, Any]]
# called with a parameter and its gradient (or a zero-argument callable returning it)
GradCallback = Callable[[ParamInfo, Any], None]


# start()'s context key by which an integration names the data-parallel wrapper its
# framework made around the model it gives the monitor (Lightning's strategy.model, the
# Trainer's model_wrapped): weight_grad may then read local gradients in one batch a pass
DATA_PARALLEL_WRAPPER = "_ddp_wrapper"


class UnreducedCapture:
    """How ``weight_grad`` captures ``unreduced`` gradients under a training stack.

    ``install(on_micro_batch, on_accumulated)`` installs the adapter's hooks and returns
    their removable handles (framework hook handles or ``patching.Patch``es). A hook
    calls ``on_micro_batch(info, grad)`` once per backward pass with that pass's own
    gradient (``monitor_mbs_grad=true``), or
    ``on_accumulated(info, grad)`` once per backward pass with the local gradient
    accumulated so far (the monitor counts the passes and records after the announced
    last micro-batch); ``grad`` may be a zero-argument callable returning it, for a value
    that costs work to build (called only when the row is recorded). ``not_observable``
    instead is the reason why the value cannot be captured exactly: it is logged once and
    no ``unreduced`` rows are written. ``stable_in_pass``: nothing changes an accumulated
    value given to ``on_accumulated`` before its backward pass ends (no reduction starts
    inside backward), so the monitor may read all of a pass's values at its end, in one
    batch, instead of one at a time in the hooks."""

    def __init__(self, install: Optional[Callable[[GradCallback, GradCallback], List[Any]]] = None,
                 not_observable: Optional[str] = None, stable_in_pass: bool = False) -> None:
        if (install is None) == (not_observable is None):
            raise ValueError("UnreducedCapture needs exactly one of install / not_observable")
        self.install = install
        self.not_observable = not_observable
        self.stable_in_pass = stable_in_pass


@runtime_checkable
class StatsEngine(Protocol):
    """Statistics of tensors on their device (``Record``s), moved to the host in bulk."""

    def record(self, t: Any, plan: StatPlan, vpp_stage: int, name: str, scope: str,
               micro_step: Optional[int] = None, cache: bool = False) -> Record:
        """Statistics of one tensor, computed now (inside a hook). ``cache``: the same
        tensor seen again in the step may reuse its vector."""
        ...

    def record_many(self, tensors: Sequence[Any], plan: StatPlan, keys: Sequence[RecordKey]) -> List[Record]:
        """Statistics of many tensors at once (parameters, gradients, optimizer states)."""
        ...

    def forget(self) -> None:
        """Forget the tensors seen so far (step end, or after a collective)."""
        ...

    def to_host(self, records: Sequence[Record]) -> Optional[Callable[[], None]]:
        """Replace the device values of ``records`` by host values, in few transfers. None
        when they are in place; else the function to call before reading them (the copy
        was only issued), which the writer calls when it formats the rows."""
        ...


@runtime_checkable
class Session(Protocol):
    """What the monitors share during one ``start()``/``stop()``."""

    rank_dir: str
    context: Dict[str, Any]
    optimizer: Any
    roots: List[Any]  # the user's model chunks, below any pure wrapper
    table: ParamTable
    engine: StatsEngine

    def named_modules(self) -> List[Tuple[int, str, Any]]:
        """``(vpp_stage, name, module)`` of every module of every chunk."""
        ...

    def structure(self) -> Structure:
        """Module and parameter names as ``targets`` and rows use them."""
        ...

    def expand(self, items: Sequence[Tuple[ParamInfo, Any]], scope: str,
               suffix: str = "") -> Tuple[List[Any], List[RecordKey]]:
        """Tensors and row keys for ``(param, tensor)`` pairs read at the optimizer step."""
        ...

    def layout(self) -> Dict[str, Any]:
        """This rank's ``layout.json`` document (``layout.py``)."""
        ...

    def reduced_grads(self) -> ParamTensors:
        """The gradients the optimizer applies, as they stand at its step (after the
        data-parallel reduction; local shards allowed). Read inside the step hooks'
        ``before``."""
        ...

    def param_values(self) -> ParamTensors:
        """The values the optimizer updates, per parameter (fp32 masters where kept)."""
        ...

    def optimizer_states(self) -> Iterator[Tuple[ParamInfo, str, Any]]:
        """Every per-parameter tensor the optimizer keeps, under PyTorch's state names."""
        ...

    def install_step_hooks(self, before: Callable[[], None], after: Callable[[], None]) -> Patch:
        """Call ``before``/``after`` around every real optimizer step; returns the patch."""
        ...

    def agree_max(self, values: Sequence[int]) -> List[int]:
        """The element-wise maximum of ``values`` over all ranks (one small all-reduce; the
        values themselves when the job is not distributed). Every rank calls it at the
        same step boundary: what makes a config edit or an escalation start at the same
        step everywhere (``dynamic.py``)."""
        ...

    def gather(self, value: Optional[str]) -> List[Optional[str]]:
        """Every rank's ``value``, in rank order (``[value]`` when not distributed). Called
        only on the rare step an escalation needs one name agreed by all ranks."""
        ...


@runtime_checkable
class TrainingStack(Protocol):
    """Where a training stack keeps what the monitors read (see ``frameworks/pytorch/stacks/``)."""

    name: str

    def optimizer_model_params(self) -> Optional[List[Any]]:
        """The model parameters the optimizer updates, in order (None: the tensors in
        its param groups)."""
        ...

    def context_defaults(self) -> Mapping[str, Any]:
        """Values the framework knows (e.g. ``grad_acc_steps``), used when the user passed none."""
        ...

    def install_step_hooks(self, before: Callable[[], None], after: Callable[[], None]) -> Patch:
        """Hook the call that is the real optimizer step, once per step."""
        ...

    def unreduced_capture(self, table: ParamTable, per_micro_batch: bool,
                          micro_batches: int) -> Optional[UnreducedCapture]:
        """None for the default hooks on the parameters, else the stack's own capture."""
        ...

    def layout(self, table: ParamTable, doc: Dict[str, Any]) -> None:
        """Fill this rank's ``layout.json`` document: groups, chunks, renames, pieces."""
        ...

    def reduced_grads(self, table: ParamTable) -> ParamTensors:
        """The gradients at the step, after the data-parallel reduction."""
        ...

    def param_values(self, table: ParamTable) -> ParamTensors:
        """The values the optimizer updates, mapped back to parameter names."""
        ...

    def optimizer_states(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, str, Any]]:
        """The optimizer's per-parameter state tensors, mapped back to parameter names."""
        ...
