"""The monitor's own time per tensor on MindSpore (PyNative, CPU) with many small
parameter tensors: ``record_many`` batched through one kernel call against a reference.

    .venv/bin/python benchmarks/ms_record_many.py                      # reference: batching off
    .venv/bin/python benchmarks/ms_record_many.py --reference-commit 96257c9
    .venv/bin/python benchmarks/ms_record_many.py --smoke

The model is ``--blocks`` blocks of Dense(d, d) + LayerNorm(d) (defaults: 250 blocks of
32: 1000 parameter tensors of 32 to 1024 elements), trained with ``nn.AdamWeightDecay``.
For each config (weight_grad, param, optimizer) a round runs three windows in a rotating
order: without the monitor, with the reference engine, with the current one. The
reference is the current engine with batching switched off (``MsStatsEngine._batched``,
one ``record`` per tensor) or, with ``--reference-commit``, the MindSpore engine and
session of that commit (loaded from git beside the current ones). Reported: the median
over rounds of the monitor's own seconds (``busy_seconds``) per step per recorded tensor,
their ratio (current / reference, per round), and the step-time ratios with / without.

``busy_seconds`` includes what ``asnumpy`` waits for: PyNative runs operators
asynchronously, and a hook that reads a parameter right after ``optimizer(grads)`` (or a
gradient right after the backward) waits there for the training's queued operators, time
the step would spend anyway. The second table ("engine only") therefore times
``record_many`` alone on the same model's parameters, gradients and moments once the
queue is empty: the engine's own cost per tensor, reference against current.
"""

import argparse
import importlib.util
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

import numpy as np  # noqa: E402
import mindspore as ms  # noqa: E402
from mindspore import nn  # noqa: E402
from mindspore.common.api import _pynative_executor  # noqa: E402

from msprobe.core.monitor_v2.frameworks.mindspore import session as ms_session  # noqa: E402
from msprobe.core.monitor_v2.frameworks.mindspore import stats as ms_stats  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

PKG = "msprobe.core.monitor_v2.frameworks.mindspore"
CONFIGS = {
    # name: (config, rows per step per parameter)
    "weight_grad": ({"weight_grad": {"enabled": True}}, 2),  # unreduced (one hook each) + reduced
    "param": ({"param": {"enabled": True}}, 2),  # param_origin + param_updated
    "optimizer": ({"optimizer": {"enabled": True}}, 2),  # exp_avg + exp_avg_sq
}


