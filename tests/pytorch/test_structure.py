"""``"structure": true``: ``start()`` writes ``rank_<r>/structure.txt``, and
``msprobe-monitor struct`` reads it and counts what a ``targets`` list selects.

The contract checked on real models with the awkward parts (a root with its own
parameter, a ``ModuleList`` that is never called, a module registered under two names,
tied weights, a frozen embedding, model chunks): every module name listed is a target
that produces rows of exactly the modules the listing says it selects, the modules with
rows in a run with every module on are exactly the listed non-containers, and the
trainable parameters listed are exactly the names of the ``weight_grad`` rows."""

import io
import json
import logging
import os
import stat

import pytest
import torch
from torch import nn

from support import rows_of
from msprobe.core.monitor_v2.analysis.cli import main
from msprobe.core.monitor_v2.errors import ConfigError, OutputError
from msprobe.core.monitor_v2.model_structure import read_structure
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

KINDS = (".input.", ".output.", ".grad_input.", ".grad_output.")


class Result:
    def __init__(self, code, out, err):
        self.code, self.out, self.err = code, out, err

    def json(self):
        return json.loads(self.out)


def cli(*argv) -> Result:
    """``msprobe-monitor`` in-process (as tests/analysis/analysis_helpers.py does)."""
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], out=out, err=err)
    assert "Traceback" not in out.getvalue() + err.getvalue(), err.getvalue()
    return Result(code, out.getvalue(), err.getvalue())


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.ReLU()
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.act(self.fc(x)))


class Model(nn.Module):
    def __init__(self, v: int = 11, d: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(v, d)
        self.emb.weight.requires_grad_(False)  # frozen
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])  # never called itself
        self.shared = nn.Linear(d, d)
        self.alias = self.shared  # the same module under a second name: listed once
        self.head = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, v))
        self.head[0].weight = self.shared.weight  # tied: one parameter, two names
        self.scale = nn.Parameter(torch.tensor(1.5))  # the root's own parameter
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = self.alias(b(h))
        return self.head(h) * self.scale


def module_of(row_name: str) -> str:
    for kind in KINDS:
        if kind in row_name:
            return row_name.rsplit(kind, 1)[0]
    raise AssertionError(row_name)


def train(out, model, config_extra=None, steps=1):
    params = [p for p in (model.parameters() if isinstance(model, nn.Module)
                          else (p for m in model for p in m.parameters())) if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    cfg = {"output_dir": str(out), "structure": True}
    cfg.update(config_extra or {})
    mon = TrainerMonitorV2(cfg)
    mon.start(model=model, optimizer=opt)
    ids = torch.tensor([[1, 4, 7], [2, 9, 0]])
    for _ in range(steps):
        if isinstance(model, nn.Module):
            loss = model(ids).square().mean()
        else:
            loss = model[1](model[0](ids)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return read_structure(str(out / "rank_0" / "structure.txt"))


def test_listed_names_are_the_names_rows_carry(tmp_path):
    out = tmp_path / "all"
    s = train(out, Model(), {"monitors": {"module": {}, "weight_grad": {"enabled": True}}})
    names = [m.name for m in s.modules]
    assert names == ["Model", "emb", "blocks", "blocks.0", "blocks.0.fc", "blocks.0.act", "blocks.0.norm",
                     "blocks.1", "blocks.1.fc", "blocks.1.act", "blocks.1.norm", "shared", "head", "head.0",
                     "head.1", "head.2"]
    assert [m.name for m in s.modules if m.container] == ["blocks"]
    assert [m.depth for m in s.modules][:4] == [0, 1, 1, 2]
    with_rows = {module_of(r["module_name"]) for r in rows_of(out, "module")}
    assert with_rows == {m.name for m in s.modules if not m.container}
    trainable = {p.name for p in s.params if p.trainable}
    assert {p.name for p in s.params if not p.trainable} == {"emb.weight"}
    assert "alias.weight" not in {p.name for p in s.params}  # tied and aliased: the first name only
    assert trainable == {r["module_name"] for r in rows_of(out, "weight_grad")}
    shapes = {p.name: p.shape for p in s.params}
    assert shapes["scale"] == () and shapes["head.2.weight"] == (11, 8)


def test_each_listed_name_as_a_target_selects_what_struct_counts(tmp_path):
    listing = tmp_path / "listing"
    s = train(listing, Model())
    for entry in s.modules:
        out = tmp_path / f"t_{entry.name}"
        train(out, Model(), {"monitors": {"module": {"targets": [entry.name]}}})
        got = {module_of(r["module_name"]) for r in rows_of(out, "module")}
        res = cli("struct", listing, "--targets", entry.name, "--json")
        assert res.code == 0
        data = res.json()
        assert got == set(data["selected_with_rows"]), entry.name
        assert data["per_target"] == {entry.name: len(data["selected"])}
        assert entry.name in data["selected"]
    # a list: the union, counted once per module
    data = cli("struct", listing, "--targets", "fc", "blocks.1", "--json").json()
    assert data["per_target"] == {"fc": 2, "blocks.1": 4}
    assert data["selected"] == ["blocks.0.fc", "blocks.1", "blocks.1.fc", "blocks.1.act", "blocks.1.norm"]


def test_struct_text_output_and_a_target_that_selects_nothing(tmp_path):
    out = tmp_path / "out"
    train(out, Model())
    text = cli("struct", out)
    assert text.code == 0
    assert "  Model  (Model)\n    emb  (Embedding)\n    blocks  (ModuleList; container: no rows of its own)\n" \
           "      blocks.0  (Block)\n" in text.out
    assert "emb.weight" in text.out and "frozen: no rows" in text.out
    res = cli("struct", out, "--targets", "norm", "attn")
    assert res.code == 1
    assert "'attn'" in res.out and "(no module name contains it)" in res.out
    assert "SELECTED: 2 of 16 modules, 2 with rows of their own" in res.out
    assert cli("struct", out / "rank_0" / "structure.txt", "--targets", "norm").code == 0
    missing = cli("struct", out, "--rank", "3")
    assert missing.code == 2 and "rank_3" in missing.err
    empty = tmp_path / "empty"
    empty.mkdir()
    res = cli("struct", empty)
    assert res.code == 2 and '"structure": true' in res.err


def test_model_chunks_carry_their_prefix(tmp_path):
    out = tmp_path / "chunks"
    torch.manual_seed(0)
    chunks = [nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8)), nn.Sequential(nn.ReLU(), nn.Linear(8, 3))]
    s = train(out, chunks, {"monitors": {"module": {}, "weight_grad": {"enabled": True}}})
    assert [m.name for m in s.modules] == ["0:Sequential", "0:0", "0:1", "1:Sequential", "1:0", "1:1"]
    assert [m.depth for m in s.modules] == [0, 1, 1, 0, 1, 1]
    assert {module_of(r["module_name"]) for r in rows_of(out, "module")} == {m.name for m in s.modules}
    assert {p.name for p in s.params} == {r["module_name"] for r in rows_of(out, "weight_grad")} == \
        {"0:0.weight", "0:1.weight", "0:1.bias", "1:1.weight", "1:1.bias"}


