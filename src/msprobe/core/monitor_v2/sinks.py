"""Live sinks (the ``sinks`` config section): a bounded set of aggregates of each written
step sent to TensorBoard, Weights & Biases, MLflow and SwanLab.

The numbers are the rows the CSV writer gets (the same host-side statistics: no device
work, no synchronisation of their own). ``SinkHub.send`` only puts the step's merged rows
on a bounded queue; one background thread turns them into metrics and calls the
libraries, whose calls block (MLflow writes a database row per call, TensorBoard's queue
blocks when full). A full queue drops that step for the dashboards, never makes the
training wait; the CSV files keep every row. A sink that fails (its ``init`` or a ``log``)
is logged once at WARNING and turned off for the rest of the run; the others go on.

Keys (the same tags as ``msprobe-monitor export --tensorboard``), per monitor and scope:

- ``<monitor>/<scope>/global_norm``: the square root of the summed squared norms of the
  step's rows (needs ``norm`` in ``ops``);
- ``<monitor>/<scope>/nonfinite_tensors``: rows with a NaN or Inf statistic, and
  ``<monitor>/<scope>/nans``: NaN elements summed (needs ``nans``);
- ``moe/routing/max_maxvio`` and ``moe/routing/dead_experts`` (over the routers), then per
  router ``moe/routing/<router>/maxvio``, ``.../cv`` and ``.../dead_experts`` (from its
  ``tokens_per_expert`` row: docs/moe.md);
- ``<monitor>/<scope>/<tensor>/<stat>``: every statistic of the tensors ``tensors`` selects
  (regular expressions, ``re.search`` on the name), then the norm of the ``top_k`` tensors
  with the largest norm.

Weight-gradient rows of several micro-batches of one step (``monitor_mbs_grad``) carry
``micro_<k>`` after the tensor name (``micro_<k>`` after the scope for the aggregates). At
most ``max_keys`` keys go out per step, in the order above; the first step that has more
is said once.
"""

import atexit
import logging
import math
import os
import queue
import re
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import rows as rows_mod
from .config import SinksSettings
from .errors import OutputError
from .logonce import LogOnce
from .stats import Row

logger = logging.getLogger("msprobe.monitor_v2")

QUEUE_STEPS = 64  # steps waiting for the sink thread before one is dropped
CLOSE_TIMEOUT_S = 120.0  # stop() waits this long for the dashboards to take the last steps


def tag(monitor: str, scope: str, name: str, stat: str, micro: Optional[int] = None) -> str:
    """The key of one tensor's statistic: ``weight_grad/unreduced/fc1.weight/norm``.

    The monitor comes first, so that TensorBoard folds every tag of a monitor into one
    section; within it tags sort by scope, then by tensor, so the statistics of a layer
    stand together."""
    middle = f"{name}/micro_{micro}" if micro is not None else name
    return f"{monitor}/{scope}/{middle}/{stat}"


def micro_labels(rows: Sequence[Any], name: Callable[[Any], str], scope: Callable[[Any], str],
                 micro: Callable[[Any], Optional[int]]) -> List[Optional[int]]:
    """For the rows of one step of one monitor: the micro-batch each row's tag names, or
    None. A tensor with one row in the step is tagged by its name alone; one with rows of
    several micro-batches (``monitor_mbs_grad``) gets ``micro_<k>`` on each."""
    counts: Dict[Tuple[str, str], int] = {}
    for r in rows:
        key = (name(r), scope(r))
        counts[key] = counts.get(key, 0) + 1
    return [micro(r) if counts[(name(r), scope(r))] > 1 else None for r in rows]


