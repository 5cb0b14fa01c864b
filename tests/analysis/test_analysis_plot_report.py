"""The HTML report of ``plot`` reads at a glance (issue 26, item 7): a table of contents
whose links all land, one section per monitor with a sub-section per scope, the figures
as small multiples (a grid, not one long column), NaN/Inf marked in a colour no series
uses, and values that ran away around a NaN/Inf kept out of the y range so the rest of
the run stays readable.

The page is opened in headless Chromium and looked at as rendered: a probe script added
to a copy of the report reads the layout (links and their targets, image sizes, grid
columns, the contents bar after scrolling) once every image has loaded, and Chromium's
``--dump-dom`` hands it back. Colours are checked on the PNG pixels, the clipped axis
against the CSV values read with NumPy."""

import colorsys
import csv
import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from analysis_helpers import cli, training_runs
from support import TinyMLP, loss_fn, make_batches
from support.extras import needs_matplotlib, needs_polars
from msprobe.core.monitor_v2 import TrainerMonitorV2
from msprobe.core.monitor_v2.analysis.plot import LINE_COLOURS, NAN_COLOUR, RUNAWAY, SPIKE_COLOUR, y_view
from test_analysis_plot import find_chromium

pytestmark = [needs_polars, needs_matplotlib]  # every test runs msprobe-monitor plot on its default engine

WIDTH = 1400

PROBE = """
window.addEventListener('load', () => {
  const rect = e => e.getBoundingClientRect();
  const ids = new Set([...document.querySelectorAll('[id]')].map(e => e.id));
  const hrefs = [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href'));
  const internal = hrefs.filter(h => h.startsWith('#'));
  const figures = [...document.querySelectorAll('figure')].map(f => {
    const img = f.querySelector('img');
    return {id: f.id, cls: f.className, natural: img.naturalWidth, width: rect(img).width,
            height: rect(f).height, left: rect(f).left};
  });
  const grids = [...document.querySelectorAll('.grid')].map(
    g => ({n: g.children.length, columns: new Set([...g.children].map(c => Math.round(rect(c).left))).size}));
  const sections = [...document.querySelectorAll('main section')].map(s => ({
    id: s.id, heading: s.querySelector('h2').firstChild.textContent,
    scopes: [...s.querySelectorAll('h3[id]')].map(h => h.id)}));
  const toc = [...document.querySelectorAll('nav#contents a')].map(a => a.getAttribute('href'));
  const targets = toc.map(h => { const t = document.getElementById(h.slice(1)); return t ? rect(t).height : -1; });
  window.scrollTo(0, document.documentElement.scrollHeight);
  const nav = rect(document.querySelector('nav#contents'));
  const out = document.createElement('pre');
  out.id = 'probe';
  out.textContent = JSON.stringify({
    broken: internal.filter(h => !ids.has(h.slice(1))), internal: internal.length,
    files: hrefs.filter(h => !h.startsWith('#')), figures, grids, sections, toc, targets,
    height: document.documentElement.scrollHeight, scrolled: window.scrollY,
    navTopAfterScroll: nav.top, navHeight: nav.height});
  document.body.appendChild(out);
});
"""


def rendered_layout(report: Path) -> Dict[str, Any]:
    """The probe's findings on ``report`` rendered by headless Chromium at WIDTH px."""
    probe = report.parent / "probe.html"
    probe.write_text(report.read_text(encoding="utf-8").replace("</body>", f"<script>{PROBE}</script></body>"),
                     encoding="utf-8")
    profile = tempfile.mkdtemp(prefix="chromium_profile_")
    cmd = [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", f"--window-size={WIDTH},1000", "--virtual-time-budget=20000",
           "--dump-dom", probe.resolve().as_uri()]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ, HOME=profile))
    except subprocess.TimeoutExpired:
        pytest.fail(f"chromium timed out: {' '.join(cmd)}")
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    m = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.S)
    assert m, f"the probe did not run (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(html.unescape(m.group(1)))


