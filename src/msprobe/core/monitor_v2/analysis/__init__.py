"""Reading the monitor's output: anomaly detection, a cross-rank summary, plots,
run comparison and export to Parquet (the ``msprobe-monitor`` command line tool), and
a DataFrame API for notebooks.

The package reads the CSV files the monitor writes
(``<output_dir>/rank_<r>/<monitor>_step<a>-<b>.csv``), or a Parquet dataset made from
them by ``msprobe-monitor export``. The commands run on Polars, an embedded columnar
engine (:mod:`.engine`, :mod:`.columnar`), batch by batch in bounded memory; the
previous pure-Python implementation (:mod:`.reference`) stays as the reference the
tests compare against (``--engine reference``). Polars and matplotlib come with
``pip install 'msprobe-monitor[analysis]'``; the training side imports neither.

By role: :mod:`.reader` and :mod:`.columnar` read the files; :mod:`.report` is the
model the analysis commands produce, and the interface of an engine
(:class:`.report.AnalysisEngine`); :mod:`.blocks` holds the row-block tools of ``diff``
and of both engines' rank check; :mod:`.render` writes each command's result as text
or JSON; :mod:`.cli` parses the command line, chooses the engine once and dispatches;
:mod:`.merge` combines the ranks' rows of a model-parallel run by their ``layout.json``
(``msprobe-monitor merge``, :func:`.merge.merge_run`).

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
