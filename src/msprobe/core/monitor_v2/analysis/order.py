"""Execution order of rows, used to say which anomaly or difference came *first*.

Within a step, the monitor's rows are ordered as the training computed them:

====  ==================================================================  ==========
rank  rows                                                                 micro key
====  ==================================================================  ==========
0     ``param`` ``param_origin``: the parameters the step's forward used   0
      (read before ``optimizer.step()``, unchanged since the step began)
1     ``module`` ``forward``, ``eval_forward`` and ``generate`` rows, in   0
      call order
2     ``module`` ``backward`` rows, in backward order (file order)         0
3     ``weight_grad`` ``unreduced``, per micro-batch                       micro_step
4     ``cc`` ``comm``                                                      last
5     ``weight_grad`` ``reduced``                                          last
6     ``optimizer`` state (after the update)                               last
7     ``param`` ``param_updated``                                          last
8     anything else (an unknown scope)                                     last
====  ==================================================================  ==========

The sort key is ``(step, micro key, phase, line in its file, rank)``. ``module`` rows
aggregate every micro-batch of the step (the file has one row per tensor and step), so
they are placed at the earliest point they can describe: a NaN that appears in the
forward pass of micro-batch 2 is reported at its forward row, before the
``unreduced`` gradient of micro-batch 2 and before any later phase.
"""

from typing import Optional

from .. import rows

LAST = rows.LAST_MICRO

PHASE_LABELS = {
    0: "parameters at step start",
    1: "forward",
    2: "backward",
    3: "local gradient",
    4: "communication",
    5: "reduced gradient",
    6: "optimizer state",
    7: "updated parameters",
    8: "other",
}

# The key itself lives in rows.py: the training side writes it into anomalies.jsonl.
OrderKey = rows.OrderKey
phase = rows.execution_phase
order_key = rows.execution_order


def where(monitor: str, scope: str, micro: Optional[int], per_micro: Optional[bool] = None) -> str:
    """A short description of the point in the step, e.g. ``forward``, ``local gradient
    of micro-batch 2`` (``per_micro``: the run wrote one gradient row per micro-batch) or
    ``local gradient, accumulated over 2 micro-batches`` (one row per step)."""
    p = phase(monitor, scope)
    label = PHASE_LABELS[p]
    if monitor != rows.WEIGHT_GRAD or micro is None or p not in (3, 5):
        return label
    if p == 3 and per_micro:
        return f"{label} of micro-batch {micro}"
    if micro > 1:
        return f"{label}, accumulated over {micro} micro-batches"
    return label
