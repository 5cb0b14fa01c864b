"""Reading the monitor's output: anomaly detection, a cross-rank summary, plots,
run comparison and export to Parquet (the ``msprobe-monitor`` command line tool), and
a DataFrame API for notebooks.

The package reads the CSV files the monitor writes
(``<output_dir>/rank_<r>/<monitor>_step<a>-<b>.csv``), or a Parquet dataset made from
them by ``msprobe-monitor export``. The commands run on Polars, an embedded columnar
engine (:mod:`.engine`, :mod:`.columnar`), batch by batch in bounded memory; the
previous pure-Python implementation (:func:`.detect.analyse`) stays as the reference
the tests compare against (``--engine reference``). Polars and matplotlib come with
``pip install 'msprobe-monitor[analysis]'``; the training side imports neither.

Notebooks::

    from msprobe.core.monitor_v2.analysis import load
    df = load("monitor_output", monitors=["weight_grad"], ranks=[0, 1], steps=(100, 200))

Entry point of the CLI: :func:`msprobe.core.monitor_v2.analysis.cli.main`.
"""

__all__ = ["cli", "export", "load"]


def load(*args, **kwargs):
    """See :func:`.columnar.load` (imported on first use: it needs Polars)."""
    from .columnar import load as _load

    return _load(*args, **kwargs)


def export(*args, **kwargs):
    """See :func:`.columnar.export`."""
    from .columnar import export as _export

    return _export(*args, **kwargs)
