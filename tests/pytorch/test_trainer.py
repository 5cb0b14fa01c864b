"""TrainerMonitorV2 end to end on PyTorch: the user document's quick-start, training is
unchanged by the monitor, stop() undoes everything, model chunks, optimizer state and
parameters checked against independent computations, errors contained."""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from support import TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, rows_of
from msprobe.core.monitor_v2.errors import MonitorStateError
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

ALL_ON = {
    "monitors": {
        "weight_grad": {"enabled": True, "monitor_mbs_grad": True},
        "optimizer": {"enabled": True},
        "param": {"enabled": True},
    }
}

# The user document's config, verbatim.
QUICKSTART_CONFIG = """{
  "framework": "pytorch",
  "output_dir": "./monitor_v2_out",
  "rank": [0],
  "start_step": 0,
  "step_interval": 1,
  "step_count_per_record": 1,
  "collect_times": 100,
  "format": "csv",
  "monitors": {
    "weight_grad": {
      "enabled": true,
      "ops": ["min", "max", "mean", "norm", "nans"],
      "eps": 1e-8,
      "monitor_mbs_grad": false
    }
  }
}
"""

# The user document's PyTorch example, verbatim from "from msprobe..." to "mon.stop()",
# with the model, data and forward() it leaves to the user defined above it.
QUICKSTART_SCRIPT = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
grad_acc_steps = 1
num_steps = 5
def forward(*args):
    x = torch.randn(4, 8)
    return model(x).pow(2).mean()

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

mon = TrainerMonitorV2("./monitor_v2_config.json", fr="pytorch")  # fr 可省略，默认读 config.framework
mon.start(model=model, optimizer=optimizer, grad_acc_steps=grad_acc_steps)

for _ in range(num_steps):
    loss = forward(...)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    mon.step()

