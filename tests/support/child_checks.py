"""Checks run in a child Python with an environment of their own: for what is read once
per process (``TRITON_INTERPRET``, which Triton reads when it is imported; the engine's
CPU test seam), where setting it in the test process could come too late and would leak
into later tests.

``ChildChecks(test_file, env)`` starts one Python that imports ``test_file`` (its folder
first on ``sys.path``, as pytest's default import mode puts it) with ``env`` added to the
workers' environment (``None`` removes a variable); ``child(check, *args)`` runs the
module's function ``check`` there by name, with JSON arguments, and fails the calling
test with the child's traceback. A module-scoped fixture holds one child for the module.
"""

import json
import os
import select
import subprocess
import sys
from typing import Any, Dict, Optional

import pytest

from .launch import worker_env

CHECK_TIMEOUT_S = 900  # a hung child fails the test instead of the run

_WORKER = r"""
import importlib.util, json, os, sys, traceback
protocol = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what the checks print goes to stderr, not into the protocol
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
spec = importlib.util.spec_from_file_location(sys.argv[2], sys.argv[1])
checks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checks)
for line in sys.stdin:
    call = json.loads(line)
    try:
        getattr(checks, call["name"])(*call["args"])
        result = {"ok": True}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    protocol.write(json.dumps(result) + "\n")
    protocol.flush()
"""


class ChildChecks:
    """A Python that imported ``test_file`` with ``env`` and runs its checks by name."""

    def __init__(self, test_file: str, env: Dict[str, Optional[str]]) -> None:
        full_env = worker_env()
        for name, value in env.items():
            if value is None:
                full_env.pop(name, None)
            else:
                full_env[name] = value
        module = os.path.splitext(os.path.basename(test_file))[0] + "_checks"
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER, test_file, module], env=full_env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self, check: Any, *args: Any) -> None:
        __tracebackhide__ = True
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"name": check.__name__, "args": list(args)}) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], CHECK_TIMEOUT_S)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            pytest.fail(f"the child running {check.__name__} ended or hung (exit code {self.process.poll()})",
                        pytrace=False)
        result = json.loads(line)
        if not result["ok"]:
            pytest.fail(f"{check.__name__}{tuple(args)} failed in the child:\n{result['error']}", pytrace=False)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
