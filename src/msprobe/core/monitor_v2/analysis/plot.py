"""``plot``: trends of one statistic over steps, as PNG files and an HTML report.

Figures (for one rank, default the lowest):

- one *overview* per monitor: the statistic aggregated over all tensors of each scope
  per step (``norm``: the global L2 norm, sqrt of the summed squares; ``max``: the
  largest max; ``min``: the smallest min; ``mean``: the average of the means; ``nans``
  and ``zeros``: the total), one line per scope (per micro_step for per-micro-batch gradients);
- one figure per (monitor, scope, layer) with a line per tensor (``--by layer``), or
  per (monitor, tensor) with a line per scope (``--by tensor``). A layer is the tensor
  name up to its first numeric component (``blocks.3`` of ``blocks.3.mlp.fc.weight``),
  else the group ``top level`` (embeddings, final norm, the root module);
  ``--layer-depth N`` takes the first N components instead.

A group with more than ``lines_per_plot`` tensors continues in a second figure, and so
on. Memory stays bounded: only the series of the first ``max_plots`` figures are kept,
in order of first appearance; the rest are counted and listed as not plotted.
``--match`` selects tensors by regular expression. For the ``module`` monitor only
``output`` (forward) and ``grad_output`` (backward) rows are drawn by default (a
module's input is the previous module's output); ``--module-io all`` draws every row.

Non-finite values are a red band over the steps where any line of the figure is NaN/Inf
(with a red cross per such step at the top of the axes, up to 40), the rank's first non-finite step
a red dashed line, detected spikes orange circles; no line is drawn in red or orange.
In a figure with a NaN/Inf, finite values that ran away (more than 1e4 times their line's
median magnitude before the first NaN/Inf) are left out of the y range and drawn as
triangles on its edge, so the rest of the run stays readable.

The HTML report has a table of contents (anomalies, then one section per monitor and one
sub-section per scope), each monitor's overview across the page and its figures as small
multiples: a grid of small figures sharing one step axis.

matplotlib is imported only here, when the figures are drawn (no pyplot, no global
backend change).
"""

import base64
import html
import os
import re
from array import array
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, List, Optional, Tuple

from .command import pip_command
from ..errors import UnsafePathError
from ..rows import GRAD_OUTPUT, MODULE, OPTIMIZER, OUTPUT, UNREDUCED, WEIGHT_GRAD, state_suffix
from ..safe_fs import make_dirs, read_own_file, replace_file
from .report import Report
from .reader import MONITORS, CsvFile, InputError, Row
from .text import compact_steps, fmt_num

INF = float("inf")
_NUM = re.compile(r"^\d+$")


@dataclass
class PlotSettings:
    stat: str = "norm"
    by: str = "layer"
    rank: Optional[int] = None
    match: Optional[str] = None
    max_plots: int = 48
    lines_per_plot: int = 12
    module_io: str = "outputs"  # or "all"
    layer_depth: Optional[int] = None
    out_dir: Optional[str] = None
    embed: bool = False
    html: bool = True
    yscale: str = "auto"


def tensor_base(monitor: str, name: str, scope: str) -> str:
    """The module or parameter a row belongs to: ``blocks.0.attn.output.0`` ->
    ``blocks.0.attn``; ``fc.weight.exp_avg`` -> ``fc.weight``."""
    if monitor == MODULE:
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and _NUM.match(parts[2]):
            return parts[0]
    elif monitor == OPTIMIZER and name.endswith(state_suffix(scope)):
        return name[: -len(state_suffix(scope))]
    return name


TOP_LEVEL = "top level"


def layer_of(base: str, depth: Optional[int]) -> str:
    """``blocks.3.mlp.fc`` -> ``blocks.3``; ``0.weight`` (a plain ``nn.Sequential``) ->
    ``0``; a name without a numeric component (embeddings, final norm, the root module)
    -> ``"top level"``; ``depth``: the first N components."""
    parts = base.split(".")
    if depth is not None:
        return ".".join(parts[:depth])
    for i, p in enumerate(parts):
        if _NUM.match(p):
            return ".".join(parts[: i + 1])
    return TOP_LEVEL


# Five well-separated colours, solid then dashed: the twelve lines of the default
# --lines-per-plot can each be told apart, where a 20-colour map gives near-identical
# neighbours. Red and orange are left out: they mean NaN/Inf and spike, and a series in
# either colour would read as an anomaly.
LINE_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#4d4d4d")
LINE_STYLES = ("-", "--", ":", "-.")
NAN_COLOUR = "#d62728"
MAX_CROSSES = 40  # NaN/Inf steps marked with a cross each; beyond, the red band alone
SPIKE_COLOUR = "#ff7f0e"


