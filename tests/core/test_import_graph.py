"""The package's import graph: no cycle, and the framework-neutral core imports no framework.

Read from the source with ``ast`` (every import, those under ``if TYPE_CHECKING:`` and inside
functions included), so a cycle hidden behind a lazy or type-only import still fails here.
"""

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[2] / "src"
PACKAGE = ROOT / "msprobe" / "core" / "monitor_v2"


def _modules() -> Dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def _imported(module: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    targets: List[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = base + ("." + node.module if node.module else "")
            else:
                source = node.module or ""
            submodules = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in modules]
            targets += submodules
            if len(submodules) < len(node.names):  # names defined in the module itself
                targets.append(source)
        elif isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
    # A module always runs its parent packages first: an edge to an ancestor adds nothing.
    return {t for t in targets if t in modules and t != module and not module.startswith(t + ".")}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {m: _imported(m, p, modules) for m, p in modules.items()}
    assert len(graph) > 40  # the walk found the package
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_framework_code_imports_a_framework_at_module_level():
    # config, writer, analysis, ... run where neither torch nor MindSpore is installed
    offenders = []
    for module, path in _modules().items():
        if ".frameworks." in module + "." and module.count(".") > 3 or ".integrations" in module:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only: a function may import lazily
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            offenders += [f"{module}: {n}" for n in names if n.split(".")[0] in ("torch", "mindspore")]
    assert offenders == []
