"""Incident evidence: ``rank_<r>/anomalies.jsonl`` and the pre-update dump.

- ``anomalies.jsonl``: written by the alerter (inside the writer's step flush, so on the
  writer's thread with ``async_write``) for the first anomalous written step of the run:
  one JSON object per anomalous row of that step, in execution order (``rows.execution_order``),
  at most ``MAX_ANOMALY_LINES`` of them, then ``{"truncated": n}``. Each run appends its
  own block, and every line of a block names its run (``run``, ``run_started``: see
  :class:`RunId`), so that a run resumed into the same directory is told from the one
  that died: the reading tools report the latest run's block first.
- ``dump_step<S>/``: the parameters, their gradients and the root module's inputs of the
  step whose gradients went non-finite, as they were before ``optimizer.step()`` applied
  them (taken by the framework's ``GradientGuard`` in the optimizer pre-step hook):
  ``manifest.json`` plus one tensor file (``tensors.pt``, ``torch.save`` of a dict, for
  PyTorch; ``tensors.npz`` for MindSpore). ``load_dump`` reads one back. A dump is never
  written over another: when ``dump_step<S>`` exists (a run resumed before step S, which
  failed again there), the new one is ``dump_step<S>.2`` (then ``.3``, ...), said in the
  log; the manifest names its run as the anomalies do.

Every file goes through ``safe_fs`` (never through a link, 0640; directories 0750).
Framework-neutral: torch/numpy are imported by ``load_dump`` only, when it reads a file.
"""

import datetime
import json
import logging
import math
import os
import re
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, IO, List, Mapping, Optional, Sequence, Tuple

from . import rows
from .errors import NonFiniteGradientError
from .safe_fs import SafeDir, append_bytes, dir_mode
from .stats import Row

logger = logging.getLogger("msprobe.monitor_v2")

ANOMALIES_FILE = "anomalies.jsonl"
MANIFEST = "manifest.json"
MAX_ANOMALY_LINES = 100
PARAM, GRAD, INPUT = "param", "grad", "input"
# dump_step<S> for the first dump of step S in a rank directory, dump_step<S>.<n> for the n-th
DUMP_DIR_RE = re.compile(r"^dump_step(?P<step>\d+)(?:\.(?P<n>[2-9]|[1-9]\d+))?$")
_MAX_DUMPS_PER_STEP = 10000  # names tried before giving up (each taken by a dump of that step)


def dump_dir_name(step: int, n: int = 1) -> str:
    """The directory of the ``n``-th dump of ``step`` in a rank directory."""
    return f"dump_step{step}" if n == 1 else f"dump_step{step}.{n}"


