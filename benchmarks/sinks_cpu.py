"""What the live sinks cost the training, measured on the sink thread itself.

    .venv/bin/python benchmarks/sinks_cpu.py [--steps 8] [--rounds 3]

The default GPT of benchmarks/overhead.py trains with every monitor on ("all monitors" of
benchmarks/config_matrix.py) and with the TensorBoard sink, then the TensorBoard, W&B
(offline) and MLflow (file store) sinks, in a temporary directory. For each config it
reports the CPU time of the training thread per step and the CPU time of every other
thread of the process per step (the sink thread computing the keys and calling the
libraries, TensorBoard's event-writer thread, W&B's and MLflow's threads), and the extra
over "all monitors" as a share of the step: an upper bound of what the sinks add even if
their threads never ran beside the training. CPU time is load-independent: on a shared
machine the wall-time ratios of overhead.py spread by tens of percent, while CPU time
counts only this process's work. W&B's ``wandb-core`` helper is a process of its own (not
counted). ``send()`` on the training path only queues a
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
            steps(1)  # untimed: the sinks open on their thread (wandb.init, an MLflow run) meanwhile
            time.sleep(2)
            c0, m0, s0 = time.process_time(), time.thread_time(), hub.sent_steps if hub is not None else 0
            steps(args.steps)
            time.sleep(0.5)  # the sink thread takes the last step
            process, main_thread = time.process_time() - c0, time.thread_time() - m0
            sent = (hub.sent_steps if hub is not None else 0) - s0
            mon.stop()
            # every thread but the training one: the sink thread, TensorBoard's writer thread, W&B's
            # and MLflow's own threads (W&B's wandb-core process is not in this process's time)
            results[name].append((main_thread / args.steps, (process - main_thread) / args.steps, sent))
    print(f"GPT {args.layers} layers, d_model {args.d_model}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters, 1 thread; {args.rounds} rounds x {args.steps} steps; torch {torch.__version__}")
    print("| config | training thread CPU per step | other threads' CPU per step | extra over all monitors, "
          "share of the step |")
    print("|---|---|---|---|")
    base = statistics.median(x[1] for x in results[NAMES[0]])
    for name in NAMES:
        step_cpu = statistics.median(x[0] for x in results[name])
        other = statistics.median(x[1] for x in results[name])
        assert name == NAMES[0] or all(x[2] == args.steps for x in results[name]), results[name]
        print(f"| {name} | {1e3 * step_cpu:.1f} ms | {1e3 * other:.2f} ms | "
              f"{100 * (other - base) / step_cpu:+.2f} % |")
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
