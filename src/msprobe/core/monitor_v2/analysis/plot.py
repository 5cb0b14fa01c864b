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

Non-finite values are drawn as red crosses at the top of the axes, the rank's first
non-finite step as a red dashed line, detected spikes as orange circles.

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

from .detect import Report
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
    if monitor == "module":
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and _NUM.match(parts[2]):
            return parts[0]
    elif monitor == "optimizer" and name.endswith("." + scope):
        return name[: -len(scope) - 1]
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


# Six well-separated colours, solid then dashed: twelve lines (the default --lines-per-plot)
# that can each be told apart, where a 20-colour map gives near-identical neighbours.
LINE_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#17becf")
LINE_STYLES = ("-", "--", ":", "-.")


def line_style(i: int) -> Tuple[str, str]:
    """(colour, line style) of the i-th line of a figure: unique for the first 24."""
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
    """A row visitor for :func:`analysis.detect.analyse` keeping the plotted series."""

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
        micro_label = f" mb{row.micro}" if (monitor == "weight_grad" and row.scope == "unreduced") else ""
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
        if monitor == "module" and self.s.module_io == "outputs" and \
                module_io(row.name) not in ("output", "grad_output"):
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


# --------------------------------------------------------------------- rendering
def _slug(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_.")
    return s[:60] or "x"


def _import_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.transforms import blended_transform_factory
    except ImportError:
        raise InputError("plot needs matplotlib: pip install 'msprobe-monitor[analysis]' "
                         "(or pip install 'matplotlib>=3.5')") from None
    return Figure, FigureCanvasAgg, blended_transform_factory


def _draw(path: str, title: str, lines: List[Tuple[str, List[float], List[float]]], stat: str,
          yscale: str, first_bad: Optional[int], spikes: List[Tuple[str, int, float]]) -> None:
    Figure, FigureCanvasAgg, blended = _import_matplotlib()
    fig = Figure(figsize=(9.0, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    finite_all: List[float] = []
    bad_steps: List[float] = []
    for i, (label, steps, values) in enumerate(lines):
        colour, style = line_style(i)
        xs = [s for s, v in zip(steps, values) if v == v and abs(v) != INF]
        ys = [v for v in values if v == v and abs(v) != INF]
        bad_steps.extend(s for s, v in zip(steps, values) if not (v == v and abs(v) != INF))
        finite_all.extend(ys)
        ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3, linewidth=1.4, color=colour,
                linestyle=style, label=label if len(label) <= 48 else label[:45] + "...")
    all_steps = [st for _, steps, _ in lines for st in steps]
    if all_steps:
        lo, hi = min(all_steps), max(all_steps)
        pad = max(0.5, 0.02 * (hi - lo))
        ax.set_xlim(lo - pad, hi + pad)
    trans = blended(ax.transData, ax.transAxes)
    if bad_steps:
        ax.scatter(bad_steps, [0.96] * len(bad_steps), marker="x", color="red", s=40, transform=trans,
                   zorder=5, label="NaN/Inf")
    if first_bad is not None:
        ax.axvline(first_bad, color="red", linestyle="--", linewidth=1.0,
                   label=f"first NaN/Inf of the rank (step {first_bad})")
    if spikes:
        ax.scatter([s for _, s, _ in spikes], [v for _, _, v in spikes], s=80, facecolors="none",
                   edgecolors="orange", linewidths=2, zorder=6, label="spike")
    if use_log_scale(lines, yscale):
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(stat)
    ax.grid(True, alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if lines or bad_steps:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path)


def render(collector: PlotCollector, report: Report, out_dir: str) -> List[Tuple[str, str, str]]:
    """Draw every figure into ``out_dir``; returns ``[(section, title, file name)]``."""
    s = collector.s
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{out_dir}: cannot create the output directory: {exc.strerror or exc}") from None
    if not os.access(out_dir, os.W_OK):
        raise InputError(f"{out_dir}: the output directory is not writable")
    rank = collector.rank
    first = report.first_nonfinite.get(rank)
    first_bad = first[1]["step"] if first else None
    # spikes of the plotted statistic on this rank: (monitor, scope, tensor, micro_step) -> steps
    plotted = {"max": "absmax"}.get(s.stat, s.stat)
    spike_steps: Dict[Tuple[str, str, str, Optional[int]], set] = {}
    for sp in report.spikes.items():
        if sp["rank"] == rank and plotted in sp["stats"]:
            micro = sp["micro_step"] if (sp["monitor"] == "weight_grad" and sp["scope"] == "unreduced") else None
            spike_steps.setdefault((sp["monitor"], sp["scope"], sp["tensor"], micro), set()).add(sp["step"])
    made: List[Tuple[str, str, str]] = []
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
        title = f"{monitor}: {agg} over all tensors, per scope (rank {rank})"
        _draw(os.path.join(out_dir, name), title, lines, s.stat, s.yscale, first_bad, [])
        made.append(("Overview", title, name))
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
            if s.by == "tensor":
                scope, _, mb = label.partition(" mb")
                tensor_of = [(t, sc) for (m, sc, t, _m) in spike_steps if m == monitor and sc == scope
                             and tensor_base(m, t, sc) == key[1]]
                names = [t for t, _ in tensor_of]
            else:
                scope = key[1]
                tensor, _, mb = label.partition(" mb")
                names = [tensor]
            micro = int(mb) if mb else None
            for tensor in names:
                hit = spike_steps.get((monitor, scope, tensor, micro))
                if hit:
                    marks.extend((label, st, v) for st, v in zip(ser.steps, ser.values) if int(st) in hit)
        if s.by == "tensor":
            title = f"{monitor} {key[1]}: {s.stat} (rank {rank})"
        else:
            layer = key[2]
            title = f"{monitor} {key[1]}, {layer}: {s.stat} (rank {rank})"
        if collector.parts.get(group, 1) > 1:
            title += f" ({part}/{collector.parts[group]})"
        n += 1
        name = f"{n:03d}_{_slug('_'.join(key[:-1]))}" + (f"_{part}" if part > 1 else "") + ".png"
        _draw(os.path.join(out_dir, name), title, lines, s.stat, s.yscale, first_bad, marks)
        made.append((monitor, title, name))
    return made


# --------------------------------------------------------------------- HTML report
_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 24px;
       color: #1d2733; background: #f7f9fb; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 28px;
     border-bottom: 2px solid #3c78d8; padding-bottom: 4px; }
.meta { color: #56606b; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0 16px 0; background: white; }
th { background: #3c78d8; color: white; text-align: left; padding: 4px 8px; }
td { border-bottom: 1px solid #dde3ea; padding: 3px 8px; font-family: Menlo, Consolas, monospace; }
tr.bad td { background: #fde8e6; } .ok { color: #1e7d32; font-weight: bold; }
.alert { color: #b3261e; font-weight: bold; }
figure { display: inline-block; margin: 8px; background: white; padding: 6px; border: 1px solid #dde3ea; }
figcaption { font-size: 12px; color: #56606b; } img { max-width: 100%; }
"""


def _html_table(headers: List[str], rows: List[List[Any]], bad_first: bool = False) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>"]
    for i, row in enumerate(rows):
        cls = ' class="bad"' if bad_first and i == 0 else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(fmt_num(c))}</td>" for c in row) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def write_html(path: str, report: Report, collector: PlotCollector, figures: List[Tuple[str, str, str]],
               embed: bool, anomaly_rows: Dict[str, Any]) -> None:
    layout = report.layout
    steps = sorted({st for c in report.collected.values() for st in c.steps})
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>msprobe-monitor report: {html.escape(layout.root)}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>msprobe-monitor report</h1>",
        f"<div class='meta'>{html.escape(os.path.abspath(layout.root))} &middot; ranks "
        f"{html.escape(', '.join(map(str, layout.ranks)))} &middot; monitors {html.escape(', '.join(layout.monitors))}"
        f" &middot; steps {html.escape(compact_steps(steps))} &middot; plots of <b>{html.escape(collector.s.stat)}</b>"
        f" on rank {collector.rank} &middot; generated {datetime.now().strftime('%Y-%m-%d %H:%M:%S')}</div>",
        "<h2>Anomalies</h2>",
    ]
    if not report.anomalies_found:
        parts.append("<p class='ok'>No anomaly: every value is finite, no spike, ranks agree.</p>")
    for title, (headers, rows, note) in anomaly_rows.items():
        parts.append(f"<h3>{html.escape(title)}</h3>")
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
    section = None
    for sec, title, name in figures:
        if sec != section:
            section = sec
            parts.append(f"<h2>{html.escape(sec if sec == 'Overview' else 'Monitor ' + sec)}</h2>")
        if embed:
            with open(os.path.join(os.path.dirname(path), name), "rb") as fh:
                src = "data:image/png;base64," + base64.b64encode(fh.read()).decode("ascii")
        else:
            src = html.escape(name)
        parts.append(f"<figure><img src=\"{src}\" alt=\"{html.escape(title)}\">"
                     f"<figcaption>{html.escape(title)}</figcaption></figure>")
    if collector.omitted_lines:
        shown = list(collector.omitted_figures)[:30]
        parts.append("<h2>Not plotted</h2><p class='meta'>"
                     f"{collector.omitted_lines} tensor line(s) of {len(collector.omitted_figures)} group(s) did "
                     f"not fit in --max-plots {collector.s.max_plots} figures; choose with --match, --monitors or "
                     "--steps, or raise --max-plots. Groups: "
                     + html.escape(", ".join(" ".join(k) for k in shown)) + "</p>")
    parts.append("</body></html>")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(parts))
