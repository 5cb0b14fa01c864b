"""Framework back ends. Each exposes the same small interface:

- ``Session(model, optimizer, context, rank_dir)``: model chunks, parameter names, the optimizer,
  the statistics engine (``session.engine``) and ``install_step_hooks(before, after)``;
- ``MONITORS``: monitor name -> monitor class;
- ``global_rank()``: the rank used for the output directory.
"""

import importlib
from types import ModuleType

from ..errors import MonitorError

_MODULES = {"pytorch": ("pytorch", "torch"), "mindspore": ("mindspore", "mindspore")}


def load_backend(framework: str) -> ModuleType:
    module, package = _MODULES[framework]
    try:
        importlib.import_module(package)
    except ImportError as exc:
        raise MonitorError(
            f"monitor_v2: framework '{framework}' needs the '{package}' package, which cannot be "
            f"imported ({exc}). Install it, e.g. pip install 'msprobe-monitor[{framework if framework != 'pytorch' else 'torch'}]'."
        ) from None
    return importlib.import_module(f"{__name__}.{module}")
