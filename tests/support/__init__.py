"""Shared test support: tiny real models, CSV readers, NumPy references, the
``torchrun``/``msrun`` launchers and the workers' ``finish()``.

Importable as ``support`` from every test module (pytest puts ``tests/`` on ``sys.path``,
``pythonpath`` in ``pyproject.toml``) and from every worker started by ``run_torchrun`` or
``run_msrun`` (they put ``tests/`` on ``PYTHONPATH``). Framework-specific helpers stay in
their own submodules, imported only after the framework's ``support.extras.require``:
``support.ms_helpers`` (MindSpore), ``support.shards`` (sharded-tensor checks) and
``support.ddp`` (a DDP communication hook that clones local gradients); ``support.extras``
holds the one rule for the optional libraries."""

from support.launch import free_port, run_msrun, run_torchrun, worker_env
from support.models import TinyMLP, loss_fn, make_batches
from support.reference import assert_row_matches, numpy_stats
from support.rows import find_row, read_csv, read_rank_dir, rows_of
from support.worker import finish

__all__ = [
    "TinyMLP", "assert_row_matches", "find_row", "finish", "free_port", "loss_fn", "make_batches",
    "numpy_stats", "read_csv", "read_rank_dir", "rows_of", "run_msrun", "run_torchrun", "worker_env",
]