# ------------------------------------------------------------------ aggregates
class Aggregates:
    """Turns a step's merged rows into at most ``max_keys`` metrics."""

    def __init__(self, settings: SinksSettings, ops: Mapping[str, Sequence[str]]) -> None:
        self.settings = settings
        self.ops = {m: tuple(o) for m, o in ops.items()}
        self._patterns = [re.compile(p) for p in settings.tensors]
        self._once = LogOnce()

    def metrics(self, step: int, merged: Sequence[Tuple[str, Sequence[Row]]]) -> Dict[str, float]:
        first: Dict[str, float] = {}  # global norms and non-finite counts
        chosen: Dict[str, float] = {}
        ranked: Dict[Tuple[str, str], List[Tuple[float, str, float]]] = {}  # (monitor, scope) -> norms
        per_layer: Dict[str, float] = {}  # moe: MaxVio, CV and dead experts of each router
        for monitor, rows in merged:
            ops = self.ops.get(monitor, ())
            micros = micro_labels(rows, lambda r: r.name, lambda r: r.scope, lambda r: r.micro_step)
            groups: Dict[str, List[Row]] = {}
            for row, micro in zip(rows, micros):
                scope = f"{row.scope}/micro_{micro}" if micro is not None else row.scope
                groups.setdefault(scope, []).append(row)
            for scope, items in groups.items():
                prefix = f"{monitor}/{scope}"
                if "norm" in ops:
                    sumsq = math.fsum(r.stat.sumsq for r in items)
                    first[f"{prefix}/global_norm"] = math.sqrt(sumsq) if not math.isnan(sumsq) else math.nan
                first[f"{prefix}/nonfinite_tensors"] = float(sum(_nonfinite(r, ops) for r in items))
                if "nans" in ops:
                    first[f"{prefix}/nans"] = float(sum(r.stat.nans for r in items))
            if monitor == rows_mod.MOE:
                routers = _moe_keys(rows)
                if routers:
                    first[f"{monitor}/{rows_mod.ROUTING}/max_maxvio"] = max(v[0] for v in routers.values())
                    first[f"{monitor}/{rows_mod.ROUTING}/dead_experts"] = sum(v[2] for v in routers.values())
                for router, (maxvio, cv, dead) in routers.items():
                    per_layer[f"{monitor}/{rows_mod.ROUTING}/{router}/maxvio"] = maxvio
                    per_layer[f"{monitor}/{rows_mod.ROUTING}/{router}/cv"] = cv
                    per_layer[f"{monitor}/{rows_mod.ROUTING}/{router}/dead_experts"] = dead
            for row, micro in zip(rows, micros):
                if self._patterns and any(p.search(row.name) for p in self._patterns):
                    for op in ops:
                        chosen[tag(monitor, row.scope, row.name, op, micro)] = float(row.stat.value(op))
                if "norm" in ops and self.settings.top_k:
                    norm = float(row.stat.value("norm"))
                    # a NaN norm ranks first: a non-finite tensor is the one to look at
                    ranked.setdefault((monitor, row.scope), []).append(
                        (math.inf if math.isnan(norm) else norm, tag(monitor, row.scope, row.name, "norm", micro),
                         norm))
        out = dict(first)
        out.update(per_layer)
        out.update(chosen)
        for items in ranked.values():
            items.sort(key=lambda item: -item[0])
            for _rank, key, norm in items[:self.settings.top_k]:
                out.setdefault(key, norm)
        cap = self.settings.max_keys
        if len(out) > cap:
            self._once.warning(
                "max-keys",
                "monitor_v2 sinks: step %d has %d keys for the dashboards, more than sinks.max_keys = %d; "
                "the first %d are sent (global norms and non-finite counts, then the tensors of "
                "sinks.tensors, then the top_k largest), the rest only to the CSV files. Raise max_keys or "
                "narrow sinks.tensors. Logged once.", step, len(out), cap, cap)
            out = dict(list(out.items())[:cap])
        return out