def scopes_in_csv(out_dir: Path, rank: int) -> Dict[str, List[str]]:
    """monitor -> its scopes, read from the CSV files with the csv module."""
    found: Dict[str, set] = {}
    for path in sorted((out_dir / f"rank_{rank}").glob("*.csv")):
        monitor = re.match(r"(.+)_step\d+-\d+\.csv$", path.name).group(1)
        with open(path, newline="") as f:
            found.setdefault(monitor, set()).update(row["scope"] for row in csv.DictReader(f))
    return {m: sorted(s) for m, s in found.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return training_runs(tmp_path_factory)


def test_report_contents_sections_and_grid_in_headless_chromium(runs, tmp_path):
    out = tmp_path / "report"
    # --layer-depth 1: the MLP's fc1, fc2 and fc3 are three layers, three figures a scope
    res = cli("plot", runs / "nan", "--out", out, "--layer-depth", "1", "--json")
    assert res.code == 0, res.err
    images = [Path(p).name for p in res.json()["images"]]
    assert len(images) >= 4 + 8 * 3, images
    page = rendered_layout(out / "report.html")

    # every link lands: anchors on an element that is shown, files next to the report
    assert page["broken"] == [] and page["internal"] >= 10, page["broken"]
    assert all(h > 0 for h in page["targets"]), list(zip(page["toc"], page["targets"]))
    assert page["files"] and all((out / f).is_file() for f in page["files"]), page["files"]
    # sections: the anomalies, then one per monitor in the CSV files, each with one
    # sub-section per scope found there
    scopes = scopes_in_csv(runs / "nan", 0)
    sections = page["sections"]
    assert [s["id"] for s in sections] == ["anomalies"] + [f"monitor-{m}" for m in
                                                           ("module", "weight_grad", "optimizer", "param")]
    for sec in sections[1:]:
        monitor = sec["id"][len("monitor-"):]
        assert sec["heading"] == f"Monitor {monitor}"
        assert sorted(sec["scopes"]) == sorted(f"monitor-{monitor}-{s}" for s in scopes[monitor]), sec
    # the contents list every section and sub-section, in page order
    wanted = [f"#{s['id']}" for s in sections] + [f"#{x}" for s in sections for x in s["scopes"]]
    assert set(wanted) <= set(page["toc"])
    order = [page["toc"].index(f"#{s['id']}") for s in sections]
    assert order == sorted(order)
    # the contents bar stays in view when the page is scrolled to the bottom
    assert page["scrolled"] > 1000 and abs(page["navTopAfterScroll"]) < 2 and page["navHeight"] > 100
    # every image loaded and is shown no larger than drawn; overviews across, the rest in grids
    figures = page["figures"]
    assert len(figures) == len(images)
    assert all(f["natural"] > 0 and 250 < f["width"] <= f["natural"] + 1 for f in figures), figures
    assert sum(f["cls"] == "overview" for f in figures) == 4
    # small multiples: at 1400 px the three figures of a scope sit side by side
    assert len(page["grids"]) == 8 and all(g["n"] >= 3 and g["columns"] == 3 for g in page["grids"]), page["grids"]
    small = [f for f in figures if f["cls"] == "small"]
    assert len({round(f["left"]) for f in small}) == 3 and max(f["width"] for f in small) < WIDTH / 3


def _pixels_near(png: Path, colour: str, tol: int = 30) -> int:
    from PIL import Image

    rgb = np.asarray(Image.open(png).convert("RGB")).astype(int)
    target = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(rgb - target).max(axis=2) <= tol).sum())


def _hue(colour: str) -> tuple:
    r, g, b = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    h, _, s = colorsys.rgb_to_hls(r, g, b)
    return h * 360, s


