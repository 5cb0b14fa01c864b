"""The exported run in TensorBoard itself: ``export --tensorboard`` on the real 2-rank run,
a TensorBoard server on 127.0.0.1, and a screenshot of its time-series page in headless
Chromium (the image of docs/dashboards.md: ``MSPROBE_UPDATE_DOC_IMAGES=1`` writes it to
docs/images/tensorboard-export.png)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from analysis_helpers import cli, training_runs
from support.extras import require

require("tensorboard", "the screenshot test serves the exported run with a TensorBoard server")

DOC_IMAGE = Path(__file__).resolve().parents[2] / "docs" / "images" / "tensorboard-export.png"
CHROMIUM_HELP = ("headless Chromium is needed for this test: as root, `apt-get update && apt-get install -y "
                 "chromium` (Debian package 'chromium', binary /usr/bin/chromium)")
TAG_FILTER = r"weight_grad/unreduced/.*weight/micro_2/norm"
RANK0_COLOUR, RANK1_COLOUR = (0xFF, 0x70, 0x43), (0x00, 0x77, 0xBB)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(CHROMIUM_HELP)


def wait_for_runs(url: str, want, proc, log: Path, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tensorboard exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/data/runs", timeout=5) as r:
                runs = json.loads(r.read())
            if sorted(runs) == want:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"tensorboard did not list the runs {want} within {timeout} s:\n{log.read_text()[-3000:]}")


def test_exported_run_renders_in_tensorboard(tmp_path_factory, tmp_path):
    from PIL import Image

    runs = training_runs(tmp_path_factory)
    tb = tmp_path / "tb"
    assert cli("export", "--tensorboard", tb, runs / "clean").code == 0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "tensorboard.log"
    env = dict(os.environ, HOME=str(tmp_path))  # no network: TensorBoard serves its bundled frontend
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(tb), "--port", str(port),
                                   "--host", "127.0.0.1", "--reload_interval", "1"],
                                  stdout=out, stderr=subprocess.STDOUT, env=env)
    profile = tempfile.mkdtemp(prefix="chromium_profile_")
    shot = tmp_path / "tensorboard.png"
    try:
        wait_for_runs(url, ["rank_0", "rank_1"], server, log)
        # the SCALARS dashboard draws SVG, which headless Chromium renders without a GPU (the TIME SERIES
        # one needs WebGL)
        page = (f"{url}/?darkMode=false#scalars&tagFilter={urllib.request.quote(TAG_FILTER, safe='')}"
                f"&_smoothingWeight=0&_ignoreYOutliers=false")
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1400,1000",
               "--virtual-time-budget=15000", page]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ, HOME=profile))
        assert shot.exists(), f"chromium wrote no screenshot (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(profile, ignore_errors=True)
    assert shot.stat().st_size > 20000
    img = Image.open(shot).convert("RGB")
    assert img.size == (1400, 1000)
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 100, "blank or near-blank screenshot"

    def count_near(rgb, tol=20, box=None):
        part = img if box is None else img.crop(box)
        return sum(n for n, c in part.getcolors(maxcolors=1 << 20) if all(abs(a - b) <= tol for a, b in zip(c, rgb)))

    assert count_near((0xF5, 0x7C, 0x00)) > 20000, "no TensorBoard header: the app did not load"
    # the cards: the chart area below the filter bar holds axes, lines and text, not one flat colour
    body = img.crop((300, 150, 1100, 1000)).getcolors(maxcolors=1 << 20)
    assert max(body)[0] < 0.9 * 800 * 850 and len(body) > 50, "no chart cards rendered"
    # the lines of the two runs (TensorBoard's first two run colours), inside the plots
    plots = (360, 150, 1400, 1000)
    assert count_near(RANK0_COLOUR, tol=30, box=plots) > 200, "no line of rank_0 drawn"
    assert count_near(RANK1_COLOUR, tol=30, box=plots) > 200, "no line of rank_1 drawn"
    if os.environ.get("MSPROBE_UPDATE_DOC_IMAGES") == "1":
        DOC_IMAGE.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOC_IMAGE)