def _moe_keys(rows: Sequence[Row]) -> Dict[str, Tuple[float, float, float]]:
    """router -> (MaxVio, CV, dead experts) of its ``tokens_per_expert`` row (scope
    ``routing``): max/mean - 1, sqrt(max(norm^2/E - mean^2, 0))/mean with E the row's
    element count, and ``zeros``."""
    out: Dict[str, Tuple[float, float, float]] = {}
    for row in rows:
        parsed = rows_mod.moe_router_of(row.name)
        if parsed is None or parsed[1] != rows_mod.TOKENS_PER_EXPERT or row.scope != rows_mod.ROUTING:
            continue
        stat = row.stat
        mean = stat.value("mean")
        if not stat.numel or not mean > 0:
            out[parsed[0]] = (math.nan, math.nan, float(stat.zeros))
            continue
        var = max(stat.sumsq / stat.numel - mean * mean, 0.0)
        out[parsed[0]] = (stat.value("max") / mean - 1.0, math.sqrt(var) / mean, float(stat.zeros))
    return out


def _nonfinite(row: Row, ops: Sequence[str]) -> bool:
    """A NaN or Inf in one of the row's written statistics (as the CSV row shows it), read
    from the exact sums: a step has hundreds of rows and this runs on each of them."""
    st = row.stat
    if st.nans and "nans" in ops:
        return True
    if "norm" in ops and not math.isfinite(st.sumsq):
        return True
    if not st.numel:
        return False
    if ("min" in ops and not math.isfinite(st.min)) or ("max" in ops and not math.isfinite(st.max)):
        return True
    return "mean" in ops and not math.isfinite(st.total)


# ------------------------------------------------------------------ the sinks
def make_private_dir(path: str) -> None:
    """Create ``path`` and its missing parents 0750; refuse a symbolic link anywhere on it
    (shared machines: a link planted where the event files go must not redirect them)."""
    probe = os.path.abspath(path)
    missing = []
    while True:
        if os.path.islink(probe):
            raise OutputError(f"monitor_v2 sinks: {probe!r} is a symbolic link; nothing is written through a link "
                              f"(choose another log_dir)")
        if not os.path.exists(probe):
            missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    for directory in reversed(missing):
        os.mkdir(directory, 0o750)
        os.chmod(directory, 0o750)


class Sink:
    """One dashboard. ``load`` imports the library on the thread of ``start()`` (an import
    holds the interpreter lock for up to seconds: on the sink thread it would slow the
    first training steps); ``open`` runs on the sink thread before the first step."""

    name = "sink"

    def __init__(self, options: Mapping[str, Any], rank: int, output_dir: str) -> None:
        self.options = dict(options)
        self.rank = rank
        self.output_dir = output_dir
        self.run_name = str(self.options.get("run_name") or "rank_{rank}").replace("{rank}", str(rank))

    def load(self) -> None:
        raise NotImplementedError

    def open(self) -> None:
        raise NotImplementedError

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardSink(Sink):
    """Event files under ``log_dir/rank_<r>`` (default ``<output_dir>/tensorboard``),
    written with TensorBoard's own writer; the layout of ``export --tensorboard``."""

    name = "tensorboard"

    def load(self) -> None:
        from tensorboard.summary import Writer

        self._writer_class = Writer

    def open(self) -> None:
        root = self.options.get("log_dir") or os.path.join(self.output_dir, "tensorboard")
        self.log_dir = os.path.join(os.path.abspath(root), self.run_name)
        make_private_dir(self.log_dir)
        self._writer = self._writer_class(self.log_dir)
        self._files_private()

    def _files_private(self) -> None:
        for name in os.listdir(self.log_dir):
            path = os.path.join(self.log_dir, name)
            if name.startswith("events.out.tfevents.") and os.path.isfile(path) and not os.path.islink(path):
                os.chmod(path, 0o640)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = time.time()
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step, wall_time=now)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
        self._files_private()


