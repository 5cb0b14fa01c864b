"""The rule of ``support.extras``: a test that needs a library which is not installed skips,
its reason naming the library, what needs it and how to get it; under
``MSPROBE_TEST_PROFILE=full`` (``scripts/test.sh``, hence CI) it fails instead. Checked on
a tiny generated test file, run by pytest in a subprocess, that requires a library no
environment has: at module level, in a test, as a mark on a test, and on one case."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from support.extras import PROFILE_VARIABLE

TESTS = Path(__file__).resolve().parents[1]
ABSENT = "msprobe_no_such_library_xyz"

IN_TESTS = f'''
import pytest

from support.extras import needs, require


def test_require_in_a_test():
    require("{ABSENT}", "the probe of the rule needs it")


@needs("{ABSENT}", "the probe of the rule needs it")
def test_needs_as_a_mark():
    pass


@pytest.mark.parametrize("case", ["plain", pytest.param("needy", marks=needs("{ABSENT}.sub", "one case needs it"))])
def test_one_case_needs_it(case):
    pass
'''
AT_MODULE_LEVEL = f'''
from support.extras import require

require("{ABSENT}", "the whole module needs it", load=False)


def test_never_runs():
    pass
'''


def run_pytest(tmp_path: Path, profile: str) -> str:
    (tmp_path / "test_probe_tests.py").write_text(IN_TESTS)
    (tmp_path / "test_probe_module.py").write_text(AT_MODULE_LEVEL)
    env = {k: v for k, v in os.environ.items() if k != PROFILE_VARIABLE}
    if profile:
        env[PROFILE_VARIABLE] = profile
    # tests/ on sys.path (support) and its conftest.py (the needs mark) loaded, as in the suite
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    env["CI"] = "true"  # pytest then writes the short summary unshortened, on a terminal or not
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsfE", "-p", "no:cacheprovider", "-p", "conftest",
                           "--continue-on-collection-errors", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return proc.stdout + proc.stderr


def test_a_missing_library_skips_with_its_name_what_needs_it_and_how_to_get_it(tmp_path):
    out = run_pytest(tmp_path, "")
    assert re.search(r"\b1 passed, 4 skipped\b", out), out
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skips) == 4, out
    for line in skips:
        assert f"{ABSENT}" in line and "is not installed" in line, line
        assert "bash scripts/setup_env.sh test installs it" in line, line
    assert any("the whole module needs it" in line and "test_probe_module.py" in line for line in skips), out
    # a mark's skip is reported at the test's own line, not in the conftest hook
    assert not any("conftest.py" in line for line in skips), out


def test_a_missing_library_fails_under_the_full_profile(tmp_path):
    out = run_pytest(tmp_path, "full")
    assert out.splitlines()[-1].startswith("1 failed, 1 passed, 3 errors in "), out
    assert "skipped" not in out, out
    for what in ("FAILED test_probe_tests.py::test_require_in_a_test", "ERROR test_probe_module.py",
                 "ERROR test_probe_tests.py::test_needs_as_a_mark",
                 "ERROR test_probe_tests.py::test_one_case_needs_it[needy]"):
        assert what in out, (what, out)
    summary = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    assert len(summary) == 4, out
    assert all(f"under {PROFILE_VARIABLE}=full every optional library must be" in line for line in summary), out


def test_no_test_skips_for_an_optional_library_around_the_rule():
    # pytest.importorskip would skip in CI as well: every optional library goes through support.extras
    allowed = {"torch"}  # the suite's own requirement, not an optional library
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "importorskip"
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).split(".")[0] not in allowed):
                found.append(f"{path.relative_to(TESTS)}:{node.lineno}: {node.args[0].value}")
    assert found == []
