"""What the PyTorch statistics engine costs on an accelerator, measured without one.

    .venv/bin/python benchmarks/device_cost.py                 # the three workloads, full shapes
    .venv/bin/python benchmarks/device_cost.py --smoke         # small shapes (the test's)
    .venv/bin/python benchmarks/device_cost.py --json cost.json
    .venv/bin/python benchmarks/device_cost.py --no-seam       # fake cuda tensors only

The engine's accelerator branches run on ``FakeTensorMode`` tensors whose device is
``cuda``: every branch a GPU takes runs, shapes and dtypes are real (a 7B model's 131M-element
embedding gradient included), and no memory is allocated. A ``TorchDispatchMode`` under the
engine sees every ATen op it issues. What it counts is **measured**:

- launches: ATen ops that launch work (views, ``empty`` and aliases launch none); the CUDA
  kernels they stand for are counted 1 an op, 2 for ``dot``/``vdot`` (cuBLAS) and one per 128
  inputs for ``stack``/``cat``, plus every Triton kernel launch the engine makes;
- bytes read and written, from shapes and dtypes (a tensor an op reads twice counts once; a
  stride-0 expanded tensor counts its distinct elements);
- the peak temporary of a read: the largest total of tensors its ops and allocations made, alive
  at once (followed by weak references);
- host syncs: ``_local_scalar_dense`` or ``is_nonzero`` of a device tensor, and device-to-host
  copies that are not ``non_blocking`` (blocking copies), apart for the hooks (module and
  ``weight_grad`` reads, the batched read at a backward pass's end), the optimizer step's
  batched reads and ``step()`` (``to_host``).

The engine sets the training's dispatch modes aside while it computes
(``outside_training_modes``); the tracer hides itself and the fake mode from that check while
it is entered (the stacks' lengths read as zero), so both see the engine's ops as on a GPU.

The times are **estimated** from stated constants (``H100``): an op's GPU time is
max(2 us, bytes / (75 % of 3.35 TB/s)), each launch costs 5 us of host time, and the added
time of a workload lies between max(GPU, host) (launches hidden behind GPU work) and GPU +
host (the GPU waits for them). The workloads are those of issue 48 (and of
``../shared/notes/gpu-path-cost-2026-12.md``, where the method comes from):

- ``weight_grad`` on a 7B Llama (32 layers, hidden 4096, intermediate 11008, vocabulary 32000,
  bf16; 291 gradients), read as ``unreduced`` (all together at the backward pass's end, as the
  monitor does on accelerators on plain torch in one process) and ``reduced`` (one
  ``record_many``);
- ``module`` on 4 of 32 layers at 1 x 4096 tokens: per layer the 37 tensors a decoder layer's
  modules show (27 of [1, 4096, 4096], 8 of [1, 4096, 11008], cos/sin [4096, 128]), read through
  the module monitor's ``recorder`` with the same-tensor cache, 5 of them sums of two
  gradient parts (``sum_parts``, counted apart: not a read);
- 3,072 expert weights of 4M elements (an MoE model's experts on one rank at 8-way expert
  parallelism), ``unreduced`` at the pass's end and ``reduced`` in one ``record_many`` each
  (where expert parallelism keeps the monitor from reading at the pass's end, its
  ``unreduced`` reads are per hook: 2 launches a tensor on the kernel path).

Three tracings. **Fallback**: the fake tensors with the engine's fused reader off
(``stats.fused_reader = None``: a device without Triton), every ATen op counted. **Kernel
path**: the same fake tensors with the fused reader in place; a Triton kernel cannot launch
on them, so ``ModelledKernel`` stands in for it: each list it takes counts the kernel's two
launches and one read of its tensors' bytes (plus its table, partials and results, chunks
as on an H100), a model the table's note states. **Seam**: the engine as it is, the same
workloads at the small shapes on real CPU tensors in a child process with
``MSPROBE_MONITOR_ACCEL_ON_CPU=1`` and ``TRITON_INTERPRET=1``, where the Triton kernel runs:
its launches are counted, and the bytes its first launch reads are those of the tensors its
table names (each element once: the kernel's design; a chunk whose fp32 sums overflow is
read twice, which ordinary data never is).

On a torch without CUDA, ``torch.cuda.Event`` cannot be made; the engine's ``to_host`` then
takes its fallback for devices without events, a blocking copy, where a GPU takes a
non-blocking copy into pinned memory and an event the writer waits on. The fake tracings
give the engine a stand-in event (``_EventOfAFakeRun``) so that they count the GPU's path.

The engine is whatever ``frameworks/pytorch/stats.py`` is when this runs: the table shows the
engine of the day against the issue's "today" and "target" columns.
"""

import argparse
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from msprobe.core.monitor_v2 import rows as monitor_rows
from msprobe.core.monitor_v2.frameworks.pytorch import stats as torch_stats
from msprobe.core.monitor_v2.frameworks.pytorch import triton_stats
from msprobe.core.monitor_v2.stats import StatPlan