def test_no_series_is_drawn_in_the_nan_or_spike_colour(runs, tmp_path):
    for marker in (NAN_COLOUR, SPIKE_COLOUR):
        hm, _ = _hue(marker)
        for colour in LINE_COLOURS:
            h, s = _hue(colour)
            distance = min(abs(h - hm), 360 - abs(h - hm))
            assert s < 0.2 or distance >= 40, f"line colour {colour} is too close to marker colour {marker}"
    # the clean run has neither NaN nor spikes: not one pixel of either colour in any figure
    assert cli("anomalies", runs / "clean").code == 0
    clean = cli("plot", runs / "clean", "--out", tmp_path / "clean", "--json").json()
    for png in map(Path, clean["images"]):
        assert _pixels_near(png, NAN_COLOUR) == 0, f"{png.name}: a series drawn in the NaN colour"
        assert _pixels_near(png, SPIKE_COLOUR) == 0, f"{png.name}: a series drawn in the spike colour"
    # with a NaN, the marks are there in that colour
    nan = cli("plot", runs / "nan", "--out", tmp_path / "nan", "--json").json()
    overviews = [Path(p) for p in nan["images"] if "overview" in Path(p).name]
    assert all(_pixels_near(png, NAN_COLOUR) > 100 for png in overviews), overviews


def _diverging_run(out: Path, bad_step: int = 12, steps: int = 24) -> None:
    """A TinyMLP whose batch at ``bad_step`` is scaled by 1e12 (a corrupt batch): that
    step's gradients are ~1e23, the weights follow, and every later step is NaN."""
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True},
                                                                 "param": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    for i, (x, y) in enumerate(make_batches(steps)):
        loss_fn(model, x * 1e12 if i == bad_step else x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def _norms(out: Path, monitor: str, scope: str) -> Dict[str, Dict[int, float]]:
    series: Dict[str, Dict[int, float]] = {}
    for path in (out / "rank_0").glob(f"{monitor}_step*.csv"):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row["scope"] == scope:
                    series.setdefault(row["module_name"], {})[int(row["step"])] = float(row["norm"])
    return series


def test_values_that_ran_away_before_a_nan_are_kept_out_of_the_y_range(tmp_path):
    out = tmp_path / "run"
    _diverging_run(out)
    grads = _norms(out, "weight_grad", "reduced")
    steps = sorted(next(iter(grads.values())))
    values = np.array([[grads[t][s] for s in steps] for t in sorted(grads)])
    finite = np.isfinite(values)
    first_bad = min(s for s, col in zip(steps, finite.T) if not col.all())
    healthy = values[:, [s < first_bad - 1 for s in steps]]
    assert first_bad == 13 and np.nanmax(values[:, steps.index(12)]) > 1e20  # the corrupt batch, then NaN
    # the view leaves out the values > RUNAWAY x their line's median before the first NaN
    lines = [(t, steps, list(values[i])) for i, t in enumerate(sorted(grads))]
    view = y_view(lines)
    medians = np.median(np.abs(values[:, [s < first_bad for s in steps]]), axis=1)
    kept = [v for i in range(len(lines)) for v in values[i][finite[i]] if abs(v) <= RUNAWAY * medians[i]]
    assert not view.log and view.limits is not None
    span = max(max(kept) - min(kept), abs(max(kept)) * 0.05)
    np.testing.assert_allclose(view.limits, (min(kept) - 0.15 * span, max(kept) + 0.15 * span), rtol=1e-12)
    assert view.limits[1] < 2 * healthy.max() + 1
    # drawn: the lines before the corrupt batch fill the axes instead of lying flat at 0
    res = cli("plot", out, "--out", tmp_path / "report", "--monitors", "weight_grad", "--json")
    assert res.code == 0, res.err
    overview = next(Path(p) for p in res.json()["images"] if "overview" in Path(p).name)
    from PIL import Image

    rgb = np.asarray(Image.open(overview).convert("RGB")).astype(int)
    reduced = LINE_COLOURS[1]  # the overview's lines: "unreduced mb1", then "reduced"
    target = np.array([int(reduced[i:i + 2], 16) for i in (1, 3, 5)])
    rows = np.where((np.abs(rgb - target).max(axis=2) <= 30).any(axis=1))[0]
    assert rows.size and rows.max() - rows.min() > 0.4 * rgb.shape[0], (rows.min(), rows.max(), rgb.shape)
    # a figure without NaN/Inf keeps every value in its range
    clean = [(t, steps[:first_bad - 1], list(values[i][:first_bad - 1])) for i, t in enumerate(sorted(grads))]
    assert y_view(clean).limits is None
