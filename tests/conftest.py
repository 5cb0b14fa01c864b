"""Fixtures, and the ``requires_library`` mark of ``support.extras.needs``; the shared
helpers are in the ``support`` package (``tests/support/``)."""

import json
from pathlib import Path
from typing import Any, Dict

import pytest

from support.extras import MARK, check_marks


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}(module, why): the test needs this optional library "
                                       "(support.extras.needs)")


def pytest_sessionstart(session: pytest.Session) -> None:
    """The module monitor's C++ graph hooks built (or found in the cache) before the first
    test, so that every test of this process takes the same path rather than one that
    changes when a background build ends (tests/pytorch/test_graph_hooks_library.py tests
    both paths and the build itself)."""
    try:
        from msprobe.core.monitor_v2.frameworks.pytorch import graph_hooks
    except ImportError:  # an environment without torch
        return
    graph_hooks.wait()


@pytest.hookimpl(tryfirst=True)  # before the fixtures: a skipped test launches no training run
def pytest_runtest_setup(item: pytest.Item) -> None:
    check_marks(item)


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a config dict to a JSON file; ``output_dir`` defaults to ``tmp_path/out``."""

    def write(cfg: Dict[str, Any], name: str = "monitor_v2_config.json") -> str:
        cfg = dict(cfg)
        cfg.setdefault("output_dir", str(tmp_path / "out"))
        path = tmp_path / name
        path.write_text(json.dumps(cfg))
        return str(path)

    return write
