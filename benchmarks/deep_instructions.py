"""Per-tensor cost of the monitor in instructions: deep_overhead.py's model under Valgrind.

    .venv/bin/python benchmarks/deep_instructions.py                 # 1,000 tensors, about 2 minutes
    .venv/bin/python benchmarks/deep_instructions.py --tensors 4000 --only all
    .venv/bin/python benchmarks/deep_instructions.py --smoke         # 40 tensors (what CI runs)

On a shared or virtual machine the same training step can take twice as long from one
second to the next (other tenants, clocks), and a difference of a few percent between
two builds of the monitor is lost in that noise however long the benchmark runs. The
number of instructions the CPU executes for a step is nearly the same from run to run:
this script counts them with Valgrind's callgrind tool, for the model of
``deep_overhead.py`` (a stack of ``Linear + LayerNorm`` blocks, four parameter tensors
each), with and without each config of that benchmark.

Each count runs in a process of its own under ``valgrind --tool=callgrind``, with the
counting off (the interpreter and torch start at about a fifth of their normal speed
instead of a fiftieth) until the steps to count: a small C helper, compiled here against
Valgrind's ``callgrind.h``, switches it on for ``--steps`` training steps, every one of
them written by the monitor, after two warm-up steps with the monitor running (the first
written step makes its files and caches). The garbage collector is off during the
counted steps, so that when it happens to run does not move the count; its cost is
what ``deep_overhead.py`` measures in time.

An instruction count is not time: an instruction that misses the caches costs more than
one that hits them, and the monitor's reads of tensors are few instructions for many
bytes. On this model (small tensors, Python-heavy) the ratio of counts is close to the
ratio of times on a quiet machine; use it to compare two builds, and deep_overhead.py
for the time itself. Needs ``valgrind`` on the PATH and its headers (Debian: the
``valgrind`` package).
"""

import argparse
import concurrent.futures
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))

_HELPER_SOURCE = """
#include <valgrind/callgrind.h>
void counting_on(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void counting_off(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")
PLAIN = "plain"


def _configs() -> Dict[str, dict]:
    """deep_overhead.py's configs (importing it puts the repository's ``src`` on the path)."""
    sys.path.insert(0, HERE)
    from deep_overhead import CONFIGS  # noqa: E402 - after the path

    return CONFIGS


def _monitor_configs() -> Dict[str, dict]:
    """Each monitor of deep_overhead.py's all-monitors config alone (``--per-monitor``): where
    the instructions of ``all`` go."""
    sys.path.insert(0, HERE)
    from deep_overhead import _ALL_MONITORS  # noqa: E402 - after the path

    return {f"{name} alone": {"monitors": {name: settings}} for name, settings in _ALL_MONITORS.items()}


def _every_config() -> Dict[str, dict]:
    return {**_configs(), **_monitor_configs()}


def build_helper(directory: str) -> str:
    """The shared library whose two functions switch callgrind's counting on and off."""
    source = os.path.join(directory, "counting.c")
    library = os.path.join(directory, "counting.so")
    with open(source, "w", encoding="utf-8") as f:
        f.write(_HELPER_SOURCE)
    _configs()  # the repository's src on the path
    from msprobe.core.monitor_v2 import native  # noqa: E402 - after the path

    try:
        compiler = native._compiler()  # the one the statistics kernel is built with ($CC, cc, gcc, clang)
    except native._Unavailable as exc:
        raise SystemExit(f"deep_instructions: {exc} (for the counting helper)") from None
    proc = subprocess.run(compiler + ["-O2", "-fPIC", "-shared", source, "-o", library], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"deep_instructions: cannot build the counting helper (Valgrind's headers, "
                         f"valgrind/callgrind.h, missing?):\n{proc.stderr[-2000:]}")
    return library


def child(args: argparse.Namespace) -> int:
    """One count, inside Valgrind: the model, two warm-up steps, then ``--steps`` counted."""
    import ctypes
    import logging

    sys.path.insert(0, HERE)
    import torch  # noqa: E402
    from deep_overhead import DeepBench  # noqa: E402
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

    logging.disable(logging.WARNING)  # the monitor's stop() summary is not wanted in the log
    counting = ctypes.CDLL(args.helper)
    torch.set_num_threads(1)
    args.device = "cpu"
    bench = DeepBench(args.tensors, args)  # deep_overhead.py's model, optimizer, batch and step
    try:
        bench.train_steps(1)
        mon = None
        if args.config != PLAIN:
            mon = TrainerMonitorV2({**_every_config()[args.config], "output_dir": os.path.join(bench.out, "run")})
            mon.start(model=bench.model, optimizer=bench.opt)
        bench.train_steps(2)
        gc.collect()
        gc.disable()
        counting.counting_on()
        bench.train_steps(args.steps)
        counting.counting_off()
        gc.enable()
        if mon is not None:
            mon.stop()
    finally:
        bench.close()
    return 0


