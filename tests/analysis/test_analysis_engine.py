"""The columnar engine (Polars) gives the same answers as the reference engine (the
previous pure-Python implementation, kept behind ``--engine reference``).

Compared on the real 2-rank DDP runs of the other analysis tests, on malformed copies of
them, and on generated outputs built to stress what the columnar engine does
differently: spike histories carried across batches (tiny batches), NaN in a history
(an empty tensor's max), files with different statistics, ranks that disagree within
and beyond the tolerance, a run appended to its own files.
"""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from analysis_helpers import cli, copy_run, training_runs

from support.extras import POLARS_ENGINE, require

pl = require("polars", POLARS_ENGINE)

from msprobe.core.monitor_v2.analysis.reference import analyse  # noqa: E402
from msprobe.core.monitor_v2.analysis.report import RankCheckSettings, SpikeSettings  # noqa: E402
from msprobe.core.monitor_v2.analysis.engine import analyse_columnar  # noqa: E402
from msprobe.core.monitor_v2.analysis.reader import Problems, scan  # noqa: E402
from msprobe.core.monitor_v2.analysis.render import report_json  # noqa: E402

HEADER_WG = "vpp_stage,step,module_name,scope,micro_step"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return training_runs(tmp_path_factory)


def both(*argv):
    ref = cli(*argv, "--engine", "reference")
    new = cli(*argv)
    assert (new.code, new.out, new.err) == (ref.code, ref.out, ref.err)
    return new


@pytest.mark.parametrize("run", ["clean", "nan", "lr", "spike", "desync"])
@pytest.mark.parametrize("flags", [(), ("--ranks", "1"), ("--steps", "3:9"), ("--no-spikes", "--no-rank-check"),
                                   ("--spike-monitors", "module,weight_grad,param,cc,optimizer", "--spike-ratio", "1.5",
                                    "--spike-mad-k", "1", "--spike-min-history", "2", "--spike-window", "3"),
                                   ("--rank-rtol", "0", "--monitors", "param,optimizer")])
def test_same_findings_on_the_training_runs(runs, run, flags):
    res = both("anomalies", runs / run, "--json", "--limit", "0", *flags)
    assert res.code in (0, 1)
    both("summary", runs / run, *flags)


def _break(root: Path) -> None:
    """Every kind of damage the reader reports, in one copy of a run."""
    files = sorted((root / "rank_0").glob("weight_grad_step*.csv"))
    lines = files[1].read_text().splitlines(keepends=True)
    lines.insert(3, "\n")
    lines.insert(5, lines[1].replace(",", ";", 1))
    lines[7] = lines[7].rsplit(",", 1)[0] + ",x\n"
    files[1].write_text("".join(lines))
    files[2].write_text(files[2].read_text()[:-7])  # cut short
    files[3].write_text("")
    text = files[4].read_text()
    files[4].write_text(text + text)  # a second header: files concatenated
    p = sorted((root / "rank_1").glob("param_step*.csv"))[2]
    rows = p.read_text().splitlines(keepends=True)
    rows[2] = rows[2].replace(",", ",99999,", 1)  # step outside the file's window
    p.write_text("".join(rows))
    q = sorted((root / "rank_1").glob("module_step*.csv"))[3]
    q.write_bytes(q.read_bytes().replace(b"fc1", b'"fc,1"', 1).replace(b"fc2", b"f\xffc2", 1))


def test_same_problems_and_findings_on_malformed_input(runs, tmp_path):
    root = copy_run(runs / "nan", tmp_path / "broken")
    _break(root)
    res = both("anomalies", root, "--json", "--limit", "0")
    assert res.json()["problems"]["count"] >= 6
    both("summary", root)
    strict = both("summary", root, "--strict")
    assert strict.code == 2 and "--strict" in strict.err


