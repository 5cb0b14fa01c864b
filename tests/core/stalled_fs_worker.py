"""A training process for test_stalled_fs.py:
``python stalled_fs_worker.py SCENARIO WRITER OUT_DIR [STALL_FLAG]``.

It trains the tiny MLP with the ``default`` writer, or ``async`` (``"async_write": true``)
(``weight_grad`` and ``param``, one file per monitor for the whole run), printing ``TRAINED <step>`` on stdout after each step, until
it is killed. The test stalls the file system under ``OUT_DIR`` (a frozen ext4 mount, or,
where none can be mounted, ``STALL_FLAG``: while that file exists every write of the
monitor waits) and sends the signals.

Scenarios, as trainers meet a preemption:

- ``sigterm-default``: SIGTERM keeps its default disposition;
- ``sigterm-exit``: the trainer's SIGTERM handler calls ``sys.exit(143)``; the program ends
  without ``stop()`` (the monitor's exit handler drains);
- ``sigterm-exit-stop``: the same handler, and ``mon.stop()`` in a ``finally`` block.

An exit handler registered before the monitor's (so it runs after it) prints
``EXIT HANDLERS DONE`` on stderr: the exit went through the monitor's.
"""

import atexit
import logging
import os
import signal
import sys
import time

import torch

from support import TinyMLP, loss_fn, make_batches

import msprobe.core.monitor_v2.writer as writer_mod
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(process)d %(levelname)s %(message)s")
scenario, writer, out = sys.argv[1:4]
stall_flag = sys.argv[4] if len(sys.argv) > 4 else ""

if stall_flag:  # no file system to freeze: the monitor's writes wait while the flag exists
    real_write = writer_mod._write_all

    def stalled_write(fd, data):
        while os.path.exists(stall_flag):
            time.sleep(0.005)
        real_write(fd, data)

    writer_mod._write_all = stalled_write

atexit.register(lambda: print("EXIT HANDLERS DONE", file=sys.stderr, flush=True))
if scenario in ("sigterm-exit", "sigterm-exit-stop"):
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))

model = TinyMLP()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
config = {"output_dir": out, "step_count_per_record": 100000,
          "monitors": {"weight_grad": {"enabled": True}, "param": {"enabled": True}}}
if writer == "async":
    config["async_write"] = True
mon = TrainerMonitorV2(config)
mon.start(model=model, optimizer=opt)
batches = make_batches(16)


def train() -> None:
    step = 0
    while True:
        x, y = batches[step % len(batches)]
        loss_fn(model, x, y).backward()
        opt.step()  # ends the monitor's step
        opt.zero_grad()
        print(f"TRAINED {step}", flush=True)
        step += 1
        time.sleep(0.02)


if scenario == "sigterm-exit-stop":
    try:
        train()
    finally:
        mon.stop()
else:
    train()
