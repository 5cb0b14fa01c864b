"""The accelerator path with the fused Triton kernel wired in (issue 48), on the CPU: the
engine's test seam (``MSPROBE_MONITOR_ACCEL_ON_CPU=1``) with Triton's interpreter
(``TRITON_INTERPRET=1``), so CPU tensors take every accelerator branch and the kernel runs.

Both variables are read once per process (Triton's at its import, the seam's when an
engine is made), so the checks (``check_*``) run in one child Python for the module
(``support.child_checks``). Values are checked against NumPy float64 on copies (min, max
and the counts exact; mean and norm within 1e-6 relative, absolute 1e-6 x mean |x| near
zero), training bit-identical with and without the monitor, and the kernel's launches
counted with Triton's pre-run hooks (as test_triton_stats.py counts them). The
interpreter is slow: sizes stay small.
"""

import copy
import logging
import math
from collections import Counter
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch

from support.child_checks import ChildChecks
from support.extras import require

require("triton", "the accelerator path's fused statistics kernel is written in Triton and tested under its "
        "interpreter")

from msprobe.core.monitor_v2.frameworks.pytorch import stats as torch_stats  # noqa: E402
from msprobe.core.monitor_v2.frameworks.pytorch import triton_stats  # noqa: E402
from msprobe.core.monitor_v2.frameworks.pytorch.stats import ACCEL_ON_CPU_ENV, TorchStatsEngine  # noqa: E402
from msprobe.core.monitor_v2.stats import GROUP_MAX_NUMEL, StatPlan  # noqa: E402

ALL_OPS = ("min", "max", "mean", "norm", "nans", "zeros")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel_seam():
    child = ChildChecks(__file__, {ACCEL_ON_CPU_ENV: "1", "TRITON_INTERPRET": "1"})
    yield child
    child.close()