def count(args: argparse.Namespace, tensors: int, config: str, helper: str, directory: str) -> float:
    """Instructions per counted step of one (model, config)."""
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={os.path.join(directory, 'callgrind.%p')}",
               sys.executable, os.path.abspath(__file__), "--child", "--helper", helper, "--config", config,
               "--tensors", str(tensors), "--steps", str(args.steps), "--width", str(args.width),
               "--batch", str(args.batch)]
    env = dict(os.environ, PYTHONHASHSEED="0")  # the same dict layouts, run to run
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    found = _COLLECTED.findall(proc.stderr)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"deep_instructions: the count of {config!r} on {tensors} tensors failed "
                         f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return int(found[-1]) / args.steps


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    sys.path.insert(0, HERE)
    from deep_overhead import add_model_arguments  # noqa: E402 - after the path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p, "1000")
    p.add_argument("--steps", type=int, default=2, help="counted training steps per count")
    p.add_argument("--only", action="append", help="run only configs whose name is this (repeatable)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--per-monitor", action="store_true",
                   help="also count each monitor of the all-monitors config alone (\"module alone\"...)")
    p.add_argument("--smoke", action="store_true",
                   help="40 tensors, one counted step, all monitors only: checks that it runs")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed for one count")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="counts run side by side (each is a process under Valgrind)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--helper", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.tensors = args.tensors or [40]
        args.steps = 1
        args.only = args.only or ["all"]
    args.tensors = args.tensors or [1000]
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        args.tensors = args.tensors[0]
        return child(args)
    if shutil.which("valgrind") is None:
        raise SystemExit("deep_instructions: needs valgrind on the PATH (Debian: apt-get install valgrind)")
    offered = _every_config() if args.per_monitor else _configs()
    configs = [name for name in offered if not args.only or name in args.only]
    if args.only and not configs:
        raise SystemExit(f"deep_instructions: no config named {args.only}; there are {sorted(offered)}")
    directory = tempfile.mkdtemp(prefix="msprobe_deep_instructions_")
    rows = []
    sys.path.insert(0, HERE)
    from deep_overhead import graph_hooks_in_use  # noqa: E402 - after the path

    # built here, outside Valgrind: each count then finds the library cached at its start()
    graph = graph_hooks_in_use()
    try:
        helper = build_helper(directory)
        print(f"instructions per training step (callgrind), {args.steps} counted step(s) per count, every "
              f"one written; model of deep_overhead.py, width {args.width}, batch {args.batch}, one thread; "
              f"module graph hooks: {graph}", flush=True)
        # A count is not a time: several run side by side without changing one another.
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            counts = {(tensors, name): pool.submit(count, args, tensors, name, helper, directory)
                      for tensors in args.tensors for name in [PLAIN] + configs}
            for tensors in args.tensors:
                plain = counts[(tensors, PLAIN)].result()
                print(f"  {tensors} tensors, plain: {plain / 1e6:.2f} M", flush=True)
                for name in configs:
                    monitored = counts[(tensors, name)].result()
                    extra = monitored - plain
                    rows.append({"tensors": tensors, "config": name, "plain": plain, "monitored": monitored,
                                 "ratio": monitored / plain, "extra_per_tensor": extra / tensors})
                    print(f"  {tensors} tensors, {name:<26} {monitored / 1e6:.2f} M, "
                          f"ratio {monitored / plain:.3f}, {extra / tensors:,.0f} more per tensor", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print()
    print("| tensors | config | instructions per step, plain | with the monitor | ratio | more per tensor |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['tensors']} | {row['config']} | {row['plain'] / 1e6:.2f} M | {row['monitored'] / 1e6:.2f} M | "
              f"{row['ratio']:.3f} | {row['extra_per_tensor']:,.0f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"steps": args.steps, "width": args.width, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