class Stack(nn.Cell):
    def __init__(self, blocks: int, d: int) -> None:
        super().__init__()
        self.blocks = nn.CellList([nn.SequentialCell([nn.Dense(d, d), nn.LayerNorm((d,))]) for _ in range(blocks)])

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def load_reference(commit: str):
    """The MindSpore engine and ``MsSession.optimizer_states`` of ``commit``, imported
    as modules of the package beside the current ones."""
    out = {}
    for module in ("stats", "session"):
        source = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:src/msprobe/core/monitor_v2/frameworks/"
                                 f"mindspore/{module}.py"], check=True, capture_output=True, text=True).stdout
        path = os.path.join(tempfile.mkdtemp(prefix="msprobe_ref_"), f"_reference_{module}.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(f"{PKG}._reference_{module}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        out[module] = mod
    return out["stats"].MsStatsEngine, out["session"].MsSession.optimizer_states


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        ms.set_seed(0)
        self.model = Stack(args.blocks, args.d)
        self.opt = nn.AdamWeightDecay(self.model.trainable_params(), learning_rate=1e-4)
        self.n_params = len(self.opt.parameters)
        rng = np.random.default_rng(0)
        self.data = [ms.Tensor(rng.standard_normal((args.batch, args.d)).astype(np.float32)) for _ in range(4)]
        self.grad_fn = ms.value_and_grad(lambda x: (self.model(x) ** 2).mean(), None, self.opt.parameters)
        self.out = tempfile.mkdtemp(prefix="msprobe_ms_many_")
        self._next = 0
        self.engine = ms_stats.MsStatsEngine
        self.optimizer_states = ms_session.MsSession.optimizer_states
        self.reference = None
        if args.reference_commit:
            self.reference = load_reference(args.reference_commit)

    def train_steps(self, n: int) -> None:
        for _ in range(n):
            x = self.data[self._next % len(self.data)]
            self._next += 1
            _, grads = self.grad_fn(x)
            self.opt(grads)
        _pynative_executor.sync()

    def use(self, mode: str) -> None:
        ms_session.MsStatsEngine = self.engine
        ms_session.MsSession.optimizer_states = self.optimizer_states
        self.engine._batched = True
        if mode == "reference":
            if self.reference is None:
                self.engine._batched = False
            else:
                ms_session.MsStatsEngine, ms_session.MsSession.optimizer_states = self.reference

    def window(self, cfg: Optional[dict], mode: str) -> tuple:
        """``(wall seconds, busy seconds)`` of ``steps_per_window`` steps."""
        mon = None
        if cfg is not None:
            self.use(mode)
            out = os.path.join(self.out, mode)
            shutil.rmtree(out, ignore_errors=True)
            mon = TrainerMonitorV2({"output_dir": out, "monitors": cfg}, fr="mindspore")
            mon.start(model=self.model, optimizer=self.opt)
        _pynative_executor.sync()
        t0 = time.perf_counter()
        self.train_steps(self.args.steps_per_window)
        wall = time.perf_counter() - t0
        busy = 0.0
        if mon is not None:
            busy = mon.busy_seconds
            mon.stop()
            self.use("current")
        return wall, busy


def engine_only(bench: Bench, args: argparse.Namespace) -> None:
    """``record_many`` alone on the model's parameters, gradients and Adam moments, with
    the operator queue empty; reference and current alternate, ``--rounds`` rounds of
    ``--engine-calls`` calls each."""
    from msprobe.core.monitor_v2.stats import StatPlan

    _, grads = bench.grad_fn(bench.data[0])
    _pynative_executor.sync()
    params = list(bench.opt.parameters)
    groups = {"parameters": params, "gradients": list(grads),
              "moments": list(bench.opt.moments1) + list(bench.opt.moments2)}
    plan = StatPlan.from_ops(["min", "max", "mean", "norm"])
    current = ms_stats.MsStatsEngine()
    if bench.reference is not None:
        reference = bench.reference[0]()
    else:
        reference = ms_stats.MsStatsEngine()
        reference._batched = False  # an instance attribute: the class keeps batching on
    print("  engine only (record_many on the tensors once the queue is empty), us per tensor:")
    for name, tensors in groups.items():
        keys = [(0, f"t{i}", "s", None) for i in range(len(tensors))]
        times: Dict[str, List[float]] = {"reference": [], "current": []}
        for r in range(args.rounds):
            for label in (("reference", "current") if r % 2 == 0 else ("current", "reference")):
                engine = reference if label == "reference" else current
                t0 = time.perf_counter()
                for _ in range(args.engine_calls):
                    engine.record_many(tensors, plan, keys)
                times[label].append((time.perf_counter() - t0) / (args.engine_calls * len(tensors)))
        ratios = [c / r for c, r in zip(times["current"], times["reference"])]
        print(f"    {name:<10} ({len(tensors)} tensors) reference {1e6 * statistics.median(times['reference']):.1f}, "
              f"current {1e6 * statistics.median(times['current']):.1f}; current / reference "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=250)
    p.add_argument("--d", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps-per-window", type=int, default=3)
    p.add_argument("--only", action="append")
    p.add_argument("--engine-calls", type=int, default=20, help="record_many calls per round in the engine-only table")
    p.add_argument("--reference-commit", help="compare with the MindSpore engine and session of this commit")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.blocks, args.rounds, args.steps_per_window = 8, 1, 1
    ms.set_context(mode=ms.PYNATIVE_MODE, runtime_num_threads=1)
    ms.set_device("CPU")
    bench = Bench(args)
    ref = f"commit {args.reference_commit}" if args.reference_commit else "batching off (one record per tensor)"
    print(f"model: {args.blocks} x (Dense({args.d}, {args.d}) + LayerNorm({args.d})), {bench.n_params} parameter "
          f"tensors; nn.AdamWeightDecay; PyNative CPU, 1 thread; reference: {ref}; {args.rounds} rounds x "
          f"{args.steps_per_window} steps; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    bench.train_steps(3)
    modes = ["off", "reference", "current"]
    for name, (cfg, rows_per_param) in CONFIGS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        per: Dict[str, List[float]] = {m: [] for m in modes}
        busy: Dict[str, List[float]] = {"reference": [], "current": []}
        for r in range(args.rounds):
            order = modes[r % 3:] + modes[:r % 3]
            if r % 2:
                order.reverse()
            for mode in order:
                wall, b = bench.window(None if mode == "off" else cfg, mode)
                per[mode].append(wall)
                if mode != "off":
                    busy[mode].append(b / (args.steps_per_window * bench.n_params * rows_per_param))
        med = {m: statistics.median(v) for m, v in busy.items()}
        ratios = [c / r for c, r in zip(busy["current"], busy["reference"])]
        step = {m: [w / o for w, o in zip(per[m], per["off"])] for m in ("reference", "current")}
        print(f"  {name:<12} busy per step per tensor: reference {1e6 * med['reference']:.1f} us, current "
              f"{1e6 * med['current']:.1f} us; current / reference {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}..{max(ratios):.3f}); step ratio with / without: reference "
              f"{statistics.median(step['reference']):.3f}, current {statistics.median(step['current']):.3f}; "
              f"step without {1e3 * statistics.median(per['off']) / args.steps_per_window:.1f} ms", flush=True)
    engine_only(bench, args)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    shutil.rmtree(bench.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