def test_file_mode_rewrite_and_targets_note(tmp_path):
    out = tmp_path / "out"
    train(out, Model(), {"monitors": {"module": {"targets": ["blocks.0"]}}})
    path = out / "rank_0" / "structure.txt"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    first = path.read_text()
    assert "# This run: monitors.module.targets = ['blocks.0'] selects 4 of 16 modules." in first
    train(out, Model(), {"monitors": {"module": {"targets": ["head"]}}})
    second = path.read_text()
    assert second.count("module\tModel\t") == 1 and "targets = ['head'] selects 4 of 16" in second
    assert [f for f in os.listdir(out / "rank_0") if f.startswith(".structure")] == []


def test_a_symlink_is_refused_and_start_leaves_nothing_installed(tmp_path):
    out = tmp_path / "out"
    (out / "rank_0").mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    os.symlink(victim, out / "rank_0" / "structure.txt")
    model = Model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(out), "structure": True, "monitors": {"module": {}}})
    with pytest.raises(OutputError) as info:
        mon.start(model=model, optimizer=opt)
    assert str(out / "rank_0" / "structure.txt") in str(info.value) and "symbolic link" in str(info.value)
    assert victim.read_text() == "keep me\n"
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks  # step not patched


def test_config_field_and_ranks_that_do_not_monitor(tmp_path, caplog):
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2({"output_dir": str(tmp_path), "structure": "yes"})
    assert info.value.field == "structure" and "'yes'" in str(info.value) and "true or false" in str(info.value)
    with pytest.raises(ConfigError) as info:
        TrainerMonitorV2({"output_dir": str(tmp_path), "structures": True})
    assert "did you mean 'structure'" in str(info.value)
    with caplog.at_level(logging.WARNING, "msprobe.monitor_v2"):
        TrainerMonitorV2({"output_dir": str(tmp_path), "structure": True, "monitors": {"module": {"enabled": False}}})
    assert "no monitor is enabled" not in caplog.text
    out = tmp_path / "other_rank"
    model = Model()
    mon = TrainerMonitorV2({"output_dir": str(out), "structure": True, "rank": [1]})
    mon.start(model=model)
    mon.stop()
    assert not (out / "rank_0").exists()
    out = tmp_path / "off"
    mon = TrainerMonitorV2({"output_dir": str(out)})
    mon.start(model=Model())
    mon.stop()
    assert not (out / "rank_0" / "structure.txt").exists()


def test_names_with_tabs_and_backslashes_round_trip(tmp_path):
    model = nn.Sequential()
    model.add_module("a\tb", nn.Linear(2, 2))
    model.add_module("c\\d", nn.Linear(2, 2))
    out = tmp_path / "odd"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(out), "structure": True, "monitors": {"module": {}}})
    mon.start(model=model, optimizer=opt)
    mon.stop()
    s = read_structure(str(out / "rank_0" / "structure.txt"))
    assert [m.name for m in s.modules] == ["Sequential", "a\tb", "c\\d"]
    assert [p.name for p in s.params] == ["a\tb.weight", "a\tb.bias", "c\\d.weight", "c\\d.bias"]
    data = json.loads(cli("struct", out, "--targets", "\t", "--json").out)
    assert data["selected"] == ["a\tb"]
