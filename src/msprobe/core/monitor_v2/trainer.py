"""``TrainerMonitorV2``: the orchestrator.

It owns the step counter and schedule, the monitors and the writer. A step's data flow:
hooks compute statistics on the device into small vectors (only on steps that will be
written); ``step()`` collects every monitor's records, moves them to the host in one
transfer per device, and hands them to the writer, which merges and formats rows.

A process forked from a training process while the monitor runs (``os.fork()``) inherits
the monitor, its hooks and the parent's open files. In the child the monitor records and
writes nothing: the files are the parent's, and the async writer's thread does not exist
there. The first time the child ends a step (a patched ``optimizer.step()``, or
``step()``), that is said once at WARNING; a child that never trains (a DataLoader
worker) says nothing.
"""

import json
import logging
import math
import numbers
import operator
import os
import sys
import time
import weakref
from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple, Union

from . import rows
from .alert import make_alerter
from .backend import Session
from .config import MonitorConfig, load_config
from .dynamic import (ConfigWatch, MonitorPlan, auto_target, describe_planned, restart_fields, same_monitor,
                      schedule_text, timed_names)
from .errors import ConfigError, MonitorStateError, NonFiniteGradientError, OutputError, ScalarError
from .frameworks import load_backend
from .layout import DTYPES, dtype_name, moe_entry, render, write_layout
from .model_structure import write_structure
from .monitor import ContainedErrors, Monitor, module_tags, short_error
from .logonce import LogOnce
from .patching import Patch
from .sinks import make_sink_hub
from .stats import Record, StatPlan, record_type
from .writer import STALL_S, AsyncCsvWriter, CsvWriter, MonitorOutput, SidecarOutput, count_rows

logger = logging.getLogger("msprobe.monitor_v2")


