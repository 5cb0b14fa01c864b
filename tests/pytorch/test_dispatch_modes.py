"""The monitor's tensor work is invisible to the training's dispatch modes (issue 46, part 1).

DeepSeek-V3's attention hands non-contiguous activations to its modules, which the one-pass
C kernel does not read: the engine reduces them with ATen ops (``torch.bmm`` among them)
inside the forward. Under selective activation checkpointing (SAC), whose policy saves
every ``aten.bmm``/``aten.mm`` result and hands them back in call order to the
recomputation, the model's own ``bmm`` in the recomputation then received the monitor's
result (``RuntimeError: shape '[2, 16, 32, 32]' is invalid for input of size 16`` in
TorchTitan). Here a small attention model with the same layout (a rotary-like module fed
the transposed query, a merge of the heads fed the transposed output, both larger than the
engine's 4096-element rows, so that its sum of squares runs ``torch.bmm``) trains under SAC
with every monitor on: bit-identical to an unmonitored copy, module rows against NumPy.
Then a user's ``TorchDispatchMode``, ``DebugMode`` and ``FlopCounterMode`` around whole
training steps see the same ops (or flops) with and without the monitor, and a
``TorchFunctionMode`` sees no computing function of the monitor's.

Last, what ``stop()`` says when the training stops before its first step ended.
"""

import collections
import copy
import functools
import logging
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from support import assert_row_matches, find_row, numpy_stats, rows_of
from support.extras import needs
from support.modes import OpRecorder
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

LOGGER = "msprobe.monitor_v2"
BATCH, SEQ, HIDDEN, HEADS = 2, 64, 64, 4  # a head-split query: 2 * 4 * 64 * 16 = 8192 elements
STEPS = 3
ALL_BUT_CC = {"module": {"enabled": True}, "weight_grad": {"enabled": True}, "optimizer": {"enabled": True},
              "param": {"enabled": True}}
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)


class Rotary(nn.Module):
    """Stands for a rotary embedding: elementwise, so its output keeps the input's
    (non-contiguous) layout."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return q * 0.5 + q.flip(-1) * 0.25


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.rotary = Rotary()
        self.merge = nn.Flatten(2)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [3, batch, heads, seq, head dim]: views of the projection, not contiguous
        q, k, v = self.qkv(x).view(BATCH, SEQ, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(self.rotary(q), k.transpose(-1, -2)).softmax(-1)  # the model's bmm
        heads = torch.matmul(scores, v).transpose(1, 2)  # [batch, seq, heads, head dim], not contiguous
        return self.proj(self.merge(heads))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm(x))  # the block's input reaches two places: a grad_input sum
        return h + self.mlp(h)


class Model(nn.Module):
    """Blocks in ``layers`` (as TorchTitan's models keep them), each under selective
    checkpointing with a fresh policy from ``policy`` when it is given."""

    def __init__(self, policy: Optional[Callable[[], Callable[..., CheckpointPolicy]]] = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(HIDDEN, 8)
        self.policy = policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            if self.policy is None:
                x = block(x)
            else:
                contexts = functools.partial(create_selective_checkpoint_contexts, self.policy())
                x = checkpoint(block, x, use_reentrant=False, context_fn=contexts)
        return self.head(x)


def save_matmuls() -> Callable[..., CheckpointPolicy]:
    """Save every matmul's result (replayed in call order by the recomputation)."""
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def save_as_torchtitan() -> Callable[..., CheckpointPolicy]:
    """TorchTitan's rule (``SelectiveAC``), written out: save the compute-intensive ops and
    attention, but recompute every second ``mm``."""
    from torch._functorch.partitioners import get_default_op_list

    saved = {op.default for op in get_default_op_list().compute_intensive_ops}
    saved.add(torch.ops.aten._scaled_dot_product_attention_math.default)
    counts = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is torch.ops.aten.mm.default:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def batches(n: int = STEPS) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(BATCH, SEQ, HIDDEN, generator=g) for _ in range(n)]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


PROBED = ("layers.0.attn.rotary", "layers.0.attn.merge", "layers.1.attn.rotary")


