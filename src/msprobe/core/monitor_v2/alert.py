"""Online alerts (the ``alert`` config section): anomalies logged the step they are
written, from the statistics already on the host (no synchronisation of its own).

- Non-finite values: the first row of the step in the order the step computed them
  (``rows.execution_order``: parameters at step start, forward, gradients, the update;
  within a phase, file order), the order the reading tools report in,
  whose min/max/mean/norm is NaN or Inf or whose NaN count is not 0. The first step of
  the run with such a row is logged in full; later ones in one line each, up to
  ``MAX_NONFINITE_STEPS`` steps, then no more.
- Spikes: a row's norm larger than ``spike_factor`` times the median of the same tensor's
  last ``spike_window`` written norms, once ``spike_warmup`` of them are known (a robust
  rule: one earlier outlier does not move the median). A norm not above ``spike_floor``
  (default 1e-6) is never a spike: a gradient that converged to exactly 0 and then reads
  1.5e-8 is rounding noise, not an explosion. At most ``MAX_SPIKES_PER_STEP``
  lines per step. Rows of evaluation passes (scope ``eval_forward``) and of generation
  passes (scope ``generate``) are not checked for spikes: they sum over however many
  batches the evaluation ran, or tokens the generation decoded, which changes their norm
  from one pass to the next (they are checked for non-finite values).
- Evidence: given the rank directory, the first step with a non-finite row or a spike
  is also written to ``rank_<r>/anomalies.jsonl`` (``evidence.py``), once per run, each
  line naming the run (``run``, ``run_started``: the alerter starts it, at ``start()``),
  so that the blocks of a run resumed into the same directory and of the run that died
  are told apart. The alerter runs inside the writer's step flush (on its thread with
  ``async_write``), so that file never costs the training step.
"""

import logging
import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from . import evidence
from .config import AlertSettings
from .rows import EVAL_FORWARD, GENERATE, VALUE_OPS
from .stats import Row

logger = logging.getLogger("msprobe.monitor_v2")

MAX_NONFINITE_STEPS = 5
MAX_SPIKES_PER_STEP = 5
_STATS = VALUE_OPS
# scopes whose norms change with the pass's length (batches evaluated, tokens generated)
_NOT_SPIKE_CHECKED = frozenset((EVAL_FORWARD, GENERATE))


def _describe(monitor: str, row: Row) -> str:
    micro = f", micro_step {row.micro_step}" if row.micro_step is not None else ""
    return f"{monitor} {row.name} (scope {row.scope}{micro}, vpp_stage {row.vpp_stage})"


def _nonfinite(row: Row) -> bool:
    if row.stat.nans:
        return True
    return any(not math.isfinite(row.stat.value(op)) for op in _STATS if row.stat.numel or op == "norm")


@dataclass(frozen=True)
class Anomaly:
    """One anomalous row, as the alerter saw it: what incident mode reacts to."""

    kind: str  # "nonfinite" or "spike"
    step: int
    monitor: str
    row: Row
    # False when every row of its monitor and scope in that step (two or more) went
    # non-finite at once: the first in file order then names no suspect (a NaN anywhere in
    # the forward pass makes every gradient NaN), so "targets": "auto" must not narrow to it.
    localised: bool = True


