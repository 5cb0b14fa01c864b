"""Reading the monitor's output: anomaly detection, a cross-rank summary, plots and
run comparison (the ``msprobe-monitor`` command line tool).

The package only reads the CSV files the monitor writes
(``<output_dir>/rank_<r>/<monitor>_step<a>-<b>.csv``). It streams them with the ``csv``
module and keeps bounded state per tensor, so it works on outputs of thousands of
tensors, steps and many ranks. It depends on nothing outside the standard library,
except ``plot``, which imports matplotlib when it runs (``pip install
'msprobe-monitor[analysis]'``).

Entry point: :func:`msprobe.core.monitor_v2.analysis.cli.main`.
"""

__all__ = ["cli"]
