"""The layout of ``analysis/`` by role: modules use one another's public names only, the
CLI chooses the analysis engine in one place, both engines implement one interface and
give the same output for every command that reads through them."""

import ast
import inspect
from pathlib import Path

import pytest

from analysis_helpers import cli, training_runs
from support.extras import MATPLOTLIB_PLOT, POLARS_ENGINE, require

from msprobe.core.monitor_v2.analysis import cli as cli_module
from msprobe.core.monitor_v2.analysis.reference import ReferenceEngine
from msprobe.core.monitor_v2.analysis.report import AnalysisEngine

ANALYSIS = Path(cli_module.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules():
    for path in sorted(ANALYSIS.glob("*.py")):
        yield path.name, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_no_module_imports_a_private_name_of_another():
    bad = []
    for name, tree in _modules():
        imported_modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                bad += [f"{name}:{node.lineno}: from {node.module or '.'} import {a.name}"
                        for a in node.names if _private(a.name)]
                bad += [f"{name}:{node.lineno}: from {node.module} (a private module)"
                        for part in (node.module or "").split(".") if _private(part)]
                if node.module is None:  # from . import engine: a module of the package
                    imported_modules.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                imported_modules.update((a.asname or a.name).split(".")[0] for a in node.names)
        for node in ast.walk(tree):  # engine._name, on a module imported above
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in imported_modules):
                bad.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert bad == []


def _functions_naming(tree: ast.Module, names: set) -> set:
    """The top-level functions of ``tree`` that name (as a variable, or import) one of ``names``."""
    users = set()
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if (isinstance(node, ast.Name) and node.id in names) or \
                        (isinstance(node, ast.alias) and (node.asname or node.name) in names):
                    users.add(fn.name)
    return users


def _reads_engine_flag(node: ast.AST) -> bool:
    """``args.engine`` or ``getattr(args, "engine", ...)``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "engine" and isinstance(node.value, ast.Name) and node.value.id == "args"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "engine")


def test_the_cli_chooses_the_engine_in_one_function():
    tree = ast.parse(Path(cli_module.__file__).read_text(encoding="utf-8"))
    # only choose_engine constructs an engine; no command calls an analysis function directly
    engines = {"ReferenceEngine", "ColumnarEngine", "analyse", "analyse_columnar"}
    assert _functions_naming(tree, engines) == {"choose_engine"}
    flag_readers = {fn.name for fn in tree.body if isinstance(fn, ast.FunctionDef)
                    and any(_reads_engine_flag(node) for node in ast.walk(fn))}
    assert flag_readers == {"choose_engine"}


def test_the_cli_leaves_rendering_to_render():
    tree = ast.parse(Path(cli_module.__file__).read_text(encoding="utf-8"))
    from_text = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "text"
                 for a in node.names}
    assert from_text <= {"dump_json", "Progress"}  # no table or number formatting in the parser's module


def _methods(cls) -> dict:
    return {name: inspect.signature(getattr(cls, name)) for name in ("open_layout", "analyse")}


def test_both_engines_implement_the_interface():
    require("polars", POLARS_ENGINE)
    from msprobe.core.monitor_v2.analysis.engine import ColumnarEngine

    want = _methods(AnalysisEngine)
    assert _methods(ReferenceEngine) == want
    assert _methods(ColumnarEngine) == want


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return training_runs(tmp_path_factory)


def test_each_command_chooses_the_engine_once(runs, tmp_path, monkeypatch):
    require("polars", POLARS_ENGINE)
    require("matplotlib", MATPLOTLIB_PLOT)
    made = []
    real = cli_module.choose_engine

    def counting(args):
        engine = real(args)
        made.append((args.command, type(engine).__name__))
        return engine

    monkeypatch.setattr(cli_module, "choose_engine", counting)
    commands = [("summary", runs / "nan"), ("anomalies", runs / "nan"),
                ("plot", runs / "nan", "--out", tmp_path / "plots", "--no-html"),
                ("diff", runs / "clean", runs / "nan"), ("export", runs / "nan", tmp_path / "parquet")]
    for argv in commands:
        for engine in ((), ("--engine", "reference")):
            made.clear()
            assert cli(*argv, *engine).code in (0, 1)
            assert made == [(argv[0], "ReferenceEngine" if engine else "ColumnarEngine")]


@pytest.mark.parametrize("argv", [
    ("plot", "{runs}/spike", "--out", "{tmp}/plots", "--json"),
    ("plot", "{runs}/nan", "--out", "{tmp}/plots", "--by", "tensor", "--rank", "1"),
    ("diff", "{runs}/clean", "{runs}/desync"),
    ("diff", "{runs}/clean", "{runs}/lr", "--json", "--limit", "0"),
    ("summary", "{runs}/spike", "--rank-groups", "0;1", "--json"),
])
def test_the_same_output_with_each_engine(runs, tmp_path, argv):
    require("polars", POLARS_ENGINE)
    if argv[0] == "plot":
        require("matplotlib", MATPLOTLIB_PLOT)
    argv = [a.format(runs=runs, tmp=tmp_path) for a in argv]
    ref = cli(*argv, "--engine", "reference")
    new = cli(*argv)
    assert (new.code, new.out, new.err) == (ref.code, ref.out, ref.err)
    assert new.code in (0, 1) and new.out