def reference_activations(model: nn.Module, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    """``<module>.input.0`` / ``<module>.output.0`` of the probed modules for ``x``: a copy of
    ``model`` without checkpointing, called under no_grad, each tensor copied by a hook (the
    same ops, so the same values, as the checkpointed training forward)."""
    probe = copy.deepcopy(model)
    probe.policy = None
    seen: Dict[str, torch.Tensor] = {}
    # TorchTitan's checkpoint wrapper adds a level the monitor's names leave out
    modules = {name.replace("._checkpoint_wrapped_module", ""): m for name, m in probe.named_modules()}
    for name in PROBED:
        def keep(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            seen[f"{name}.input.0"] = args[0].detach().clone()
            seen[f"{name}.output.0"] = out.detach().clone()

        modules[name].register_forward_hook(keep)
    with torch.no_grad():
        probe(x)
    assert not seen["layers.0.attn.rotary.input.0"].is_contiguous()  # what the engine's ATen path reduces
    assert not seen["layers.0.attn.merge.input.0"].is_contiguous()
    return seen


def train_pair(write_config, model: nn.Module, twin: nn.Module) -> TrainerMonitorV2:
    """Train ``model`` monitored and ``twin`` not, step by step: the same losses to the bit
    each step, the same parameters at the end; the probed modules' forward rows against
    NumPy statistics of the reference activations."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-3)
    mon = TrainerMonitorV2(write_config({"monitors": ALL_BUT_CC}))
    mon.start(model=model, optimizer=opt)
    expected: List[Dict[str, torch.Tensor]] = []
    try:
        for x in batches():
            expected.append(reference_activations(twin, x))
            loss = loss_of(model, x)
            loss.backward()
            opt.step()  # patched: ends the monitor's step
            opt.zero_grad()
            twin_loss = loss_of(twin, x)
            twin_loss.backward()
            twin_opt.step()
            twin_opt.zero_grad()
            assert torch.equal(loss, twin_loss)
    finally:
        mon.stop()
    assert mon.errors.count == 0
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    rows = rows_of(mon.config.output_dir, "module")
    for step, want in enumerate(expected):
        for tag, t in want.items():
            assert_row_matches(find_row(rows, step=step, module_name=tag, scope="forward"), numpy_stats(t),
                               rtol=1e-5, atol=1e-6)
        # the backward rows of the same modules are there too
        for name in PROBED:
            find_row(rows, step=step, module_name=f"{name}.grad_output.0", scope="backward")
    for monitor in ("weight_grad", "optimizer", "param"):
        assert {r["step"] for r in rows_of(mon.config.output_dir, monitor)} == {str(s) for s in range(STEPS)}
    return mon


@pytest.mark.parametrize("policy", [save_matmuls, save_as_torchtitan])
def test_selective_checkpointing_with_non_contiguous_activations(write_config, policy):
    model = Model(policy)
    train_pair(write_config, model, copy.deepcopy(model))


@needs("torchtitan", "this test applies TorchTitan's own selective activation checkpointing (SelectiveAC)")
def test_torchtitan_selective_checkpointing(write_config):
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    model = Model()
    twin = copy.deepcopy(model)
    for m in (model, twin):  # its checkpoint_wrapper around each of model.layers, with its policy
        SelectiveAC(SelectiveAC.Config()).apply(m)
    assert type(model.layers[0]).__name__ == "CheckpointWrapper"
    train_pair(write_config, model, twin)


# ------------------------------------------------------------------ modes around the training
class CallRecorder(TorchFunctionMode):
    """A user's torch-function mode: the name of every function it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def seen_by_mode(write_config, kind: str, monitored: bool, extra: Optional[Dict[str, Any]] = None) -> Any:
    """What a mode of ``kind`` entered around each whole training step (forward, backward,
    the optimizer's step, which ends the monitor's step) saw, under selective
    checkpointing, with or without the monitor (its config: every monitor but cc, plus
    ``extra``)."""
    from torch.utils._debug_mode import DebugMode
    from torch.utils.flop_counter import FlopCounterMode

    model = Model(save_matmuls)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = None
    if monitored:
        mon = TrainerMonitorV2(write_config({"monitors": ALL_BUT_CC, **(extra or {})}))
        mon.start(model=model, optimizer=opt)
    seen: List[Any] = []
    try:
        for x in batches():
            mode = {"dispatch": OpRecorder, "debug": DebugMode, "function": CallRecorder,
                    "flops": functools.partial(FlopCounterMode, display=False)}[kind]()
            with mode:
                loss_of(model, x).backward()
                opt.step()
                opt.zero_grad()
            if kind == "dispatch":
                seen.append(mode.ops)
            elif kind == "debug":
                seen.append(mode.debug_string().splitlines())  # each op with its arguments' shapes
            elif kind == "function":
                seen.append(mode.calls)
            else:
                seen.append(mode.get_total_flops())
    finally:
        if mon is not None:
            mon.stop()
    if mon is not None:
        assert mon.errors.count == 0
        module_rows = rows_of(mon.config.output_dir, "module")
        assert {r["step"] for r in module_rows} == {str(s) for s in range(STEPS)}
        find_row(module_rows, step=0, module_name="layers.0.attn.merge.input.0", scope="forward")
    return seen


@pytest.mark.parametrize("kind", ["dispatch", "debug", "flops"])
def test_a_dispatch_mode_around_training_sees_what_it_sees_without_the_monitor(write_config, kind):
    plain = seen_by_mode(write_config, kind, monitored=False)
    watched = seen_by_mode(write_config, kind, monitored=True)
    if kind == "flops":
        assert watched == plain and plain[0] > 0
        return
    for step, (a, b) in enumerate(zip(plain, watched)):
        assert b == a, (step, sorted((collections.Counter(b) - collections.Counter(a)).items())[:10])


def test_the_pre_update_gradient_check_of_alert_dump_is_not_seen_by_a_mode(write_config):
    """With ``alert.dump`` the optimizer's pre-step hook checks every gradient for NaN/Inf
    (``_foreach_norm``, ``isfinite``): work of the monitor's own, not seen by a mode
    entered around the step either."""
    dump = {"alert": {"dump": True}}
    plain = seen_by_mode(write_config, "dispatch", monitored=False)
    watched = seen_by_mode(write_config, "dispatch", monitored=True, extra=dump)
    assert plain and plain[0]
    for step, (a, b) in enumerate(zip(plain, watched)):
        assert b == a, (step, sorted((collections.Counter(b) - collections.Counter(a)).items())[:10])


# The torch-function calls the monitor's hooks make while a mode is on: reading what a tensor
# is (its type's getters and metadata methods), never computing with it.
METADATA = {"Tensor.__get__", "_TensorBase.__get__", "TensorBase.__get__", "Tensor._is_view", "TensorBase._is_view",
            "_TensorBase._is_view", "Tensor.numel", "TensorBase.numel", "_TensorBase.numel", "Tensor.data_ptr",
            "TensorBase.data_ptr", "_TensorBase.data_ptr", "Tensor.is_contiguous", "TensorBase.is_contiguous",
            "_TensorBase.is_contiguous", "Tensor.is_neg", "TensorBase.is_neg", "_TensorBase.is_neg",
            "Tensor.is_inference", "TensorBase.is_inference", "_TensorBase.is_inference", "Tensor.register_hook",
            "Tensor.register_post_accumulate_grad_hook"}


def test_a_function_mode_around_training_sees_no_computation_of_the_monitor(write_config):
    plain = seen_by_mode(write_config, "function", monitored=False)
    watched = seen_by_mode(write_config, "function", monitored=True)
    for step, (a, b) in enumerate(zip(plain, watched)):
        extra = collections.Counter(b) - collections.Counter(a)
        computing = {name: n for name, n in extra.items() if name not in METADATA and not name.endswith(".__get__")}
        assert not computing, (step, computing)
        assert not collections.Counter(a) - collections.Counter(b), step  # nothing of the training's is lost


def test_the_engine_puts_the_modes_back_as_they_were():
    """The engine's ATen path with modes on: its result is the statistics of the tensor,
    the modes saw none of its ops, and both stacks are as before afterwards (also where
    the path raises)."""
    from msprobe.core.monitor_v2.frameworks.pytorch.stats import TorchStatsEngine
    from msprobe.core.monitor_v2.stats import StatPlan

    engine = TorchStatsEngine()
    plan = StatPlan.from_ops(["min", "max", "mean", "norm", "nans"])
    t = torch.randn(4, 4096).t()  # not contiguous: the ATen path
    base = t.t()
    flat = base.contiguous().reshape(-1)  # the same values in another shape
    with CallRecorder() as calls, OpRecorder() as ops:
        before = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
        rec = engine.record(t, plan, 0, "t", "forward")
        engine.to_host([rec])
        total = engine.sum_parts(base, flat)  # a part of another shape: reshaped
        after = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
        with pytest.raises(AttributeError):
            engine.record(object(), plan, 0, "not a tensor", "forward")
        raised = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
    assert before == after == raised == (1, 1)
    # no op at all; of torch functions, at most reads of what a tensor is (an attribute's
    # getter, as the hooks' METADATA below: which paths read one depends on what earlier
    # tests left loaded, e.g. the sparse paths)
    assert ops.ops == []
    assert [c for c in calls.calls if not c.endswith(".__get__")] == [], calls.calls
    assert torch.equal(total, base * 2)
    want = numpy_stats(t)
    got = dict(zip(("min", "max", "mean", "norm"), rec.vector))
    got["mean"] = rec.vector[2] / rec.numel
    for op in ("min", "max", "mean", "norm"):
        assert got[op] == pytest.approx(want[op], rel=1e-6, abs=1e-9)


# ------------------------------------------------------------------ stop() after a crash
class Crashes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        raise RuntimeError("shape '[2, 16, 32, 32]' is invalid for input of size 16")


def warnings_of(caplog) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == LOGGER]


def test_stop_during_a_crash_before_the_first_step_ended_says_so(write_config, caplog):
    model = Crashes()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True}}}))
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(RuntimeError, match="is invalid"):
        mon.start(model=model, optimizer=opt)
        try:
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        finally:
            mon.stop()  # as a training script's finally block does
    (msg,) = warnings_of(caplog)
    assert ("wrote no rows: training stopped before its first step ended: stop() ran while an exception was "
            "raised (RuntimeError: shape '[2, 16, 32, 32]' is invalid for input of size 16") in msg, msg
    assert "neither mon.step() nor" not in msg


def test_stop_after_passes_that_no_step_ended_says_so(write_config, caplog):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"patch_optimizer_step": False, "monitors": {"module": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    model(torch.randn(2, 4)).sum().backward()  # a pass, but neither optimizer.step() nor mon.step()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mon.stop()
    (msg,) = warnings_of(caplog)
    assert ("training stopped before its first step ended: the monitor's hooks ran (a forward or backward pass "
            "began), but neither mon.step() nor a patched optimizer.step() ended a step") in msg, msg


def test_stop_without_any_pass_keeps_saying_no_step_ended(write_config, caplog):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mon.stop()
    (msg,) = warnings_of(caplog)
    assert "no step ended: neither mon.step() nor a patched optimizer.step() was called" in msg, msg
