"""Fixtures only; the shared helpers are in the ``support`` package (``tests/support/``)."""

import json
from pathlib import Path
from typing import Any, Dict

import pytest


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