# The H100 model's constants (the estimate's only inputs besides the measured counts)
HBM_BYTES_PER_S = 3.35e12
HBM_EFFICIENCY = 0.75
TINY_KERNEL_US = 2.0  # the least GPU time of a kernel
HOST_US_PER_LAUNCH = 5.0

# ops that launch no kernel (allocation, aliasing)
_NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias",
              "lift_fresh", "_unsafe_view", "set_"}
# ops whose result is read on the host: a synchronisation where their input is on the device
_HOST_READS = {"_local_scalar_dense", "is_nonzero", "item", "equal", "nonzero"}
_COPIES = {"_to_copy", "copy_", "to"}
_ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
_CAT_INPUTS_PER_KERNEL = 128


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements ``t`` names (a stride-0 dimension repeats one)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


@dataclass
class Read:
    """One engine call (one tensor in a hook, one batched call, one ``to_host``)."""
    workload: str
    phase: str  # hooks, batched (the optimizer step's reads), step (to_host)
    tensors: int
    elements: int
    monitored_bytes: int  # one read of the monitored tensors in their dtype
    ops: int = 0
    kernels: int = 0
    triton_launches: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    peak_temporary: int = 0
    syncs: int = 0
    blocking_copies: int = 0
    gpu_us: float = 0.0
    names: Counter = field(default_factory=Counter)


class DeviceCostTracer(TorchDispatchMode):
    """Counts the ATen ops the engine issues inside ``read()`` blocks (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: List[Read] = []
        self.current: Optional[Read] = None
        self._live: Dict[int, int] = {}  # id of a temporary's tensor -> its bytes
        self._live_bytes = 0
        self._baseline = 0
        self._hidden: List[Tuple[str, Any]] = []

    # the engine's check for the training's modes must not see this tracer or the fake mode
    def __enter__(self) -> "DeviceCostTracer":
        for name in ("_dispatch_modes", "_function_modes"):
            if hasattr(torch_stats, name):
                self._hidden.append((name, getattr(torch_stats, name)))
                setattr(torch_stats, name, lambda: 0)
        _TritonLaunches.install(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        for name, value in self._hidden:
            setattr(torch_stats, name, value)
        self._hidden.clear()
        _TritonLaunches.remove()
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def read(self, workload: str, phase: str, tensors: Sequence[torch.Tensor]) -> Iterator[Read]:
        read = Read(workload, phase, len(tensors), sum(t.numel() for t in tensors),
                    sum(t.numel() * t.element_size() for t in tensors))
        self.current, self._baseline = read, self._live_bytes
        try:
            yield read
        finally:
            self.current = None
            self.reads.append(read)

    def _forget(self, key: int) -> None:
        self._live_bytes -= self._live.pop(key, 0)

    def launch(self, name: str, read_bytes: int, written_bytes: int, kernels: int) -> None:
        """A kernel launch seen outside ATen (Triton): its bytes as the caller counts them
        (the statistics kernel's tensors are named by its pointer table, not among its
        arguments: ``_TritonLaunches`` reads them from the table)."""
        read = self.current
        if read is None:
            return
        read.triton_launches += kernels
        read.kernels += kernels
        read.bytes_read += read_bytes
        read.bytes_written += written_bytes
        read.gpu_us += _gpu_us(read_bytes + written_bytes) * kernels
        read.names[name] += kernels

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        read = self.current
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if name == "_local_scalar_dense" and inputs and isinstance(inputs[0], FakeTensor):
            # a fake tensor has no values: a host read gets a zero of its kind (``to_host``'s
            # ``tolist()`` then completes, as on a device, and its copies are counted once);
            # it is a sync where the tensor is on the device
            if read is not None and inputs[0].device.type != "cpu":
                read.syncs += 1
            return 0.0 if inputs[0].is_floating_point() else 0
        out = func(*args, **kwargs)
        if read is None:
            return out
        on_device = any(t.device.type != "cpu" for t in inputs)
        if name in _HOST_READS and on_device:
            read.syncs += 1
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        aliasing = any(r.alias_info is not None for r in func._schema.returns)
        # views, allocations, metadata queries (a fake tensor's ``device``) launch nothing;
        # an allocation's result is a temporary all the same (the kernel's partials)
        if name in _ALLOCATIONS and not aliasing:
            self._track(read, outputs)
        if aliasing or not outputs or name in _NO_LAUNCH or name in _HOST_READS:
            return out
        if name in _COPIES and on_device and outputs and all(t.device.type == "cpu" for t in outputs):
            if not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2] is True):
                read.blocking_copies += 1
                read.syncs += 1
        seen = set()
        read_bytes = 0
        for t in inputs:
            if id(t) not in seen:
                seen.add(id(t))
                read_bytes += _distinct_bytes(t)
        written_bytes = sum(_distinct_bytes(t) for t in outputs)
        kernels = 1
        if name in ("dot", "vdot"):
            kernels = 2  # cuBLAS: the reduction and its final kernel
        elif name in ("stack", "cat"):
            kernels = max(1, math.ceil(len(inputs) / _CAT_INPUTS_PER_KERNEL))
        read.ops += 1
        read.kernels += kernels
        read.bytes_read += read_bytes
        read.bytes_written += written_bytes
        read.gpu_us += _gpu_us(read_bytes + written_bytes) + TINY_KERNEL_US * (kernels - 1)
        read.names[name] += 1
        self._track(read, outputs)
        return out

    def _track(self, read: Read, outputs: Sequence[torch.Tensor]) -> None:
        """Temporaries: alive until their tensor goes; the read's peak follows them."""
        for t in outputs:
            key = id(t)
            if key in self._live:
                continue
            nbytes = _distinct_bytes(t)
            self._live[key] = nbytes
            self._live_bytes += nbytes
            weakref.finalize(t, self._forget, key)
        read.peak_temporary = max(read.peak_temporary, self._live_bytes - self._baseline)