# ------------------------------------------------------------------ runs
@dataclass(frozen=True)
class RunId:
    """One run of the monitor on one rank (one ``start()``): ``id`` is unique (its start
    time, the process id and random bits), ``started`` the start time in UTC (ISO 8601,
    milliseconds). Written with each ``anomalies.jsonl`` line and dump manifest of the run."""

    id: str
    started: str
    pid: int

    @classmethod
    def new(cls) -> "RunId":
        now = datetime.datetime.now(datetime.timezone.utc)
        pid = os.getpid()
        return cls(f"{now:%Y%m%dT%H%M%S}Z-{pid}-{secrets.token_hex(3)}",
                   now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z", pid)

    def fields(self) -> Dict[str, Any]:
        return {"run": self.id, "run_started": self.started}


_RUNS: Dict[str, RunId] = {}  # rank directory -> the run of this process writing into it now
_RUNS_LOCK = threading.Lock()


def start_run(rank_dir: Optional[str]) -> RunId:
    """A new run writing evidence into ``rank_dir`` (the alerter's, at ``start()``)."""
    run = RunId.new()
    if rank_dir is not None:
        with _RUNS_LOCK:
            _RUNS[os.path.abspath(rank_dir)] = run
    return run


def run_of(rank_dir: str) -> RunId:
    """The run of this process writing into ``rank_dir`` (the one :func:`start_run`
    started last; a new one if none was)."""
    with _RUNS_LOCK:
        run = _RUNS.get(os.path.abspath(rank_dir))
        if run is None:
            run = _RUNS[os.path.abspath(rank_dir)] = RunId.new()
        return run


def json_float(value: float) -> Any:
    """A statistic as JSON: non-finite floats as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def execution_keys(rank: int, step: int, rows_by_monitor: Sequence[Tuple[str, Sequence[Row]]]) -> Dict[int, Any]:
    """``id(row)`` -> the row's ``rows.execution_order`` key, ``line`` being its place among
    its monitor's rows of that step (its order in the file within the step)."""
    return {id(row): rows.execution_order(step, monitor, row.scope, row.micro_step, line, rank)
            for monitor, monitor_rows in rows_by_monitor for line, row in enumerate(monitor_rows)}


def anomaly_lines(rank: int, step: int, rows_by_monitor: Sequence[Tuple[str, Sequence[Row]]],
                  kinds: Mapping[int, str], nonfinite: Callable[[Row], bool],
                  run: Optional[RunId] = None) -> List[Dict[str, Any]]:
    """The JSON objects of one step: one per row whose ``id`` is in ``kinds`` (its kind,
    "nonfinite" or "spike"), sorted by execution order. ``order`` is the row's
    :func:`execution_keys` key; every line (the ``truncated`` one too) names ``run``."""
    order = execution_keys(rank, step, rows_by_monitor)
    lines = []
    for monitor, monitor_rows in rows_by_monitor:
        bad = sum(1 for r in monitor_rows if nonfinite(r))
        for row in monitor_rows:
            kind = kinds.get(id(row))
            if kind is None:
                continue
            stat = row.stat
            lines.append({
                "rank": rank,
                "step": step,
                "micro_step": row.micro_step,
                "monitor": monitor,
                "module_name": row.name,
                "scope": row.scope,
                "vpp_stage": row.vpp_stage,
                "kind": kind,
                "stats": {**{op: json_float(stat.value(op)) for op in rows.VALUE_OPS}, "nans": stat.nans},
                "order": list(order[id(row)]),
                "rows_nonfinite": bad,
                "rows_total": len(monitor_rows),
                "first": False,
                **(run.fields() if run is not None else {}),
            })
    lines.sort(key=lambda d: d["order"])
    if lines:
        lines[0]["first"] = True
    if len(lines) > MAX_ANOMALY_LINES:
        lines = lines[:MAX_ANOMALY_LINES] + [{"truncated": len(lines) - MAX_ANOMALY_LINES,
                                              **(run.fields() if run is not None else {})}]
    return lines


def append_anomalies(rank_dir: str, lines: Sequence[Mapping[str, Any]]) -> str:
    """Append ``lines`` to ``rank_dir/anomalies.jsonl`` in one write; returns the path."""
    path = os.path.join(rank_dir, ANOMALIES_FILE)
    append_bytes(path, "".join(json.dumps(line, allow_nan=False) + "\n" for line in lines).encode())
    return path


def write_dump(rank_dir: str, step: int, manifest: Dict[str, Any], payload: Any, file_name: str,
               save: Callable[[Any, IO[bytes]], None]) -> str:
    """Write ``payload`` (the tensors, by ``<kind>:<name>``) with ``save`` into a new
    directory ``rank_dir/dump_step<S>[.<n>]/file_name`` (never one that exists: an earlier
    run's dump of the same step is kept), then ``manifest.json``: a manifest that exists
    names a complete tensor file. Returns the directory."""
    with SafeDir(rank_dir) as top:
        name, sub = _new_dump_dir(top, step)
        try:
            with sub.replace(file_name) as fh:
                save(payload, fh)
            sub.write_bytes(MANIFEST, (json.dumps(manifest, indent=1, allow_nan=False) + "\n").encode())
        finally:
            sub.close()
    return os.path.join(rank_dir, name)


def _new_dump_dir(top: SafeDir, step: int) -> Tuple[str, SafeDir]:
    """The first free name of :func:`dump_dir_name` for ``step``, created by this call
    (``mkdir`` fails on any name that exists, whatever it is: a directory of an earlier
    dump, a file, a link), opened without following a link."""
    for n in range(1, _MAX_DUMPS_PER_STEP + 1):
        name = dump_dir_name(step, n)
        try:
            os.mkdir(name, 0o700, dir_fd=top.fd)
        except FileExistsError:
            continue
        sub = top.subdir(name)
        try:
            os.fchmod(sub.fd, dir_mode())
        except BaseException:
            sub.close()
            raise
        return name, sub
    raise FileExistsError(f"{_MAX_DUMPS_PER_STEP} dump directories of step {step} exist in {top.path}")


def payload_key(kind: str, name: str) -> str:
    return f"{kind}:{name}"


MAX_INPUTS_PER_STEP = 256  # weak references kept per step (long accumulation loops)


class GradientGuardBase:
    """The framework-neutral part of the pre-update check (``alert.dump`` /
    ``alert.stop_on_nonfinite``): what is dumped in which order within the budget, the
    manifest, the writing thread, the exception. A framework's ``GradientGuard`` says how
    to find the non-finite gradients, measure, copy and save a tensor, and hooks the
    root modules' inputs (``_on_forward``). ``session``, ``errors``: the back end's."""

    TENSOR_FILE = ""

    def __init__(self, session: Any, settings: Any, rank: int, rank_dir: str, errors: Any) -> None:
        self.session = session
        self.settings = settings
        self.rank = rank
        self.rank_dir = rank_dir
        self.errors = errors
        self.taken = False  # the dump of this run was taken (its files are written on a thread)
        self.dumped: Optional[str] = None  # the dump directory, once its files are written
        self._inputs: List[Tuple[int, int, Any, Any]] = []  # vpp, call, arg index or kwarg name, weakref
        self._calls = 0
        self._handles: List[Any] = []
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------ what a framework provides
    def attach(self) -> None:
        """Hook the root modules' forward calls (only with ``dump``) to ``_on_forward``."""
        raise NotImplementedError

    def _training_forward(self) -> bool:
        return True

    def _is_tensor(self, value: Any) -> bool:
        raise NotImplementedError

    def _nonfinite_positions(self, items: List[Tuple[Any, Any]]) -> List[int]:
        raise NotImplementedError

    def _describe(self, t: Any) -> Tuple[Any, int, List[int], str]:
        """``(local tensor, bytes, shape, dtype name)``."""
        raise NotImplementedError

    def _copy(self, t: Any) -> Any:
        """A host copy of ``t``, taken now."""
        raise NotImplementedError

    def _save(self, payload: Dict[str, Any], fh: IO[bytes]) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------- shared
    def _on_forward(self, vpp: int, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        if self.taken or not self._training_forward():  # evaluation passes are not the step's
            return
        call = self._calls
        self._calls += 1
        for where, value in [(i, a) for i, a in enumerate(args)] + list(kwargs.items()):
            if self._is_tensor(value) and len(self._inputs) < MAX_INPUTS_PER_STEP:
                self._inputs.append((vpp, call, where, weakref.ref(value)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def close(self) -> None:
        """Wait for the dump's files (``stop()``)."""
        if self._thread is not None:
            self._thread.join()

    def check(self, step: int) -> None:
        """In the optimizer pre-step hook. Raises ``NonFiniteGradientError`` (with
        ``stop_on_nonfinite``) so that the update is not applied."""
        try:
            if self.taken and not self.settings.stop_on_nonfinite:
                return  # dumped once; nothing more to do, no more syncs
            items = [(info, g) for info, g in self.session.reduced_grads() if g is not None]
            bad = self._nonfinite_positions(items) if items else []
            if not bad:
                return
            if not self.taken and self.settings.dump_max_bytes is not None:
                self._dump(step, items, bad)
            if self.settings.stop_on_nonfinite:
                self.close()  # the directory's name is known once its files are written
                raise NonFiniteGradientError(step, len(bad), len(items), [items[i][0].name for i in bad],
                                             self.dumped)
        finally:
            self._inputs = []
            self._calls = 0

    def _dump(self, step: int, items: List[Tuple[Any, Any]], bad: List[int]) -> None:
        """Parameters with a non-finite gradient (each, then its gradient), the root
        inputs, then the other parameters, copied to the host while they fit the budget."""
        budget = self.settings.dump_max_bytes
        used = 0
        entries: List[Dict[str, Any]] = []
        skipped: List[Dict[str, Any]] = []
        payload: Dict[str, Any] = {}

        def take(name: str, kind: str, t: Any, extra: Dict[str, Any]) -> None:
            nonlocal used
            if t is None:
                skipped.append({"name": name, "kind": kind, "bytes": 0, "why": "no longer alive", **extra})
                return
            t, size, shape, dtype = self._describe(t)
            if used + size > budget:
                skipped.append({"name": name, "kind": kind, "bytes": size, **extra,
                                "why": f"over the byte budget (max_bytes {budget}, {used} used)"})
                return
            used += size
            payload[payload_key(kind, name)] = self._copy(t)
            entries.append({"name": name, "kind": kind, "file": self.TENSOR_FILE, "shape": shape,
                            "dtype": dtype, "bytes": size, **extra})

        def take_param(info: Any, grad: Any) -> None:
            take(info.name, PARAM, info.param, {})
            take(info.name, GRAD, grad, {})

        for i in bad:
            take_param(*items[i])
        multi = len(self.session.roots) > 1
        for vpp, call, arg, ref in self._inputs:
            label = f"args.{arg}" if isinstance(arg, int) else f"kwargs.{arg}"
            pos = {"arg": arg} if isinstance(arg, int) else {"kwarg": arg}
            take((f"{vpp}:" if multi else "") + f"call{call}.{label}", INPUT, ref(),
                 {"call": {"vpp_stage": vpp, "call": call, **pos}})
        bad_set = set(bad)
        for i, item in enumerate(items):
            if i not in bad_set:
                take_param(*item)
        manifest = {"step": step, "rank": self.rank,
                    "reason": f"{len(bad)} of {len(items)} gradient(s) non-finite before the optimizer step",
                    "max_bytes": budget, "bytes": used, "tensors": entries, "skipped": skipped,
                    **run_of(self.rank_dir).fields()}
        self.taken = True
        # the files on a thread of their own: a slow file system never holds the step (the
        # directory's name, which depends on the dumps already there, is chosen there too)
        self._thread = threading.Thread(target=self._write, args=(step, manifest, payload),
                                        name="msprobe-monitor-dump")
        self._thread.start()

    def _write(self, step: int, manifest: Dict[str, Any], payload: Dict[str, Any]) -> None:
        try:
            path = write_dump(self.rank_dir, step, manifest, payload, self.TENSOR_FILE, self._save)
        except Exception as exc:  # noqa: BLE001 - evidence must never break training
            logger.error("monitor_v2: rank %d could not write the dump of step %d: %r", self.rank, step, exc)
            return
        self.dumped = path
        first = dump_dir_name(step)
        kept = ("" if os.path.basename(path) == first else
                f" ({first} holds an earlier run's dump of this step: kept as it was, this one has a new name)")
        logger.warning("monitor_v2 alert: rank %d step %d: gradients non-finite before the update; "
                       "%d tensor(s) (%d bytes, %d skipped) dumped to %s%s", self.rank, step,
                       len(manifest["tensors"]), manifest["bytes"], len(manifest["skipped"]), path, kept)


def load_dump(path: str) -> Dict[str, Any]:
    """Read a dump directory (``rank_<r>/dump_step<S>``) back.

    Returns ``{"manifest": dict, "params": {name: tensor}, "grads": {name: tensor},
    "inputs": {name: tensor}, "calls": [{"args": [...], "kwargs": {...}}]}``: ``calls`` are
    the root module's forward calls of the step, in order, with the tensors that were
    still alive (a missing one is ``None``; non-tensor arguments were not kept). PyTorch
    dumps give ``torch.Tensor``s (loaded with ``weights_only=True``), MindSpore dumps
    numpy arrays. The replay recipe is in docs/output-format.md."""
    with SafeDir(path, create=False) as d:
        manifest = json.loads(d.read_bytes(MANIFEST))
        files = sorted({t["file"] for t in manifest.get("tensors", ())})
        data: Dict[str, Any] = {}
        for name in files:
            raw = d.read_bytes(name)
            data.update(_load_tensor_file(name, raw))
    out: Dict[str, Any] = {"manifest": manifest, "params": {}, "grads": {}, "inputs": {}, "calls": []}
    group = {PARAM: "params", GRAD: "grads", INPUT: "inputs"}
    for entry in manifest.get("tensors", ()):
        out[group[entry["kind"]]][entry["name"]] = data[payload_key(entry["kind"], entry["name"])]
    calls: Dict[Tuple[int, int], Dict[str, Any]] = {}
    for entry in list(manifest.get("tensors", ())) + list(manifest.get("skipped", ())):
        where = entry.get("call")
        if entry["kind"] != INPUT or where is None:
            continue
        call = calls.setdefault((where["vpp_stage"], where["call"]), {"args": {}, "kwargs": {}})
        value = out["inputs"].get(entry["name"])
        if "arg" in where:
            call["args"][where["arg"]] = value
        else:
            call["kwargs"][where["kwarg"]] = value
    for key in sorted(calls):
        args = calls[key]["args"]
        out["calls"].append({"vpp_stage": key[0], "args": [args.get(i) for i in range(max(args, default=-1) + 1)],
                             "kwargs": calls[key]["kwargs"]})
    return out


def _load_tensor_file(name: str, raw: bytes) -> Dict[str, Any]:
    import io

    if name.endswith(".npz"):
        import numpy

        with numpy.load(io.BytesIO(raw), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    import torch

    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
