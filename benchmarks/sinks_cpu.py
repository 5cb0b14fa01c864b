"""What the live sinks cost the training, measured on the sink thread itself.

    .venv/bin/python benchmarks/sinks_cpu.py [--steps 8] [--rounds 3]

The default GPT of benchmarks/overhead.py trains with every monitor on ("all monitors" of
benchmarks/config_matrix.py) and with the TensorBoard sink, then the TensorBoard, W&B
(offline) and MLflow (file store) sinks, in a temporary directory. For each config it
reports the CPU time of one training step (the process, all threads), and the CPU time
the sink thread spent per step (``time.thread_time()`` on that thread: computing the keys
and calling the libraries), as a share of the step. That share is load-independent: on a
shared machine the wall-time ratios of overhead.py spread by tens of percent, while a
thread's CPU time counts only its own work. ``send()`` on the training path only queues a
step (it is inside "monitor code", which overhead.py reports).
"""

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import torch  # noqa: E402

from config_matrix import configs  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batches  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

NAMES = ["all monitors", "all + tensorboard sink", "all + tensorboard, wandb, mlflow sinks"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    out = tempfile.mkdtemp(prefix="msprobe_sinks_bench_")
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DISABLE_GIT="true",
                      MLFLOW_ALLOW_FILE_STORE="true", MLFLOW_TRACKING_URI=f"file:{out}/mlruns")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=6, vocab_size=8192, block_size=128)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = synthetic_batches(cfg, 8, seed=0, device=torch.device("cpu"))

    def steps(n: int) -> None:
        for _ in range(n):
            x, y = next(data)
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    steps(2)
    matrix = configs(args.layers, sinks=True)
    results = {n: [] for n in NAMES}
    for r in range(args.rounds):
        for name in NAMES if r % 2 == 0 else NAMES[::-1]:
            run = os.path.join(out, "run")
            shutil.rmtree(run, ignore_errors=True)
            mon = TrainerMonitorV2({**matrix[name], "output_dir": run})
            mon.start(model=model, optimizer=opt)
            writer = mon._writer  # benchmark only: the hub hangs off the CSV writer
            hub = getattr(writer, "_writer", writer).sinks
            c0 = time.process_time()
            steps(args.steps)
            step_cpu = (time.process_time() - c0) / args.steps
            mon.stop()
            sink_cpu = hub.steps_cpu_s / max(1, hub.sent_steps) if hub is not None else 0.0
            results[name].append((step_cpu, sink_cpu, hub.sent_steps if hub is not None else 0))
    print(f"GPT {args.layers} layers, d_model {args.d_model}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters, 1 thread; {args.rounds} rounds x {args.steps} steps; torch {torch.__version__}")
    print("| config | CPU per step (process) | sink thread CPU per step | share of the step |")
    print("|---|---|---|---|")
    for name in NAMES:
        step_cpu = statistics.median(x[0] for x in results[name])
        sink_cpu = statistics.median(x[1] for x in results[name])
        assert name == NAMES[0] or all(x[2] == args.steps for x in results[name]), results[name]
        print(f"| {name} | {1e3 * step_cpu:.1f} ms | {1e3 * sink_cpu:.2f} ms | {100 * sink_cpu / step_cpu:.2f} % |")
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
