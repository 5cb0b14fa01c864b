"""Tensors the engine cannot reduce as they are (issue 20).

A module output on ``device="meta"``, a strided nested tensor, or a packed float4 one has
no statistics: only its own row is left out (said once at WARNING, naming the tensor and
why); every other row of the step, of that module and of the other monitors is written.
float8 outputs are reduced through an exact fp32 cast, quantized ones as the values they
stand for (``dequantize()``), jagged nested ones as their packed values: checked against
NumPy. A meta parameter held by the optimizer (``param`` on) loses only its own rows.
"""

import logging
import warnings

import pytest
import torch

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

from support import assert_row_matches, find_row, numpy_stats, rows_of

LOGGER = "msprobe.monitor_v2"
OPS = ["min", "max", "mean", "norm", "nans"]


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


class Odd(torch.nn.Module):
    """Returns its input's image next to tensors of every kind the engine must survive."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, h):
        odd = {
            "meta": lambda: torch.empty(h.shape, device="meta"),
            "float8": lambda: h.detach().to(torch.float8_e4m3fn),
            "float8_e5m2": lambda: h.detach().to(torch.float8_e5m2),
            "quantized": lambda: torch.quantize_per_tensor(h.detach(), 0.05, 3, torch.quint8),
            "nested": lambda: torch.nested.nested_tensor([h.detach()[0], h.detach()[1, :2]]),
            "jagged": lambda: torch.nested.nested_tensor([h.detach()[0], h.detach()[1, :2]], layout=torch.jagged),
        }[self.kind]()
        return h * 2.0, odd, h + 1.0


class Model(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(6, 4)
        self.odd = Odd(kind)
        self.fc2 = torch.nn.Linear(4, 3)

    def forward(self, x):
        a, _, b = self.odd(self.fc1(x))
        return self.fc2(a + b)


def _train(write_config, model, steps=3, monitors=None, capture=None):
    cfg = {"monitors": monitors or {"module": {"enabled": True, "ops": OPS}, "weight_grad": {"enabled": True}}}
    opt = torch.optim.SGD([p for p in model.parameters() if not p.is_meta], lr=0.1)
    mon = TrainerMonitorV2(write_config(cfg))
    mon.start(model=model, optimizer=opt)
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(5, 6, generator=g)
        if capture is not None:
            capture.append(x)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return mon


@pytest.mark.parametrize("kind", ["meta", "nested"])
def test_a_tensor_without_statistics_loses_only_its_own_row(write_config, tmp_path, caplog, kind):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    warnings.simplefilter("ignore")  # the nested-tensor prototype warning
    mon = _train(write_config, Model(kind))
    out = tmp_path / "out"
    rows = rows_of(out, "module")
    names = {(r["step"], r["module_name"], r["scope"]) for r in rows}
    for step in ("0", "1", "2"):
        assert (step, "odd.output.1", "forward") not in names
        for name in ("odd.input.0", "odd.output.0", "odd.output.2", "fc1.output.0", "fc2.output.0"):
            assert (step, name, "forward") in names, name
        assert (step, "odd.grad_output.0", "backward") in names
    assert {r["step"] for r in rows_of(out, "weight_grad")} == {"0", "1", "2"}
    said = [r.getMessage() for r in caplog.records if "odd.output.1" in r.getMessage()]
    assert len(said) == 1 and "row is left out" in said[0], said
    assert ("meta tensor" if kind == "meta" else "strided nested tensor") in said[0]
    assert not [r for r in caplog.records if "lost" in r.getMessage()]
    assert mon.errors.count == 0


@pytest.mark.parametrize("kind", ["float8", "float8_e5m2", "quantized", "jagged"])
def test_float8_quantized_and_jagged_outputs_get_exact_statistics(write_config, tmp_path, kind):
    warnings.simplefilter("ignore")
    model = Model(kind)
    xs = []
    _train(write_config, model, steps=1, capture=xs)
    # the unmonitored computation, on the weights of step 0 (reloaded from the training's start)
    ref = Model(kind)
    with torch.no_grad():
        h = ref.fc1(xs[0])
        odd = ref.odd(h)[1]
    if kind == "quantized":
        values = odd.dequantize()
    elif kind == "jagged":
        values = torch.cat([c.reshape(-1) for c in odd.unbind()])
    else:
        values = odd.to(torch.float32)
    row = find_row(rows_of(tmp_path / "out", "module"), step="0", module_name="odd.output.1", scope="forward")
    assert_row_matches(row, numpy_stats(values))


def test_a_meta_parameter_held_by_the_optimizer_loses_only_its_rows(write_config, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = Model("float8")
    model.ghost = torch.nn.Parameter(torch.empty(3, 3, device="meta"))
    opt_params = [model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias, model.ghost]
    opt = torch.optim.SGD(opt_params, lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"param": {"enabled": True}, "weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    for s in range(2):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(s))
        model(x).square().mean().backward()
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
        opt.step()
        opt.zero_grad()
    mon.stop()
    rows = rows_of(tmp_path / "out", "param")
    assert rows and not [r for r in rows if r["module_name"] == "ghost"]
    post = find_row(rows, step="1", module_name="fc2.weight", scope="param_updated")
    assert_row_matches(post, numpy_stats(model.fc2.weight.detach()))
    pre = find_row(rows, step="1", module_name="fc2.weight", scope="param_origin")
    assert_row_matches(pre, numpy_stats(weights["fc2.weight"]))
    said = [r.getMessage() for r in caplog.records if "ghost" in r.getMessage()]
    assert len(said) == 1 and "meta tensor" in said[0], said
    assert mon.errors.count == 0


def test_a_step_whose_statistics_fail_to_reach_the_host_is_counted_in_rows(write_config, tmp_path, caplog,
                                                                          monkeypatch):
    """The fault is injected at the engine's one transfer (as the output-fault tests inject
    at the writer's one write): the loss message counts the rows the steps would have had."""
    from msprobe.core.monitor_v2.frameworks.pytorch import stats as torch_stats

    caplog.set_level(logging.WARNING, logger=LOGGER)
    real = torch_stats.TorchStatsEngine.to_host
    calls = []

    def failing_on_step_1(self, records):
        calls.append(len(records))
        if len(calls) == 2:
            raise RuntimeError("injected: the device is gone")
        return real(self, records)

    monkeypatch.setattr(torch_stats.TorchStatsEngine, "to_host", failing_on_step_1)
    _train(write_config, Model("float8"), steps=3, monitors={"weight_grad": {"enabled": True}})
    rows = rows_of(tmp_path / "out", "weight_grad")
    per_step = len([r for r in rows if r["step"] == "0"])
    assert per_step == 8 and {r["step"] for r in rows} == {"0", "2"}  # fc1/fc2 weight+bias, unreduced+reduced
    lost = [r.getMessage() for r in caplog.records if "of output were lost" in r.getMessage()]
    assert len(lost) == 1 and f"1 step(s) of output were lost ({per_step} row(s))" in lost[0], lost
