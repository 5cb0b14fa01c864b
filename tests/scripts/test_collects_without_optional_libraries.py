"""The suite collects where the optional libraries are absent: a user who does not use
MindSpore (or DeepSpeed, Megatron-Core, transformers, kernels, TRL, Lightning, Accelerate,
a dashboard) can run it, and the tests that need one are reported as skipped with a reason.

``pytest --collect-only`` runs in a subprocess whose imports of those libraries fail as
if they were not installed: a meta-path finder raises ``ModuleNotFoundError`` for them and
``importlib.util.find_spec`` answers ``None`` (the tests that only look for a library,
without importing it, ask that). A directory under ``tests/`` named like one of them is not
blocked: it would shadow the library (as ``tests/mindspore/`` did, a namespace package that
let ``importorskip("mindspore")`` pass) and the collection errors this test looks for."""

import os
import re
import subprocess
import sys
from pathlib import Path

from support.extras import PROFILE_VARIABLE

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
BLOCKED = ["mindspore", "deepspeed", "megatron", "transformers", "lightning", "pytorch_lightning",
           "lightning_fabric", "accelerate", "tensorboard", "tensorboardX", "wandb", "mlflow", "swanlab",
           "hypothesis", "kernels", "trl"]

BLOCKER = """
import importlib.abc, importlib.machinery, importlib.util, os, sys
BLOCKED = set({blocked!r})
TESTS = {tests!r}

def under_tests(p):
    return os.path.abspath(p).startswith(TESTS + os.sep) or os.path.abspath(p) == TESTS

# What an import of a blocked library finds where it is not installed: a directory of the
# suite named like it (a shadow, which the collection must then trip over), or nothing.
def shadow(name, path=None):
    if path is None:
        path = [p for p in sys.path if p and under_tests(p)]
    return importlib.machinery.PathFinder.find_spec(name, list(path))

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in BLOCKED:
            return None
        spec = shadow(name, path)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return spec

_find_spec = importlib.util.find_spec
def find_spec(name, package=None):
    if name.split(".")[0] in BLOCKED and name not in sys.modules:
        return shadow(name) if "." not in name else None
    return _find_spec(name, package)

importlib.util.find_spec = find_spec
sys.meta_path.insert(0, Absent())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-rs", "-p", "no:cacheprovider", {tests!r}]))
"""

# Every test module that needs one of the blocked libraries at collection.
NEED_OPTIONAL = sorted(
    [str(p.relative_to(ROOT)) for p in (TESTS / "ms").glob("test_*.py")]
    + ["tests/stacks/test_deepspeed.py", "tests/stacks/test_megatron.py",
       "tests/integrations/test_accelerate.py", "tests/integrations/test_lightning.py",
       "tests/integrations/test_lightning_deepspeed.py", "tests/integrations/test_trainer_deepspeed.py",
       "tests/integrations/test_transformers_trainer.py", "tests/integrations/test_hub_kernels.py",
       "tests/integrations/test_trl.py", "tests/benchmarks/test_ms_overhead_smoke.py",
       "tests/benchmarks/test_overhead_deepspeed_smoke.py", "tests/benchmarks/test_overhead_megatron_smoke.py"]
)


def test_the_suite_collects_without_the_optional_libraries_and_skips_their_tests_with_reasons():
    code = BLOCKER.format(blocked=BLOCKED, tests=str(TESTS))
    # without MSPROBE_TEST_PROFILE (scripts/test.sh sets it): here the blocked libraries must skip, not fail
    env = {k: v for k, v in os.environ.items() if k != PROFILE_VARIABLE}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert not re.search(r"\berrors?\b", out.splitlines()[-1]), out[-6000:]
    assert "ERROR" not in out, out[-6000:]
    assert re.search(r"^\d+ tests collected", out.splitlines()[-1]), out[-2000:]
    skipped = {}
    for line in out.splitlines():
        m = re.match(r"SKIPPED \[\d+\] (\S+?):\d+: (.+)", line)
        if m:
            skipped[m.group(1)] = m.group(2)
    missing = [f for f in NEED_OPTIONAL if f not in skipped]
    assert not missing, f"not reported as skipped at collection: {missing}\n{out[-4000:]}"
    for f in NEED_OPTIONAL:
        assert skipped[f].strip(), f"{f} skipped without a reason"
