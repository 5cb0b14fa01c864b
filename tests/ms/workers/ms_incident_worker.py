"""Worker of tests/ms/test_ms_incident_ranks.py, started by ``msrun`` with 2 workers on
the CPU: ``python ms_incident_worker.py <out_dir>``. Two scenarios in one launch:

``edit`` (``<out_dir>/edit``): data-parallel training (``nn.DistributedGradReducer``),
``"dynamic": true``; rank 0 alone edits the shared config with ``control`` late in
step 3, after rank 1 has already checked the file at that boundary.
``<out_dir>/seen_rank<r>.json``: what each rank's own check saw at each boundary.

``anomaly`` (``<out_dir>/anomaly``): one model per rank (no gradient reduction, so rank 0
stays clean, and no collective of the training), ``param`` and ``cc`` on, ``alert.on_anomaly`` turning ``module`` on with
``"targets": "auto"``; a NaN is written into rank 1's ``fc2.weight`` before step 4.

``<out_dir>/warnings_rank<r>.json``: the monitor's WARNING lines of the whole run.
"""

import json
import logging
import os
import sys
import time

import mindspore as ms  # noqa: E402
import numpy as np
from mindspore import Tensor, nn  # noqa: E402
from mindspore.communication import get_group_size, get_rank, init  # noqa: E402

from support.ms_helpers import MLP, batches, mse  # noqa: E402  (sets PYNATIVE_MODE and the CPU)

ms.set_context(mode=ms.PYNATIVE_MODE)
init()

from msprobe.core.monitor_v2.analysis.control import ControlEdit, control  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

STEPS = 10
out = sys.argv[1]
rank, world = get_rank(), get_group_size()
assert world == 2, world


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


collected = Collect()
logging.getLogger("msprobe.monitor_v2").addHandler(collected)


def edit(run_dir: str) -> None:
    cfg = os.path.join(run_dir, "monitor_config.json")
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(cfg, "w") as f:
            json.dump({"output_dir": run_dir, "dynamic": True, "monitors": {"weight_grad": {"enabled": True}}}, f)
    while not os.path.exists(cfg):  # the reducer's first all-reduce is the barrier from here on
        time.sleep(0.05)
    net = MLP(d_hidden=5)
    opt = nn.SGD(net.trainable_params(), learning_rate=0.05)
    reducer = nn.DistributedGradReducer(opt.parameters, mean=True)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    mon = TrainerMonitorV2(cfg, fr="mindspore")
    mon.start(model=net, optimizer=opt)
    seen = []
    watch = mon._watch
    original = watch.changed

    def recorded() -> bool:
        result = original()
        seen.append([mon.current_step, result])
        return result

    watch.changed = recorded
    for step, (x, y) in enumerate(batches(STEPS, seed=10 + rank)):
        _, grads = grad_fn(Tensor(x), Tensor(y))
        grads = reducer(grads)
        if step == 3 and rank == 0:
            time.sleep(1.5)  # rank 1 ends step 3 (and checks the file) first
            control(cfg, ControlEdit(enable="module", targets=["fc1"], steps=3))
        opt(grads)  # ends the monitor's step (optimizer patched)
    mon.stop()
    with open(os.path.join(out, f"seen_rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def anomaly(run_dir: str) -> None:
    net = MLP(d_hidden=5)
    opt = nn.SGD(net.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    mon = TrainerMonitorV2({"output_dir": run_dir, "monitors": {"param": {"enabled": True}},
                            "alert": {"on_anomaly": {"steps": 3, "monitors": {"module": {"targets": "auto"}}}}},
                           fr="mindspore")
    mon.start(model=net, optimizer=opt)
    for step, (x, y) in enumerate(batches(STEPS, seed=10 + rank)):
        if step == 4 and rank == 1:
            w = net.fc2.weight.asnumpy().copy()
            w[1, 2] = np.nan
            net.fc2.weight.set_data(Tensor(w))
        _, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
    mon.stop()


edit(os.path.join(out, "edit"))
anomaly(os.path.join(out, "anomaly"))
with open(os.path.join(out, f"warnings_rank{rank}.json"), "w") as f:
    json.dump(collected.lines, f)
print(f"rank {rank} done", flush=True)