class Alerter:
    def __init__(self, settings: AlertSettings, rank: int, rank_dir: Optional[str] = None) -> None:
        self.settings = settings
        self.rank = rank
        self.rank_dir = rank_dir  # None: no anomalies.jsonl
        self.run = evidence.start_run(rank_dir)  # named by every line of this run's block
        self.anomalies_written = False
        self._history: Dict[Tuple, Deque[float]] = {}
        self._nonfinite_steps = 0
        self.alerts: List[str] = []  # every message logged, for callers and tests
        # The first anomaly of the run. The writer may check on its own thread (async_write):
        # the training thread reads this at a step boundary, so it is set under a lock, once.
        self._first_lock = threading.Lock()
        self.first_anomaly: Optional[Anomaly] = None

    def _seen(self, anomaly: Anomaly) -> None:
        with self._first_lock:
            if self.first_anomaly is None:
                self.first_anomaly = anomaly

    def _log(self, message: str) -> None:
        self.alerts.append(message)
        logger.warning("monitor_v2 alert: %s", message)

    def check_step(self, step: int, rows_by_monitor: Sequence[Tuple[str, Sequence[Row]]]) -> None:
        kinds: Dict[int, str] = {}  # id(row) -> kind, for anomalies.jsonl
        if self.settings.nonfinite:
            kinds.update((id(row), "nonfinite") for _, row in self._check_nonfinite(step, rows_by_monitor))
        if self.settings.spike_factor is not None:
            for _, _, row, _, _ in self._check_spikes(step, rows_by_monitor):
                kinds.setdefault(id(row), "spike")
        if kinds and self.rank_dir is not None and not self.anomalies_written:
            self._write_evidence(step, rows_by_monitor, kinds)

    def _write_evidence(self, step: int, rows_by_monitor: Sequence[Tuple[str, Sequence[Row]]],
                        kinds: Dict[int, str]) -> None:
        self.anomalies_written = True  # once, even when the write fails: the CSVs keep the rows
        try:
            path = evidence.append_anomalies(
                self.rank_dir, evidence.anomaly_lines(self.rank, step, rows_by_monitor, kinds, _nonfinite, self.run))
        except OSError as exc:
            logger.error("monitor_v2: rank %d could not write %s at step %d: %r (the CSV rows are unaffected)",
                         self.rank, evidence.ANOMALIES_FILE, step, exc)
            return
        logger.warning("monitor_v2 alert: rank %d step %d: the anomalous rows of this step are in %s (run %s)",
                       self.rank, step, path, self.run.id)

    def _check_nonfinite(self, step: int,
                         rows_by_monitor: Sequence[Tuple[str, Sequence[Row]]]) -> List[Tuple[str, Row]]:
        bad = [(monitor, row) for monitor, rows in rows_by_monitor for row in rows if _nonfinite(row)]
        if not bad or self._nonfinite_steps >= MAX_NONFINITE_STEPS:
            return bad
        self._nonfinite_steps += 1
        # named in the order the step computed them (the order the reading tools report in),
        # not in file order: parameters at step start, forward, gradients, update
        ordered = self._in_execution_order(step, bad, rows_by_monitor)
        monitor, first = ordered[0]
        phases = self._wholly_bad_phases(bad, rows_by_monitor)
        whole = phases.get((monitor, first.scope), 0)
        if self.first_anomaly is None:
            self._seen(self._suspect(step, ordered, phases))
        stat = first.stat
        values = ", ".join(f"{op}={stat.value(op)}" for op in _STATS) + f", nans={stat.nans}"
        if self._nonfinite_steps == 1:
            self._log(f"rank {self.rank} step {step}: first non-finite value of the run in {_describe(monitor, first)}: "
                      f"{values}; {len(bad)} row(s) of this step are non-finite"
                      + (f"; all {whole} {monitor} {first.scope} rows are, so they cannot tell where it began"
                         if whole else ""))
        else:
            more = " (further steps are not reported)" if self._nonfinite_steps == MAX_NONFINITE_STEPS else ""
            self._log(f"rank {self.rank} step {step}: {len(bad)} non-finite row(s), first {_describe(monitor, first)}{more}")
        return bad

    @staticmethod
    def _wholly_bad_phases(bad: Sequence[Tuple[str, Row]],
                           rows_by_monitor: Sequence[Tuple[str, Sequence[Row]]]) -> Dict[Tuple[str, str], int]:
        """``(monitor, scope)`` -> row count, for the phases whose rows (two or more) all
        went non-finite: the first of those in file order names no suspect."""
        total: Dict[Tuple[str, str], int] = {}
        for monitor, rows in rows_by_monitor:
            for row in rows:
                total[(monitor, row.scope)] = total.get((monitor, row.scope), 0) + 1
        nonfinite: Dict[Tuple[str, str], int] = {}
        for monitor, row in bad:
            nonfinite[(monitor, row.scope)] = nonfinite.get((monitor, row.scope), 0) + 1
        return {k: n for k, n in nonfinite.items() if n > 1 and n == total[k]}

    def _in_execution_order(self, step: int, bad: Sequence[Tuple[str, Row]],
                            rows_by_monitor: Sequence[Tuple[str, Sequence[Row]]]) -> List[Tuple[str, Row]]:
        order = evidence.execution_keys(self.rank, step, rows_by_monitor)
        return sorted(bad, key=lambda mr: order[id(mr[1])])

    @staticmethod
    def _suspect(step: int, ordered: Sequence[Tuple[str, Row]], whole: Dict[Tuple[str, str], int]) -> Anomaly:
        """What incident mode reacts to: the earliest non-finite row (``ordered``: in the
        order the step computed them) of a phase where not every row went non-finite (that
        row names a layer); else the earliest non-finite row, marked not localised."""
        for monitor, row in ordered:
            if (monitor, row.scope) not in whole:
                return Anomaly("nonfinite", step, monitor, row)
        monitor, row = ordered[0]
        return Anomaly("nonfinite", step, monitor, row, localised=False)

    def _check_spikes(self, step: int, rows_by_monitor: Sequence[Tuple[str, Sequence[Row]]]) -> List[Tuple]:
        s = self.settings
        spikes = []
        for monitor, rows in rows_by_monitor:
            for row in rows:
                value = row.stat.value("norm")
                if not math.isfinite(value) or row.scope in _NOT_SPIKE_CHECKED:
                    continue
                key = (monitor, row.vpp_stage, row.name, row.scope, row.micro_step)
                history = self._history.get(key)
                if history is None:
                    history = self._history[key] = deque(maxlen=s.spike_window)
                if len(history) >= s.spike_warmup and value > s.spike_floor:
                    median = statistics.median(history)
                    if median > 0 and value > s.spike_factor * median:
                        spikes.append((value / median, monitor, row, median, len(history)))
                history.append(value)
        if spikes:
            _, monitor, row, _, _ = spikes[0]
            self._seen(Anomaly("spike", step, monitor, row))
        for ratio, monitor, row, median, n in spikes[:MAX_SPIKES_PER_STEP]:
            self._log(f"rank {self.rank} step {step}: norm spike in {_describe(monitor, row)}: "
                      f"{row.stat.value('norm'):.6g} is {ratio:.1f}x the median {median:.6g} of its last {n} norms")
        if len(spikes) > MAX_SPIKES_PER_STEP:
            self._log(f"rank {self.rank} step {step}: {len(spikes) - MAX_SPIKES_PER_STEP} more spike(s) not listed")
        return spikes


def make_alerter(settings: Optional[AlertSettings], rank: int, rank_dir: Optional[str] = None) -> Optional[Alerter]:
    return Alerter(settings, rank, rank_dir) if settings is not None else None