def line_style(i: int) -> Tuple[str, str]:
    """(colour, line style) of the i-th line of a figure: unique for the first 20."""
    return LINE_COLOURS[i % len(LINE_COLOURS)], LINE_STYLES[(i // len(LINE_COLOURS)) % len(LINE_STYLES)]


def use_log_scale(lines: List[Tuple[str, List[float], List[float]]], yscale: str = "auto") -> bool:
    """``auto``: a log axis when every value is > 0 and either the values span more than
    3 decades or the lines' typical levels (medians) differ more than 20x, as forward
    activations (~65) and backward gradients (~0.1) do: on a linear axis the lower
    line would be flat at 0."""
    if yscale != "auto":
        return yscale == "log"
    values = [v for _, _, vs in lines for v in vs if v == v and abs(v) != INF]
    if not values or min(values) <= 0:
        return False
    if max(values) / min(values) > 1e3:
        return True
    medians = []
    for _, _, vs in lines:
        ys = sorted(v for v in vs if v == v and abs(v) != INF)
        if ys:
            medians.append(ys[len(ys) // 2])
    return len(medians) > 1 and max(medians) / min(medians) > 20


def module_io(name: str) -> str:
    """``input``/``output``/``grad_input``/``grad_output`` of a module row name."""
    parts = name.rsplit(".", 2)
    return parts[1] if len(parts) == 3 else ""


class Series:
    __slots__ = ("steps", "values")

    def __init__(self) -> None:
        self.steps = array("d")
        self.values = array("d")


_DROPPED = Series()  # marks a line that did not fit in the --max-plots budget


class _Agg:
    __slots__ = ("acc", "n", "bad")

    def __init__(self) -> None:
        self.acc = 0.0
        self.n = 0
        self.bad = False


class PlotCollector:
    """A row visitor for an analysis engine (:class:`.report.AnalysisEngine`) keeping the plotted series."""

    def __init__(self, settings: PlotSettings, rank: int) -> None:
        self.s = settings
        self.rank = rank
        self.regex = re.compile(settings.match) if settings.match else None
        self.overview: Dict[str, Dict[str, Dict[int, _Agg]]] = {}
        self.figures: Dict[Tuple[str, ...], Dict[str, Series]] = {}
        self.fig_order: List[Tuple[str, ...]] = []
        self.omitted_figures: Dict[Tuple[str, ...], None] = {}  # groups with at least one line left out
        self.omitted_lines = 0
        self.parts: Dict[Tuple[str, ...], int] = {}
        self.where: Dict[Tuple[Tuple[str, ...], str], Series] = {}

    def __call__(self, rank: int, monitor: str, row: Row, f: CsvFile) -> None:
        if rank != self.rank:
            return
        v = row.vals.get(self.s.stat)
        if v is None:
            return
        v = float(v)
        micro_label = f" mb{row.micro}" if (monitor == WEIGHT_GRAD and row.scope == UNREDUCED) else ""
        if row.dp is not None:  # a merged view's row kept per data-parallel rank: a line of its own
            micro_label += f" dp{row.dp}"
        # overview
        lines = self.overview.setdefault(monitor, {})
        per_step = lines.setdefault(row.scope + micro_label, {})
        agg = per_step.get(row.step)
        if agg is None:
            agg = per_step[row.step] = _Agg()
            if self.s.stat == "min":
                agg.acc = INF
            elif self.s.stat == "max":
                agg.acc = -INF
        self._aggregate(agg, v)
        # detail
        if self.regex is not None and not self.regex.search(row.name):
            return
        if monitor == MODULE and self.s.module_io == "outputs" and \
                module_io(row.name) not in (OUTPUT, GRAD_OUTPUT):
            return
        base = tensor_base(monitor, row.name, row.scope)
        if self.s.by == "tensor":
            group: Tuple[str, ...] = (monitor, base)
            line = row.scope + micro_label
        else:
            group = (monitor, row.scope, layer_of(base, self.s.layer_depth))
            line = row.name + micro_label
        series = self.where.get((group, line))
        if series is None:
            # the group's last figure, or a new one (part 2, 3, ...) when it is full
            part = self.parts.get(group, 0)
            fig = self.figures.get(group + (str(part),)) if part else None
            if fig is None or len(fig) >= self.s.lines_per_plot:
                fig_key = group + (str(part + 1),)
                if len(self.figures) >= self.s.max_plots:
                    if len(self.omitted_figures) < 10000:
                        self.omitted_figures.setdefault(group, None)
                    self.omitted_lines += 1
                    self.where[(group, line)] = _DROPPED
                    return
                fig = self.figures[fig_key] = {}
                self.fig_order.append(fig_key)
                self.parts[group] = part + 1
            series = fig[line] = Series()
            self.where[(group, line)] = series
        elif series is _DROPPED:
            return
        series.steps.append(row.step)
        series.values.append(v)

    def _aggregate(self, agg: _Agg, v: float) -> None:
        if v != v or v in (INF, -INF):
            agg.bad = True
            return
        stat = self.s.stat
        agg.n += 1
        if stat == "norm":
            agg.acc += v * v
        elif stat == "max":
            agg.acc = max(agg.acc, v)
        elif stat == "min":
            agg.acc = min(agg.acc, v)
        else:  # mean (averaged), nans and zeros (summed)
            agg.acc += v

    def overview_value(self, agg: _Agg) -> float:
        if agg.bad or agg.n == 0:
            return float("nan")
        if self.s.stat == "norm":
            return agg.acc ** 0.5
        if self.s.stat == "mean":
            return agg.acc / agg.n
        return agg.acc


def _whose(report: Any, rank: int) -> str:
    """``rank 3``, or ``merged view`` for the pseudo-rank of a merged view."""
    return "merged view" if report.layout.merged is not None else f"rank {rank}"


def _split_dp(label: str) -> Tuple[str, Optional[int]]:
    """A line label without its `` dp<d>`` suffix (a merged view's per-dp row), and ``d``."""
    m = _DP_LABEL.search(label)
    return (label, None) if m is None else (label[:m.start()], int(m.group(1)))


_DP_LABEL = re.compile(r" dp(\d+)$")


# --------------------------------------------------------------------- rendering
def _slug(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_.")
    return s[:60] or "x"


def import_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.transforms import blended_transform_factory
    except ImportError:
        raise InputError(f"plot needs matplotlib: {pip_command('matplotlib>=3.5')}") from None
    return Figure, FigureCanvasAgg, blended_transform_factory


class DrawnFigure(tuple):
    """One drawn figure: unpacks as ``(section, title, file name)``; ``monitor``,
    ``scope`` (None for an overview and for ``--by tensor``) and ``overview`` place it
    in the report."""

    monitor: str
    scope: Optional[str]
    overview: bool

    def __new__(cls, section: str, title: str, name: str, monitor: str, scope: Optional[str],
                overview: bool) -> "DrawnFigure":
        fig = super().__new__(cls, (section, title, name))
        fig.monitor, fig.scope, fig.overview = monitor, scope, overview
        return fig


def _finite(v: float) -> bool:
    return v == v and abs(v) != INF


@dataclass
class YView:
    """How the y axis of a figure is drawn: ``log``, and ``limits`` when values that ran
    away around a NaN/Inf are left out (None: matplotlib's own limits)."""
    log: bool
    limits: Optional[Tuple[float, float]] = None


RUNAWAY = 1e4  # a value this many times the line's typical size before its NaN has run away


def y_view(lines: List[Tuple[str, List[float], List[float]]], yscale: str = "auto") -> YView:
    """Before and after a NaN/Inf, finite values often run away (a bad batch, a loss
    blowing up: 1e30 where the run had 1); on an axis scaled to them the rest of the run
    is a flat line. So in a figure with a non-finite value, a finite value more than
    ``RUNAWAY`` times the median magnitude of its line's values before the figure's
    first non-finite step is left out of the y range (it is drawn as a triangle on the
    edge), and the scale (log or linear) is chosen from the values kept. A figure
    without NaN/Inf keeps every value in range."""
    bad = [s for _, steps, vals in lines for s, v in zip(steps, vals) if not _finite(v)]
    if not bad:
        return YView(use_log_scale(lines, yscale))
    first = min(bad)
    kept_lines, kept, dropped = [], [], 0
    for label, steps, vals in lines:
        sizes = sorted(abs(v) for s, v in zip(steps, vals) if _finite(v) and s < first)
        ref = sizes[len(sizes) // 2] if sizes else 0.0
        pts = [(s, v) for s, v in zip(steps, vals) if _finite(v)]
        ok = [(s, v) for s, v in pts if ref == 0.0 or abs(v) <= RUNAWAY * ref]
        dropped += len(pts) - len(ok)
        kept_lines.append((label, [s for s, _ in ok], [v for _, v in ok]))
        kept.extend(v for _, v in ok)
    if not dropped or not kept:
        return YView(use_log_scale(lines, yscale))
    log = use_log_scale(kept_lines, yscale)
    lo, hi = min(kept), max(kept)
    if log:
        return YView(True, (lo / 1.5, hi * 1.5))
    span = max(hi - lo, abs(hi) * 0.05, 1e-30)
    return YView(False, (lo - 0.15 * span, hi + 0.15 * span))


def _runs(bad: List[float], steps: List[float]) -> List[Tuple[float, float]]:
    """Consecutive runs (first, last) of the ``bad`` steps within the sorted ``steps``."""
    bad_set = set(bad)
    out: List[List[float]] = []
    prev_bad = False
    for st in steps:
        if st in bad_set:
            if prev_bad:
                out[-1][1] = st
            else:
                out.append([st, st])
        prev_bad = st in bad_set
    return [(a, b) for a, b in out]


def _short(label: str, prefix: Optional[str]) -> str:
    if prefix and label.startswith(prefix + ".") and len(label) > len(prefix) + 1:
        label = label[len(prefix) + 1:]
    return label if len(label) <= 40 else label[:37] + "..."


def _draw(path: str, title: str, lines: List[Tuple[str, List[float], List[float]]], stat: str,
          yscale: str, first_bad: Optional[int], spikes: List[Tuple[str, int, float]],
          x_range: Optional[Tuple[float, float]] = None, small: bool = False,
          prefix: Optional[str] = None) -> None:
    """One figure. ``small``: a cell of the report's grid (legend below the axes, labels
    without the ``prefix`` the title already names); else one across the page.
    ``x_range``: the steps every figure of the report shows."""
    Figure, FigureCanvasAgg, blended = import_matplotlib()
    fig = Figure(figsize=(4.6, 3.2) if small else (8.4, 3.2), dpi=100, layout="constrained" if small else None)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    view = y_view(lines, yscale)
    bad_steps: set = set()
    bad_lines = 0
    clipped_x: List[float] = []
    clipped_y: List[float] = []
    clipped_c: List[str] = []
    clipped_m: List[str] = []
    for i, (label, steps, values) in enumerate(lines):
        colour, style = line_style(i)
        xs = [s for s, v in zip(steps, values) if _finite(v)]
        ys = [v for v in values if _finite(v)]
        bad = [s for s, v in zip(steps, values) if not _finite(v)]
        bad_steps.update(bad)
        bad_lines += bool(bad)
        ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3, linewidth=1.4, color=colour,
                linestyle=style, label=_short(label, prefix))
        if view.limits is not None:
            lo, hi = view.limits
            for x, y in zip(xs, ys):
                if y > hi or y < lo:
                    clipped_x.append(x)
                    clipped_y.append(hi if y > hi else lo)
                    clipped_c.append(colour)
                    clipped_m.append("^" if y > hi else "v")
    all_steps = sorted({st for _, steps, _ in lines for st in steps})
    lo_x, hi_x = x_range if x_range else ((all_steps[0], all_steps[-1]) if all_steps else (0, 1))
    pad = max(0.5, 0.02 * (hi_x - lo_x))
    ax.set_xlim(lo_x - pad, hi_x + pad)
    trans = blended(ax.transData, ax.transAxes)
    if bad_steps:
        gaps = [b - a for a, b in zip(all_steps, all_steps[1:])]
        half = (sorted(gaps)[len(gaps) // 2] if gaps else 1.0) / 2
        label = f"NaN/Inf ({bad_lines} of {len(lines)} line{'s' if len(lines) > 1 else ''})"
        # a cross per step while they can be told apart; over a long run the band alone
        crosses = len(bad_steps) <= MAX_CROSSES
        for a, b in _runs(sorted(bad_steps), all_steps):
            ax.axvspan(a - half, b + half, color=NAN_COLOUR, alpha=0.12, linewidth=0, zorder=0,
                       label=None if crosses else label)
            label = label if crosses else None
        if crosses:
            ax.scatter(sorted(bad_steps), [0.96] * len(bad_steps), marker="x", color=NAN_COLOUR, s=30,
                       transform=trans, zorder=5, clip_on=False, label=label)
    if first_bad is not None:
        ax.axvline(first_bad, color=NAN_COLOUR, linestyle="--", linewidth=1.0,
                   label=f"first NaN/Inf of the rank (step {first_bad})")
    if spikes:
        # a spike beyond a clipped axis is circled on its edge
        lo_y, hi_y = view.limits if view.limits is not None else (-INF, INF)
        ax.scatter([s for _, s, _ in spikes], [min(max(v, lo_y), hi_y) for _, _, v in spikes], s=80,
                   facecolors="none", clip_on=False,
                   edgecolors=SPIKE_COLOUR, linewidths=2, zorder=6, label="spike")
    if view.log:
        ax.set_yscale("log")
    if view.limits is not None:
        ax.set_ylim(*view.limits)
        label = "beyond the y range (clipped)"
        for marker in ("^", "v"):
            idx = [k for k, m in enumerate(clipped_m) if m == marker]
            if idx:
                ax.scatter([clipped_x[k] for k in idx], [clipped_y[k] for k in idx], marker=marker, s=28,
                           c=[clipped_c[k] for k in idx], clip_on=False, zorder=7, label=label)
                label = None
    ax.set_title(title, fontsize=9 if small else 10)
    ax.set_xlabel("step", fontsize=8.5 if small else 10)
    ax.set_ylabel(stat, fontsize=8.5 if small else 10)
    ax.tick_params(labelsize=8 if small else 9)
    ax.grid(True, alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if lines or bad_steps:
        if small:
            # below the axes, two entries a row; the figure grows with it and the constrained
            # layout keeps it clear of the axis label
            rows = (len(ax.get_legend_handles_labels()[1]) + 1) // 2
            fig.set_size_inches(4.6, 2.45 + 0.15 * rows)
            fig.legend(fontsize=7.5, loc="outside lower center", ncol=2, frameon=False, handlelength=2.2,
                       columnspacing=1.0)
        else:
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    if not small:
        fig.tight_layout()
    with replace_file(path) as fh:  # never through a link planted at the name
        fig.savefig(fh, format="png")


def render(collector: PlotCollector, report: Report, out_dir: str) -> List[DrawnFigure]:
    """Draw every figure into ``out_dir``; returns them in report order (each unpacks as
    ``(section, title, file name)``)."""
    s = collector.s
    try:
        make_dirs(out_dir, link_ok=False)  # a linked report directory is refused, naming it
    except UnsafePathError as exc:
        raise InputError(str(exc)) from None
    except OSError as exc:
        raise InputError(f"{out_dir}: cannot create the output directory: {exc.strerror or exc}") from None
    if not os.access(out_dir, os.W_OK):
        raise InputError(f"{out_dir}: the output directory is not writable")
    rank = collector.rank
    first = report.first_nonfinite.get(rank)
    first_bad = first[1]["step"] if first else None
    # one step axis for every figure: the small multiples line up
    every_step = [st for per_scope in collector.overview.values() for per_step in per_scope.values()
                  for st in per_step]
    x_range = (min(every_step), max(every_step)) if every_step else None
    # spikes of the plotted statistic on this rank: (monitor, scope, tensor, micro_step) -> steps
    plotted = {"max": "absmax"}.get(s.stat, s.stat)
    spike_steps: Dict[Tuple[str, str, str, Optional[int]], set] = {}
    for sp in report.spikes.items():
        if sp["rank"] == rank and plotted in sp["stats"]:
            micro = sp["micro_step"] if (sp["monitor"] == WEIGHT_GRAD and sp["scope"] == UNREDUCED) else None
            spike_steps.setdefault((sp["monitor"], sp["scope"], sp["tensor"], micro, sp.get("dp_rank")),
                                   set()).add(sp["step"])
    made: List[DrawnFigure] = []
    n = 0
    for monitor in MONITORS:
        lines_map = collector.overview.get(monitor)
        if not lines_map:
            continue
        lines = []
        for label, per_step in lines_map.items():
            steps = sorted(per_step)
            lines.append((label, steps, [collector.overview_value(per_step[st]) for st in steps]))
        n += 1
        name = f"{n:03d}_overview_{monitor}_{s.stat}.png"
        agg = {"norm": "global L2 norm", "max": "largest max", "min": "smallest min",
               "mean": "average of means", "nans": "total NaN count",
               "zeros": "total zero count"}[s.stat]
        title = f"{monitor}: {agg} over all tensors, per scope ({_whose(report, rank)})"
        _draw(os.path.join(out_dir, name), title, lines, s.stat, s.yscale, first_bad, [], x_range)
        made.append(DrawnFigure("Overview", title, name, monitor, None, True))
    scope_rank: Dict[Tuple[str, str], int] = {}
    for key in collector.fig_order:
        scope_rank.setdefault((key[0], key[1]), len(scope_rank))

    def fig_sort(item: Tuple[int, Tuple[str, ...]]) -> Tuple[int, int, int]:
        i, key = item
        m = MONITORS.index(key[0]) if key[0] in MONITORS else 99
        return (m, 0, i) if s.by == "tensor" else (m, scope_rank[(key[0], key[1])], i)

    for _, key in sorted(enumerate(collector.fig_order), key=fig_sort):
        series = collector.figures[key]
        monitor, group, part = key[0], key[:-1], int(key[-1])
        lines = [(label, list(ser.steps), list(ser.values)) for label, ser in series.items()]
        marks: List[Tuple[str, int, float]] = []
        for label, ser in series.items():
            core, dp = _split_dp(label)
            if s.by == "tensor":
                scope, _, mb = core.partition(" mb")
                tensor_of = [(t, sc) for (m, sc, t, _m, _d) in spike_steps if m == monitor and sc == scope
                             and tensor_base(m, t, sc) == key[1]]
                names = [t for t, _ in tensor_of]
            else:
                scope = key[1]
                tensor, _, mb = core.partition(" mb")
                names = [tensor]
            micro = int(mb) if mb else None
            for tensor in names:
                hit = spike_steps.get((monitor, scope, tensor, micro, dp))
                if hit:
                    marks.extend((label, st, v) for st, v in zip(ser.steps, ser.values) if int(st) in hit)
        if s.by == "tensor":
            title = f"{monitor} {key[1]}: {s.stat} ({_whose(report, rank)})"
            prefix = None
        else:
            layer = key[2]
            title = f"{monitor} {key[1]}, {layer}: {s.stat} ({_whose(report, rank)})"
            prefix = None if layer == TOP_LEVEL else layer
        if collector.parts.get(group, 1) > 1:
            title += f" ({part}/{collector.parts[group]})"
        n += 1
        name = f"{n:03d}_{_slug('_'.join(key[:-1]))}" + (f"_{part}" if part > 1 else "") + ".png"
        _draw(os.path.join(out_dir, name), title, lines, s.stat, s.yscale, first_bad, marks, x_range,
              small=True, prefix=prefix)
        made.append(DrawnFigure(monitor, title, name, monitor, None if s.by == "tensor" else key[1], False))
    return made


def draw_moe_heat_maps(layout: Any, rank: int, problems: Any, steps: Any, out_dir: str,
                       numbered_from: int) -> List[DrawnFigure]:
    """The MoE routers' layer x step heat maps of one rank: MaxVio (max/mean - 1 of the
    tokens per expert) and the dead experts (``zeros``), from the ``moe`` rows (none
    without them). Appended to the ``moe`` section of the report, across the page."""
    from .moe import heat_maps

    routers, all_steps, vio, dead = heat_maps(layout, rank, problems, steps)
    if not routers or not all_steps:
        return []
    Figure, FigureCanvasAgg, _ = import_matplotlib()
    made: List[DrawnFigure] = []
    for i, (what, grid, cmap) in enumerate((("MaxVio = max/mean - 1 of tokens per expert", vio, "viridis"),
                                            ("dead experts (zero tokens)", dead, "Reds"))):
        fig = Figure(figsize=(8.4, max(2.4, 0.32 * len(routers) + 1.4)), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap,
                          extent=(all_steps[0] - 0.5, all_steps[-1] + 0.5, len(routers) - 0.5, -0.5))
        ax.set_yticks(range(len(routers)))
        ax.set_yticklabels(routers, fontsize=7)
        ax.set_xlabel("step")
        fig.colorbar(image, ax=ax)
        # a merged view: the model's counts (merge summed the ranks' sidecars)
        who = "merged view: the model's tokens" if getattr(layout, "merged", None) is not None else f"rank {rank}"
        title = f"moe: {what}, router x step ({who})"
        ax.set_title(title, fontsize=10)
        name = f"{numbered_from + i:03d}_moe_heat_{'maxvio' if i == 0 else 'dead'}.png"
        with replace_file(os.path.join(out_dir, name)) as fh:  # never through a link planted at the name
            fig.savefig(fh, format="png")
        made.append(DrawnFigure("moe", title, name, "moe", None, True))
    return made


# --------------------------------------------------------------------- HTML report
_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 0;
       color: #1d2733; background: #f7f9fb; }
.layout { display: grid; grid-template-columns: 210px minmax(0, 1fr); }
nav { position: sticky; top: 0; align-self: start; max-height: 100vh; overflow-y: auto; box-sizing: border-box;
      padding: 16px 12px; background: #eef2f7; border-right: 1px solid #dde3ea; font-size: 13px; }
nav h2 { font-size: 15px; margin: 0 0 8px 0; border: none; }
nav ul { list-style: none; padding-left: 0; margin: 0; } nav ul ul { padding-left: 14px; }
nav li { margin: 3px 0; } nav a { color: #1d4f91; text-decoration: none; } nav a:hover { text-decoration: underline; }
nav .count { color: #56606b; } nav .alert { color: #b3261e; }
main { padding: 12px 18px; min-width: 0; }
h1 { font-size: 22px; margin: 4px 0; } h2 { font-size: 18px; margin-top: 28px;
     border-bottom: 2px solid #3c78d8; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 6px 0; } h2 a.top, h3 a.top { font-size: 12px; font-weight: normal;
     margin-left: 10px; color: #56606b; text-decoration: none; }
.meta { color: #56606b; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0 16px 0; background: white; }
th { background: #3c78d8; color: white; text-align: left; padding: 4px 8px; }
td { border-bottom: 1px solid #dde3ea; padding: 3px 8px; font-family: Menlo, Consolas, monospace; }
tr.bad td { background: #fde8e6; } .ok { color: #1e7d32; font-weight: bold; }
.alert { color: #b3261e; font-weight: bold; }
.tables { overflow-x: auto; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(320px, 1fr)); gap: 8px; }
figure { margin: 0; background: white; padding: 4px; border: 1px solid #dde3ea; }
figure.overview { max-width: 760px; margin: 8px 0; }
figcaption { font-size: 12px; color: #56606b; } img { width: 100%; height: auto; display: block; }
.legend { font-size: 12px; color: #56606b; margin: 4px 0 10px 0; }
.legend b.nan { color: #d62728; } .legend b.spike { color: #ff7f0e; }
@media (max-width: 800px) { .layout { grid-template-columns: 1fr; } nav { position: static; max-height: none; } }
"""


def _html_table(headers: List[str], rows: List[List[Any]], bad_first: bool = False) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>"]
    for i, row in enumerate(rows):
        cls = ' class="bad"' if bad_first and i == 0 else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(fmt_num(c))}</td>" for c in row) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _anchor(*parts: str) -> str:
    """An id for the report's links: letters, digits, '-', '_' and '.' only."""
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p) for p in parts)


def _toc_title(title: str) -> str:
    """'First non-finite value of each rank' -> itself; '... (NaN/Inf)' and '(first
    difference of each rank)' dropped: the contents stay one line each."""
    return re.sub(r"\s*\((NaN/Inf|first difference of each rank)\)$", "", title)


_Groups = List[Tuple[Optional[str], List[DrawnFigure]]]


def _sections(figures: List[DrawnFigure]) -> List[Tuple[str, List[DrawnFigure], _Groups]]:
    """[(monitor, its overviews, [(scope or None, its figures)])] in report order."""
    out: Dict[str, Tuple[List[DrawnFigure], _Groups]] = {}
    for fig in figures:
        overviews, groups = out.setdefault(fig.monitor, ([], []))
        if fig.overview:
            overviews.append(fig)
        else:
            if not groups or groups[-1][0] != fig.scope:
                groups.append((fig.scope, []))
            groups[-1][1].append(fig)
    return [(monitor, overviews, groups) for monitor, (overviews, groups) in out.items()]


def write_html(path: str, report: Report, collector: PlotCollector, figures: List[DrawnFigure],
               embed: bool, anomaly_rows: Dict[str, Any]) -> None:
    layout = report.layout
    steps = sorted({st for c in report.collected.values() for st in c.steps})
    sections = _sections(figures)
    # the table of contents: anomalies, a monitor and its scopes, what was not plotted
    toc = ["<nav id='contents'><h2>Contents</h2><ul>",
           "<li><a href='#anomalies'>Anomalies</a> "
           + ("<span class='alert'>(found)</span>" if report.anomalies_found else "<span class='count'>(none)</span>"),
           "<ul>" + "".join(f"<li><a href='#{_anchor('anomalies', str(i))}'>{html.escape(_toc_title(title))}</a> "
                            f"<span class='{'alert' if rows else 'count'}'>({len(rows)})</span></li>"
                            for i, (title, (_, rows, _)) in enumerate(anomaly_rows.items(), 1)) + "</ul></li>"]
    for monitor, overviews, groups in sections:
        count = len(overviews) + sum(len(f) for _, f in groups)
        toc.append(f"<li><a href='#{_anchor('monitor', monitor)}'>{html.escape(monitor)}</a> "
                   f"<span class='count'>({count} figure{'s' if count != 1 else ''})</span>")
        scoped = [g for g in groups if g[0] is not None]
        if scoped:
            toc.append("<ul>" + "".join(
                f"<li><a href='#{_anchor('monitor', monitor, scope)}'>{html.escape(scope)}</a> "
                f"<span class='count'>({len(f)})</span></li>" for scope, f in scoped) + "</ul>")
        toc.append("</li>")
    if collector.omitted_lines:
        toc.append("<li><a href='#not-plotted'>Not plotted</a></li>")
    toc.append("</ul></nav>")
    top = "<a class='top' href='#contents'>&uarr; contents</a>"
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>msprobe-monitor report: {html.escape(layout.root)}</title>",
        f"<style>{_CSS}</style></head><body><div class='layout'>",
        *toc,
        "<main>",
        "<h1>msprobe-monitor report</h1>",
        f"<div class='meta'>{html.escape(os.path.abspath(layout.root))} &middot; ranks "
        f"{html.escape(', '.join(map(str, layout.ranks)))} &middot; monitors {html.escape(', '.join(layout.monitors))}"
        f" &middot; steps {html.escape(compact_steps(steps))} &middot; plots of <b>{html.escape(collector.s.stat)}</b>"
        f" on {html.escape(_whose(report, collector.rank))} &middot; generated {datetime.now().strftime('%Y-%m-%d %H:%M:%S')}</div>",
        f"<section id='anomalies'><h2>Anomalies{top}</h2><div class='tables'>",
    ]
    if not report.anomalies_found:
        parts.append("<p class='ok'>No anomaly: every value is finite, no spike, ranks agree.</p>")
    for i, (title, (headers, rows, note)) in enumerate(anomaly_rows.items(), 1):
        parts.append(f"<h3 id='{_anchor('anomalies', str(i))}'>{html.escape(title)}</h3>")
        if note:
            parts.append(f"<p class='meta'>{html.escape(note)}</p>")
        if rows:
            parts.append(_html_table(headers, rows, bad_first=title.startswith("First non-finite value (")))
        else:
            parts.append("<p class='ok'>none</p>")
    if report.problems.count:
        parts.append(f"<h3 class='alert'>Malformed input ({report.problems.count} skipped)</h3><ul>")
        parts.extend(f"<li><code>{html.escape(str(p))}</code></li>" for p in report.problems.items[:50])
        parts.append("</ul>")
    parts.append("</div></section>")
    if sections:
        parts.append("<p class='legend'>In every figure: <b class='nan'>red band and crosses</b> = steps with "
                     "NaN/Inf (the line stops there), red dashed line = the rank's first NaN/Inf, <b "
                     "class='spike'>orange circle</b> = spike, triangle on the edge = a finite value that ran away "
                     "(in a figure with NaN/Inf, over 1e4 times its line's median before the first one) and is "
                     "left out of the y range. Figures share the step axis; each has its own y axis.</p>")

    def figure_html(fig: DrawnFigure, cls: str) -> str:
        _, title, name = fig
        if embed:
            data = read_own_file(os.path.join(os.path.dirname(path), name))
            src = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
            img = f"<img src=\"{src}\" alt=\"{html.escape(title)}\">"
        else:
            src = html.escape(name)
            img = f"<a href=\"{src}\"><img src=\"{src}\" alt=\"{html.escape(title)}\"></a>"
        fid = _anchor("fig", os.path.splitext(name)[0])
        return f"<figure id='{fid}' class='{cls}'>{img}<figcaption>{html.escape(title)}</figcaption></figure>"

    for monitor, overviews, groups in sections:
        parts.append(f"<section id='{_anchor('monitor', monitor)}' class='monitor'>"
                     f"<h2>Monitor {html.escape(monitor)}{top}</h2>")
        parts.extend(figure_html(f, "overview") for f in overviews)
        for scope, figs in groups:
            if scope is not None:
                parts.append(f"<h3 id='{_anchor('monitor', monitor, scope)}'>{html.escape(monitor)} "
                             f"{html.escape(scope)} <span class='count meta'>({len(figs)} figure"
                             f"{'s' if len(figs) != 1 else ''})</span>{top}</h3>")
            parts.append("<div class='grid'>")
            parts.extend(figure_html(f, "small") for f in figs)
            parts.append("</div>")
        parts.append("</section>")
    if collector.omitted_lines:
        shown = list(collector.omitted_figures)[:30]
        parts.append(f"<section id='not-plotted'><h2>Not plotted{top}</h2><p class='meta'>"
                     f"{collector.omitted_lines} tensor line(s) of {len(collector.omitted_figures)} group(s) did "
                     f"not fit in --max-plots {collector.s.max_plots} figures; choose with --match, --monitors or "
                     "--steps, or raise --max-plots. Groups: "
                     + html.escape(", ".join(" ".join(k) for k in shown)) + "</p></section>")
    parts.append("</main></div></body></html>")
    with replace_file(path) as fh:  # never through a link planted at the name
        fh.write("\n".join(parts).encode("utf-8"))