class WandbSink(Sink):
    """A W&B run of its own per rank (``reinit="create_new"``: a run the training opened
    itself is left alone); the console is not captured."""

    name = "wandb"

    def load(self) -> None:
        import wandb

        self._wandb = wandb

    def open(self) -> None:
        wandb = self._wandb
        o = self.options
        kwargs = {k: o[k] for k in ("project", "entity", "group", "mode") if o.get(k) is not None}
        self._run = wandb.init(name=self.run_name, dir=o.get("dir") or self.output_dir, reinit="create_new",
                               # no system-metrics sampling: the training's own run does that
                               settings=wandb.Settings(console="off", x_disable_stats=True), **kwargs)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


def mlflow_key(key: str) -> str:
    """MLflow takes letters, digits, ``_ - . / :`` and spaces in a metric name: the other
    characters of a name (``[ ] @`` of cc tags) become ``_``."""
    return _MLFLOW_BAD.sub("_", key)


class MlflowSink(Sink):
    """A run per rank in ``experiment`` of ``tracking_uri`` (default: MLflow's own, which
    honours ``MLFLOW_TRACKING_URI``), through an ``MlflowClient`` of its own: the training's
    active run, if any, is not touched."""

    name = "mlflow"
    BATCH = 1000  # MLflow's limit of metrics per log_batch call

    def load(self) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric, self._client_class = Metric, MlflowClient

    def open(self) -> None:
        self._client = self._client_class(tracking_uri=self.options.get("tracking_uri"))
        exp_name = self.options.get("experiment") or "msprobe-monitor"
        exp = self._client.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(exp_name)
        self._run_id = self._client.create_run(exp_id, run_name=self.run_name).info.run_id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        items = [self._metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(items), self.BATCH):
            self._client.log_batch(self._run_id, metrics=items[i:i + self.BATCH])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


class SwanlabSink(Sink):
    """SwanLab keeps one run per process: the training's run when one is active (the keys
    are added to it and it is not finished here), else a run of its own."""

    name = "swanlab"

    def load(self) -> None:
        import swanlab

        self._swanlab = swanlab

    def open(self) -> None:
        swanlab = self._swanlab
        self._own = not swanlab.has_run()
        if self._own:
            o = self.options
            kwargs = {k: o[k] for k in ("project", "workspace", "mode") if o.get(k) is not None}
            self._run = swanlab.init(name=self.run_name, log_dir=o.get("log_dir") or os.path.join(
                self.output_dir, "swanlog"), **kwargs)
        else:
            self._run = swanlab.get_run()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        if self._own:
            self._run.finish()


SINKS: Dict[str, type] = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink,
                          "swanlab": SwanlabSink}