class TrainerMonitorV2:
    """Monitor a training loop; the config reference is docs/configuration.md.

    >>> mon = TrainerMonitorV2("./monitor_v2_config.json", fr="pytorch")
    >>> mon.start(model=model, optimizer=optimizer, grad_acc_steps=4)
    >>> ...  # train; mon.step() after each optimizer step unless it is patched
    >>> mon.stop()
    """

    def __init__(self, config_path: Union[str, "os.PathLike[str]", Mapping[str, Any]], fr: Optional[str] = None) -> None:
        self.config: MonitorConfig = load_config(config_path, fr)
        self.schedule = self.config.schedule
        self.errors = ContainedErrors()
        self.rank: Optional[int] = None
        self.monitors: List[Monitor] = []
        self._step = 0
        self._active = False
        self._state = "new"  # new -> running | idle (rank not monitored) -> stopped
        self._writer: Any = None
        self._session: Optional[Session] = None  # from start() to stop()
        self._step_hooks = Patch()
        self._patched = False
        self._written_steps = 0
        self._steps_with_rows = 0  # written steps that produced at least one row
        self._optimizer_steps = 0  # optimizer.step() calls seen (patched or not)
        self._pid = os.getpid()
        self._once = LogOnce()
        self._guard: Any = None  # alert.dump / stop_on_nonfinite: the pre-update gradient check
        # the exception being raised or handled when stop() ran (a training that crashed), if any
        self._stopped_during: Optional[BaseException] = None
        # log_scalars(): records by step, at most the current step and the one just ended
        # (written with the next step's rows, or by stop()); the step that ended last and
        # whether it was written
        self._scalars: Dict[int, List[Record]] = {}
        self._ended: Optional[Tuple[int, bool]] = None
        # layout.json: its document, the inner CSV writer (which writes it first) and the
        # count of each monitor's row dtypes already in it
        self._layout_doc: Optional[Dict[str, Any]] = None
        self._layout_writer: Any = None
        self._layout_text = ""
        self._dtypes_seen: Dict[str, int] = {}
        self._init_incident(config_path, fr)

    # ------------------------------------------------------------------ properties
    @property
    def current_step(self) -> int:
        """The step being trained now (0-based; advanced by ``step()``)."""
        return self._step

    @property
    def optimizer_steps(self) -> int:
        """Real optimizer steps seen since ``start()`` (updates the optimizer ran; a step
        that a gradient scaler skipped for overflow is not one)."""
        return self._optimizer_steps

    @property
    def busy_seconds(self) -> float:
        """Wall time spent so far in the monitor's own code on the training path (hooks,
        the optimizer-step hooks, ``step()``): its direct cost, logged by ``stop()``."""
        return self.errors.busy

    @property
    def rank_dir(self) -> Optional[str]:
        if self.rank is None:
            return None
        return os.path.join(self.config.output_dir, f"rank_{self.rank}")

    # --------------------------------------------------------------------- start
    def start(self, model: Any = None, optimizer: Any = None, *, first_step: int = 0, **context: Any) -> None:
        """Install the enabled monitors on ``model`` (a module, or a list of model
        chunks) and ``optimizer``. ``context`` (e.g. ``grad_acc_steps``) reaches every
        monitor. ``first_step``: the number of the first step monitored (a run resumed
        at step N starts at N, so that steps keep the training framework's numbers)."""
        if self._state != "new":
            raise MonitorStateError(f"start() was already called (monitor is {self._state}); create a new TrainerMonitorV2")
        if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
            raise ConfigError(f"start(): first_step must be an integer >= 0, got {first_step!r}", field="first_step")
        backend = load_backend(self.config.framework)
        self.rank = backend.global_rank()
        if self.config.ranks is not None and self.rank not in self.config.ranks:
            self._state = "idle"
            logger.info("monitor_v2: rank %d is not in 'rank' %s; nothing is monitored here", self.rank, list(self.config.ranks))
            return

        enabled = self.config.enabled_monitors
        if any(s.name == rows.MOE for s in enabled) and rows.MOE not in backend.MONITORS:
            # an MoE model trains as well without it: said once, the other monitors run
            logger.warning("monitor_v2: monitor 'moe' is not available for framework '%s' in this version (its "
                           "routers are not observed; the other monitors run)", self.config.framework)
            enabled = [s for s in enabled if s.name != rows.MOE]
        on_anomaly = self.config.alert.on_anomaly if self.config.alert is not None else None
        escalated = [s for s in on_anomaly.monitors.values() if s.enabled] if on_anomaly is not None else []
        for settings in enabled + escalated:
            if settings.name not in backend.MONITORS:
                raise ConfigError(
                    f"monitor_v2: monitor '{settings.name}' is not available for framework "
                    f"'{self.config.framework}' in this version (available: {', '.join(backend.MONITORS)})",
                    field=f"monitors.{settings.name}",
                )
            if backend.MONITORS[settings.name].needs_optimizer and optimizer is None:
                raise ConfigError(
                    f"start(): monitor '{settings.name}' needs the optimizer: call start(model=..., optimizer=...)",
                    field="optimizer",
                )
        session: Session = backend.Session(model, optimizer, context, self.rank_dir)
        self.monitors = [backend.MONITORS[s.name](s, session, self.errors) for s in enabled]

        outputs = _outputs(self.monitors)
        self._alerter = make_alerter(self.config.alert, self.rank, self.rank_dir)
        writer = CsvWriter(
            self.rank_dir,
            self.schedule,
            outputs,
            self._alerter,
        )
        writer.sinks = make_sink_hub(self.config.sinks, self.rank, self.config.output_dir,
                                     {o.name: o.ops for o in outputs})
        if self.config.async_write is None:  # the default: on the writer thread, step() waits up to STALL_S
            self._writer = AsyncCsvWriter(writer, wait_s=STALL_S)
        else:  # true: never waits; false: on the training thread, as long as the file system takes
            self._writer = AsyncCsvWriter(writer) if self.config.async_write else writer
        self._session = session

        attached: List[Monitor] = []
        try:
            if self.config.structure:
                self._write_structure(session)
            self._write_layout(session, writer)
            for m in self.monitors:
                attached.append(m)  # before attach(): a failing attach may have installed part
                m.attach()
            patch = self.config.patch_optimizer_step
            self._patched = optimizer is not None and (patch is None or patch)
            self._guard = self._make_guard(backend, session)
            self._step_hooks = session.install_step_hooks(
                self._then_check_gradients(self.errors.wrap("optimizer pre-step hook", self._before_optimizer_step)),
                self.errors.wrap("optimizer post-step hook", self._after_optimizer_step),
            )
        except BaseException:
            if self._guard is not None:
                self._guard.detach()
            for m in reversed(attached):
                try:
                    m.detach()
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    pass
            try:
                _close_session(session)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            self._writer.close()
            raise
        self._state = "running"
        self._pid = os.getpid()
        _RUNNING.add(self)
        self._start_incident(backend, optimizer, first_step)
        self._begin_step(first_step)

    def _write_structure(self, session: Session) -> None:
        """``rank_<r>/structure.txt`` (``"structure": true``): the names ``targets`` and rows use."""
        module = self.config.monitors.get(rows.MODULE)
        enabled = module is not None and module.enabled
        structure = session.structure()
        for m in self.monitors:  # moe: the routers it found (the name rule's are checked at their first call)
            notes = m.structure_notes() if hasattr(m, "structure_notes") else {}
            for entry in structure.modules:
                if entry.name in notes:
                    entry.router = notes[entry.name]
        path = write_structure(self.rank_dir, structure, module.get("targets") if enabled else (), enabled)
        from .analysis.command import command_line  # light: no Polars on the training side

        logger.info("monitor_v2: model structure (module and parameter names) written to %s; "
                    "%s counts what a targets list selects", path, command_line("struct", self.config.output_dir))

    def _write_layout(self, session: Session, writer: CsvWriter) -> None:
        """``rank_<r>/layout.json``: where this rank sits in the parallel layout, what
        ``msprobe-monitor merge`` combines the ranks' rows with. Read now (the layout as
        ``start()`` found it), written next to the first CSV file. A stack the monitor
        cannot read is said once and costs neither the training nor the rows."""
        try:
            doc = session.layout()
        except Exception as exc:  # noqa: BLE001 - a layout we cannot read must not stop training
            logger.warning("monitor_v2: the parallel layout of this rank could not be read (%r); layout.json is "
                           "not written and 'msprobe-monitor merge' cannot combine this rank's rows", exc)
            return
        try:
            doc[DTYPES] = _param_dtypes(session)
        except Exception as exc:  # noqa: BLE001 - the layout is written without them
            logger.warning("monitor_v2: the parameters' dtypes could not be read (%r); layout.json has no "
                           "\"dtypes\" for them", exc)
            doc[DTYPES] = {}
        self._layout_doc = doc
        self._layout_writer = writer
        # rendered now, at start(): the first written step only writes the file; a later
        # version (module rows' dtypes) replaces the text, then the file (_note_dtypes)
        self._layout_text = render(doc)
        writer.before_first_file = self._write_layout_text

    def _write_layout_text(self) -> None:
        # the moe routers are known once their first call showed their outputs: the first
        # written step's, which has run when its rows are written
        routers = {k: v for m in self.monitors if m.name == rows.MOE for k, v in m.layout().items()}
        doc = self._layout_doc
        if routers and doc is not None:
            before = json.dumps(doc.get("moe"), sort_keys=True)
            for router, fields in routers.items():
                moe_entry(doc, router).update(fields)  # beside what the stack's layout set (EP)
            if json.dumps(doc.get("moe"), sort_keys=True) != before:
                self._layout_text = render(doc)
        write_layout(self.rank_dir, self._layout_text)

    def _note_dtypes(self) -> None:
        """The dtypes of rows the monitors noted since the last look (the module rows', on
        the first written step) into ``layout.json``: written again, after the rows of
        the step, in the writer's order."""
        doc = self._layout_doc
        if doc is None:
            return
        known = doc[DTYPES]
        new = {}
        for m in self.monitors:
            noted = getattr(m, "row_dtypes", None)
            if noted and len(noted) != self._dtypes_seen.get(m.name, 0):
                self._dtypes_seen[m.name] = len(noted)
                new.update((name, dtype) for name, dtype in list(noted.items()) if name not in known)
        if not new:
            return
        known.update(new)
        self._layout_text = render(doc)
        if self._layout_writer.before_first_file is None:  # written already: again
            self._writer.call_in_order(self._rewrite_layout)

    def _rewrite_layout(self) -> None:
        try:
            self._write_layout_text()
        except (OSError, OutputError) as exc:
            self._once.warning("layout-again", "monitor_v2: %s; the CSV files are written as usual. Logged once.",
                               exc)

    # ------------------------------------------ alert.dump / stop_on_nonfinite
    def _make_guard(self, backend: Any, session: Session) -> Any:
        alert = self.config.alert
        if alert is None or not alert.checks_gradients or session.optimizer is None:
            return None
        guard_class = getattr(backend, "GradientGuard", None)
        if guard_class is None:
            logger.warning("monitor_v2: alert.dump and alert.stop_on_nonfinite are not available for framework "
                           "'%s' in this version; anomalies.jsonl is still written", self.config.framework)
            return None
        guard = guard_class(session, alert, self.rank, self.rank_dir, self.errors)
        guard.attach()
        return guard

    def _then_check_gradients(self, before: Any) -> Any:
        """The pre-step hook, then (only with a guard) the gradient check, which alone may
        raise into the training code: ``NonFiniteGradientError`` stops the update."""
        if self._guard is None:
            return before

        def hook() -> None:
            before()
            if self._state != "running":
                return
            start = time.perf_counter()
            try:
                self._guard.check(self._step)
            except NonFiniteGradientError:
                try:  # the step ends here, without its update: its rows so far are written
                    self._advance()
                except Exception as exc:  # noqa: BLE001
                    self.errors.report("ending the step stopped by alert.stop_on_nonfinite", exc)
                raise
            except Exception as exc:  # noqa: BLE001
                self.errors.report("alert.dump gradient check", exc)
            finally:
                self.errors.busy += time.perf_counter() - start

        return hook

    # ---------------------------------------------------------------- step logic
    def _begin_step(self, step: int) -> None:
        self._step = step
        written = self.schedule.is_written(step)
        timed = self._timed  # monitors on for a number of steps are written on each of them
        self._active = written or bool(timed)
        if self._active:
            self._observe_added()
        idle = 0 if written else self._steps_not_written(step)
        for m in self.monitors:
            m.idle_ahead = 0 if m.name in timed else idle
            m.begin_step(step, written or m.name in timed)

    def _observe_added(self) -> None:
        """Parameters and modules added after ``start()`` (a param group, a layer), found by
        the session at the beginning of a written step and observed from it on: a check of
        a few sizes and a flag while nothing changed (``find_added``). A back end whose
        session does not look has none."""
        find = getattr(self._session, "find_added", None)
        if find is None:
            return
        try:
            added = find()
        except Exception as exc:  # noqa: BLE001 - the monitor never breaks training
            self.errors.report("finding parameters and modules added after start()", exc)
            return
        if not added:
            return
        for m in self.monitors:
            try:
                m.on_added(added)
            except Exception as exc:  # noqa: BLE001
                self.errors.report(f"{m.name} observing parameters and modules added after start()", exc)

    def _steps_not_written(self, step: int, horizon: int = 8) -> int:
        """How many steps from ``step`` on the schedule does not write (at most ``horizon``):
        what a monitor weighs when taking hooks off costs more than it saves for one step."""
        n = 0
        while n < horizon and not self.schedule.is_written(step + n):
            n += 1
        return n

    def _in_child(self) -> None:
        """After ``os.fork()``, in the child: record nothing, write nothing."""
        if self._state not in ("running", "stopping"):
            return
        self._state = "forked"
        for m in self.monitors:
            m.active = False
        if self._writer is not None:
            self._writer.abandon_in_child()

    def _say_forked(self) -> None:
        self._once.warning(
            "forked",
            "monitor_v2: process %d, forked from the training process %d while the monitor was running, trains: "
            "the monitor records and writes nothing here (%s belongs to the parent process, whose rows and "
            "counts are unchanged). Start a monitor of its own in the child to observe it. Logged once.",
            os.getpid(), self._pid, self.rank_dir)

    def _before_optimizer_step(self) -> None:
        if self._state != "running":
            if self._state == "forked":
                self._say_forked()
            return
        for m in self.monitors:
            try:
                m.before_optimizer_step()
            except Exception as exc:  # noqa: BLE001
                self.errors.report(f"{m.name} before optimizer.step()", exc)

    def _after_optimizer_step(self) -> None:
        if self._state != "running":
            return
        self._optimizer_steps += 1
        for m in self.monitors:
            try:
                m.after_optimizer_step()
            except Exception as exc:  # noqa: BLE001
                self.errors.report(f"{m.name} after optimizer.step()", exc)
        if self._patched:
            self._advance()

    def step(self) -> None:
        """End the current training step: write what was collected and advance.

        Ignored (with a one-time warning) while ``optimizer.step()`` is patched to do it."""
        if self._state != "running":
            if self._state == "forked":
                self._say_forked()
            return
        if self._patched:
            self._once.warning(
                "manual-step",
                "monitor_v2: step() called by hand while optimizer.step() is patched to call it; "
                "the manual call is ignored. Set \"patch_optimizer_step\": false to step by hand. "
                "Logged once."
            )
            return
        start = time.perf_counter()
        self._advance()
        self.errors.busy += time.perf_counter() - start

    def log_scalars(self, step: int, values: Optional[Mapping[str, Any]] = None, /, **named: Any) -> None:
        """Write training scalars (the loss, the global gradient norm) as rows of step
        ``step``: ``rank_<r>/scalars_step<a>-<b>.csv``, one row per name, scope ``scalars``,
        min = max = mean = the value, norm = its absolute value, nans = 1 for a NaN.

        ``mon.log_scalars(step, loss=loss, grad_norm=norm)`` or
        ``mon.log_scalars(step, {"loss": loss})``. ``step`` is the monitor's step number (the
        CSV's ``step`` column; ``start(first_step=N)`` makes it the framework's): the step
        being trained (``current_step``), whose rows are written when it ends, or the step
        that has just ended (``current_step - 1``: the loss logged after a patched
        ``optimizer.step()`` ended it), whose rows are written with the next step's, or by
        ``stop()``. The rows follow the schedule: a step that is not written writes none.
        Another step is a mismatch of the two counters: said once at WARNING, the values
        dropped (never an error in the training loop).

        A value is a real number or a one-element tensor of the framework (any dtype,
        read in at least fp32; on an accelerator it is not read now, but with the step's
        other statistics: no synchronisation here). A name logged twice in one step makes
        one row, merged as every row is (min, max, mean of the values; norm the root of
        their squares). A name that is not a non-empty string of printable characters, a
        value of another kind or a step that is not an integer raise ``ScalarError`` at
        once: the call is wrong on every step."""
        items = _scalar_items(step, values, named)
        state = self._state
        if state == "new":
            raise MonitorStateError("log_scalars() before start(): call mon.start(...) first")
        if state != "running":
            if state == "forked":
                self._say_forked()
            return  # a rank not monitored, or a stopped monitor: nothing to write
        step = operator.index(step)
        start = time.perf_counter()
        try:
            if step == self._step:
                active = self._active
            elif self._ended is not None and step == self._ended[0]:
                active = self._ended[1]
            else:
                self._once.warning(
                    "scalars-step",
                    "monitor_v2: log_scalars(%d, ...) names neither the step being trained (%d) nor the one that "
                    "ended last (%s): the values are dropped. The step is the monitor's step number, as in the "
                    "CSV files: start(first_step=N) makes it the framework's global step. Logged once.",
                    step, self._step, "none" if self._ended is None else self._ended[0])
                return
            if active:
                self._scalars.setdefault(step, []).extend(self._scalar_records(items))
        except Exception as exc:  # noqa: BLE001 - the monitor never breaks training
            self.errors.report("log_scalars", exc)
        finally:
            self.errors.busy += time.perf_counter() - start

    def _scalar_records(self, items: List[Tuple[str, Any]]) -> List[Record]:
        """One record per scalar: host values for numbers, the engine's record (kept on
        the device until the step's transfer) for tensors."""
        make = record_type()
        out: List[Record] = []
        for name, value in items:
            if isinstance(value, float):
                nans = 1 if math.isnan(value) else 0
                out.append(make(0, name, rows.SCALARS, None, [value, value, value, abs(value)], nans, 1, None))
            else:
                out.append(self._session.engine.record(value, _SCALAR_PLAN, 0, name, rows.SCALARS))
        return out

    def _write_late_scalars(self, before: Optional[int]) -> None:
        """Write the scalars logged for steps that had ended (all, or those before ``before``)
        in their own step's rows."""
        if not self._scalars:
            return
        for step in sorted(self._scalars):
            if before is not None and step >= before:
                continue
            records = self._scalars.pop(step)
            try:
                ready = self._session.engine.to_host(records)
                if ready is None:
                    self._writer.write_step(step, {rows.SCALARS: records})
                else:
                    self._writer.write_step(step, {rows.SCALARS: records}, ready)
            except Exception as exc:  # noqa: BLE001
                self.errors.report("writing scalars", exc)
                self._writer.report_lost(step, exc, count_rows({rows.SCALARS: records}))

    def _advance(self) -> None:
        step = self._step
        self._write_late_scalars(step)
        records: Dict[str, list] = {}
        for m in self.monitors:
            try:
                recs = m.collect()
            except Exception as exc:  # noqa: BLE001
                self.errors.report(f"{m.name} collect", exc)
                continue
            if recs:
                records[m.name] = recs
        sidecars: Dict[str, list] = {}
        for m in self.monitors:
            side = getattr(m, "sidecar", None)  # moe's raw counts (its copies are issued there)
            if side is not None and self._active:
                try:
                    got = side()
                except Exception as exc:  # noqa: BLE001
                    self.errors.report(f"{m.name} sidecar", exc)
                    continue
                if got:
                    sidecars[rows.MOE_COUNTS] = got
        scalars = self._scalars.pop(step, None)
        if scalars:
            records[rows.SCALARS] = scalars
        if self._active and records:
            try:
                # device values are only being copied: the writer waits for them (ready) when
                # it formats the rows, on its own thread with async_write
                ready = self._session.engine.to_host([r for recs in records.values() for r in recs])
                records.update(sidecars)
                if ready is None:
                    self._writer.write_step(step, records)
                else:
                    self._writer.write_step(step, records, ready)
                self._steps_with_rows += 1
            except Exception as exc:  # noqa: BLE001
                self.errors.report("writing step results", exc)
                self._writer.report_lost(step, exc, count_rows(records))
        self._session.engine.forget()
        if self._active:
            try:
                self._note_dtypes()
            except Exception as exc:  # noqa: BLE001
                self.errors.report("recording dtypes in layout.json", exc)
        self._ended = (step, self._active)
        self._written_steps += self._active
        if self._watch is not None or self._escalation_armed or self._next_change is not None:
            self._between_steps(step + 1, self._active)
        self._begin_step(step + 1)

    # ------------------------------------------------- incident mode (dynamic.py)
    def _init_incident(self, config_path: Any, fr: Optional[str]) -> None:
        """``dynamic``, per-monitor ``steps`` and ``alert.on_anomaly``: what each step
        boundary checks. All None/False/empty when none is configured: no cost then."""
        self._fr = fr
        self._alerter: Any = None
        self._watch: Optional[ConfigWatch] = None
        self._raw_monitors: Any = config_path.get("monitors") if isinstance(config_path, Mapping) else None
        if self.config.dynamic:
            if isinstance(config_path, Mapping):
                raise ConfigError("monitor_v2 config: field 'dynamic' is true, but the config was given as a dict: "
                                  "\"dynamic\" watches the config file, so pass its path to TrainerMonitorV2",
                                  field="dynamic")
            self._watch = ConfigWatch(os.fspath(config_path), fr)
            self._raw_monitors = self._watch.raw.get("monitors")
        self._escalation_armed = False
        self._escalated = False  # on_anomaly fires once per run
        self._next_change: Optional[int] = None
        self._timed: Set[str] = set()
        self._plan: Optional[MonitorPlan] = None
        self._backend: Any = None
        self._optimizer: Any = None
        self._agree = True  # False: ranks decide alone ('rank' leaves ranks out of the collective)

    def _start_incident(self, backend: Any, optimizer: Any, first_step: int) -> None:
        self._backend = backend
        self._optimizer = optimizer
        self._plan = MonitorPlan(self.config.enabled_monitors, first_step, self._raw_monitors)
        self._escalation_armed = self._on_anomaly() is not None
        wanted = self._plan.wanted(first_step)
        self._timed = timed_names(wanted)
        self._next_change = self._plan.next_change(first_step)
        if self.config.ranks is not None and (self._watch is not None or self._escalation_armed):
            self._agree = False
            logger.warning("monitor_v2: with 'rank' set, the ranks it leaves out take no part in a collective, so "
                           "the monitored ranks do not agree on a step: each applies a config edit or an escalation "
                           "at the step it sees it, which may differ between ranks")

    def _on_anomaly(self) -> Any:
        alert = self.config.alert
        return alert.on_anomaly if alert is not None else None

    def _between_steps(self, next_step: int, written: bool) -> None:
        """At the boundary before ``next_step``: agree with the other ranks on a config
        edit and an anomaly (one small all-reduce), then apply what changed."""
        try:
            changed = self._watch is not None and self._watch.changed()
            anomaly = (self._escalation_armed and self._alerter is not None
                       and self._alerter.first_anomaly is not None)
            flags = [int(changed), int(anomaly)]
            # every rank calls the collective on the same steps: each one with dynamic on,
            # each written one while an escalation is armed (written steps agree everywhere)
            if self._agree and (self._watch is not None or (self._escalation_armed and written)):
                flags = self._session.agree_max(flags)
            elif self._agree:
                # seen between written steps (the async writer's thread): acted on at the next
                # written step, with the other ranks, never by this rank alone
                flags[1] = 0
            replan = self._next_change is not None and next_step >= self._next_change
            if flags[0] and self._watch is not None:
                replan = self._reload(next_step) or replan
            if flags[1] and self._escalation_armed:
                self._escalate(next_step)
                replan = True
            if replan:
                self._apply_plan(next_step)
        except Exception as exc:  # noqa: BLE001 - the monitor never breaks training
            self.errors.report("applying a config edit or an escalation", exc)

    def _check_edit(self, config: MonitorConfig) -> None:
        """What start() checks beyond load_config, for an edited config."""
        on_anomaly = config.alert.on_anomaly if config.alert is not None else None
        escalated = [s for s in on_anomaly.monitors.values() if s.enabled] if on_anomaly is not None else []
        for settings in config.enabled_monitors + escalated:
            if settings.name not in self._backend.MONITORS:
                raise ConfigError(f"monitor_v2: monitor '{settings.name}' is not available for framework "
                                  f"'{self.config.framework}' in this version", field=f"monitors.{settings.name}")
            if self._backend.MONITORS[settings.name].needs_optimizer and self._optimizer is None:
                raise ConfigError(f"monitor_v2: monitor '{settings.name}' needs the optimizer, which start() "
                                  f"was not given", field=f"monitors.{settings.name}")

    def _reload(self, next_step: int) -> bool:
        """Read the edited config; True when it applies (from ``next_step``)."""
        assert self._watch is not None and self._plan is not None
        new = self._watch.read(self._check_edit)
        if new is None:
            return False
        old = self.config
        restart = restart_fields(old, new)
        if restart:
            logger.warning("monitor_v2: the edit of %s changes %s, which only a restart applies; the rest of the "
                           "edit applies from step %d", self._watch.path, ", ".join(restart), next_step)
        alert = old.alert
        if old.alert is not None and new.alert is not None:
            alert = new.alert
            if self._alerter is not None:
                self._alerter.settings = new.alert  # thresholds; the norms' history stays
        self.config = replace(old, monitors=new.monitors, schedule=new.schedule, alert=alert, dynamic=new.dynamic)
        if self.schedule != new.schedule:
            logger.warning("monitor_v2: rank %s: schedule from step %d: %s", self.rank, next_step, schedule_text(new))
        self.schedule = new.schedule
        self._raw_monitors = self._watch.raw.get("monitors")
        self._plan.replace_base(new.enabled_monitors, next_step, self._raw_monitors)
        self._escalation_armed = not self._escalated and self._on_anomaly() is not None
        if not new.dynamic:
            logger.warning("monitor_v2: the edit of %s sets \"dynamic\" to false: later edits are not read "
                           "until a restart", self._watch.path)
            self._watch = None
        logger.warning("monitor_v2: rank %s: config edit applied from step %d: %s", self.rank, next_step,
                       describe_planned(self._plan.wanted(next_step)))
        return True

    def _escalate(self, next_step: int) -> None:
        """``alert.on_anomaly``: its monitors on for its steps from ``next_step``, once per run."""
        assert self._plan is not None and self._session is not None
        self._escalation_armed = False
        self._escalated = True
        on = self._on_anomaly()
        if on is None:
            return
        anomaly = self._alerter.first_anomaly if self._alerter is not None else None
        monitors = [s for s in on.monitors.values() if s.enabled]
        target = None
        if on.auto_targets and rows.MODULE in on.monitors:
            roots = [t for _, t, m in self._module_tags() if any(m is r for r in self._session.roots)]
            # an anomaly that every row of its phase shares names no layer: watch every module
            mine = (auto_target(anomaly.monitor, anomaly.row.name, roots)
                    if anomaly is not None and anomaly.localised else None)
            # the same name on every rank: the lowest rank that saw an anomaly decides
            names = self._session.gather(mine) if self._agree else [mine]
            target = next((n for n in names if n is not None), None)
            monitors = [replace(s, options={**s.options, "targets": (target,) if target else ()})
                        if s.name == rows.MODULE else s for s in monitors]
        self._plan.escalate(monitors, next_step, on.steps)
        why = (f"the first {anomaly.kind} value of the run at step {anomaly.step} in {anomaly.monitor} "
               f"{anomaly.row.name}" if anomaly is not None else "an anomaly seen on another rank")
        narrowed = ""
        if on.auto_targets:
            if target:
                narrowed = f"; module targets \"auto\": {target!r}, the module of the offending tensor"
            elif anomaly is not None and not anomaly.localised:
                narrowed = (f"; module targets \"auto\": every module (every {anomaly.monitor} "
                            f"{anomaly.row.scope} row went non-finite at once: none of them names the layer)")
            else:
                narrowed = "; module targets \"auto\": every module (the offending tensor belongs to no narrower one)"
        logger.warning("monitor_v2: rank %s: alert.on_anomaly turns on %s, then back to the running config, "
                       "because of %s%s", self.rank,
                       describe_planned({s.name: self._plan.escalation[s.name] for s in monitors}), why, narrowed)

    def _module_tags(self) -> List[Any]:
        return module_tags(self._session.named_modules(), self._session.table.qualify)

    def _apply_plan(self, step: int) -> None:
        """Stop, start or restart monitors so that the running ones are the plan's at ``step``."""
        assert self._plan is not None
        wanted = self._plan.wanted(step)
        running = {m.name: m for m in self.monitors}
        kept: Dict[str, Monitor] = {}
        for name, m in running.items():
            planned = wanted.get(name)
            if planned is not None and same_monitor(planned.settings, m.settings):
                kept[name] = m
                continue
            try:
                m.detach()
            except Exception as exc:  # noqa: BLE001
                self.errors.report(f"{name} detach", exc)
        monitors: List[Monitor] = []
        for name, planned in wanted.items():
            m = kept.get(name)
            if m is None:
                m = self._attach_monitor(planned.settings)
            if m is not None:
                monitors.append(m)
        self.monitors = monitors
        self._timed = timed_names(wanted)
        self._next_change = self._plan.next_change(step)
        outputs = _outputs(monitors)
        self._writer.update_outputs(step, outputs, self.schedule)

    def _attach_monitor(self, settings: Any) -> Optional[Monitor]:
        """A monitor built and attached mid-run as start() does; None (error contained) if that fails."""
        try:
            m = self._backend.MONITORS[settings.name](settings, self._session, self.errors)
        except Exception as exc:  # noqa: BLE001
            self.errors.report(f"{settings.name} attach", exc)
            return None
        try:
            m.attach()
        except Exception as exc:  # noqa: BLE001
            self.errors.report(f"{settings.name} attach", exc)
            try:
                m.detach()  # a failing attach may have installed part
            except Exception:  # noqa: BLE001 - the attach error is the one reported
                pass
            return None
        return m

    # ---------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Remove every hook and wrapper, flush and close the output. Idempotent.

        Unless ``async_write`` is false, the rows are written on the writer's thread and
        ``stop()`` waits for those not written yet, for a bounded time
        (``MSPROBE_MONITOR_EXIT_WAIT``, see ``writer.AsyncCsvWriter``); a Ctrl-C while it
        waits raises here after a warning, and calling ``stop()`` again goes on with the
        drain (and the exit handler drains too). In a forked child it only removes the hooks."""
        if self._state in ("new", "stopped"):
            return
        state = self._state
        if state == "idle":
            self._state = "stopped"
            return
        if state == "running":
            self._write_late_scalars(self._step)  # logged for the last step after it ended
        if state in ("running", "forked"):
            # a stop() in a finally block or an exception handler: the training did not end
            self._stopped_during = sys.exc_info()[1]
            self._state = "stopping" if state == "running" else "stopped"
            self._step_hooks.remove()
            if self._guard is not None:
                self._guard.detach()
            for m in reversed(self.monitors):
                try:
                    m.detach()
                except Exception as exc:  # noqa: BLE001
                    self.errors.report(f"{m.name} detach", exc)
            try:
                _close_session(self._session)
            except Exception as exc:  # noqa: BLE001
                self.errors.report("session close", exc)
            _RUNNING.discard(self)
            if state == "forked":
                return
        # "stopping": hooks are gone; an earlier stop() may have been interrupted in the drain
        if self._guard is not None:
            self._guard.close()  # the dump's files
        try:
            self._writer.close()  # logs what was lost; never raises for output problems
        except Exception as exc:  # noqa: BLE001 - stop() must not mask the training's own error
            logger.warning("monitor_v2: closing the output failed: %r", exc)
        self._state = "stopped"
        self._session = None
        problem = self._why_nothing_was_written()
        if problem:
            logger.warning("monitor_v2: rank %d wrote no rows: %s", self.rank, problem)
        if self._step:  # steps count from 0 and advance by one: _step steps have ended
            self._announce_end(bool(problem))

    def _announce_end(self, warned: bool) -> None:
        """The end-of-run line: what reached the disk (steps that produced rows, and
        rows), never the schedule's count; the command to read it only when there is
        something to read."""
        lost = len(self._writer.lost_steps)
        # steps lost whole are never among the written ones; a step written in part (some
        # monitors' files got its rows) is, and is said as such (docs/long-runs.md)
        partly = len(self._writer.partly_lost_steps)
        steps = len(self._writer.written_steps - self._writer.lost_steps)
        rows = self._writer.written_rows
        head = f"monitor_v2: rank {self.rank} stopped after {self._step} steps"
        if not rows:
            _announce(f"{head}; wrote no rows to {self.rank_dir}"
                      + (f" ({lost} step(s) lost)" if lost else "")
                      + (": see the warning above" if warned or lost else ""))
            return
        from .analysis.command import command_line  # light: no Polars on the training side

        losses = ", ".join(([f"{lost} step(s) lost"] if lost else [])
                           + ([f"{partly} written in part"] if partly else []))
        _announce(
            f"{head}; wrote {rows} rows of {steps} step(s)"
            + (f" ({losses}: see the warning above)" if losses else "")
            + f" to {self.rank_dir}; its own code took {self.errors.busy:.3f} s on the training path "
            f"({1e3 * self.errors.busy / max(1, steps):.1f} ms per written step). "
            f"Read them: {command_line('summary', self.config.output_dir)}")

    def _why_nothing_was_written(self) -> Optional[str]:
        """The likely cause when a monitored rank ran but wrote nothing (None otherwise)."""
        if self._steps_with_rows or not self.monitors:  # no monitor: warned at construction
            return None
        if self.errors.count:
            return f"the monitor contained {self.errors.count} error(s) (logged above)."
        sched = self.schedule
        if self._step == 0:
            crash = self._stopped_during
            if crash is not None:
                return (f"training stopped before its first step ended: stop() ran while an exception was raised "
                        f"({short_error(crash)}), so no step was complete and none was written.")
            if self._optimizer_steps and not self._patched:
                return (f"optimizer.step() ran {self._optimizer_steps} time(s) but mon.step() was never called, so "
                        f"no step ended. With \"patch_optimizer_step\": false, call mon.step() after each "
                        f"optimizer.step(), or drop that field so that optimizer.step() ends the step by itself.")
            if not self._optimizer_steps:
                if self.errors.busy > 0:  # its hooks ran: a forward or backward pass of step 0 began
                    return ("training stopped before its first step ended: the monitor's hooks ran (a forward or "
                            "backward pass began), but neither mon.step() nor a patched optimizer.step() ended "
                            "a step (pass the optimizer to start(), or call mon.step() once per training step).")
                return ("no step ended: neither mon.step() nor a patched optimizer.step() was called "
                        "(pass the optimizer to start(), or call mon.step() once per training step).")
        if self._written_steps == 0:
            return (f"{self._step} step(s) ended (0..{self._step - 1}) and none was in the collection window "
                    f"(start_step {sched.start_step}, step_interval {sched.step_interval}"
                    + (f", stop_step {sched.stop_step}" if sched.stop_step is not None else "")
                    + f"); the first step written would be step {sched.start_step}.")
        return (f"{self._written_steps} step(s) were in the collection window but the monitors "
                f"({', '.join(m.name for m in self.monitors)}) reported nothing: e.g. 'targets' that match "
                f"no module, an optimizer that holds none of the model's parameters, or no backward pass.")


# The statistics every scalar row has: the default ops (the file's header is fixed).
_SCALAR_PLAN = StatPlan.from_ops(rows.DEFAULT_OPS)


def _param_dtypes(session: Session) -> Dict[str, str]:
    """Each parameter's dtype under the name its rows carry (the model's and the
    optimizer's parameters), for ``layout.json``."""
    table = session.table
    found: Dict[str, str] = {}
    for info in list(table.model_params()) + list(table.optimizer_params()):
        if info.name not in found:
            found[info.name] = dtype_name(info.param.dtype)
    return found


