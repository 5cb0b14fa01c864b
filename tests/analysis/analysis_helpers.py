"""Shared by the tests of ``msprobe-monitor`` (the analysis CLI).

``training_runs()`` launches ``workers/train_runs.py`` once per test session (2 gloo
ranks under torchrun) and returns the directory holding its runs: ``clean``, ``nan``,
``lr``, ``spike`` and ``desync`` (see the worker's docstring). ``cli()`` runs the command
line tool in-process and captures its exit code, stdout and stderr.
"""

import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict

from msprobe.core.monitor_v2.analysis.cli import main

WORKER = Path(__file__).parent / "workers" / "train_runs.py"
STEPS = 14
NAN_STEP, LR_STEP, SPIKE_STEP, DESYNC_STEP = 4, 6, 12, 5
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]

_CACHE: Dict[str, Path] = {}


def training_runs(tmp_path_factory) -> Path:
    if "root" not in _CACHE:
        from support import run_torchrun

        root = tmp_path_factory.mktemp("analysis_runs")
        run_torchrun(WORKER, root, NAN_STEP, LR_STEP, SPIKE_STEP, DESYNC_STEP)
        _CACHE["root"] = root
    return _CACHE["root"]


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Dict[str, Any]:
        return json.loads(self.out)


def cli(*argv: Any) -> Result:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], out=out, err=err)
    res = Result(code, out.getvalue(), err.getvalue())
    assert "Traceback" not in res.out + res.err, res.err
    return res


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
