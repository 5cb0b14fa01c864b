"""Framework back ends. Each exposes the same small interface:

- ``Session(model, optimizer, context, rank_dir)``: a class whose instances satisfy
  ``backend.Session`` (the protocol: model chunks, the ``ParamTable`` of parameter names,
  the optimizer, the statistics engine ``session.engine``, a ``backend.StatsEngine``, and
  ``install_step_hooks(before, after)``);
- ``MONITORS``: monitor name -> monitor class;
- ``global_rank()``: the rank used for the output directory.
"""

import importlib
import os
from types import ModuleType
from typing import Optional, Sequence

from ..analysis.command import pip_command
from ..errors import ConfigError, MonitorError

_MODULES = {"pytorch": ("pytorch", "torch"), "mindspore": ("mindspore", "mindspore")}


def load_backend(framework: str) -> ModuleType:
    module, package = _MODULES[framework]
    try:
        importlib.import_module(package)
    except ImportError as exc:
        raise MonitorError(
            f"monitor_v2: framework '{framework}' needs the '{package}' package, which cannot be "
            f"imported ({exc}). Install it, e.g. {pip_command(package)}."
        ) from None
    return importlib.import_module(f"{__name__}.{module}")


def rank_from_environment(names: Sequence[str]) -> Optional[int]:
    """The rank a launcher put in the first of the variables ``names`` that is set (an
    empty value counts as unset); None when none is. A value that is not an integer >= 0
    is a clear error: writing under a wrong rank would mix the ranks' files."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if not value:
            continue
        if not (value.isascii() and value.isdigit()) or len(value) > 18:
            raise ConfigError(
                f"monitor_v2: the environment variable {name}={value[:40]!r} is not a rank (an integer >= 0). "
                f"It names the rank's output directory when torch.distributed is not initialized: "
                f"unset it or set it to this process's rank.", field=name)
        return int(value)
    return None
