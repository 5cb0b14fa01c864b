"""Plain-text tables, number formatting, JSON-safe values and progress on stderr."""

import json
import math
import sys
import time
from typing import Any, Optional, Sequence, TextIO


def fmt_num(value: Any, digits: int = 6) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.{digits}g}"
    return str(value)


def compact_steps(steps: Sequence[int]) -> str:
    """[0, 5, 10, 15] -> '0-15 every 5 (4 steps)'; short irregular lists as they are."""
    steps = sorted(steps)
    if not steps:
        return "-"
    if len(steps) == 1:
        return str(steps[0])
    diffs = {b - a for a, b in zip(steps, steps[1:])}
    if len(diffs) == 1:
        d = diffs.pop()
        every = "" if d == 1 else f" every {d}"
        return f"{steps[0]}-{steps[-1]}{every} ({len(steps)} steps)"
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{steps[0]}-{steps[-1]} ({len(steps)} steps, irregular)"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ",
          right: Optional[Sequence[bool]] = None) -> str:
    """A left-aligned text table (numbers right-aligned unless ``right`` says otherwise)."""
    cells = [[fmt_num(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    if right is None:
        right = [all(_numeric(r[i]) for r in rows) and bool(rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)]
        return (indent + "  ".join(parts)).rstrip()

    out = [line(list(headers)), indent + "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) or value is None


def json_safe(obj: Any) -> Any:
    """NaN/Inf become the strings ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has no such numbers)."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dump_json(obj: Any, stream: TextIO) -> None:
    json.dump(json_safe(obj), stream, indent=2, allow_nan=False)
    stream.write("\n")


class Progress:
    """``files done/total`` on stderr: rewritten in place on a terminal, or one line every
    few seconds when forced with ``--progress`` on a pipe. Silent otherwise."""

    def __init__(self, total: int, label: str, enabled: Optional[bool] = None,
                 stream: Optional[TextIO] = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = self.tty if enabled is None else enabled
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self._last = 0.0
        self._t0 = time.monotonic()
        self._shown = False

    def advance(self, what: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        now = time.monotonic()
        interval = 0.1 if self.tty else 2.0
        if now - self._last < interval and self.done < self.total:
            return
        self._last = now
        msg = f"{self.label}: {self.done}/{self.total} files ({100 * self.done // self.total}%) {what}"
        if self.tty:
            self.stream.write("\r" + msg[:150].ljust(80))
        else:
            self.stream.write(msg + "\n")
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self.enabled and self._shown and self.tty:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()
