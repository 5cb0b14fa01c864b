"""A training process for test_shared_output_dir.py:
``python shared_dir_worker.py OUT_DIR MODE READY_FILE GO_FILE``.

It starts a monitor (``weight_grad`` and ``param``, 100 steps per file, so two jobs would
write the very same files), logs to stderr, creates ``READY_FILE`` once ``start()`` has
returned, and then:

- ``sync`` / ``async`` (``async_write``): waits for ``GO_FILE``, trains 12 steps of the
  tiny MLP on fixed data, stops and prints ``DONE``;
- ``hold``: sleeps until it is killed (a job that dies while it holds the directory).
"""

import logging
import os
import sys
import time

import torch

from support import TinyMLP, loss_fn, make_batches

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(process)d %(levelname)s %(message)s")
out, mode, ready, go = sys.argv[1:5]
STEPS = 12


def wait_for(path: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{path} never appeared")
        time.sleep(0.01)


model = TinyMLP()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mon = TrainerMonitorV2({"output_dir": out, "async_write": mode == "async", "step_count_per_record": 100,
                        "monitors": {"weight_grad": {"enabled": True}, "param": {"enabled": True}}})
mon.start(model=model, optimizer=opt)
print(f"STARTED {os.getpid()}", file=sys.stderr, flush=True)
open(ready, "w").close()
if mode == "hold":
    while True:
        time.sleep(1)
wait_for(go)
for x, y in make_batches(STEPS):
    loss_fn(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.005)  # the two jobs' steps interleave
mon.stop()
print("DONE", file=sys.stderr, flush=True)