# ------------------------------------------------------------------ generated outputs
def _write_generated(root: Path, seed: int, ranks: int = 3, steps: int = 60) -> None:
    rnd = random.Random(seed)
    names = [f"layers.{i}.w" for i in range(5)]
    for r in range(ranks):
        d = root / f"rank_{r}"
        d.mkdir(parents=True)
        level = {n: 10 ** rnd.uniform(-2, 1) for n in names}
        for first in range(0, steps, 4):
            ops = ("min", "max", "mean", "norm", "nans") if first % 8 else ("max", "norm")
            lines = [HEADER_WG + "," + ",".join(ops)]
            for step in range(first, first + 4):
                for n in names:
                    for scope, micros in (("unreduced", (1, 2)), ("reduced", (2,))):
                        for m in micros:
                            level[n] *= math.exp(rnd.gauss(0, 0.3))
                            v = level[n] * (rnd.choice([1, 1, 1, 8, 30]) if scope == "unreduced" else 1.0)
                            if scope == "reduced":
                                rr = random.Random(f"{seed}-{step}-{n}")
                                v = 10 ** rr.uniform(-1, 1) * (1.001 if (r == 2 and step == 33) else 1.0)
                            vals = {"min": -v / 2, "max": v / 3, "mean": v / 100, "norm": v, "nans": 0}
                            if rnd.random() < 0.03:  # an empty tensor: NaN min/max/mean, norm 0
                                vals.update(min=float("nan"), max=float("nan"), mean=float("nan"), norm=0.0)
                            if r == 1 and step == 41 and n == names[2] and m == 1:
                                vals.update(norm=float("inf"))
                            lines.append(f"0,{step},{n},{scope},{m}," + ",".join(
                                str(vals[op]) if op == "nans" else format(vals[op], ".9g") for op in ops))
            (d / f"weight_grad_step{first}-{first + 3}.csv").write_text("\n".join(lines) + "\n")
    # a run appended to one file of rank 0 (steps go back)
    f = root / "rank_0" / "weight_grad_step8-11.csv"
    text = f.read_text()
    f.write_text(text + "".join(text.splitlines(keepends=True)[1:]))


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("batch_rows", [37, 10 ** 6])
def test_same_findings_on_generated_outputs_and_tiny_batches(tmp_path, seed, batch_rows):
    _write_generated(tmp_path, seed)
    spikes = SpikeSettings(window=7, min_history=3, mad_k=2.0, ratio=1.5,
                           monitors=("weight_grad",), stats=("norm", "max"))
    checks = RankCheckSettings(rtol=1e-5)
    layout = scan(str(tmp_path))
    ref = analyse(layout, Problems(), spikes, checks, limit=None)
    new = analyse_columnar(layout, Problems(), spikes, checks, limit=None, batch_rows=batch_rows)
    a, b = report_json(ref, 0), report_json(new, 0)
    assert json.dumps(a) == json.dumps(b)  # (NaN != NaN in a dict comparison)
    assert a["spikes"]["count"] > 20 and a["rank_check"]["ranks_differing"] >= 1  # the test exercises both
    assert a["nonfinite"]["first"]["kind"] == "inf"
    assert [(i["rank"], i["runs"], i["steps_repeated"]) for i in a["appended"]["items"]] == [(0, 2, [8, 9, 10, 11])]


def test_a_tensor_id_hash_collision_falls_back_to_the_names(tmp_path, monkeypatch):
    """Every tensor's name hash is made to collide with another name: each batch then
    takes the exact join on the names, and the findings stay the reference's."""
    from msprobe.core.monitor_v2.analysis import engine

    _write_generated(tmp_path, 1)
    real = engine._tensor_ids
    taken = []

    def colliding(pl_, fr, carry):
        by_hash = carry.setdefault("by_hash", {})
        hashes = fr.select(pl_.struct("module_name", "scope").hash(seed=7))[:, 0].unique().to_list()
        for h in hashes:
            by_hash.setdefault(h, (10 ** 6 + len(by_hash), "another tensor", "reduced"))
        gid, ids = real(pl_, fr, carry)
        # every name has its own id, none the colliding one's
        taken.append(len(ids) == fr.select("module_name", "scope").n_unique() and gid.max() < 10 ** 6)
        return gid, ids

    monkeypatch.setattr(engine, "_tensor_ids", colliding)
    spikes = SpikeSettings(window=7, min_history=3, mad_k=2.0, ratio=1.5,
                           monitors=("weight_grad",), stats=("norm", "max"))
    checks = RankCheckSettings(rtol=1e-5)
    layout = scan(str(tmp_path))
    ref = analyse(layout, Problems(), spikes, checks, limit=None)
    new = analyse_columnar(layout, Problems(), spikes, checks, limit=None, batch_rows=37)
    assert len(taken) > 10 and all(taken)
    assert json.dumps(report_json(ref, 0)) == json.dumps(report_json(new, 0))


