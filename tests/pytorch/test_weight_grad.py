"""weight_grad: unreduced (per step and per micro-batch) and reduced gradients, checked
against gradients computed independently with torch.autograd.grad on an unmonitored
copy of the model trained in lockstep."""

import copy
import logging

import pytest
import torch

from support import TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, rows_of
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2


def reference_micro_grads(model, batches):
    """Per-micro-batch gradients of ``model`` (not accumulated anywhere)."""
    params = [p for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    out = []
    for x, y in batches:
        grads = torch.autograd.grad(loss_fn(model, x, y), params)
        out.append(dict(zip(names, [g.clone() for g in grads])))
    return out


def train(mon_cfg, write_config, steps=3, acc=1, start_kwargs=None, hidden=10):
    model = TinyMLP(d_hidden=hidden)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config(mon_cfg))
    mon.start(model=model, optimizer=opt, **(start_kwargs or {}))
    batches = make_batches(steps * acc)
    expected = []  # per step: list of per-micro-batch grad dicts
    for s in range(steps):
        micro = batches[s * acc:(s + 1) * acc]
        grads = reference_micro_grads(ref, micro)
        expected.append(grads)
        for name, p in ref.named_parameters():
            p.grad = sum(g[name] for g in grads)
        ref_opt.step()
        ref_opt.zero_grad()
        for x, y in micro:
            loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return mon, expected


def out_dir(mon):
    return mon.config.output_dir


def test_unreduced_and_reduced_without_accumulation(write_config):
    mon, expected = train({"monitors": {"weight_grad": {"enabled": True}}}, write_config)
    rows = rows_of(out_dir(mon), "weight_grad")
    assert len(rows) == 3 * 4 * 2  # steps x params x scopes
    for s, grads in enumerate(expected):
        for name, g in grads[0].items():
            for scope in ("unreduced", "reduced"):
                row = find_row(rows, step=s, module_name=name, scope=scope)
                assert row["micro_step"] == "1"
                assert row["vpp_stage"] == "0"
                assert_row_matches(row, numpy_stats(g))


def test_unreduced_accumulated_over_micro_batches(write_config):
    cfg = {"monitors": {"weight_grad": {"enabled": True, "monitor_mbs_grad": False}}}
    mon, expected = train(cfg, write_config, steps=2, acc=3, start_kwargs={"grad_acc_steps": 3})
    rows = rows_of(out_dir(mon), "weight_grad")
    for s, grads in enumerate(expected):
        for name in grads[0]:
            total = sum(g[name] for g in grads)
            unreduced = [r for r in rows if r["step"] == str(s) and r["module_name"] == name and r["scope"] == "unreduced"]
            assert len(unreduced) == 1, "one accumulated row per parameter and step"
            assert unreduced[0]["micro_step"] == "3"
            assert_row_matches(unreduced[0], numpy_stats(total))
            reduced = find_row(rows, step=s, module_name=name, scope="reduced")
            assert reduced["micro_step"] == "3"
            assert_row_matches(reduced, numpy_stats(total))


def test_per_micro_batch_gradients_are_not_running_sums(write_config):
    cfg = {"monitors": {"weight_grad": {"enabled": True, "monitor_mbs_grad": True, "grad_acc_steps": 3}}}
    mon, expected = train(cfg, write_config, steps=2, acc=3)
    rows = rows_of(out_dir(mon), "weight_grad")
    for s, grads in enumerate(expected):
        for name in grads[0]:
            for mb, g in enumerate(grads, start=1):
                row = find_row(rows, step=s, module_name=name, scope="unreduced", micro_step=mb)
                assert_row_matches(row, numpy_stats(g[name]))
            reduced = find_row(rows, step=s, module_name=name, scope="reduced")
            assert reduced["micro_step"] == "3"
            assert_row_matches(reduced, numpy_stats(sum(g[name] for g in grads)))