def _scalar_items(step: Any, values: Optional[Mapping[str, Any]], named: Mapping[str, Any]) -> List[Tuple[str, Any]]:
    """``log_scalars``' arguments checked: ``(name, value)`` pairs, each value a Python
    float or a one-element tensor; ``ScalarError`` naming what is wrong."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise ScalarError(f"log_scalars(): step must be an integer (the monitor's step number), got {step!r}")
    if values is not None and not isinstance(values, Mapping):
        raise ScalarError(f"log_scalars(): the second argument must be a mapping {{name: value}}, got "
                          f"{type(values).__name__}; or pass the scalars by keyword: log_scalars(step, loss=...)")
    items = list(values.items()) if values is not None else []
    if values is not None:
        twice = sorted(set(values) & set(named), key=str)
        if twice:
            raise ScalarError(f"log_scalars(): {', '.join(map(repr, twice))} given both in the mapping and by "
                              f"keyword", name=str(twice[0]))
    items.extend(named.items())
    if not items:
        raise ScalarError("log_scalars(): no scalar given; pass them by keyword, e.g. log_scalars(step, loss=loss)")
    return [(_scalar_name(name), _scalar_value(name, value)) for name, value in items]


def _scalar_name(name: Any) -> str:
    if not isinstance(name, str) or not name or not name.isprintable():
        raise ScalarError(f"log_scalars(): scalar name {name!r} is not allowed: a name is a non-empty string of "
                          f"printable characters (no line breaks), e.g. 'loss' or 'grad_norm'",
                          name=name if isinstance(name, str) else None)
    return name


def _scalar_value(name: str, value: Any) -> Any:
    """A float for a number (NumPy's included), the tensor itself for a one-element tensor."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if type(value).__module__ == "numpy" and getattr(value, "size", None) == 1 \
            and getattr(getattr(value, "dtype", None), "kind", "") in "fiu":
        return float(value.reshape(-1)[0])
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype") and not isinstance(value, (str, bytes)):
        numel = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
        if numel == 1 and "complex" not in str(value.dtype).lower() and "bool" not in str(value.dtype).lower():
            return value
        raise ScalarError(f"log_scalars(): scalar {name!r}: a tensor of shape {tuple(shape)} and dtype "
                          f"{value.dtype}; a scalar is a real number or a one-element tensor of a real dtype "
                          f"(log a reduction of it, e.g. its mean)", name=name)
    raise ScalarError(f"log_scalars(): scalar {name!r}: value {value!r} of type {type(value).__name__}; a scalar "
                      f"is a real number or a one-element tensor (a Python float or int, a NumPy scalar, a "
                      f"0-d torch or MindSpore tensor)", name=name)


def _close_session(session: Any) -> None:
    """What the session itself installed (PyTorch's watch for parameters and modules added
    after ``start()``); a back end whose session installs nothing has no ``close``."""
    close = getattr(session, "close", None)
    if close is not None:
        close()


def _announce(message: str) -> None:
    """The one end-of-run line. Through logging (INFO) once the program has configured
    logging; otherwise on stderr, where Python's default setup (no handlers: warnings
    only) would hide an INFO record."""
    if logger.hasHandlers():
        logger.info(message)
    else:
        print(message, file=sys.stderr, flush=True)


# Monitors running in this process, told when it forks (a weak set: never kept alive here).
_RUNNING: "weakref.WeakSet[TrainerMonitorV2]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for mon in list(_RUNNING):
        mon._in_child()
    _RUNNING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _outputs(monitors: List[Monitor]) -> List[MonitorOutput]:
    """The files the monitors write: one per monitor, the scalars file (``log_scalars``), and
    moe's raw counts with ``per_expert``."""
    outputs = [MonitorOutput(m.name, m.settings.ops, m.name in rows.MICRO_STEP_MONITORS) for m in monitors]
    outputs.append(MonitorOutput(rows.SCALARS, rows.DEFAULT_OPS, False))
    if any(m.name == rows.MOE and m.settings.options.get("per_expert") for m in monitors):
        outputs.append(SidecarOutput(rows.MOE_COUNTS, rows.MOE_COUNTS_HEADER))
    return outputs
