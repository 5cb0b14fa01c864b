"""The ``msprobe-monitor`` command as it runs from a shell of the environment that prints it.

The monitor (at ``stop()``) and the CLI (``summary``'s "Details: ...") print commands to
paste. A bare ``msprobe-monitor`` only runs where the environment's ``bin`` directory is
on ``PATH`` (an activated venv); a script started as ``.venv/bin/python train.py`` gets
"command not found". So the printed form is: the bare name when ``PATH`` finds this very
installation's script, else that script's full path, else this interpreter running the
package as a module (``analysis/__main__.py``); prefixed with ``PYTHONPATH=...`` when the
package itself was found through ``PYTHONPATH`` (a checkout's ``src``).

Light on purpose: the training side imports it at ``stop()`` (no Polars, no matplotlib).
"""

import os
import shlex
import shutil
import sys
from typing import Mapping, Optional

MODULE = "msprobe.core.monitor_v2.analysis"
SCRIPT = "msprobe-monitor"


def _package_root() -> str:
    """The directory that holds the ``msprobe`` package imported now."""
    here = os.path.dirname(os.path.abspath(__file__))  # .../msprobe/core/monitor_v2/analysis
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))


def _pythonpath_prefix(environ: Mapping[str, str]) -> str:
    """``PYTHONPATH=<root> `` when this package was found through ``PYTHONPATH`` (a
    shell without that variable would import another copy, or none)."""
    root = os.path.realpath(_package_root())
    for entry in (environ.get("PYTHONPATH") or "").split(os.pathsep):
        if entry and os.path.realpath(entry) == root:
            return f"PYTHONPATH={shlex.quote(_package_root())} "
    return ""


def script_command(script: str, module: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """The shell words that run the console script ``script`` of this environment: the
    bare name where ``PATH`` finds this environment's copy, else its full path, else this
    interpreter running ``module``."""
    env = os.environ if environ is None else environ
    python = sys.executable or "python3"
    # not realpath: a venv's python is a symlink to the base interpreter, and the script
    # sits next to the link
    tool = os.path.join(os.path.dirname(os.path.abspath(python)), script)
    if os.path.isfile(tool) and os.access(tool, os.X_OK):
        found = shutil.which(script, path=env.get("PATH"))
        if found and os.path.realpath(found) == os.path.realpath(tool):
            return script
        return shlex.quote(tool)
    return f"{shlex.quote(python)} -m {module}"


def cli_command(environ: Optional[Mapping[str, str]] = None) -> str:
    """The shell words that run ``msprobe-monitor`` here (``summary DIR`` etc. follow)."""
    env = os.environ if environ is None else environ
    return _pythonpath_prefix(env) + script_command(SCRIPT, MODULE, env)


def command_line(subcommand: str, *args: str) -> str:
    """``msprobe-monitor SUBCOMMAND ARGS...`` as it runs here, each argument quoted for a
    POSIX shell."""
    return " ".join([cli_command(), subcommand, *(shlex.quote(str(a)) for a in args)])


def tensorboard_command(logdir: str) -> str:
    """``tensorboard --logdir LOGDIR`` as it runs here (TensorBoard's own script, or its
    module with this interpreter)."""
    return f"{script_command('tensorboard', 'tensorboard.main')} --logdir {shlex.quote(str(logdir))}"


def pip_command(*requirements: str) -> str:
    """``pip install`` for this interpreter, as it runs here: a bare ``pip`` may be
    missing from ``PATH`` or belong to another Python."""
    python = sys.executable or "python3"
    return " ".join([shlex.quote(python), "-m", "pip", "install", *(shlex.quote(r) for r in requirements)])
