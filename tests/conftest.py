"""Fixtures only; the shared helpers are in the ``support`` package (``tests/support/``)."""

import json
from pathlib import Path
from typing import Any, Dict

import pytest

# Transition: test files written before ``support`` existed still ``from conftest import``
# these names. Convert such a file with
#   sed -i 's/^\(\s*\)from conftest import/\1from support import/; s/_free_port/free_port/g' FILE
# and drop this block once no test file imports from conftest.
from support import (  # noqa: F401
    TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, read_csv, read_rank_dir, rows_of,
    run_msrun, run_torchrun,
)
from support import free_port as _free_port  # noqa: F401


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
