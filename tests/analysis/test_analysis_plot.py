"""``msprobe-monitor plot``: PNG files (checked by size and decoded dimensions) and the HTML
report, opened in headless Chromium and checked on a screenshot."""

import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from analysis_helpers import NAN_STEP, cli, training_runs
from support.extras import needs_matplotlib, needs_polars

CHROMIUM_HELP = ("headless Chromium is needed for this test: as root, `apt-get update && apt-get install -y "
                 "chromium` (Debian package 'chromium', binary /usr/bin/chromium); scripts/setup_env.sh does "
                 "it when run as root")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return training_runs(tmp_path_factory)


def png_size(path: Path):
    """(width, height) from the PNG signature and IHDR chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert head[12:16] == b"IHDR", f"{path}: no IHDR chunk"
    return struct.unpack(">II", head[16:24])


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(CHROMIUM_HELP)


def screenshot(url: str, out_png: Path) -> None:
    exe = find_chromium()
    profile = tempfile.mkdtemp(prefix="chromium_profile_")
    try:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", f"--screenshot={out_png}", "--window-size=1200,900", url]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                  env=dict(os.environ, HOME=profile))
        except subprocess.TimeoutExpired:
            pytest.fail(f"chromium timed out: {' '.join(cmd)}")
        assert out_png.exists(), f"chromium wrote no screenshot (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@needs_polars
@needs_matplotlib
def test_plot_writes_images_and_report(runs, tmp_path):
    out = tmp_path / "report"
    res = cli("plot", runs / "nan", "--out", out, "--json")
    assert res.code == 0, res.err
    data = res.json()
    images = [Path(p) for p in data["images"]]
    # one overview per monitor, then one figure per (monitor, scope, layer); the MLP's
    # layers fc1..fc3 have no numeric component: one "top level" group per scope
    names = [p.name for p in images]
    assert names[:4] == [f"00{i}_overview_{m}_norm.png" for i, m in
                         enumerate(("module", "weight_grad", "optimizer", "param"), 1)]
    assert names[4:] == [f"{i:03d}_{m}_top_level.png" for i, m in enumerate(
        ("module_forward", "module_backward", "weight_grad_unreduced", "weight_grad_reduced", "optimizer_exp_avg",
         "optimizer_exp_avg_sq", "param_param_origin", "param_param_updated"), 5)]
    assert data["lines_not_plotted"] == 0
    for img in images:
        assert img.parent == out and img.exists()
        assert img.stat().st_size > 5000, img
        w, h = png_size(img)
        # an overview across the page, the others cells of the report's grid
        assert (w >= 800 if "overview" in img.name else w >= 450) and h >= 300, (img, w, h)
    html = (out / "report.html").read_text()
    for img in images:
        assert f'src="{img.name}"' in html
    # the anomaly table: the first non-finite value
    assert "fc2.output.0" in html and f"rank_1/module_step{NAN_STEP}-{NAN_STEP}.csv" in html
    assert data["html"] == str(out / "report.html")


@needs_polars
@needs_matplotlib
def test_plot_options(runs, tmp_path):
    out = tmp_path / "by_tensor"
    res = cli("plot", runs / "clean", "--out", out, "--by", "tensor", "--match", r"^fc1\.", "--stat", "max",
              "--rank", "1", "--embed", "--json")
    assert res.code == 0, res.err
    names = [Path(p).name for p in res.json()["images"]]
    detail = [n for n in names if "overview" not in n]
    assert detail and all("fc1" in n for n in detail), names
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(names)
    assert not re.search(r'<img src="[^d]', html)
    # bounded: --max-plots
    small = cli("plot", runs / "clean", "--out", tmp_path / "small", "--max-plots", "2", "--no-html", "--json")
    data = small.json()
    assert len(data["images"]) == 4 + 2 and data["lines_not_plotted"] > 0 and data["html"] is None
    assert not (tmp_path / "small" / "report.html").exists()
    # a group with more lines than --lines-per-plot continues in further figures
    split = cli("plot", runs / "clean", "--out", tmp_path / "split", "--monitors", "weight_grad",
                "--lines-per-plot", "5", "--module-io", "all", "--json").json()
    names = [Path(p).name for p in split["images"]]
    # 6 parameters x 2 micro-batches = 12 unreduced lines -> 3 figures; 6 reduced -> 2
    assert names[1:] == ["002_weight_grad_unreduced_top_level.png", "003_weight_grad_unreduced_top_level_2.png",
                         "004_weight_grad_unreduced_top_level_3.png", "005_weight_grad_reduced_top_level.png",
                         "006_weight_grad_reduced_top_level_2.png"]
    # default output directory: OUT_DIR/analysis_report
    copy = tmp_path / "copy"
    shutil.copytree(runs / "clean", copy)
    assert cli("plot", copy, "--max-plots", "1").code == 0
    assert (copy / "analysis_report" / "report.html").exists()
    assert cli("plot", runs / "clean", "--rank", "7").code == 2
    assert cli("plot", runs / "clean", "--match", "(").code == 2


def test_plot_without_matplotlib_is_a_clear_error(runs, tmp_path, monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    res = cli("plot", runs / "clean", "--out", tmp_path / "x")
    # the hint runs as printed: this interpreter's pip, not whichever "pip" PATH finds
    assert res.code == 2 and f"{sys.executable} -m pip install 'matplotlib>=3.5'" in res.err


@needs_polars
@needs_matplotlib
def test_html_report_renders_in_headless_chromium(runs, tmp_path):
    from PIL import Image

    out = tmp_path / "report"
    assert cli("plot", runs / "clean", "--out", out, "--max-plots", "4").code == 0
    shot = tmp_path / "shot.png"
    screenshot((out / "report.html").resolve().as_uri(), shot)
    assert shot.stat().st_size > 10000
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 900)
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "blank or near-blank screenshot"
    background = max(colours)[0]
    assert background < 0.95 * img.size[0] * img.size[1], "the page is almost one colour"

    def count_near(rgb, tol=12):
        return sum(n for n, c in colours if all(abs(a - b) <= tol for a, b in zip(c, rgb)))

    assert count_near((0x3C, 0x78, 0xD8)) > 500, "the styled anomaly tables are not visible"
    assert count_near((0x1F, 0x77, 0xB4), tol=20) > 50, "no plot line: the PNG files did not load"
