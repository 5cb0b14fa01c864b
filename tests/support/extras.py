"""The one rule for the optional libraries of the suite (MindSpore, DeepSpeed, Megatron-Core,
transformers, Lightning, Accelerate, hypothesis, the dashboards, Polars, matplotlib): a test
that needs one which is not installed skips, its reason naming the library, what needs it
and how to get it; but where ``MSPROBE_TEST_PROFILE=full`` is set (``scripts/test.sh``
sets it, and CI runs that), the missing library is a failure: there, everything is meant
to be installed, and a test must not go quiet because a library went missing.

- ``require(module, why)`` in a test (or at module level, for a module all of whose tests
  need it) imports and returns the module; ``load=False`` only looks for it, for a library
  that a worker or a subprocess imports (DeepSpeed with ``DS_ACCELERATOR=cpu``).
- ``needs(module, why)`` is the same as a mark, for a test, a class, a module
  (``pytestmark``) or one ``pytest.param`` case; ``tests/conftest.py`` applies it.
- ``require_command(name, why)`` is the same for a console script (``msprobe-monitor``)."""

import importlib
import importlib.util
import os
import shutil
from types import ModuleType
from typing import Optional

import pytest

PROFILE_VARIABLE = "MSPROBE_TEST_PROFILE"
HOW_TO_GET = "bash scripts/setup_env.sh test installs it"
MARK = "requires_library"


def full_profile() -> bool:
    """True where every optional library must be there (CI's ``scripts/test.sh``)."""
    return os.environ.get(PROFILE_VARIABLE, "") == "full"


def _absent(what: str, why: str, state: str = "is not installed") -> None:
    __tracebackhide__ = True  # the skip is reported at the test's line, not here
    if full_profile():
        pytest.fail(f"{what} {state}, and under {PROFILE_VARIABLE}=full every optional library must be: {why} "
                    f"({HOW_TO_GET})", pytrace=False)
    pytest.skip(f"{what} {state}: {why} ({HOW_TO_GET})", allow_module_level=True)


def _found(module: str) -> bool:
    # looked up through the attribute at each call: the collection test replaces find_spec
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or half-imported
        return False


def require(module: str, why: str, *, load: bool = True) -> Optional[ModuleType]:
    """The module, imported (``load=False``: only looked for, and None returned); where it
    is missing, a skip naming it and ``why`` it is needed, or a failure under the full profile."""
    __tracebackhide__ = True
    if not load:
        if not _found(module):
            _absent(module, why)
        return None
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        failed = exc  # said below, outside the handler: the skip or failure is not chained to it
    if failed.name is not None and (module == failed.name or module.startswith(failed.name + ".")):
        _absent(module, why)
    else:  # there, but it cannot be imported: said as such, not as "not installed"
        _absent(module, why, f"cannot be imported ({type(failed).__name__}: {failed})")
    return None


def needs(module: str, why: str) -> pytest.MarkDecorator:
    """``require(module, why, load=False)`` as a mark, checked when the test is set up."""
    return getattr(pytest.mark, MARK)(module, why=why)


def check_marks(item: pytest.Item) -> None:
    """The ``needs`` marks of a test being set up (``tests/conftest.py`` calls it)."""
    for mark in item.iter_markers(name=MARK):
        try:
            require(mark.args[0], mark.kwargs["why"], load=False)
        except pytest.skip.Exception as exc:
            # reported at the test's own line, as pytest's skip marks are, not at this hook
            raise pytest.skip.Exception(exc.msg, _use_item_location=True) from None


def require_command(name: str, why: str, path: Optional[str] = None) -> str:
    """The path of console script ``name`` (looked up on ``path``, default ``$PATH``)."""
    __tracebackhide__ = True
    found = shutil.which(name, path=path)
    if found is None:
        _absent(f"the {name} command", why, "is not installed (the console script of this package, pip-installed)")
    return found or name


# the analysis CLI's own needs, shared by the tests that run it (tests/analysis and others)
POLARS_ENGINE = ("msprobe-monitor's default engine (summary, anomalies, diff, plot, export; not --engine "
                 "reference) is Polars")
MATPLOTLIB_PLOT = "msprobe-monitor plot draws its figures with matplotlib"
needs_polars = needs("polars", POLARS_ENGINE)
needs_matplotlib = needs("matplotlib", MATPLOTLIB_PLOT)