# ------------------------------------------------------------------ no polars
def test_without_polars_the_cli_names_what_to_install(runs, tmp_path):
    code = ("import sys; sys.modules['polars'] = None\n"
            "from msprobe.core.monitor_v2.analysis.cli import main\n"
            f"sys.exit(main(['summary', {str(runs / 'clean')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{sys.executable} -m pip install 'polars>=1.20' 'matplotlib>=3.5'" in proc.stderr and "Polars" in proc.stderr
    # the reference engine still works without it
    code2 = code.replace("'summary', ", "'summary', '--engine', 'reference', ")
    assert subprocess.run([sys.executable, "-c", code2], capture_output=True, timeout=60).returncode == 0


def test_training_side_imports_no_third_party_analysis_package():
    code = ("import sys, msprobe.core.monitor_v2.trainer\n"
            "bad = [m for m in ('polars', 'duckdb', 'pyarrow', 'pandas') if m in sys.modules]\n"
            "print(bad); sys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_well_formed_files_take_the_fast_path_and_damaged_ones_the_csv_reader(runs, tmp_path, monkeypatch):
    from msprobe.core.monitor_v2.analysis import columnar

    seen = []
    real = columnar._read_reference
    monkeypatch.setattr(columnar, "_read_reference",
                        lambda pl_, f, *a: seen.append(os.path.basename(f.path)) or real(pl_, f, *a))
    assert cli("summary", runs / "nan").code == 0
    assert seen == []
    root = copy_run(runs / "nan", tmp_path / "broken")
    _break(root)
    assert cli("summary", root).code == 0
    assert 5 <= len(seen) <= 8  # only the damaged files


def test_ranks_listing_tensors_in_another_order_are_compared_by_name(tmp_path):
    """Rank 1 writes its tensors in the reverse order, with the values of a and b swapped:
    a disagreement that only matching by name finds."""
    header = "vpp_stage,step,module_name,scope,min,max,mean,norm,nans\n"
    for r, order in ((0, ("a", "b")), (1, ("b", "a")), (2, ("a", "b"))):
        d = tmp_path / f"rank_{r}"
        d.mkdir()
        val = {"a": 1.0, "b": 2.0} if r != 1 else {"a": 2.0, "b": 1.0}
        rows = [f"0,0,{n},param_updated,{val[n]},{val[n]},{val[n]},{val[n]},0\n" for n in order]
        (d / "param_step0-0.csv").write_text(header + "".join(rows))
    res = both("anomalies", tmp_path, "--json")
    assert [(i["rank"], i["tensor"], i["rows_differing"]) for i in res.json()["rank_check"]["items"]] == [(1, "b", 2)]


def _write_converged(root: Path) -> None:
    """One gradient that converged to exactly 0 for 30 steps, then reads 1.5e-8 for 10
    (2 micro-batches per step), next to one that jumps from 1 to 100 at step 35."""
    d = root / "rank_0"
    d.mkdir(parents=True)
    lines = [HEADER_WG + ",min,max,norm"]
    for step in range(40):
        v = 0.0 if step < 30 else 1.5e-8
        w = 100.0 if step == 35 else 1.0 + 0.01 * (step % 3)
        for m in (1, 2):
            lines.append(f"0,{step},zero.w,unreduced,{m},{-v:.9g},{v:.9g},{v:.9g}")
            lines.append(f"0,{step},live.w,unreduced,{m},{-w:.9g},{w:.9g},{w:.9g}")
    (d / "weight_grad_step0-39.csv").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("floor, zero_flagged", [(1e-6, False), (0.0, True)])
def test_values_near_zero_are_not_spikes_in_both_engines(tmp_path, floor, zero_flagged):
    _write_converged(tmp_path)
    spikes = SpikeSettings(monitors=("weight_grad",), floor=floor)
    layout = scan(str(tmp_path))
    ref = report_json(analyse(layout, Problems(), spikes, RankCheckSettings(), limit=None), 0)
    for batch_rows in (7, 10 ** 6):
        new = analyse_columnar(layout, Problems(), spikes, RankCheckSettings(), limit=None, batch_rows=batch_rows)
        assert json.dumps(report_json(new, 0)) == json.dumps(ref)
    flagged = {(i["tensor"], i["step"]) for i in ref["spikes"]["items"]}
    assert ("live.w", 35) in flagged  # a real jump is found whatever the floor
    assert any(t == "zero.w" for t, _ in flagged) == zero_flagged
    if zero_flagged:
        assert ("zero.w", 30) in flagged


def test_the_cli_takes_the_spike_floor(tmp_path, capsys):
    _write_converged(tmp_path)
    default = cli("anomalies", str(tmp_path), "--json", "--no-rank-check")
    assert "zero.w" not in default.out and "live.w" in default.out
    loose = cli("anomalies", str(tmp_path), "--json", "--no-rank-check", "--spike-floor", "0")
    assert "zero.w" in loose.out
    bad = cli("anomalies", str(tmp_path), "--spike-floor", "-1")
    assert bad.code == 2 and "--spike-floor" in bad.err + capsys.readouterr().err  # argparse prints to sys.stderr