mon.stop()
"""


def test_user_document_quickstart_runs_unchanged(tmp_path):
    (tmp_path / "monitor_v2_config.json").write_text(QUICKSTART_CONFIG)
    (tmp_path / "train.py").write_text(QUICKSTART_SCRIPT)
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rank_dir = tmp_path / "monitor_v2_out" / "rank_0"
    assert sorted(os.listdir(rank_dir)) == sorted([f"weight_grad_step{s}-{s}.csv" for s in range(5)] + ["layout.json"])
    rows = rows_of(tmp_path / "monitor_v2_out", "weight_grad")
    assert {r["scope"] for r in rows} == {"unreduced", "reduced"}
    assert len(rows) == 5 * 4 * 2
    # mon.step() by hand under the (default) patch is ignored, with one warning.
    assert proc.stderr.count("called by hand") == 1


def run_training(cfg, write_config, steps=4, acc=2, optimizer_cls=torch.optim.AdamW, **opt_kwargs):
    """Train TinyMLP with or without the monitor; returns losses and final parameters."""
    model = TinyMLP()
    opt = optimizer_cls(model.parameters(), **(opt_kwargs or {"lr": 0.01}))
    mon = None
    if cfg is not None:
        mon = TrainerMonitorV2(write_config(cfg))
        mon.start(model=model, optimizer=opt, grad_acc_steps=acc)
    losses = []
    batches = make_batches(steps * acc)
    for s in range(steps):
        for x, y in batches[s * acc:(s + 1) * acc]:
            loss = loss_fn(model, x, y) / acc
            loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.stop()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], mon


def test_training_is_bit_identical_with_and_without_monitor(write_config):
    losses_off, params_off, _ = run_training(None, write_config)
    losses_on, params_on, mon = run_training(ALL_ON, write_config)
    assert torch.equal(losses_off, losses_on)
    for a, b in zip(params_off, params_on):
        assert torch.equal(a, b)
    assert mon.errors.count == 0
    assert len(rows_of(mon.config.output_dir, "weight_grad")) > 0


def hook_state(model, opt):
    """Everything a monitor could leave behind on a model and an optimizer."""
    state = {}
    for name, p in model.named_parameters():
        state[name] = (
            len(p._backward_hooks or {}),
            len(getattr(p, "_post_accumulate_grad_hooks", None) or {}),
        )
    for name, m in model.named_modules():
        state["module:" + name] = tuple(
            len(getattr(m, attr)) for attr in (
                "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
            )
        ) + tuple(k in vars(m) for k in ("forward", "_replicate_for_data_parallel"))  # the call wrapper's
    state["opt"] = (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks), "step" in vars(opt))
    return state


def test_stop_removes_every_hook_and_is_idempotent(write_config):
    model = TinyMLP()
    opt = torch.optim.Adam(model.parameters())
    before = hook_state(model, opt)
    mon = TrainerMonitorV2(write_config(ALL_ON))
    mon.start(model=model, optimizer=opt)
    during = hook_state(model, opt)
    assert during != before, "the monitor installed hooks"
    for x, y in make_batches(2):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert hook_state(model, opt) == before
    mon.stop()  # twice is harmless
    assert hook_state(model, opt) == before
    # after stop(), training writes nothing more
    n_files = len(os.listdir(mon.rank_dir))
    loss_fn(model, *make_batches(1)[0]).backward()
    opt.step()
    assert len(os.listdir(mon.rank_dir)) == n_files


def test_stop_without_start_is_harmless_and_start_twice_is_an_error(write_config):
    mon = TrainerMonitorV2(write_config(ALL_ON))
    mon.stop()
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.start(model=model, optimizer=opt)
    with pytest.raises(MonitorStateError):
        mon.start(model=model, optimizer=opt)
    mon.stop()


class DuckOptimizer:
    """Not a torch.optim.Optimizer: only step(), zero_grad() and param_groups."""

    def __init__(self, params, lr=0.1):
        self.param_groups = [{"params": list(params)}]
        self.state = {}
        self.lr = lr
        self.calls = 0

    def step(self):
        self.calls += 1
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                p -= self.lr * p.grad

    def zero_grad(self):
        for p in self.param_groups[0]["params"]:
            p.grad = None


def test_non_torch_optimizer_is_wrapped_and_unwrapped(write_config):
    model = TinyMLP()
    opt = DuckOptimizer(model.parameters())
    original_step = DuckOptimizer.step
    mon = TrainerMonitorV2(write_config({"monitors": {"param": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    assert "step" in vars(opt)
    for x, y in make_batches(3):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert "step" not in vars(opt) and type(opt).step is original_step
    assert opt.calls == 3
    steps = sorted({r["step"] for r in rows_of(mon.config.output_dir, "param")})
    assert steps == ["0", "1", "2"]


def test_model_chunks_prefix_names_with_vpp_stage(write_config):
    chunks = [TinyMLP(seed=0), TinyMLP(d_in=3, seed=1)]
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    mon.start(model=chunks, optimizer=opt)
    x, y = make_batches(1)[0]
    out = chunks[1](chunks[0](x))
    out.pow(2).sum().backward()
    grads = {f"{i}:{n}": p.grad.clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    opt.step()
    mon.stop()
    rows = rows_of(mon.config.output_dir, "weight_grad")
    for name, g in grads.items():
        row = find_row(rows, module_name=name, scope="unreduced")
        assert row["vpp_stage"] == name.split(":")[0]
        assert_row_matches(row, numpy_stats(g))


def test_adamw_moments_match_an_independent_adam(write_config):
    """exp_avg / exp_avg_sq after each step, against Adam's moment recursion in NumPy."""
    b1, b2 = 0.8, 0.95
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(b1, b2))
    mon = TrainerMonitorV2(write_config({"monitors": {"optimizer": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    m = {n: np.zeros(tuple(p.shape)) for n, p in model.named_parameters()}
    v = {n: np.zeros(tuple(p.shape)) for n, p in model.named_parameters()}
    expected = []
    for x, y in make_batches(3):
        loss_fn(model, x, y).backward()
        step_expected = {}
        for n, p in model.named_parameters():
            g = p.grad.double().numpy().copy()
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            step_expected[n] = (m[n].copy(), v[n].copy())
        expected.append(step_expected)
        opt.step()
        opt.zero_grad()
    mon.stop()
    rows = rows_of(mon.config.output_dir, "optimizer")
    assert len(rows) == 3 * 4 * 2
    for s, step_expected in enumerate(expected):
        for n, (m_ref, v_ref) in step_expected.items():
            for key, ref in (("exp_avg", m_ref), ("exp_avg_sq", v_ref)):
                row = find_row(rows, step=s, module_name=f"{n}.{key}", scope=key)
                assert_row_matches(row, numpy_stats(torch.from_numpy(ref)), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize(
    "optimizer_cls, kwargs, state_names",
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, {"momentum_buffer"}),
        (torch.optim.Adagrad, {"lr": 0.1}, {"sum"}),
        (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}, {"square_avg", "momentum_buffer", "grad_avg"}),
        (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}, {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    ],
    ids=["sgd-momentum", "adagrad", "rmsprop-centered", "adam-amsgrad"],
)
def test_other_optimizers_report_their_own_state(write_config, optimizer_cls, kwargs, state_names):
    model = TinyMLP()
    opt = optimizer_cls(model.parameters(), **kwargs)
    mon = TrainerMonitorV2(write_config({"monitors": {"optimizer": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(2):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    rows = rows_of(mon.config.output_dir, "optimizer")
    assert {r["scope"] for r in rows} == state_names
    for n, p in model.named_parameters():  # the last step's state, read from the optimizer
        for key in state_names:
            row = find_row(rows, step=1, module_name=f"{n}.{key}")
            assert_row_matches(row, numpy_stats(opt.state[p][key]))
    mon.stop()


def test_param_origin_and_updated_match_copies(write_config):
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    mon = TrainerMonitorV2(write_config({"monitors": {"param": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    snapshots = []
    for x, y in make_batches(3):
        loss_fn(model, x, y).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        snapshots.append((before, after))
        opt.zero_grad()
    mon.stop()
    rows = rows_of(mon.config.output_dir, "param")
    for s, (before, after) in enumerate(snapshots):
        for n in before:
            assert_row_matches(find_row(rows, step=s, module_name=n, scope="param_origin"), numpy_stats(before[n]))
            assert_row_matches(find_row(rows, step=s, module_name=n, scope="param_updated"), numpy_stats(after[n]))


def test_disabled_distribution_flags_write_nothing(write_config):
    cfg = {"monitors": {"optimizer": {"enabled": True, "mv_distribution": False},
                        "param": {"enabled": True, "param_distribution": False}}}
    _, _, mon = run_training(cfg, write_config, steps=2, acc=1)
    assert os.listdir(mon.rank_dir) == []


def test_errors_in_hooks_are_contained_and_logged_once(write_config, caplog, monkeypatch):
    caplog.set_level(logging.ERROR, logger="msprobe.monitor_v2")
    from msprobe.core.monitor_v2.frameworks.pytorch import stats

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(stats.TorchStatsEngine, "record", broken)
    monkeypatch.setattr(stats.TorchStatsEngine, "record_many", broken)
    losses_off, params_off, _ = run_training(None, write_config)
    losses_on, params_on, mon = run_training(ALL_ON, write_config)
    assert torch.equal(losses_off, losses_on)
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_on))
    assert mon.errors.count > 10
    logged = [r for r in caplog.records if "injected failure" in r.getMessage()]
    sites = {r.getMessage().split(",")[0] for r in logged}
    assert len(logged) == len(sites), "each failing site is logged once"


def test_a_layout_that_cannot_be_read_is_said_once_and_costs_neither_training_nor_rows(write_config, caplog,
                                                                                       monkeypatch):
    """layout.json is read at start(); a training stack whose layout raises leaves the
    file out (one WARNING naming what merge then cannot do) and changes nothing else."""
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    from msprobe.core.monitor_v2.frameworks.pytorch.stacks.base import TrainingStack

    def broken(self, table, doc):
        raise RuntimeError("injected layout failure")

    losses_off, params_off, _ = run_training(None, write_config)
    monkeypatch.setattr(TrainingStack, "layout", broken)
    losses_on, params_on, mon = run_training(ALL_ON, write_config)
    assert torch.equal(losses_off, losses_on)
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_on))
    rank_dir = os.path.join(mon.config.output_dir, "rank_0")
    assert "layout.json" not in os.listdir(rank_dir)
    assert rows_of(mon.config.output_dir, "weight_grad") and rows_of(mon.config.output_dir, "param")
    said = [r.getMessage() for r in caplog.records if "layout" in r.getMessage()]
    assert len(said) == 1 and "injected layout failure" in said[0] and "merge" in said[0], said


def test_rank_not_in_rank_list_installs_nothing(write_config):
    model = TinyMLP()
    opt = torch.optim.Adam(model.parameters())
    before = hook_state(model, opt)
    mon = TrainerMonitorV2(write_config({"rank": [1], **ALL_ON}))
    mon.start(model=model, optimizer=opt)
    assert hook_state(model, opt) == before
    for x, y in make_batches(2):
        loss_fn(model, x, y).backward()
        opt.step()
        mon.step()
    mon.stop()
    assert not os.path.exists(os.path.join(mon.config.output_dir, "rank_0"))


def test_steps_outside_the_window_compute_nothing(write_config, monkeypatch):
    from msprobe.core.monitor_v2.frameworks.pytorch import stats

    calls = []
    real_record, real_many = stats.TorchStatsEngine.record, stats.TorchStatsEngine.record_many
    monkeypatch.setattr(stats.TorchStatsEngine, "record", lambda *a, **k: calls.append(1) or real_record(*a, **k))
    monkeypatch.setattr(stats.TorchStatsEngine, "record_many", lambda *a, **k: calls.append(1) or real_many(*a, **k))
    cfg = {"start_step": 3, "step_interval": 2, **ALL_ON}
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters())
    mon = TrainerMonitorV2(write_config(cfg))
    mon.start(model=model, optimizer=opt)
    per_step = []
    for x, y in make_batches(6):
        n = len(calls)
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        per_step.append(len(calls) - n)
    mon.stop()
    assert [c > 0 for c in per_step] == [False, False, False, True, False, True]


def test_a_failing_start_leaves_nothing_installed(write_config):
    """module attaches first; weight_grad then rejects the start() argument: the module
    hooks already installed are removed again before the error reaches the caller."""
    from msprobe.core.monitor_v2.errors import ConfigError

    model = TinyMLP()
    opt = torch.optim.Adam(model.parameters())
    before = hook_state(model, opt)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {}, "weight_grad": {"enabled": True}}}))
    with pytest.raises(ConfigError, match="grad_acc_steps"):
        mon.start(model=model, optimizer=opt, grad_acc_steps="4")
    assert hook_state(model, opt) == before


def test_own_cost_is_measured_and_logged_at_stop(write_config, caplog):
    cfg = {"start_step": 1, "step_interval": 2, **ALL_ON}
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters())
    mon = TrainerMonitorV2(write_config(cfg))
    mon.start(model=model, optimizer=opt)
    assert mon.busy_seconds == 0.0
    for x, y in make_batches(5):  # steps 0..4: 1 and 3 are written
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    busy = mon.busy_seconds
    assert busy > 0.0
    with caplog.at_level(logging.INFO, logger="msprobe.monitor_v2"):
        mon.stop()
    (line,) = [r.getMessage() for r in caplog.records if "its own code took" in r.getMessage()]
    assert "stopped after 5 steps; wrote " in line and " rows of 2 step(s) to " in line
    assert f"{busy:.3f} s" in line
    assert f"{1e3 * busy / 2:.1f} ms per written step" in line


def test_native_kernel_and_aten_reductions_write_the_same_rows(write_config, tmp_path, monkeypatch):
    """The one-pass C kernel (the default on the CPU) and ATen's reductions (without a
    C compiler) agree on every row of a training with every monitor, a NaN included."""
    from msprobe.core.monitor_v2 import native

    assert native.load() is not None, "the one-pass kernel did not build: is a C compiler (gcc) installed?"
    outputs = {}
    for path in ("native", "aten"):
        if path == "aten":
            monkeypatch.setenv(native.ENV_SWITCH, "0")
        cfg = {**ALL_ON, "output_dir": str(tmp_path / path)}
        cfg["monitors"] = {**ALL_ON["monitors"], "module": {"enabled": True}}
        model = TinyMLP()
        opt = torch.optim.AdamW(model.parameters())
        mon = TrainerMonitorV2(write_config(cfg, name=f"{path}.json"))
        mon.start(model=model, optimizer=opt)
        for k, (x, y) in enumerate(make_batches(3)):
            if k == 2:
                x = x.clone()
                x[0, 0] = float("nan")
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        mon.stop()
        outputs[path] = {m: rows_of(cfg["output_dir"], m) for m in ("weight_grad", "optimizer", "param", "module")}
    for monitor, rows in outputs["native"].items():
        other = outputs["aten"][monitor]
        assert rows and [(r["module_name"], r["scope"], r["step"]) for r in rows] == \
            [(r["module_name"], r["scope"], r["step"]) for r in other]
        for a, b in zip(rows, other):
            for op in ("min", "max", "mean", "norm", "nans"):
                va, vb = float(a[op]), float(b[op])
                assert (np.isnan(va) and np.isnan(vb)) or va == pytest.approx(vb, rel=1e-5, abs=1e-7), \
                    (monitor, a["module_name"], a["scope"], op, va, vb)
    nan_rows = [r for r in outputs["native"]["module"] if r["nans"] not in ("0", "")]
    assert nan_rows, "the injected NaN is reported"
