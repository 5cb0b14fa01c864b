"""The module monitor's hooks on the autograd graph (grad_output pre-hooks, grad_input
post-hooks): an error inside them is contained and logged once per site, training stays
bit-identical to an unmonitored copy, and the rows that do not depend on them are
written; without errors their rows match gradients computed independently."""

import copy
import logging

import torch

from support import TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, rows_of
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2


def train(model, opt, batches):
    for x, y in batches:
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def test_an_error_in_a_graph_hook_is_contained_and_training_is_unchanged(write_config, caplog):
    model = TinyMLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "targets": ["fc2"]}}}))
    mon.start(model=model, optimizer=opt)
    engine = mon._session.engine
    record = engine.record

    def failing(t, plan, vpp, name, scope, *args, **kwargs):  # the monitor's own engine, not the framework
        if scope == "backward":
            raise RuntimeError("planted failure in a graph hook")
        return record(t, plan, vpp, name, scope, *args, **kwargs)

    engine.record = failing
    batches = make_batches(3)
    with caplog.at_level(logging.ERROR, logger="msprobe.monitor_v2"):
        train(model, opt, batches)
    mon.stop()
    train(ref, ref_opt, batches)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    sites = [r.getMessage() for r in caplog.records if "planted failure" in r.getMessage()]
    assert len([m for m in sites if "grad_output hook of fc2" in m]) == 1
    assert len([m for m in sites if "grad_input hook of fc2" in m]) == 1
    rows = rows_of(mon.config.output_dir, "module")
    assert {r["scope"] for r in rows} == {"forward"}
    assert len({r["step"] for r in rows}) == 3


def test_graph_hook_rows_match_independent_gradients(write_config):
    model = TinyMLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "targets": ["fc2"]}}}))
    mon.start(model=model, optimizer=opt)
    x, y = make_batches(1)[0]
    hidden = ref.act(ref.fc1(x)).detach().requires_grad_(True)
    out = ref.fc2(hidden)
    out.retain_grad()
    torch.nn.functional.mse_loss(out, y).backward()
    train(model, opt, [(x, y)])
    mon.stop()
    rows = rows_of(mon.config.output_dir, "module")
    backward = {r["module_name"]: r for r in rows if r["scope"] == "backward"}
    grad_out = next(r for n, r in backward.items() if "output" in n)
    grad_in = next(r for n, r in backward.items() if "input" in n)
    assert_row_matches(grad_out, numpy_stats(out.grad))
    assert_row_matches(grad_in, numpy_stats(hidden.grad))