def test_more_backward_passes_than_announced_still_one_accumulated_row(write_config):
    # Nothing announced (1 micro-batch), but each step runs 2 backward passes.
    mon, expected = train({"monitors": {"weight_grad": {"enabled": True}}}, write_config, steps=2, acc=2)
    rows = rows_of(out_dir(mon), "weight_grad")
    for s, grads in enumerate(expected):
        for name in grads[0]:
            unreduced = [r for r in rows if r["step"] == str(s) and r["module_name"] == name and r["scope"] == "unreduced"]
            assert len(unreduced) == 1
            assert unreduced[0]["micro_step"] == "2"
            assert_row_matches(unreduced[0], numpy_stats(grads[0][name] + grads[1][name]))


def test_fewer_backward_passes_than_announced_reads_before_step_and_warns(write_config, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    cfg = {"monitors": {"weight_grad": {"enabled": True, "micro_batch_number": 4}}}
    mon, expected = train(cfg, write_config, steps=2, acc=2)
    rows = rows_of(out_dir(mon), "weight_grad")
    for s, grads in enumerate(expected):
        for name in grads[0]:
            row = find_row(rows, step=s, module_name=name, scope="unreduced")
            assert_row_matches(row, numpy_stats(grads[0][name] + grads[1][name]))
    warnings = [r for r in caplog.records if "fewer backward passes" in r.getMessage()]
    assert len(warnings) == 1


def test_micro_batch_number_in_config_wins_over_start_argument(write_config):
    cfg = {"monitors": {"weight_grad": {"enabled": True, "micro_batch_number": 2}}}
    mon, expected = train(cfg, write_config, steps=1, acc=2, start_kwargs={"grad_acc_steps": 5})
    rows = rows_of(out_dir(mon), "weight_grad")
    assert {r["micro_step"] for r in rows} == {"2"}


def test_parameters_without_gradient_write_no_rows(write_config, tmp_path):
    model = TinyMLP()
    model.fc1.weight.requires_grad_(False)
    unused = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD(list(model.parameters()) + [unused], lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(2):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    names = {r["module_name"] for r in rows_of(out_dir(mon), "weight_grad")}
    assert names == {"fc1.bias", "fc2.weight", "fc2.bias"}


def test_tied_parameter_reports_one_gradient(write_config):
    emb = torch.nn.Embedding(7, 4)
    head = torch.nn.Linear(4, 7, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True, "monitor_mbs_grad": True}}}))
    mon.start(model=model, optimizer=opt)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    (g,) = torch.autograd.grad(ref(tokens).logsumexp(-1).sum(), [ref[0].weight])
    model(tokens).logsumexp(-1).sum().backward()
    opt.step()
    mon.stop()
    rows = rows_of(out_dir(mon), "weight_grad")
    assert [r["module_name"] for r in rows] == ["0.weight", "0.weight"]
    for row in rows:
        assert_row_matches(row, numpy_stats(g))


def test_weight_grad_needs_an_optimizer(write_config):
    from msprobe.core.monitor_v2.errors import ConfigError

    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    with pytest.raises(ConfigError, match="optimizer"):
        mon.start(model=TinyMLP())


def test_reduced_sees_gradients_changed_after_backward(write_config):
    """Clipping or scaling the gradients between backward and optimizer.step() shows in
    'reduced' and not in 'unreduced' (no stale statistics reused)."""
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config({"monitors": {"weight_grad": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    x, y = make_batches(1)[0]
    loss_fn(model, x, y).backward()
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)
    model.fc2.bias.grad.mul_(3.0)
    clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    mon.stop()
    rows = rows_of(out_dir(mon), "weight_grad")
    for name in raw:
        assert_row_matches(find_row(rows, module_name=name, scope="unreduced"), numpy_stats(raw[name]))
        assert_row_matches(find_row(rows, module_name=name, scope="reduced"), numpy_stats(clipped[name]))
