"""``rows.py`` is the one definition of a row: a real run with every monitor writes only
file names, headers and scopes it declares, the analysis reader reads them back, and
the module itself needs nothing outside the standard library (the analysis tools
import it without any framework)."""

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from msprobe.core.monitor_v2 import rows
from msprobe.core.monitor_v2.analysis.reader import CsvFile, Problems, iter_rows, scan

ROWS_SOURCE = Path(rows.__file__)
ALL_MONITORS = {name: {"enabled": True, "ops": list(rows.ALL_OPS)} for name in rows.MONITORS}


def test_rows_imports_only_the_standard_library():
    tree = ast.parse(ROWS_SOURCE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"rows.py imports from the package: {ast.dump(node)}"
            imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_rows_imports_no_third_party_module_when_run():
    # what a fresh interpreter loads to import rows.py alone (not through the package)
    code = ("import importlib.util, sys\n"
            "before = set(sys.modules)\n"
            f"spec = importlib.util.spec_from_file_location('rows_alone', {str(ROWS_SOURCE)!r})\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            "print('\\n'.join(sorted({m.split('.')[0] for m in set(sys.modules) - before})))\n")
    loaded = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                text=True).stdout.split())
    assert loaded <= set(sys.stdlib_module_names), loaded - set(sys.stdlib_module_names)


def test_header_and_names():
    assert rows.header(("min", "nans"), False) == ["vpp_stage", "step", "module_name", "scope", "min", "nans"]
    assert rows.header(rows.DEFAULT_OPS, True)[:5] == list(rows.BASE_COLUMNS) + [rows.MICRO_STEP]
    assert rows.FILE_RE.match(rows.file_name(rows.WEIGHT_GRAD, 3, 7)).group("monitor", "a", "b") == (
        "weight_grad", "3", "7")
    assert rows.chunk_name(1, "fc1.weight") == "1:fc1.weight"
    assert rows.optimizer_row("fc1.weight", rows.EXP_AVG) == "fc1.weight.exp_avg"
    assert rows.module_row("fc1", rows.GRAD_INPUT, 0) == "fc1.grad_input.0"
    assert rows.cc_row("all_reduce", rows.POST, 0, rows.call_site("train.py", 12)) == "all_reduce.post.0@train.py[12]"
    assert set(rows.SCOPES) == set(rows.MONITORS)


def _train(out: Path, chunks: bool) -> None:
    import torch
    import torch.distributed as dist

    from support import TinyMLP, loss_fn, make_batches
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    model = [TinyMLP(seed=0), TinyMLP(seed=1)] if chunks else TinyMLP()
    parts = model if chunks else [model]
    opt = torch.optim.Adam([p for m in parts for p in m.parameters()], lr=1e-2)
    monitors = {name: dict(entry) for name, entry in ALL_MONITORS.items()}
    monitors["weight_grad"]["monitor_mbs_grad"] = chunks
    monitors["cc"]["cc_pre_hook"] = True
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": monitors})
    mon.start(model=model, optimizer=opt, grad_acc_steps=2)
    batches = make_batches(6)
    for step in range(3):
        for x, y in batches[2 * step:2 * step + 2]:
            (sum(loss_fn(m, x, y) for m in parts) / 2).backward()
        for p in parts[0].parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation pass between steps: eval_forward rows
            parts[0](batches[0][0])
    mon.stop()


@pytest.mark.parametrize("chunks", [False, True], ids=["one-model", "two-chunks"])
def test_a_real_run_writes_only_what_rows_declares(tmp_path, chunks):
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    store = tempfile.mktemp(dir=tmp_path)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        _train(tmp_path / "out", chunks)
    finally:
        dist.destroy_process_group()

    rank_dir = tmp_path / "out" / "rank_0"
    csvs = sorted(p for p in rank_dir.iterdir() if p.suffix == ".csv")
    seen_monitors, seen_scopes, seen_names = set(), {}, set()
    for path in csvs:
        match = rows.FILE_RE.match(path.name)
        assert match and match.group("monitor") in rows.MONITORS, path.name
        monitor = match.group("monitor")
        assert path.name == rows.file_name(monitor, int(match.group("a")), int(match.group("b")))
        seen_monitors.add(monitor)
        lines = path.read_text().splitlines()
        assert lines[0].split(",") == rows.header(rows.ALL_OPS, monitor in rows.MICRO_STEP_MONITORS), path.name
        for line in lines[1:]:
            cells = line.split(",")
            seen_scopes.setdefault(monitor, set()).add(cells[3])
            seen_names.add((monitor, cells[2], cells[3]))
    # TinyMLP has no router: the moe rows are checked the same way in tests/pytorch/test_moe.py
    assert seen_monitors == set(rows.MONITORS) - {rows.MOE}
    for monitor, scopes in seen_scopes.items():
        assert scopes <= set(rows.SCOPES[monitor]), (monitor, scopes - set(rows.SCOPES[monitor]))
    # every scope this run can produce appears (Adam has no momentum buffer)
    assert seen_scopes[rows.MODULE] == set(rows.SCOPES[rows.MODULE]) - {rows.GENERATE}  # nothing generates here
    assert seen_scopes[rows.WEIGHT_GRAD] == set(rows.SCOPES[rows.WEIGHT_GRAD])
    assert seen_scopes[rows.PARAM] == set(rows.SCOPES[rows.PARAM])
    assert seen_scopes[rows.OPTIMIZER] == {rows.EXP_AVG, rows.EXP_AVG_SQ}
    assert seen_scopes[rows.CC] == {rows.COMM}

    # names as rows.py composes them
    param = rows.chunk_name(0, "fc1.weight") if chunks else "fc1.weight"
    module = rows.chunk_name(0, "fc2") if chunks else "fc2"  # its input needs a gradient: grad_input rows
    assert (rows.WEIGHT_GRAD, param, rows.UNREDUCED) in seen_names
    assert (rows.PARAM, param, rows.PARAM_UPDATED) in seen_names
    assert (rows.OPTIMIZER, rows.optimizer_row(param, rows.EXP_AVG_SQ), rows.EXP_AVG_SQ) in seen_names
    for kind, scope in ((rows.INPUT, rows.FORWARD), (rows.OUTPUT, rows.FORWARD), (rows.OUTPUT, rows.EVAL_FORWARD),
                        (rows.GRAD_INPUT, rows.BACKWARD), (rows.GRAD_OUTPUT, rows.BACKWARD)):
        assert (rows.MODULE, rows.module_row(module, kind, 0), scope) in seen_names, (kind, scope)
    line = _all_reduce_line()
    for when in (rows.PRE, rows.POST):
        site = rows.call_site(os.path.basename(__file__), line)
        assert (rows.CC, rows.cc_row("all_reduce", when, 0, site), rows.COMM) in seen_names

    # and the analysis reader reads every file back, without a problem
    layout = scan(str(tmp_path / "out"))
    assert layout.monitors == [m for m in rows.MONITORS if m != rows.MOE] and layout.ranks == [0]
    problems = Problems(strict=True)
    read = 0
    for monitor in rows.MONITORS:
        for f in layout.files_of(0, monitor):
            assert isinstance(f, CsvFile)
            for row in iter_rows(f, problems):
                assert row.scope in rows.SCOPES[monitor]
                assert set(row.vals) == set(rows.ALL_OPS)
                read += 1
    written = sum(len(p.read_text().splitlines()) - 1 for p in csvs)
    assert read == written and problems.count == 0


def _all_reduce_line() -> int:
    source = Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(source, 1) if "dist.all_reduce(p.grad)" in text)