# ------------------------------------------------------------------ the hub
class SinkHub:
    """Owns the sinks of one rank and the thread that feeds them."""

    _STOP = object()

    def __init__(self, settings: SinksSettings, rank: int, output_dir: str, ops: Mapping[str, Sequence[str]]) -> None:
        self.settings = settings
        self.rank = rank
        self.aggregates = Aggregates(settings, ops)
        self.failed: Dict[str, str] = {}  # sink name -> its first error
        self.sinks: List[Sink] = []
        for name, options in settings.backends.items():
            sink = SINKS[name](options, rank, output_dir)
            if self._call(sink, "import", sink.load, Exception):  # on the training thread: Ctrl-C stays Ctrl-C
                self.sinks.append(sink)
        if self.sinks:
            logger.info("monitor_v2 sinks: rank %d sends at most %d keys per written step to %s", rank,
                        settings.max_keys, ", ".join(f"{s.name} (run {s.run_name})" for s in self.sinks))
        self.sent_steps = 0
        self.dropped_steps = 0
        # CPU seconds of the sink thread, read on it: after opening the sinks, after the last step, in all
        self.open_cpu_s = self.steps_end_cpu_s = self.cpu_s = 0.0
        self._once = LogOnce()
        self._closed = False
        # set once every sink has been opened (or has failed to): opening a W&B run takes
        # seconds on the sink thread, which the overhead benchmark must not time as steps
        self.opened = threading.Event()
        self._queue: "queue.Queue" = queue.Queue(maxsize=QUEUE_STEPS)
        self._thread = threading.Thread(target=self._run, name="msprobe-monitor-sinks", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # training side (or the async writer's thread)
    def send(self, step: int, merged: Sequence[Tuple[str, Sequence[Row]]]) -> None:
        """Hand a step's rows to the sink thread; never waits."""
        if self._closed:
            return
        try:
            self._queue.put_nowait((step, merged))
        except queue.Full:
            self.dropped_steps += 1
            self._once.warning(
                "queue-full",
                "monitor_v2 sinks: the dashboards (%s) are %d steps behind; step %d is not sent to them, so "
                "that training does not wait (the CSV files have it). Later drops are counted and said at "
                "stop().", ", ".join(s.name for s in self.sinks), QUEUE_STEPS, step)

    # sink thread
    def _run(self) -> None:
        live = list(self.sinks)
        try:
            for sink in list(live):
                if not self._call(sink, "open", sink.open):
                    live.remove(sink)
        finally:
            self.opened.set()
        self.open_cpu_s = time.thread_time()  # this thread's CPU: what the sinks cost, apart from the training
        while True:
            item = self._queue.get()
            if item is self._STOP:
                break
            step, merged = item
            try:
                metrics = self.aggregates.metrics(step, merged)
            except Exception as exc:  # noqa: BLE001 - a bug here must not stop the CSV output
                logger.error("monitor_v2 sinks: computing the metrics of step %d failed: %r", step, exc)
                continue
            for sink in list(live):
                if not self._call(sink, "log", lambda s=sink: s.log(step, metrics)):
                    live.remove(sink)
            self.sent_steps += 1
        self.steps_end_cpu_s = time.thread_time()
        for sink in live:
            self._call(sink, "close", sink.close)
        self.cpu_s = time.thread_time()

    def _call(self, sink: Sink, what: str, fn: Callable[[], None], caught: type = BaseException) -> bool:
        try:
            fn()
            return True
        except caught as exc:  # noqa: BLE001 - a dashboard never stops training (nor a library's SystemExit)
            self.failed[sink.name] = f"{what}: {exc!r}"
            logger.warning(
                "monitor_v2 sinks: the %s sink failed (%s: %r) on rank %d; it is turned off for the rest of the run "
                "(the CSV files and the other sinks go on). Logged once.", sink.name, what, exc, self.rank)
            return False

    @property
    def steps_cpu_s(self) -> float:
        """CPU seconds the sink thread spent on the steps (computing keys, calling the libraries)."""
        return max(0.0, self.steps_end_cpu_s - self.open_cpu_s)

    def close(self) -> None:
        """Send what is queued, close the sinks; waits at most ``CLOSE_TIMEOUT_S``. Never raises."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._queue.put(self._STOP)  # blocks only while the queue is full: the thread is draining it
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("monitor_v2 sinks: the dashboards (%s) did not take the last steps within %.0f s; "
                           "stop() goes on without them", ", ".join(s.name for s in self.sinks), CLOSE_TIMEOUT_S)
        elif self.sinks:
            logger.info("monitor_v2 sinks: rank %d sent %d step(s); the sink thread used %.1f ms of CPU per step "
                        "(and %.2f s to open and close the sinks)", self.rank, self.sent_steps,
                        1e3 * self.steps_cpu_s / max(1, self.sent_steps), self.cpu_s - self.steps_cpu_s)
        if self.dropped_steps:
            logger.warning("monitor_v2 sinks: %d written step(s) were not sent to the dashboards (they fell "
                           "behind); the CSV files hold them", self.dropped_steps)


def make_sink_hub(settings: Optional[SinksSettings], rank: int, output_dir: str,
                  ops: Mapping[str, Sequence[str]]) -> Optional[SinkHub]:
    """The rank's hub, or None when no sink is configured or this rank does not send."""
    if settings is None or not settings.backends:
        return None
    if settings.ranks is not None and rank not in settings.ranks:
        return None
    return SinkHub(settings, rank, output_dir, ops)
