"""``msprobe-monitor export --tensorboard DEST OUT_DIR``: the output as TensorBoard event
files, written with TensorBoard's own writer (``tensorboard.summary.Writer``).

- One run per rank: ``DEST/rank_<r>/events.out.tfevents.*`` (the layout of the live
  TensorBoard sink, so ``tensorboard --logdir DEST`` lists the ranks as runs).
- One scalar series per tensor, scope and statistic, tagged
  ``<monitor>/<scope>/<tensor>/<stat>`` (``sinks.tag``): TensorBoard folds the tags of a
  monitor into one section, where the statistics of a layer sort together. Weight-gradient
  rows of several micro-batches of one step carry ``micro_<k>`` after the tensor name.
- The x axis is the monitor's step. Each rank's rows are written in step order across
  monitors: TensorBoard drops a run's later points when a step goes back ("orphaned
  data"), so one monitor after the other would lose all but the last.

Re-exporting into the same DEST replaces the event files of the ranks it writes.
"""

import heapq
import os
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..sinks import micro_labels, tag
from .reader import MONITORS, CsvFile, InputError, Layout, Problems, Row, StepRange, iter_rows

INSTALL_HINT = "pip install tensorboard (or pip install 'msprobe-monitor[analysis]')"
EVENT_PREFIX = "events.out.tfevents."


def tensorboard_writer_class():
    try:
        from tensorboard.summary import Writer
    except ImportError:
        raise InputError("export --tensorboard needs TensorBoard, which is not installed: " + INSTALL_HINT) from None
    return Writer


def _rows(f: CsvFile, problems: Problems, steps: Optional[StepRange]) -> Iterator[Row]:
    if f.path.endswith(".parquet"):  # an exported Parquet dataset (see .columnar)
        from .columnar import parquet_rows

        return parquet_rows(f, steps)
    return iter_rows(f, problems, steps)


def _blocks(monitor: str, files: Sequence[CsvFile], problems: Problems,
            steps: Optional[StepRange]) -> Iterator[Tuple[int, str, List[Row]]]:
    """``(step, monitor, rows)`` of each run of consecutive rows with the same step."""
    current: Optional[int] = None
    block: List[Row] = []
    for f in files:
        for row in _rows(f, problems, steps):
            if row.step != current and block:
                yield current, monitor, block  # type: ignore[misc]
                block = []
            current = row.step
            block.append(row)
    if block:
        yield current, monitor, block  # type: ignore[misc]


def _safe_dir(path: str) -> str:
    """Create ``path`` (0750) unless a symbolic link stands anywhere on it; return it."""
    path = os.path.abspath(path)
    probe = path
    while True:
        if os.path.islink(probe):
            raise InputError(f"{probe}: is a symbolic link; export writes nothing through a link "
                             f"(give the real directory as DEST)")
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if os.path.lexists(path) and not os.path.isdir(path):
        raise InputError(f"{path}: exists and is not a directory")
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o750, exist_ok=True)
        os.chmod(path, 0o750)
    return path


def export_tensorboard(path: str, dest: str, layout: Layout, problems: Problems,
                       steps: Optional[StepRange] = None,
                       progress: Optional[Callable[[str, int], None]] = None) -> Dict[str, int]:
    """Write the rows of ``layout`` (read from ``path``) as event files under ``dest``;
    returns ``{"runs": ..., "scalars": ..., "tags": ...}``."""
    writer_class = tensorboard_writer_class()
    root = _safe_dir(dest)
    runs = scalars = 0
    tags = set()
    for rank in layout.ranks:
        run_dir = _safe_dir(os.path.join(root, f"rank_{rank}"))
        for old in os.listdir(run_dir):
            if old.startswith(EVENT_PREFIX) and not os.path.islink(os.path.join(run_dir, old)):
                os.remove(os.path.join(run_dir, old))
        streams = [_blocks(m, layout.files_of(rank, m), problems, steps) for m in MONITORS if layout.files_of(rank, m)]
        writer = writer_class(run_dir)
        try:
            # step order across monitors; a monitor's own order within a step (stable merge)
            for step, monitor, rows in heapq.merge(*streams, key=lambda b: b[0]):
                micros = micro_labels(rows, lambda r: r.name, lambda r: r.scope, lambda r: r.micro)
                for row, micro in zip(rows, micros):
                    for op, value in row.vals.items():
                        key = tag(monitor, row.scope, row.name, op, micro)
                        writer.add_scalar(key, float(value), step)
                        tags.add((rank, key))
                        scalars += 1
            writer.flush()
        finally:
            writer.close()
        for name in os.listdir(run_dir):
            full = os.path.join(run_dir, name)
            if name.startswith(EVENT_PREFIX) and os.path.isfile(full) and not os.path.islink(full):
                os.chmod(full, 0o640)
        runs += 1
        if progress is not None:
            progress(f"rank {rank}", sum(len(layout.files_of(rank, m)) for m in MONITORS))
    return {"runs": runs, "scalars": scalars, "tags": len(tags)}
