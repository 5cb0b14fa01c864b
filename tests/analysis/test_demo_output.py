"""What the demo prints on a run with an injected NaN: the step table keeps NaN visible
(``max exp_avg_sq`` is nan, not 0), its columns line up whatever the values, the NaN
summary counts rows (checked against the CSV files), and the last lines are commands that
run as printed in the shell the demo was started from."""

import csv
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from support.extras import needs_polars

DEMO = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--vocab", "64", "--context", "16", "--batch", "4",
        "--steps", "6", "--step-interval", "1", "--log-every", "100"]


def csv_rows(out: Path):
    for path in sorted((out / "rank_0").glob("*.csv")):
        with open(path, newline="") as f:
            yield from csv.DictReader(f)


@needs_polars  # the printed summary and anomalies commands run
def test_demo_table_and_next_commands(tmp_path):
    caller = tmp_path / "caller"  # the shell's directory: the output is printed relative to it
    out = caller / "demo"
    caller.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MSPROBE_DEMO_CALLER_CWD": str(caller)}
    proc = subprocess.run([sys.executable, str(DEMO), *TINY, "--out", str(out), "--inject-nan-step", "3",
                           "--inject-nan-layer", "blocks.1.mlp.fc"], capture_output=True, text=True, timeout=180,
                          env=env, cwd=tmp_path)  # not the caller's: scripts/demo.sh cds to the repository
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()

    # the table: a header, a rule of dashes per column, one line per step
    h = next(i for i, line in enumerate(lines) if line.lstrip().startswith("step ") and "max exp_avg_sq" in line)
    header, rule, body = lines[h], lines[h + 1], lines[h + 2:h + 8]
    spans = [m.span() for m in re.finditer(r"-+", rule)]
    assert len(spans) == 8
    for row in [header] + body:
        assert len(row) <= len(rule)
        for (a, b), (c, _) in zip(spans, spans[1:]):
            assert row[b:c].strip() == "", f"a cell overflows its column: {row!r}"
    cells = {int(row[spans[0][0]:spans[0][1]]): [row[a:b].strip() for a, b in spans] for row in body}
    col = {name: i for i, name in enumerate(["step", "loss", "grad", "mb", "top", "vmax", "pnorm", "bad"])}
    assert cells[3][col["vmax"]] == "nan" and cells[2][col["vmax"]] != "nan"
    assert cells[3][col["top"]].endswith("(nan)")

    # non-finite rows per step and in total, against the CSV files
    bad_per_step = {}
    rows = list(csv_rows(out))
    for r in rows:
        stats = [float(r[k]) for k in ("min", "max", "mean", "norm")]
        empty = float(r["norm"]) == 0.0
        bad = int(r["nans"]) > 0 or not math.isfinite(stats[3]) or (not empty and not all(map(math.isfinite, stats)))
        bad_per_step[int(r["step"])] = bad_per_step.get(int(r["step"]), 0) + bad
    assert {s: int(c[col["bad"]]) for s, c in cells.items()} == bad_per_step
    assert bad_per_step[2] == 0 and bad_per_step[3] > 0
    assert f"non-finite rows: {sum(bad_per_step.values())} of {len(rows)} rows hold a NaN or Inf" in proc.stdout

    # the last lines run as printed, from the caller's directory, in a plain shell
    i = lines.index("next: read the results (docs/cli.md explains each command):")
    commands = [line.split("#")[0].strip() for line in lines[i + 1:]]
    assert len(commands) == 3 and all(c for c in commands)
    words = shlex.split(commands[0])
    assert words[-2:] == ["summary", "demo"]
    for command in commands[:2]:  # summary, anomalies (plot needs matplotlib; its own tests cover it)
        run = subprocess.run(["/bin/sh", "-c", command], cwd=caller, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PATH": "/usr/bin:/bin"})
        assert run.returncode in (0, 1), run.stderr  # anomalies exits 1: it found the NaN
        assert "blocks.1.mlp.fc.output.0" in run.stdout
