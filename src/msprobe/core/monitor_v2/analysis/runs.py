"""The order in which the runs of one window wrote their files: plain file, ``.run<k>``
files, and the runs appended inside each (``FileMeta``, ``segment_order``). Pure ordering,
no reading: both analysis engines use it (``report.WindowRuns`` row by row, ``columnar``
in Polars), so it lives apart from either."""

from dataclasses import dataclass
from typing import List, Sequence, Tuple


@dataclass(frozen=True)
class FileMeta:
    """What says when a file of a window was written: its window, its name's run series
    (``.run<k>``: 1 for the plain name), its statistics, the runs (segments) it holds and
    its modification time (0: not known)."""

    first: int
    last: int
    run: int
    ops: Tuple[str, ...]
    segments: int
    mtime_ns: int


def names_settle(metas: Sequence[FileMeta]) -> bool:
    """Whether the names and headers of a window's files say in which order their runs
    wrote. The writer appends to a file only when it starts with the run's own header, and
    makes ``.run<k>`` only beside files of other headers: a ``.run<k>`` file's run came after
    the lone run of each lower-``k`` file of another header. Files of one header (a run
    resumed where its own series had no file of the window, a second job at the same time),
    or a lower-``k`` file holding several runs (a later one may have come back to it after
    the ``.run<k>`` file was made), or windows cut differently, do not say it."""
    live = [m for m in metas if m.segments]
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            if not ((a.first, a.last) == (b.first, b.last) and a.run < b.run and a.ops != b.ops
                    and a.segments == 1):
                return False
    return True


def segment_order(metas: Sequence[FileMeta]) -> Tuple[List[Tuple[int, int]], bool]:
    """The runs of a window, ``(file index, segment)``, from the first written to the
    latest, and whether the files' modification times chose that order.

    Each file's runs are in the order they were appended; files in the order of their
    names (plain, ``.run2``, ...). Where the names do not say it (:func:`names_settle`) and
    every file's modification time is known, the last run of each file is placed by when
    its file was last written: the runs that are last in their file take the places of the
    last runs in name order, sorted by time (ties in name order). A run that is not the last
    of its file keeps its place."""
    seq = [(i, s) for i, m in enumerate(metas) for s in range(m.segments)]
    if names_settle(metas) or any(m.mtime_ns == 0 for m in metas if m.segments):
        return seq, False
    slots = [p for p, (i, s) in enumerate(seq) if s == metas[i].segments - 1]
    lasts = sorted((seq[p] for p in slots), key=lambda t: (metas[t[0]].mtime_ns, t[0]))
    for p, item in zip(slots, lasts):
        seq[p] = item
    return seq, True


RunLabel = Tuple[int, Tuple[str, ...], int]  # the file's run series, its statistics, its segment