# ------------------------------------------------------------------ helpers (in the child)
class Launches:
    """The kernel's launches while entered, by kernel, with Triton's pre-run hooks."""

    def __init__(self) -> None:
        self.names: List[str] = []
        self._hooks: List[Tuple[Any, Any]] = []

    def __enter__(self) -> "Launches":
        for name, kernel in zip(("partials", "finish"), triton_stats._kernels()):
            def hook(*args: Any, _name: str = name, **kwargs: Any) -> None:
                self.names.append(_name)
            kernel.add_pre_run_hook(hook)
            self._hooks.append((kernel, hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for kernel, hook in self._hooks:
            kernel.pre_run_hooks.remove(hook)

    def __len__(self) -> int:
        return len(self.names)


def _assert_matches_numpy(rec: Any, t: torch.Tensor, what: str) -> None:
    a = t.detach().to(torch.float64).numpy().copy().ravel()
    assert rec.numel == a.size, what
    mn, mx, total, norm = rec.vector
    assert (rec.nans or 0) == int(np.isnan(a).sum()), what
    assert rec.zeros is None or rec.zeros == int((a == 0).sum()), what
    if np.isnan(a).any():
        assert all(math.isnan(v) for v in (mn, mx, total, norm)), (what, rec.vector)
        return
    assert mn == a.min() and mx == a.max(), (what, rec.vector, a.min(), a.max())
    assert math.isclose(norm, float(np.sqrt(np.sum(a * a))), rel_tol=1e-6), (what, norm)
    scale = float(np.mean(np.abs(a)))
    assert math.isclose(total / a.size, float(np.mean(a)), rel_tol=1e-6, abs_tol=1e-6 * scale), (what, total)


def _host(engine: TorchStatsEngine, recs: List[Any]) -> List[Any]:
    ready = engine.to_host(recs)
    if ready is not None:
        ready()
    return recs


def _tensors() -> List[torch.Tensor]:
    """A mixed list: every kernel dtype, sizes around a group's largest member and above
    it, a transpose and a permutation (dense: read as they are), NaN, -0.0 and zeros."""
    g = torch.Generator().manual_seed(48)
    out: List[torch.Tensor] = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 5, 5, 300, GROUP_MAX_NUMEL, GROUP_MAX_NUMEL + 3, 100_003):
            out.append((torch.randn(n, generator=g) * 2 + 0.5).to(dtype))
    out[3][7] = math.nan
    out[4][0] = -0.0
    out[5][:10] = 0.0
    out.append(torch.randn(300, 257, generator=g).t())
    out.append(torch.randn(6, 40, 33, generator=g).bfloat16().permute(2, 0, 1))
    return out


# ------------------------------------------------------------------ checks (in the child)
def check_reads_go_through_the_kernel() -> None:
    """``record_many`` of a mixed list of every size: two launches for all of it (no
    per-tensor read above a group's size); ``record`` of one tensor, a transpose among
    them: two launches and no tensor-sized temporary (no contiguous copy); values
    against NumPy."""
    assert triton_stats.available(CPU)
    engine = TorchStatsEngine()
    assert not engine.on_host(CPU) and engine._native is None
    plan = StatPlan.from_ops(ALL_OPS)
    tensors = _tensors()
    keys = [(0, f"t{i}", "s", None) for i in range(len(tensors))]
    with Launches() as launches:
        recs = engine.record_many(tensors, plan, keys)
    assert launches.names == ["partials", "finish"], launches.names
    for t in (tensors[-2], tensors[-1], tensors[-3], tensors[0]):
        with Launches() as launches:
            recs.append(engine.record(t, plan, 0, "one", "s"))
        assert launches.names == ["partials", "finish"], (t.shape, launches.names)
    _host(engine, recs)
    for rec, t in zip(recs, tensors + [tensors[-2], tensors[-1], tensors[-3], tensors[0]]):
        _assert_matches_numpy(rec, t, f"{rec.name} {t.dtype} {tuple(t.shape)}")


def check_no_copy_of_a_transpose() -> None:
    """The engine's ATen calls around the kernel for a transposed tensor: none makes a
    tensor-sized result (a contiguous copy would)."""
    from support.modes import SeenByTheEngine

    class Sizes(SeenByTheEngine):
        def __init__(self) -> None:
            super().__init__()
            self.largest = 0
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops[func.overloadpacket.__name__] += 1
            for o in torch.utils._pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and not func.is_view:
                    self.largest = max(self.largest, o.numel())
            return out

    engine = TorchStatsEngine()
    t = torch.randn(300, 257).t()
    plan = StatPlan.from_ops(ALL_OPS)
    with Sizes() as sizes, Launches() as launches:
        rec = engine.record(t, plan, 0, "t", "s")
    assert len(launches) == 2
    # the interpreter's own copies of the kernel's small arguments are seen too: no
    # result as large as the tensor is the check that matters
    assert sizes.largest < 1000, (sizes.largest, sizes.ops)
    for reduction in ("aminmax", "sum", "_foreach_norm", "isnan", "eq", "clone", "contiguous"):
        assert reduction not in sizes.ops, sizes.ops
    _assert_matches_numpy(_host(engine, [rec])[0], t, "transpose")


def check_a_failing_launch_falls_back_to_aten_said_once() -> None:
    """A launch that raises: the read is done by ATen (right values), one INFO line names
    the failure, and the device type is not tried again."""
    said: List[logging.LogRecord] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record)

    handler = Said(logging.DEBUG)
    log = logging.getLogger("msprobe.monitor_v2")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    tries: List[int] = []
    launch = triton_stats._launch

    def failing(*args: Any, **kwargs: Any) -> Any:
        tries.append(1)
        raise RuntimeError("out of resources: shared memory (a test's failing launch)")

    triton_stats._launch = failing
    saved = (set(triton_stats._failed), triton_stats._said, set(torch_stats._no_kernel))
    triton_stats._said = type(triton_stats._said)()
    try:
        engine = TorchStatsEngine()
        plan = StatPlan.from_ops(ALL_OPS)
        tensors = _tensors()[:8]
        recs = engine.record_many(tensors, plan, [(0, f"t{i}", "s", None) for i in range(len(tensors))])
        recs += [engine.record(t, plan, 0, f"one{i}", "s") for i, t in enumerate(tensors[:3])]
        recs += engine.record_many(tensors, plan, [(0, f"u{i}", "s", None) for i in range(len(tensors))])
        _host(engine, recs)
        for rec, t in zip(recs, tensors + tensors[:3] + tensors):
            _assert_matches_numpy(rec, t, rec.name)
        assert len(tries) == 1, tries  # not tried again on this device type
        lines = [r for r in said if "Triton statistics kernel" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelname == "INFO", [r.getMessage() for r in said]
        assert "failed" in lines[0].getMessage() and "out of resources" in lines[0].getMessage()
    finally:
        triton_stats._launch = launch
        triton_stats._failed.clear()
        triton_stats._failed.update(saved[0])
        triton_stats._said = saved[1]
        torch_stats._no_kernel.clear()
        torch_stats._no_kernel.update(saved[2])
        log.removeHandler(handler)
        log.setLevel(level)


class EngineCalls:
    """Every ``record_many`` and per-tensor read (``_record_other``) of the engine while
    entered: ``(kind, scope, tensors, kernel launches during the call)``."""

    def __init__(self, launches: Launches) -> None:
        self.launches = launches
        self.calls: List[Tuple[str, str, int, int]] = []
        self._saved: Dict[str, Any] = {}

    def __enter__(self) -> "EngineCalls":
        calls, launches = self.calls, self.launches

        def many(engine, tensors, plan, keys, _original=TorchStatsEngine.record_many):
            before = len(launches)
            out = _original(engine, tensors, plan, keys)
            calls.append(("many", keys[0][2] if keys else "", len(tensors), len(launches) - before))
            return out

        def one(engine, t, plan, vpp_stage, name, scope, micro_step, cache,
                _original=TorchStatsEngine._record_other):
            before = len(launches)
            out = _original(engine, t, plan, vpp_stage, name, scope, micro_step, cache)
            calls.append(("one", scope, 1, len(launches) - before))
            return out

        self._saved = {"record_many": TorchStatsEngine.record_many, "_record_other": TorchStatsEngine._record_other}
        TorchStatsEngine.record_many = many
        TorchStatsEngine._record_other = one
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, value in self._saved.items():
            setattr(TorchStatsEngine, name, value)


def check_whole_monitor_through_the_kernel(out_dir: str) -> None:
    """Every monitor (module, weight_grad unreduced and reduced, optimizer, param) on
    test_module.py's tiny GPT for two steps: rows against NumPy float64 of the
    unmonitored twin's tensors, training bit-identical, every batched read two launches
    (one call each: weight_grad's whole backward pass at its end, reduced, param,
    optimizer), every module tensor at most two, and no per-hook weight_grad read."""
    from pathlib import Path

    from support import find_row, rows_of
    from test_accel_path import _tight, _train
    from test_module import TinyGPT, assert_rows_match_reference, expected, make_data

    model = TinyGPT()
    twin = copy.deepcopy(model)
    batches = make_data(2)
    exp = expected(model, batches[:1])
    out = Path(out_dir)
    config = {"output_dir": str(out), "async_write": True, "monitors": {
        "module": {"enabled": True}, "weight_grad": {"enabled": True},
        "optimizer": {"enabled": True}, "param": {"enabled": True}}}
    with Launches() as launches, EngineCalls(launches) as engine_calls:
        mon, losses, grads, params, moments = _train(model, batches, config)
    assert len(launches) > 0
    _, losses_off, _, params_off, _ = _train(twin, batches)
    assert mon.errors.count == 0
    assert all(torch.equal(a, b) for a, b in zip(losses, losses_off))  # training bit-identical
    for a, b in zip(params + [dict(model.named_parameters())], params_off + [dict(twin.named_parameters())]):
        assert all(torch.equal(a[n], b[n]) for n in a)
    calls = engine_calls.calls
    many = [c for c in calls if c[0] == "many"]
    trained = sum(1 for p in model.parameters() if p.requires_grad)
    unreduced = [c for c in many if c[1] == "unreduced"]
    assert [c[2] for c in unreduced] == [trained, trained], unreduced  # the pass's end, once a step
    assert all(c[3] == 2 for c in many), many  # two launches a batched read, whatever its length
    assert {c[1] for c in many} >= {"unreduced", "reduced", "param_origin"}, many
    assert not [c for c in calls if c[0] == "one" and c[1] == "unreduced"], calls
    module_reads = [c for c in calls if c[0] == "one"]
    assert module_reads and all(c[3] <= 2 for c in module_reads), module_reads
    assert_rows_match_reference(rows_of(out, "module"), exp, step=0)
    wg, opt_rows, param_rows = rows_of(out, "weight_grad"), rows_of(out, "optimizer"), rows_of(out, "param")
    for s in range(2):
        for n, g in grads[s].items():
            _tight(find_row(wg, step=s, module_name=n, scope="unreduced"), g)
            _tight(find_row(wg, step=s, module_name=n, scope="reduced"), g)
        for n, m in moments[s].items():
            _tight(find_row(opt_rows, step=s, module_name=f"{n}.exp_avg", scope="exp_avg"), m)
        for n, p in params[s].items():
            _tight(find_row(param_rows, step=s, module_name=n, scope="param_origin"), p)


def check_large_gradients_read_at_the_pass_end(out_dir: str) -> None:
    """A gradient above a group's size (75,000 elements) is read with the others at the
    end of the backward pass on an accelerator (on the CPU it is read in its hook): one
    ``record_many`` of every gradient, two launches; rows against NumPy."""
    from pathlib import Path

    from support import TinyMLP, find_row, loss_fn, make_batches, rows_of
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    model = TinyMLP(d_in=300, d_hidden=250, d_out=3)
    assert model.fc1.weight.numel() > GROUP_MAX_NUMEL
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": out_dir, "monitors": {"weight_grad": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    grads = []
    try:
        with Launches() as launches, EngineCalls(launches) as engine_calls:
            for x, y in make_batches(2, batch=4, d_in=300):
                loss_fn(model, x, y).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
    finally:
        mon.stop()
    assert mon.errors.count == 0
    unreduced = [c for c in engine_calls.calls if c[1] == "unreduced"]
    assert unreduced == [("many", "unreduced", 4, 2)] * 2, unreduced
    rows = rows_of(Path(out_dir), "weight_grad")
    from test_accel_path import _tight

    for s, step_grads in enumerate(grads):
        for n, g in step_grads.items():
            _tight(find_row(rows, step=s, module_name=n, scope="unreduced"), g)


# ------------------------------------------------------------------ the tests
def test_reads_go_through_the_kernel(kernel_seam):
    kernel_seam(check_reads_go_through_the_kernel)


def test_no_copy_of_a_transpose(kernel_seam):
    kernel_seam(check_no_copy_of_a_transpose)


def test_a_failing_launch_falls_back_to_aten_said_once(kernel_seam):
    kernel_seam(check_a_failing_launch_falls_back_to_aten_said_once)


def test_whole_monitor_through_the_kernel(kernel_seam, tmp_path):
    kernel_seam(check_whole_monitor_through_the_kernel, str(tmp_path / "out"))


def test_large_gradients_read_at_the_pass_end(kernel_seam, tmp_path):
    kernel_seam(check_large_gradients_read_at_the_pass_end, str(tmp_path / "out"))