def _gpu_us(nbytes: int) -> float:
    return max(TINY_KERNEL_US, nbytes / (HBM_BYTES_PER_S * HBM_EFFICIENCY) * 1e6)


_KERNEL_ELEMENT_BYTES = {0: 4, 1: 2, 2: 2}  # triton_stats' dtype codes: fp32, bf16, fp16


def _triton_bytes(name: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[int, int]:
    """(bytes read, bytes written) of a Triton launch. The statistics kernel's first launch
    (``partials_kernel(table, n, ...)``) reads each element of the tensors its table names
    once (its design: a chunk is read a second time only where its fp32 sums overflowed
    or underflowed), the table, and writes its partials; its second (``finish_kernel``)
    reads the table and the partials and writes the vectors and counts; any other launch
    counts its tensor arguments as read."""
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if name == "partials_kernel" and len(args) >= 5:
        table, n, partials = args[0], int(args[1]), args[4]
        numels = table[n:2 * n].tolist()
        codes = table[2 * n:3 * n].tolist()
        data = sum(numel * _KERNEL_ELEMENT_BYTES[code] for numel, code in zip(numels, codes))
        return data + _distinct_bytes(table), _distinct_bytes(partials)
    if name == "finish_kernel" and len(tensors) > 2:
        return sum(map(_distinct_bytes, tensors[:2])), sum(map(_distinct_bytes, tensors[2:]))
    return sum(map(_distinct_bytes, tensors)), 0


class _TritonLaunches:
    """Counts Triton kernel launches (compiled or under ``TRITON_INTERPRET=1``) where Triton
    is imported: their bytes are the tensors among their arguments (a pointer table's
    tensors are not seen: those launches count what their arguments show)."""

    _patched: List[Tuple[Any, Any]] = []

    @classmethod
    def install(cls, tracer: DeviceCostTracer) -> None:
        if "triton" not in sys.modules:
            return
        targets = []
        try:
            from triton.runtime.jit import JITFunction
            targets.append(JITFunction)
        except ImportError:
            pass
        try:
            from triton.runtime.interpreter import InterpretedFunction
            targets.append(InterpretedFunction)
        except ImportError:
            pass
        for target in targets:
            original = target.__dict__.get("run")
            if original is None:
                continue

            def run(self: Any, *args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                # the interpreter's own tensor work (copies of the arguments) is not the
                # engine's, nor is reading the table here
                current, tracer.current = tracer.current, None
                try:
                    name = getattr(self, "__name__", "kernel")
                    read_bytes, written_bytes = _triton_bytes(name, args, kwargs)
                    tracer.current = current
                    tracer.launch(f"triton:{name}", read_bytes, written_bytes, 1)
                    tracer.current = None
                    return __original(self, *args, **kwargs)
                finally:
                    tracer.current = current

            target.run = run
            cls._patched.append((target, original))

    @classmethod
    def remove(cls) -> None:
        while cls._patched:
            target, original = cls._patched.pop()
            target.run = original


# ---- the workloads -----------------------------------------------------------------------

@dataclass(frozen=True)
class Shapes:
    layers: int = 32
    hidden: int = 4096
    inter: int = 11008
    vocab: int = 32000
    module_layers: int = 4
    tokens: int = 4096
    rope_dim: int = 128
    experts: int = 3072
    expert_shape: Tuple[int, int] = (2048, 2048)  # 4M elements
    big_shape: Tuple[int, int] = (32000, 4096)  # the one 131M-element tensor (an embedding gradient)


# small enough for Triton's interpreter (the seam's run); 24 experts of a little more than
# a group's largest member, so that a batched read of them is not grouped by the ATen path
SMOKE = Shapes(layers=2, hidden=256, inter=688, vocab=1024, module_layers=1, tokens=64, rope_dim=16, experts=24,
               expert_shape=(256, 264), big_shape=(1024, 2048))


def llama_params(s: Shapes) -> List[Tuple[str, Tuple[int, ...]]]:
    """A Llama's parameter names and shapes (Llama-2-7B's with the default ``Shapes``)."""
    params = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        params += [(p + "self_attn.q_proj.weight", (s.hidden, s.hidden)),
                   (p + "self_attn.k_proj.weight", (s.hidden, s.hidden)),
                   (p + "self_attn.v_proj.weight", (s.hidden, s.hidden)),
                   (p + "self_attn.o_proj.weight", (s.hidden, s.hidden)),
                   (p + "mlp.gate_proj.weight", (s.inter, s.hidden)),
                   (p + "mlp.up_proj.weight", (s.inter, s.hidden)),
                   (p + "mlp.down_proj.weight", (s.hidden, s.inter)),
                   (p + "input_layernorm.weight", (s.hidden,)),
                   (p + "post_attention_layernorm.weight", (s.hidden,))]
    return params + [("model.norm.weight", (s.hidden,)), ("lm_head.weight", (s.vocab, s.hidden))]


# "cuda": fake tensors (no memory); "cpu": real ones, through the engine's test seam
_DEVICE = ["cuda"]
# the phase of weight_grad's read of a whole backward pass's gradients at its end: inside
# backward as the hooks are (a sync there counts as one in hooks), batched as the
# optimizer step's reads are
PASS_END = "pass end"
# the module monitor's sum of the parts of a gradient that reaches a module's input through
# several edges (``sum_parts``): inside backward, a gradient-sized result the statistics
# need, not a read of the statistics engine
SUM_OF_PARTS = "sum of parts"


def _device_tensor(shape: Sequence[int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if _DEVICE[0] == "cpu":
        return torch.randn(tuple(shape), dtype=dtype)
    return torch.empty(tuple(shape), dtype=dtype, device="cuda")


def _keys(names: Sequence[str], scope: str) -> List[Tuple[int, str, str, Optional[int]]]:
    return [(0, name, scope, None) for name in names]


def weight_grad_workload(engine: Any, tracer: DeviceCostTracer, plan: StatPlan, s: Shapes) -> None:
    params = llama_params(s)
    grads = [_device_tensor(shape) for _, shape in params]
    names = [name for name, _ in params]
    # unreduced: every gradient together at the backward pass's end (weight_grad's batched
    # read on plain torch: on accelerators gradients of every size)
    with tracer.read("weight_grad 7B", PASS_END, grads):
        records = engine.record_many(grads, plan, _keys(names, "unreduced"))
    with tracer.read("weight_grad 7B", "batched", grads):
        records += engine.record_many(grads, plan, _keys(names, "reduced"))
    with tracer.read("weight_grad 7B", "step", []):
        engine.to_host(records)


def module_workload(engine: Any, tracer: DeviceCostTracer, plan: StatPlan, s: Shapes) -> None:
    record = engine.recorder(plan, cache=True)
    records = []
    for layer in range(s.module_layers):
        hidden = [_device_tensor((1, s.tokens, s.hidden)) for _ in range(27 - 5)]
        inter = [_device_tensor((1, s.tokens, s.inter)) for _ in range(8)]
        rope = [_device_tensor((s.tokens, s.rope_dim)) for _ in range(2)]
        for i in range(5):  # a grad_input that arrives through two edges: its parts summed first
            parts = [_device_tensor((1, s.tokens, s.hidden)) for _ in range(2)]
            with tracer.read("module 4 layers", SUM_OF_PARTS, parts):
                total = engine.sum_parts(parts[0], parts[1])
            hidden.append(total)
        for j, t in enumerate(hidden + inter + rope):
            with tracer.read("module 4 layers", "hooks", [t]):
                records.append(record(t, 0, f"model.layers.{layer}.t{j}", "output"))
    with tracer.read("module 4 layers", "step", []):
        engine.to_host(records)
    engine.forget()


def experts_workload(engine: Any, tracer: DeviceCostTracer, plan: StatPlan, s: Shapes) -> None:
    grads = [_device_tensor(s.expert_shape) for _ in range(s.experts)]
    names = [f"model.layers.{i // 48}.mlp.experts.{i % 48}.weight" for i in range(s.experts)]
    with tracer.read("3,072 experts", PASS_END, grads):
        records = engine.record_many(grads, plan, _keys(names, "unreduced"))
    with tracer.read("3,072 experts", "batched", grads):
        records += engine.record_many(grads, plan, _keys(names, "reduced"))
    with tracer.read("3,072 experts", "step", []):
        engine.to_host(records)


def one_big_tensor(engine: Any, tracer: DeviceCostTracer, plan: StatPlan, s: Shapes) -> None:
    g = _device_tensor(s.big_shape)
    with tracer.read("one big tensor", "hooks", [g]):
        rec = engine.record(g, plan, 0, "model.embed_tokens.weight", "unreduced")
    with tracer.read("one big tensor", "step", []):
        engine.to_host([rec])


WORKLOADS: Dict[str, Callable[..., None]] = {
    "weight_grad 7B": weight_grad_workload,
    "module 4 layers": module_workload,
    "3,072 experts": experts_workload,
    "one big tensor": one_big_tensor,
}


H100_SMS = 132  # multiprocessors: how the kernel cuts a list into chunks on an H100


def _h100_chunk(total: int) -> int:
    """``triton_stats._chunk_size`` on an H100: elements a program of the kernel reads."""
    wanted = -(-total // (triton_stats._PROGRAMS_PER_SM * H100_SMS))
    return min(triton_stats._MAX_CHUNK, max(triton_stats._BLOCK, 1 << max(0, wanted - 1).bit_length()))


def _kernel_takes(t: torch.Tensor) -> bool:
    """``triton_stats.accepts`` with fake tensors let in (their type is ``FakeTensor``)."""
    if isinstance(t, FakeTensor):
        return (t.dtype in triton_stats._CODES and t.layout == torch.strided and not t.is_nested
                and (t.is_contiguous() or triton_stats._dense(t)) and not t.is_neg())
    return _ACCEPTS[0](t)


_ACCEPTS = [triton_stats.accepts]


class ModelledKernel:
    """The engine's ``fused_reader`` on fake ``cuda`` tensors, where no Triton kernel can
    run: for a list the kernel takes, the two launches ``triton_stats.read_many`` makes, with
    their bytes (each element of the list read once, the table, the partials written and
    read back, the vectors and counts written; chunks as on an H100), and its results,
    allocated as it allocates them. A model, stated as such in the table's note."""

    def __init__(self, tracer: DeviceCostTracer) -> None:
        self.tracer = tracer

    def __call__(self, tensors: Sequence[torch.Tensor], plan: StatPlan) -> Optional[List[Tuple[Any, Any, Any]]]:
        if not tensors or not all(map(_kernel_takes, tensors)) or len({t.device for t in tensors}) != 1:
            return None
        n = len(tensors)
        numels = [t.numel() for t in tensors]
        chunk = _h100_chunk(sum(numels))
        device = tensors[0].device
        vectors = torch.empty((n, 4), dtype=torch.float64, device=device)
        counts = torch.empty((2, n), dtype=torch.int64, device=device)
        for start, stop in triton_stats.parts(numels, chunk):  # a pair of launches a part, as read_many
            m = stop - start
            n_chunks = sum(-(-numel // chunk) for numel in numels[start:stop])
            table = 8 * (4 * m + 1)
            partials = torch.empty(triton_stats._PARTIALS * max(n_chunks, 1), dtype=torch.float64, device=device)
            data = sum(t.numel() * t.element_size() for t in tensors[start:stop])
            if n_chunks:
                self.tracer.launch("triton:partials_kernel", data + table, _distinct_bytes(partials), 1)
            self.tracer.launch("triton:finish_kernel", _distinct_bytes(partials) + table, 48 * m, 1)
            del partials
        absent = [None] * n
        nans, zeros = counts.unbind(0)  # (indexing a fake cuda tensor asks a torch without CUDA for its device)
        return list(zip(vectors.unbind(0), nans.unbind(0) if plan.nans else absent,
                        zeros.unbind(0) if plan.zeros else absent))


class _EventOfAFakeRun:
    """``torch.cuda.Event`` for fake ``cuda`` tensors on a torch without CUDA, whose own
    class cannot be made: without it the engine's ``to_host`` takes its fallback for
    devices without events (a blocking copy) instead of what it does on a GPU (a
    non-blocking copy into pinned memory and an event the writer waits on)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


# the three ways the workloads are traced: the ATen path and the kernel path (modelled) on
# fake ``cuda`` tensors at full shapes, and the engine as it is (the Triton kernel under its
# interpreter) on real CPU tensors through the test seam at small shapes
ATEN, KERNEL, SEAM = "aten", "kernel", "seam"
KERNEL_SUFFIX = " (kernel)"


def trace(shapes: Shapes, only: Optional[Sequence[str]] = None, path: str = ATEN) -> List[Read]:
    """Every workload's reads, each with a fresh engine: on fake ``cuda`` tensors through
    the ATen path (``ATEN``: no fused reader) or the fused kernel's (``KERNEL``: its launches
    modelled, ``ModelledKernel``); ``SEAM``: on real CPU tensors that the engine treats as an
    accelerator's (``SEAM_ENV``), with whatever fused reader it has."""
    seam = path == SEAM
    _DEVICE[0] = "cpu" if seam else "cuda"
    if seam:
        # Triton imported now (the engine imports it at its first read), so that the
        # tracer counts the first workload's launches too
        triton_stats.available(torch.device("cpu"))
    plan = StatPlan.from_ops(monitor_rows.DEFAULT_OPS)
    reads: List[Read] = []
    # an engine's warning about a fake tensor is not one a run would give
    quiet = logging.getLogger("msprobe.monitor_v2")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    with contextlib.ExitStack() as undo:
        undo.callback(quiet.setLevel, level)
        if not seam and not torch.cuda.is_available():
            # the fake tensors say "cuda" to a torch without CUDA, whose capture check
            # raises (no stream of it can be capturing) and whose events cannot be made
            capturing, event = torch.cuda.is_current_stream_capturing, torch.cuda.Event
            torch.cuda.is_current_stream_capturing = lambda: False
            torch.cuda.Event = _EventOfAFakeRun
            undo.callback(setattr, torch.cuda, "is_current_stream_capturing", capturing)
            undo.callback(setattr, torch.cuda, "Event", event)
        reader = torch_stats.fused_reader
        undo.callback(setattr, torch_stats, "fused_reader", reader)
        undo.callback(setattr, triton_stats, "accepts", _ACCEPTS[0])
        for name, workload in WORKLOADS.items():
            if only and name not in only:
                continue
            engine = torch_stats.TorchStatsEngine()
            tracer = DeviceCostTracer()
            if path == ATEN:
                torch_stats.fused_reader = None
            elif path == KERNEL:
                torch_stats.fused_reader = ModelledKernel(tracer)
                triton_stats.accepts = _kernel_takes
            with contextlib.nullcontext() if seam else FakeTensorMode(), tracer:
                workload(engine, tracer, plan, shapes)
            for r in tracer.reads:
                r.workload += {ATEN: "", KERNEL: KERNEL_SUFFIX, SEAM: SEAM_SUFFIX}[path]
            reads += tracer.reads
    return reads


# the engine's test seam: CPU tensors take the accelerator branches, the Triton kernel runs
# under its interpreter (both read when the engine and Triton are imported: a process of
# its own)
SEAM_ENV = {"MSPROBE_MONITOR_ACCEL_ON_CPU": "1", "TRITON_INTERPRET": "1"}
SEAM_SUFFIX = " (seam)"


def trace_through_seam(only: Optional[Sequence[str]], timeout: float) -> Tuple[List[Read], str]:
    """The workloads at the small shapes on real CPU tensors through the seam, in a child
    process: (its reads, a note where it could not run)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "seam.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--seam-only", "--json", path]
        for name in only or ():
            cmd += ["--only", name]
        try:
            proc = subprocess.run(cmd, env={**os.environ, **SEAM_ENV}, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return [], f"the seam's run took more than {timeout:g} s"
        if proc.returncode != 0 or not os.path.exists(path):
            return [], "the seam's run failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
        with open(path) as f:
            got = json.load(f)
    return [Read(**{**r, "names": Counter(r["names"])}) for r in got["reads"]], ""


# ---- the summary --------------------------------------------------------------------------

@dataclass
class Workload:
    name: str
    tensors: int = 0  # tensors read (a tensor read twice, unreduced and reduced, counts twice)
    elements: int = 0
    monitored_bytes: int = 0
    ops: int = 0
    kernels: int = 0
    triton_launches: int = 0
    bytes_moved: int = 0
    peak_temporary: int = 0
    hook_syncs: int = 0
    step_syncs: int = 0
    step_blocking_copies: int = 0
    gpu_ms: float = 0.0
    host_ms: float = 0.0
    per_tensor_kernels: Tuple[int, int] = (0, 0)  # fewest, most, over reads of one tensor in hooks
    batched_kernels_per_tensor: float = 0.0

    @property
    def added_ms(self) -> Tuple[float, float]:
        return max(self.gpu_ms, self.host_ms), self.gpu_ms + self.host_ms


def summarise(reads: Sequence[Read]) -> Dict[str, Workload]:
    out: Dict[str, Workload] = {}
    for r in reads:
        w = out.setdefault(r.workload, Workload(r.workload))
        w.tensors += r.tensors
        w.elements += r.elements
        w.monitored_bytes += r.monitored_bytes
        w.ops += r.ops
        w.kernels += r.kernels
        w.triton_launches += r.triton_launches
        w.bytes_moved += r.bytes_read + r.bytes_written
        w.peak_temporary = max(w.peak_temporary, r.peak_temporary)
        if r.phase == "step":
            w.step_syncs += r.syncs
            w.step_blocking_copies += r.blocking_copies
        elif r.phase in ("hooks", PASS_END, SUM_OF_PARTS):
            w.hook_syncs += r.syncs
        w.gpu_ms += r.gpu_us / 1e3
        w.host_ms += r.kernels * HOST_US_PER_LAUNCH / 1e3
    for name, w in out.items():
        single = [r.kernels for r in reads if r.workload == name and r.phase == "hooks" and r.tensors == 1]
        if single:
            w.per_tensor_kernels = (min(single), max(single))
        batched = [r for r in reads if r.workload == name and r.phase in ("batched", PASS_END) and r.tensors > 1]
        if batched:
            w.batched_kernels_per_tensor = sum(r.kernels for r in batched) / sum(r.tensors for r in batched)
    return out


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:,.1f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:,.1f} KiB"


def _ms(lo: float, hi: float) -> str:
    if hi >= 1000:
        return f"{lo / 1e3:.2f}-{hi / 1e3:.2f} s"
    return f"{lo:.1f}-{hi:.1f} ms"


def bytes_per_element(reads: Sequence[Read]) -> Optional[Tuple[float, float]]:
    """(bytes moved per element, that over one read) of the reads of tensors of at least
    64K elements in hooks and batched calls."""
    chosen = [r for r in reads if r.phase != "step" and r.tensors and r.elements / r.tensors >= 1 << 16]
    if not chosen:
        return None
    moved = sum(r.bytes_read + r.bytes_written for r in chosen)
    one_read = sum(r.monitored_bytes for r in chosen)
    return moved / sum(r.elements for r in chosen), moved / one_read


def table(reads: Sequence[Read], seam_note: str = "") -> str:
    """The one table: issue 48's measures, today and target columns, and this engine's
    figures: the ATen path (fake ``cuda`` tensors, full shapes, every op counted), the
    kernel path at full shapes (fake tensors, the kernel's launches modelled) and through
    the seam (real CPU tensors at the small shapes, the Triton kernel run under its
    interpreter: launches counted, bytes from its table)."""
    def part(suffix: str) -> List[Read]:
        if suffix:
            return [r for r in reads if r.workload.endswith(suffix)]
        return [r for r in reads if not r.workload.endswith((SEAM_SUFFIX, KERNEL_SUFFIX))]

    aten, kernel, seam = part(""), part(KERNEL_SUFFIX), part(SEAM_SUFFIX)
    w, wk, ws = summarise(aten), summarise(kernel), summarise(seam)
    seam_ran = any(r.triton_launches for r in seam)
    no_seam = seam_note or ("no read through the seam launched a Triton kernel" if seam
                            else "not measured (the seam was not run)")
    rows: List[Tuple[str, str, str, str]] = []

    def per_element(chosen: Sequence[Read]) -> str:
        got = bytes_per_element(chosen)
        if got is None:
            return "no read took it"
        per, ratio = got
        return f"{per:.1f} B ({ratio:.2f}x one read; {per - per / ratio:.1f} B beyond it)"

    kernel_bytes = f"full shapes {per_element(kernel)}" if kernel else ""
    kernel_bytes += (f"; seam {per_element(seam)}" if seam_ran else f"; seam: {no_seam}")
    rows.append(("bytes per element, tensors >= 64K elements, kernel path", "32 B (16x, bf16)",
                 "<= 1.3x one read", kernel_bytes.lstrip("; ")))
    rows.append(("same, ATen fallback", "32 B", "<= 5 B beyond one read", per_element(aten)))

    def three(name: str, show: Callable[[Workload], str], sep: str = "; ") -> str:
        got = [f"fallback {show(w[name])}"] if name in w else []
        if name + KERNEL_SUFFIX in wk:
            got.append(f"kernel path {show(wk[name + KERNEL_SUFFIX])}")
        if seam_ran and name + SEAM_SUFFIX in ws:
            got.append(f"seam {show(ws[name + SEAM_SUFFIX])}")
        return sep.join(got)

    def single(x: Workload) -> str:
        lo, hi = x.per_tensor_kernels
        return f"{lo}-{hi}"

    if "module 4 layers" in w:
        rows.append(("launches per tensor in module hooks", "10-107", "<= 2 (kernel path), <= 4 (fallback)",
                     three("module 4 layers", single)))
    batched = [n for n, x in w.items() if x.batched_kernels_per_tensor]
    if batched:
        rows.append(("launches for batched `reduced`/`param`/`optimizer`/`unreduced` reads", "~10 per tensor",
                     "<= 1 per 10 tensors (kernel path)",
                     "; ".join(f"{n}: " + three(n, lambda x: f"{x.batched_kernels_per_tensor:.3f}", ", ")
                               + " per tensor" for n in batched)))
    if "one big tensor" in w:
        big = [r for r in aten if r.workload == "one big tensor" and r.phase == "hooks"]

        def launches(x: Workload) -> str:
            return str(sum(r.kernels for r in reads if r.workload == x.name and r.phase == "hooks"))

        rows.append((f"launches for one {big[0].elements / 1e6:.0f}M-element tensor", "107", "<= 3",
                     three("one big tensor", launches)))

    def peak(chosen: Sequence[Read]) -> str:
        data = [r for r in chosen if r.phase not in ("step", SUM_OF_PARTS)]
        return _mib(max(r.peak_temporary for r in data)) if data else "-"

    if aten:
        sums = [r.peak_temporary for r in aten if r.phase == SUM_OF_PARTS]
        rows.append(("peak temporary of one read", "up to n bytes", "<= 8 MiB",
                     f"fallback {peak(aten)}" + (f"; kernel path {peak(kernel)}" if kernel else "")
                     + (f"; seam {peak(seam)}" if seam_ran else "")
                     + (f" (the module monitor's sum of a gradient's parts, not a read: {_mib(max(sums))})"
                        if sums else "")))

    def syncs(x: Dict[str, Workload]) -> str:
        copies = [v.step_blocking_copies for v in x.values() if not v.name.startswith("one big tensor")]
        hooks = sum(v.hook_syncs for v in x.values())
        return f"{hooks} / {min(copies)}-{max(copies)}" if copies else f"{hooks} / -"

    rows.append(("host syncs in hooks / blocking copies in `step()` with `async_write`", "0 / 2-3", "0 / 0",
                 f"fallback {syncs(w)}" + (f"; kernel path {syncs(wk)}" if wk else "")
                 + (f"; seam {syncs(ws)}" if seam_ran else "")))
    names = [n for n in ("weight_grad 7B", "module 4 layers", "3,072 experts") if n in w]
    if names:
        est = "ATen path: " + " / ".join(_ms(*w[n].added_ms) for n in names)
        if all(n + KERNEL_SUFFIX in wk for n in names):
            est += "; kernel path: " + " / ".join(_ms(*wk[n + KERNEL_SUFFIX].added_ms) for n in names)
        rows.append(("estimated H100: 7B `weight_grad` / `module` 4 of 32 layers / 3,072 experts",
                     "185-276 ms / 46-70 ms / 0.39-0.73 s", "<= 15 ms / <= 5 ms / <= 30 ms", est))
        today = {"weight_grad 7B": "18,044 / 431 GB", "module 4 layers": "4,784 / 106 GB",
                 "3,072 experts": "67,584 / 825 GB"}
        for n in names:
            x = w[n]
            got = (f"ATen path {x.kernels:,} / {x.bytes_moved / 1e9:,.1f} GB ({x.ops:,} ATen ops; one read: "
                   f"{x.monitored_bytes / 1e9:,.1f} GB)")
            k = wk.get(n + KERNEL_SUFFIX)
            if k is not None:
                got += f"; kernel path {k.kernels:,} / {k.bytes_moved / 1e9:,.1f} GB ({k.triton_launches:,} Triton)"
            rows.append((f"{n}: launches / bytes moved (measured)", today[n], "-", got))
    rows.append(("on a GPU: `weight_grad` / all monitors on a 1B model", "unmeasured", "<= 1.01 / <= 1.05",
                 "needs a GPU (scripts/gpu_checks.sh)"))
    lines = ["| measure | today (issue 48) | target | this engine |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


NOTE = ("Fallback: the ATen path on fake `cuda` tensors at full shapes, every op counted (the fused "
        "reader off, as on a device without Triton). Kernel path: the same fake tensors with the engine's "
        "fused reader in place; Triton cannot run on fake tensors, so each read it takes counts the "
        "kernel's two launches (a pair for each part of at most 2^17 chunks, 8.6G elements) and one "
        "read of its tensors' bytes (plus its table, partials and results), a model. Seam: the small "
        "shapes on real CPU tensors through MSPROBE_MONITOR_ACCEL_ON_CPU=1 with TRITON_INTERPRET=1, the "
        "Triton kernel run: its launches counted, its bytes read from its table (each element once). The "
        "table of addresses each call copies to the device (16 bytes a tensor, from pinned memory, not a "
        "kernel) is not counted as a launch. Times are estimates from the stated constants.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="small shapes (seconds): checks that the benchmark runs")
    p.add_argument("--only", action="append", choices=list(WORKLOADS), help="run only this workload (repeatable)")
    p.add_argument("--json", default=None, help="also write every read and the workloads' sums to this file")
    p.add_argument("--no-seam", action="store_true",
                   help="fake cuda tensors only (no run of the small shapes through the seam, in a child process)")
    p.add_argument("--seam-timeout", type=float, default=300, help="seconds the seam's run may take")
    p.add_argument("--seam-only", action="store_true", help=argparse.SUPPRESS)  # the child's part
    args = p.parse_args(argv)
    if args.seam_only:
        shapes = SMOKE
        reads = trace(shapes, args.only, SEAM)
    else:
        shapes = SMOKE if args.smoke else Shapes()
        reads = trace(shapes, args.only, ATEN) + trace(shapes, args.only, KERNEL)
    if not any(r.ops or r.triton_launches for r in reads):
        print("the tracer saw no operation of the engine: it set the tracer aside as a training mode",
              file=sys.stderr)
        return 1
    note = ""
    if not args.seam_only and not args.no_seam:
        seam_reads, note = trace_through_seam(args.only, args.seam_timeout)
        reads += seam_reads
    print(f"Constants: HBM {HBM_BYTES_PER_S / 1e12:.2f} TB/s at {HBM_EFFICIENCY:.0%}, {HOST_US_PER_LAUNCH:g} us of host "
          f"time a launch, {TINY_KERNEL_US:g} us the least kernel time; shapes: {shapes}; seam: small shapes "
          f"{SMOKE.expert_shape}... on CPU tensors, {', '.join(f'{k}={v}' for k, v in SEAM_ENV.items())}")
    print()
    print(table(reads, note))
    print()
    print(NOTE)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shapes": asdict(shapes),
                       "constants": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "hbm_efficiency": HBM_EFFICIENCY,
                                     "host_us_per_launch": HOST_US_PER_LAUNCH, "tiny_kernel_us": TINY_KERNEL_US},
                       "workloads": {n: {**asdict(x), "added_ms": x.added_ms} for n, x in summarise(reads).items()},
                       "reads": [{**asdict(r), "names": dict(r.names)} for r in reads]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
