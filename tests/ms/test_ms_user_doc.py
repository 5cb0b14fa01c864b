"""The user document's MindSpore example, run as a user would: a training script in its
own directory, next to the document's ``monitor_v2_config.json`` (framework mindspore),
with the document's three monitor calls written as in the document
(``TrainerMonitorV2("./monitor_v2_config.json", fr="mindspore")``, ``start`` with
``grad_acc_steps``, ``mon.step()`` in the loop, ``mon.stop()``), in a fresh process.

Also: GRAPH mode is refused by ``start()`` with a ``MonitorError`` naming PYNATIVE (in a
subprocess, so that the context change stays there)."""

import json
import os
import subprocess
import sys
import textwrap

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import assert_row_matches, find_row, read_csv  # noqa: E402
from support.ms_helpers import np, np_stats  # noqa: E402

# The document's quick-start config, with "framework" set to mindspore.
DOC_CONFIG = {
    "framework": "mindspore",
    "output_dir": "./monitor_v2_out",
    "rank": [0],
    "start_step": 0,
    "step_interval": 1,
    "step_count_per_record": 1,
    "collect_times": 100,
    "format": "csv",
    "monitors": {
        "weight_grad": {
            "enabled": True,
            "ops": ["min", "max", "mean", "norm", "nans"],
            "eps": 1e-8,
            "monitor_mbs_grad": False,
        }
    },
}

TRAIN_SCRIPT = textwrap.dedent('''
    import numpy as np
    import mindspore as ms
    from mindspore import nn, Tensor

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")


    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Dense(8, 16)
            self.relu = nn.ReLU()
            self.fc2 = nn.Dense(16, 2)

        def construct(self, x):
            return self.fc2(self.relu(self.fc1(x)))


    model = Net()
    optimizer = nn.Adam(model.trainable_params(), learning_rate=1e-3)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(model(x), y), None, optimizer.parameters)
    rng = np.random.default_rng(0)
    grad_acc_steps = 1
    num_steps = 3
    passed = {}

    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    mon = TrainerMonitorV2("./monitor_v2_config.json", fr="mindspore")
    mon.start(model=model, optimizer=optimizer, grad_acc_steps=grad_acc_steps)
    for step in range(num_steps):
        x = Tensor(rng.standard_normal((4, 8)).astype(np.float32))
        y = Tensor(rng.standard_normal((4, 2)).astype(np.float32))
        loss, grads = grad_fn(x, y)
        for p, g in zip(optimizer.parameters, grads):
            passed[f"{step}/{p.name}"] = g.asnumpy().copy()
        optimizer(grads)
        mon.step()
    mon.stop()
    np.savez("passed_grads.npz", **passed)
    print("TRAINING DONE")
''')


def clean_env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for var in ("RANK", "RANK_ID", "RANK_SIZE", "MS_WORKER_NUM", "MS_ROLE"):
        env.pop(var, None)
    return env


def test_user_document_mindspore_example(tmp_path):
    (tmp_path / "monitor_v2_config.json").write_text(json.dumps(DOC_CONFIG, indent=2))
    (tmp_path / "train.py").write_text(TRAIN_SCRIPT)
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "TRAINING DONE" in proc.stdout

    rank_dir = tmp_path / "monitor_v2_out" / "rank_0"
    assert sorted(p.name for p in rank_dir.iterdir()) == ["layout.json"] + [f"weight_grad_step{s}-{s}.csv"
                                                                            for s in range(3)]
    passed = np.load(tmp_path / "passed_grads.npz")
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for s in range(3):
        path = rank_dir / f"weight_grad_step{s}-{s}.csv"
        assert path.read_text().splitlines()[0] == "vpp_stage,step,module_name,scope,micro_step,min,max,mean,norm,nans"
        rows = read_csv(path)
        assert len(rows) == len(names) * 2
        for name in names:
            for scope in ("unreduced", "reduced"):
                row = find_row(rows, step=s, module_name=name, scope=scope)
                assert row["vpp_stage"] == "0" and row["micro_step"] == "1"
                assert_row_matches(row, np_stats(passed[f"{s}/{name}"]), rtol=1e-5, atol=1e-8)
    # the manual mon.step() of the document is ignored (optimizer patched), with one warning
    assert proc.stderr.count("step() called by hand") == 1, proc.stderr[-3000:]


GRAPH_SCRIPT = textwrap.dedent('''
    import json, sys
    import mindspore as ms
    from mindspore import nn

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    from msprobe.core.monitor_v2.errors import MonitorError
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    net = nn.Dense(3, 2)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    mon = TrainerMonitorV2({"output_dir": sys.argv[1], "monitors": {
        "module": {"enabled": True}, "weight_grad": {"enabled": True}}}, fr="mindspore")
    result = {}
    try:
        mon.start(model=net, optimizer=opt)
        result["raised"] = None
    except Exception as exc:
        result["raised"] = type(exc).__name__
        result["is_monitor_error"] = isinstance(exc, MonitorError)
        result["message"] = str(exc)
    hooks = 0
    for cell in (net, opt):
        for attr in ("_lazy_forward_pre_hook", "_lazy_forward_hook", "_lazy_backward_hook"):
            hooks += len(getattr(cell, attr, None) or ())
    hooks += sum(len(p.hooks()) for p in net.trainable_params())
    result["hooks_left"] = hooks
    mon.stop()
    print("RESULT " + json.dumps(result))
''')


def test_graph_mode_is_refused_at_start(tmp_path):
    (tmp_path / "graph.py").write_text(GRAPH_SCRIPT)
    proc = subprocess.run([sys.executable, "graph.py", str(tmp_path / "out")], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    assert result["raised"] is not None, "start() accepted GRAPH_MODE"
    assert result["is_monitor_error"], result
    assert "PYNATIVE" in result["message"], result["message"]
    assert result["hooks_left"] == 0, result
    assert not list((tmp_path / "out").rglob("*.csv"))
