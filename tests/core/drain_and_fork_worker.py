"""A training process for test_drain_and_fork.py: ``python drain_and_fork_worker.py SCENARIO OUT_DIR``.

Drain scenarios (``async_write``, a disk slowed to 20 ms per write, 60 steps): a SIGINT
reaches the main thread 0.3 s into ``stop()``; then ``again`` calls ``stop()`` again,
``exit`` just ends the program (the exit handler drains), ``exit-interrupted`` ends it
with a second SIGINT 0.3 s into the exit handler's drain.

Fork scenarios (``fork-sync``, ``fork-async``): 3 steps, ``os.fork()``, the child trains 3
steps and exits through the interpreter (its exit handlers run); the parent waits, trains
3 more steps and stops.
"""

import logging
import os
import signal
import sys
import threading
import time

import torch

from support import TinyMLP, loss_fn, make_batches  # noqa: E402

import msprobe.core.monitor_v2.writer as writer_mod  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(process)d %(levelname)s %(message)s")
scenario, out = sys.argv[1], sys.argv[2]


def interrupt_in(seconds: float) -> None:
    def send() -> None:
        time.sleep(seconds)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=send, daemon=True).start()


def train(model, opt, batches):
    for x, y in batches:
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()


model = TinyMLP()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mon = TrainerMonitorV2({"output_dir": out, "async_write": scenario != "fork-sync",
                        "monitors": {"weight_grad": {"enabled": True}}})
mon.start(model=model, optimizer=opt)

if scenario.startswith("fork"):
    batches = make_batches(9)
    train(model, opt, batches[:3])
    pid = os.fork()
    if pid == 0:
        train(model, opt, batches[3:6])
        print(f"CHILD {os.getpid()} done", file=sys.stderr, flush=True)
        sys.exit(0)  # through the interpreter: exit handlers run in the child
    _, status = os.waitpid(pid, 0)
    print(f"CHILD_STATUS {status}", file=sys.stderr, flush=True)
    train(model, opt, batches[6:])
    mon.stop()
    sys.exit(0)

real_write = writer_mod._write_all


def slow_write(fd, data):  # a slow disk: 20 ms per write
    time.sleep(0.02)
    real_write(fd, data)


writer_mod._write_all = slow_write
train(model, opt, make_batches(60))
interrupt_in(0.3)
try:
    mon.stop()
    print("STOP NOT INTERRUPTED", file=sys.stderr, flush=True)
except KeyboardInterrupt:
    print("STOP INTERRUPTED", file=sys.stderr, flush=True)
if scenario == "again":
    mon.stop()
    print("STOP AGAIN RETURNED", file=sys.stderr, flush=True)
elif scenario == "exit-interrupted":
    interrupt_in(0.3 + 0.1)  # while the exit handler drains
print("END OF PROGRAM", file=sys.stderr, flush=True)
