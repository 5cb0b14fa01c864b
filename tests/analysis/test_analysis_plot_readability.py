"""``plot`` on a plain ``nn.Sequential`` (issue 14, item 8): layers are its numbered
children, not one "top level" group; forward activations and backward gradients of very
different sizes share a log axis; every line of a figure has its own colour and style."""

import json
from pathlib import Path

import torch

from analysis_helpers import cli
from support import make_batches
from support.extras import needs_matplotlib, needs_polars
from msprobe.core.monitor_v2 import TrainerMonitorV2
from msprobe.core.monitor_v2.analysis.plot import layer_of, line_style, use_log_scale


def test_layer_of_sequential_and_nested_names():
    assert layer_of("0.weight", None) == "0"
    assert layer_of("3", None) == "3"  # a module row of the 4th child
    assert layer_of("blocks.3.mlp.fc.weight", None) == "blocks.3"
    assert layer_of("fc1.weight", None) == "top level"
    assert layer_of("0.weight", 1) == "0"


def test_lines_are_distinguishable():
    styles = [line_style(i) for i in range(12)]
    assert len(set(styles)) == 12


def test_log_axis_when_levels_differ_by_orders_of_magnitude():
    fwd = ("forward", [0, 1, 2], [65.0, 64.0, 66.0])
    bwd = ("backward", [0, 1, 2], [0.1, 0.12, 0.09])
    assert use_log_scale([fwd, bwd])
    assert not use_log_scale([fwd, ("other", [0, 1, 2], [30.0, 31.0, 29.0])])
    assert not use_log_scale([fwd, ("zero", [0], [0.0])])  # a log axis cannot show 0
    assert use_log_scale([fwd], "log") and not use_log_scale([fwd, bwd], "linear")


@needs_polars
@needs_matplotlib
def test_plot_of_a_sequential_model(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = tmp_path / "out"
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"output_dir": str(out), "monitors": {"module": {"enabled": True},
                                                                    "weight_grad": {"enabled": True}}}))
    mon = TrainerMonitorV2(str(cfg))
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(4):
        (model(x) * 50).sub(y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mon.step()
    mon.stop()
    res = cli("plot", out, "--out", tmp_path / "report", "--json")
    assert res.code == 0, res.err
    names = [Path(p).name for p in res.json()["images"]]
    detail = [n for n in names if "overview" not in n]
    assert any(n.endswith("weight_grad_unreduced_0.png") for n in detail), names
    assert any(n.endswith("weight_grad_unreduced_2.png") for n in detail), names
    assert any(n.endswith("module_forward_0.png") for n in detail), names
    # only the root module (the Sequential itself) is left at the top level
    assert not any("top_level" in n for n in detail if "weight_grad" in n), names
