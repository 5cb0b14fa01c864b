"""``msprobe-monitor compare`` on real runs (tests/analysis/compare_runs.py, the tiny GPT;
workers/compare_ddp.py, a 2-rank gloo DDP job), its numbers checked against an
independent computation: NumPy over the rows of both runs read with the csv module."""

import csv
import json
import math
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import pytest

from analysis_helpers import cli
from support.extras import needs
from compare_runs import DEFECT_SCALE, train_gpt, write_loss_log

WORKER = Path(__file__).parent / "workers" / "compare_ddp.py"
DEFECT_LAYER, DEFECT_STEP, PERTURB_STEP = "blocks.1.mlp", 3, 2
BF16_TOL, FP32_TOL = 4e-2, 1e-4  # the documented defaults (docs/compare.md)
FLOOR = 1e-12  # of both
PHASES = {("param", "param_origin"): 0, ("module", "forward"): 1, ("module", "backward"): 2,
          ("weight_grad", "unreduced"): 3, ("weight_grad", "reduced"): 5, ("param", "param_updated"): 7}


def _phase(monitor: str, scope: str) -> int:
    return PHASES.get((monitor, scope), 6 if monitor == "optimizer" else 8)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("compare_runs")
    out = {}
    for name, kw in {"fp32": {}, "bf16": {"bf16": True}, "defect": {"defect_layer": DEFECT_LAYER,
                                                                      "defect_step": DEFECT_STEP},
                     "seed": {"init_seed": 1, "data_seed": 2}}.items():
        losses = train_gpt(root / name, **kw)
        write_loss_log(root / f"{name}.loss", losses)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Path:
    from support import run_torchrun

    root = tmp_path_factory.mktemp("compare_ddp")
    run_torchrun(WORKER, root, PERTURB_STEP)
    return root


# ------------------------------------------------------------------ the independent computation
Key = Tuple[int, str, int, str, str, str]


def read_run(root: Path) -> Dict[Key, Dict[str, float]]:
    """Every statistics row of every rank, keyed as compare aligns them (a reduced row's
    micro_step dropped), read with the csv module. The ``scalars`` rows (loss, grad norm)
    are not among them: compare judges them by the migration standard only (``scalars``)."""
    rows = {}
    for path in sorted(root.glob("rank_*/*.csv")):
        rank = int(path.parent.name.split("_")[1])
        monitor = path.name.split("_step")[0]
        if monitor == "scalars":
            continue
        with open(path, newline="") as fh:
            for rec in csv.DictReader(fh):
                micro = rec.get("micro_step", "") if rec["scope"] != "reduced" else ""
                rows[(rank, monitor, int(rec["step"]), rec["module_name"], rec["scope"], micro or "")] = \
                    {k: float(rec[k]) for k in ("min", "max", "mean", "norm", "nans")}
    return rows


def scaled_norm_errors(ref: Path, cand: Path, floor: float) -> Dict[Key, float]:
    a, b = read_run(ref), read_run(cand)
    keys = sorted(set(a) & set(b))
    ra = np.array([a[k]["norm"] for k in keys])
    cb = np.array([b[k]["norm"] for k in keys])
    scale = np.maximum(np.maximum(np.abs(ra), np.abs(cb)), floor)
    err = np.abs(cb - ra) / scale
    near = np.maximum(np.abs(ra), np.abs(cb)) <= floor
    return {k: (math.nan if n else float(e)) for k, e, n in zip(keys, err, near)}  # NaN: near zero


def read_scalars(root: Path, rank: int = 0) -> Dict[str, Dict[int, float]]:
    """``name -> step -> value`` of the scalars rows (the value in min = max = mean)."""
    out: Dict[str, Dict[int, float]] = {}
    for path in sorted((root / f"rank_{rank}").glob("scalars_step*.csv")):
        with open(path, newline="") as fh:
            for rec in csv.DictReader(fh):
                assert rec["min"] == rec["max"] == rec["mean"]
                out.setdefault(rec["module_name"], {})[int(rec["step"])] = float(rec["mean"])
    return out


def compare_csv(path: Path) -> Dict[Key, Dict[str, str]]:
    with open(path, newline="") as fh:
        return {(int(r["rank"]), r["monitor"], int(r["step"]), r["module_name"], r["scope"], r["micro_step"]): r
                for r in csv.DictReader(fh)}


def earliest_beyond(errors: Dict[Key, float], tol: float) -> Tuple[int, int]:
    return min((k[2], _phase(k[1], k[4])) for k, e in errors.items() if e == e and e > tol)


# ------------------------------------------------------------------ fp32 against bf16
def test_bf16_within_tolerance_and_errors_match_numpy(runs, tmp_path):
    out = tmp_path / "cmp"
    res = cli("compare", runs["fp32"], runs["bf16"], "--dtype", "bf16", "--out", out)
    assert res.code == 0, res.out
    assert res.out.startswith("Verdict: bfloat16 within tolerance")
    assert f"Wrote {out / 'compare.csv'}" in res.out
    expected = scaled_norm_errors(runs["fp32"], runs["bf16"], FLOOR)
    got = compare_csv(out / "compare.csv")
    assert set(got) == set(expected)
    for k, e in expected.items():
        if e != e:
            assert got[k]["class"] == "near_zero" and got[k]["level"] == "pass"
            continue
        assert float(got[k]["error"]) == pytest.approx(e, rel=1e-9, abs=1e-15), k
        assert got[k]["class"] == "compared" and got[k]["level"] == ("pass" if e <= BF16_TOL else "warning")
    # the runs really differ at the bf16 level, and within its tolerance
    assert 1e-3 < np.nanmax(list(expected.values())) <= BF16_TOL
    doc = json.loads((out / "compare.json").read_text())
    assert doc["verdict"] == "pass" and doc["where_they_part"] is None
    # the loss and grad norm both runs logged (mon.log_scalars): judged by the migration
    # standard, against NumPy over their scalars rows; not rows of compare.csv
    assert not any(k[1] == "scalars" for k in got)
    sa, sb = read_scalars(runs["fp32"]), read_scalars(runs["bf16"])
    assert sorted(sa) == sorted(sb) == ["grad_norm", "loss"] and sorted(sa["loss"]) == list(range(6))
    la, lb = (np.array([s["loss"][i] for i in range(6)]) for s in (sa, sb))
    ga, gb = (np.array([s["grad_norm"][i] for i in range(6)]) for s in (sa, sb))
    sc = doc["scalars"]
    assert sc["source"] == {"ref": "scalars rows", "cand": "scalars rows"} and sc["level"] == "pass"
    assert sc["loss"]["steps"] == 6 and sc["loss"]["first_abs"] == pytest.approx(abs(lb[0] - la[0]), rel=1e-12)
    assert sc["loss"]["max_abs"] == pytest.approx(np.abs(lb - la).max(), rel=1e-12)
    assert sc["grad_norm"]["mean_signed_rel"] == pytest.approx(float(np.mean((gb - ga) / np.abs(ga))), rel=1e-9)
    assert "loss and grad norm (migration standard, from scalars rows; scalars are judged here only" in res.out
    # the four errors of each value statistic, against NumPy
    a, b = read_run(runs["fp32"]), read_run(runs["bf16"])
    for k in list(got)[:200]:
        for s in ("min", "max", "mean", "norm"):
            x, y = a[k][s], b[k][s]
            if max(abs(x), abs(y)) <= FLOOR:
                continue
            assert float(got[k][f"{s}_signed"]) == pytest.approx(y - x, rel=1e-12, abs=1e-300)
            assert float(got[k][f"{s}_abs"]) == pytest.approx(abs(y - x), rel=1e-12, abs=1e-300)
            assert float(got[k][f"{s}_rel"]) == pytest.approx(abs(y - x) / max(abs(x), FLOOR), rel=1e-12, abs=1e-300)
            assert float(got[k][f"{s}_scaled"]) == pytest.approx(abs(y - x) / max(abs(x), abs(y), FLOOR),
                                                                 rel=1e-12, abs=1e-300)


def _dtype_counts(root: Path) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for dt in json.loads((root / "rank_0" / "layout.json").read_text()).get("dtypes", {}).values():
        counts[dt] = counts.get(dt, 0) + 1
    return counts


def test_dtype_from_layout_json_or_float32(runs, tmp_path):
    import shutil

    # the runs record their rows' dtypes (layout.json "dtypes"): the autocast run's module
    # rows are bfloat16, so the comparison takes bf16 tolerances without being told
    ref_dtypes, cand_dtypes = _dtype_counts(runs["fp32"]), _dtype_counts(runs["bf16"])
    assert "bfloat16" not in ref_dtypes and cand_dtypes.get("bfloat16", 0) > 0
    res = cli("compare", runs["fp32"], runs["bf16"], "--out", tmp_path / "a", "--json")
    doc = res.json()
    assert res.code == 0, doc["counts"]
    assert doc["settings"]["dtype"] == "bfloat16" and "layout.json" in doc["settings"]["dtype_source"]
    assert doc["provenance"]["ref"]["dtypes"] == ref_dtypes and doc["provenance"]["cand"]["dtypes"] == cand_dtypes
    # --dtype overrides what is recorded: float32's tolerance, which bf16 autocast is beyond
    doc = cli("compare", runs["fp32"], runs["bf16"], "--dtype", "fp32", "--out", tmp_path / "b", "--json").json()
    assert doc["exit_code"] == 1 and (doc["settings"]["dtype"], doc["settings"]["dtype_source"]) == ("float32",
                                                                                                    "--dtype")
    # runs that recorded none (an older monitor): float32, the strictest default, said so
    stripped = {}
    for name in ("fp32", "bf16"):
        stripped[name] = tmp_path / f"{name}_no_dtypes"
        shutil.copytree(runs[name], stripped[name])
        lj = stripped[name] / "rank_0" / "layout.json"
        layout = json.loads(lj.read_text())
        del layout["dtypes"]
        lj.write_text(json.dumps(layout))
    res = cli("compare", stripped["fp32"], stripped["bf16"], "--out", tmp_path / "c", "--json")
    doc = res.json()
    assert res.code == 1 and doc["settings"]["dtype"] == "float32"
    assert "no dtypes recorded" in doc["settings"]["dtype_source"] and doc["provenance"]["cand"]["dtypes"] is None
    res = cli("compare", stripped["fp32"], stripped["bf16"], "--dtype", "bf16", "--out", tmp_path / "d", "--json")
    assert res.code == 0 and res.json()["settings"]["dtype"] == "bfloat16"


# ------------------------------------------------------------------ the injected defect
def test_injected_defect_found_at_its_step_phase_and_module(runs, tmp_path):
    res = cli("compare", runs["fp32"], runs["defect"], "--out", tmp_path / "cmp", "--json")
    assert res.code == 1
    doc = res.json()
    part = doc["where_they_part"]
    assert (part["step"], part["phase"]) == (DEFECT_STEP, "forward")
    assert part["born_at"]["module"] == DEFECT_LAYER
    assert doc["worst_layers"][0]["layer"] == "blocks.1"
    # independently: the earliest (step, phase) with a row beyond the float32 tolerance,
    # and the module whose output error exceeds 10 x its input error first in call order
    errors = scaled_norm_errors(runs["fp32"], runs["defect"], FLOOR)
    assert earliest_beyond(errors, FP32_TOL) == (DEFECT_STEP, 1)
    out_e = errors[(0, "module", DEFECT_STEP, f"{DEFECT_LAYER}.output.0", "forward", "")]
    in_e = errors[(0, "module", DEFECT_STEP, f"{DEFECT_LAYER}.input.0", "forward", "")]
    assert out_e == pytest.approx(1 - 1 / DEFECT_SCALE, rel=1e-3) and in_e * 10 < out_e
    assert part["born_at"]["output_error"] == pytest.approx(out_e, rel=1e-9)
    # every module before it in call order has its output within 10 x its input (or within tolerance)
    with open(runs["fp32"] / "rank_0" / f"module_step{DEFECT_STEP}-{DEFECT_STEP}.csv", newline="") as fh:
        names = [r["module_name"] for r in csv.DictReader(fh) if r["scope"] == "forward"]
    before = names[: names.index(f"{DEFECT_LAYER}.output.0")]
    for n in before:
        assert not errors[(0, "module", DEFECT_STEP, n, "forward", "")] > FP32_TOL, n
    text = cli("compare", runs["fp32"], runs["defect"], "--out", tmp_path / "cmp2").out
    assert f"Where they part: step {DEFECT_STEP}, forward" in text
    assert f"born at module {DEFECT_LAYER} " in text


# ------------------------------------------------------------------ the reduce
def test_perturbed_after_all_reduce_is_reduced_not_unreduced(ddp_runs, tmp_path):
    res = cli("compare", ddp_runs / "ref", ddp_runs / "cand", "--out", tmp_path / "cmp", "--json")
    assert res.code == 1
    doc = res.json()
    part = doc["where_they_part"]
    assert (part["step"], part["phase"]) == (PERTURB_STEP, "reduced")
    assert part["reduced_not_unreduced"] is True
    assert part["first_row"]["tensor"] == "fc2.weight"
    grown = {(g["rank"], g["tensor"]) for g in doc["grows_after_reduce"] if g["step"] == PERTURB_STEP}
    assert grown == {(0, "fc2.weight"), (1, "fc2.weight")}
    errors = scaled_norm_errors(ddp_runs / "ref", ddp_runs / "cand", FLOOR)
    assert earliest_beyond(errors, FP32_TOL) == (PERTURB_STEP, 5)
    for rank in (0, 1):
        assert errors[(rank, "weight_grad", PERTURB_STEP, "fc2.weight", "unreduced", "1")] == 0.0
        assert errors[(rank, "weight_grad", PERTURB_STEP, "fc2.weight", "reduced", "")] == \
            pytest.approx(1 - 1 / 1.01, rel=1e-3)
    text = cli("compare", ddp_runs / "ref", ddp_runs / "cand", "--out", tmp_path / "cmp2").out
    assert "reduced, not unreduced" in text


# ------------------------------------------------------------------ the baseline
def test_baseline_turns_errors_into_ratios_to_the_noise(runs, tmp_path):
    out = tmp_path / "cmp"
    res = cli("compare", runs["fp32"], runs["bf16"], "--dtype", "bfloat16", "--baseline", runs["seed"],
              "--out", out, "--json")
    doc = res.json()
    err = scaled_norm_errors(runs["fp32"], runs["bf16"], FLOOR)
    noise = scaled_norm_errors(runs["fp32"], runs["seed"], FLOOR)
    got = compare_csv(out / "compare.csv")
    levels = {"pass": 0, "warning": 0, "error": 0}
    for k, e in err.items():
        if k not in noise or e != e:
            continue
        ratio = e / max(0.0 if noise[k] != noise[k] else noise[k], 2.0 ** -8)  # near zero: no noise
        assert float(got[k]["ratio"]) == pytest.approx(ratio, rel=1e-9, abs=1e-15), k
        level = "error" if ratio > 10 else "warning" if ratio > 2 else "pass"
        assert got[k]["level"] == level
        levels[level] += 1
    # a run with other weights and data is far noisier than bf16 rounding: nearly all pass
    # (a row the two references happen to share, e.g. position ids, has noise 0)
    assert levels["error"] == 0 and levels["warning"] <= 0.01 * levels["pass"]
    near = sum(1 for e in err.values() if e != e)
    assert doc["counts"]["near_zero"] == near
    assert doc["counts"]["pass"] == levels["pass"] + near and doc["counts"]["warning"] == levels["warning"]
    assert res.code == (1 if levels["warning"] else 0)
    # the defect against a bf16 REF2 (the noise of another precision): the defect's rows
    # are above 2 x that noise where the defect is
    res = cli("compare", runs["fp32"], runs["defect"], "--baseline", runs["bf16"], "--out", tmp_path / "d", "--json")
    got = compare_csv(tmp_path / "d" / "compare.csv")
    row = got[(0, "module", DEFECT_STEP, f"{DEFECT_LAYER}.output.0", "forward", "")]
    derr = scaled_norm_errors(runs["fp32"], runs["defect"], FLOOR)
    dnoise = scaled_norm_errors(runs["fp32"], runs["bf16"], FLOOR)
    k = (0, "module", DEFECT_STEP, f"{DEFECT_LAYER}.output.0", "forward", "")
    assert float(row["ratio"]) == pytest.approx(derr[k] / max(dnoise[k], 2.0 ** -14), rel=1e-9)
    assert float(row["ratio"]) > 2 and row["level"] != "pass"


# ------------------------------------------------------------------ loss and grad norm
def test_loss_log_migration_standard(runs, tmp_path):
    base = runs["fp32"].parent
    res = cli("compare", runs["fp32"], runs["bf16"], "--dtype", "bf16", "--loss-log", base / "fp32.loss",
              base / "bf16.loss", "--out", tmp_path / "a", "--json")
    doc = res.json()
    assert res.code == 0 and doc["scalars"]["level"] == "pass"
    # an explicit --loss-log wins over the scalars rows the runs have (said in a note)
    assert doc["scalars"]["source"] == {"ref": "--loss-log", "cand": "--loss-log"}
    assert sum("scalars rows (grad_norm, loss) are set aside" in n for n in doc["notes"]) == 2

    def losses(name):
        return np.loadtxt(base / f"{name}.loss")

    a, b = losses("fp32"), losses("bf16")
    assert doc["scalars"]["loss"]["first_abs"] == pytest.approx(abs(b[0, 1] - a[0, 1]), rel=1e-12)
    assert doc["scalars"]["grad_norm"]["mean_signed_rel"] == pytest.approx(
        float(np.mean((b[:, 2] - a[:, 2]) / np.abs(a[:, 2]))), rel=1e-9)
    # another model and data: the losses are beyond the standard
    res = cli("compare", runs["fp32"], runs["bf16"], "--dtype", "bf16", "--loss-log", base / "fp32.loss",
              base / "seed.loss", "--out", tmp_path / "b", "--json")
    s = np.loadtxt(base / "seed.loss")
    first_ok = abs(s[0, 1] - a[0, 1]) <= 0.005 or abs(s[0, 1] - a[0, 1]) <= 0.005 * abs(a[0, 1])
    all_ok = all(abs(s[i, 1] - a[i, 1]) <= 0.01 or abs(s[i, 1] - a[i, 1]) <= 0.01 * abs(a[i, 1])
                 for i in range(len(a)))
    gn_ok = abs(np.mean((s[:, 2] - a[:, 2]) / np.abs(a[:, 2]))) <= 0.05
    assert not (first_ok and all_ok and gn_ok)
    # (the runs' own scalars rows, fp32 against bf16, pass: the log decides)
    assert res.code == 1 and res.json()["scalars"]["level"] == "error"


def test_scalars_rows(runs, tmp_path):
    """Rows as ``mon.log_scalars`` writes them (rank_<r>/scalars_step<a>-<b>.csv, the value
    in min = max = mean, norm = |value|)."""
    import shutil

    sides = {}
    for name, loss in (("ref", 2.0), ("cand", 2.03)):
        d = tmp_path / name
        shutil.copytree(runs["fp32"], d)
        with open(d / "rank_0" / "scalars_step0-5.csv", "w") as fh:
            fh.write("vpp_stage,step,module_name,scope,min,max,mean,norm,nans\n")
            for step in range(6):
                v = loss - 0.1 * step
                fh.write(f"0,{step},loss,scalars,{v},{v},{v},{abs(v)},0\n")
        sides[name] = d
    res = cli("compare", sides["ref"], sides["cand"], "--out", tmp_path / "o", "--json")
    doc = res.json()
    # 0.03 on the first loss: beyond 0.005 and 0.5 % of 2.0; the module rows agree exactly
    assert doc["scalars"]["loss"]["first_ok"] is False and doc["scalars"]["level"] == "error"
    assert doc["counts"]["error"] == 0 and doc["counts"]["warning"] == 0
    assert res.code == 1 and doc["verdict"] == "error"


# ------------------------------------------------------------------ alignment and bad input
def shifted_renamed_run(src: Path, cand: Path) -> Path:
    """A copy of ``src`` that numbers its steps from 1 and calls the MLPs ``ffn``."""
    import shutil

    shutil.copytree(src, cand)
    # last window first: each file moves to the next window's name
    for path in sorted((cand / "rank_0").glob("*.csv"), key=lambda p: -int(p.stem.split("_step")[1].split("-")[0])):
        with open(path, newline="") as fh:
            recs = list(csv.reader(fh))
        for r in recs[1:]:
            r[1] = str(int(r[1]) + 1)
            r[2] = r[2].replace(".mlp", ".ffn")
        path.unlink()
        a, b = path.stem.split("_step")[1].split("-")
        with open(path.parent / f"{path.stem.split('_step')[0]}_step{int(a) + 1}-{int(b) + 1}.csv", "w",
                  newline="") as fh:
            csv.writer(fh, lineterminator="\n").writerows(recs)
    return cand


def test_step_offset_map_and_rows_in_one_run(runs, tmp_path):
    cand = shifted_renamed_run(runs["fp32"], tmp_path / "cand")
    (tmp_path / "map.txt").write_text("# candidate reference\nblocks.0.ffn blocks.0.mlp\n")
    res = cli("compare", runs["fp32"], cand, "--step-offset", "-1", "--map", tmp_path / "map.txt",
              "--out", tmp_path / "o", "--json")
    doc = res.json()
    assert doc["verdict"] == "pass" and res.code == 0
    ref = read_run(runs["fp32"])
    # the other blocks' MLP rows are named differently in each run: counted, never dropped
    n_other = sum(1 for k in ref if ".mlp" in k[3] and not k[3].startswith("blocks.0."))
    only = doc["only_in_one"]
    assert sum(v["ref"] for m in only.values() for v in m.values()) == n_other
    assert sum(v["cand"] for m in only.values() for v in m.values()) == n_other
    assert doc["counts"]["compared"] + doc["counts"]["near_zero"] == len(ref) - n_other


@pytest.mark.parametrize("argv, message", [
    (("--dtype", "int8"), "dtype 'int8': choose among"),
    (("--fail-on", "never"), "argument --fail-on: invalid choice"),
])
def test_bad_input_exit_2(runs, tmp_path, capsys, argv, message):
    res = cli("compare", runs["fp32"], runs["bf16"], *argv, "--out", tmp_path / "o")
    assert res.code == 2 and message in res.err + capsys.readouterr().err  # argparse writes to sys.stderr


def test_missing_run_and_bad_map(runs, tmp_path):
    res = cli("compare", runs["fp32"], tmp_path / "nope", "--out", tmp_path / "o")
    assert res.code == 2 and "CAND" in res.err and "no such directory" in res.err
    (tmp_path / "map.txt").write_text("one two three\n")
    res = cli("compare", runs["fp32"], runs["bf16"], "--map", tmp_path / "map.txt", "--out", tmp_path / "o")
    assert res.code == 2 and "map.txt:1" in res.err


def test_fail_on_error_and_html(runs, tmp_path):
    # the defect's 1 % in float32 is 100 x the tolerance: error level; bf16 vs fp32 at float32 tolerances too
    res = cli("compare", runs["fp32"], runs["defect"], "--fail-on", "error", "--out", tmp_path / "o")
    assert res.code == 1
    res = cli("compare", runs["fp32"], runs["defect"], "--fail-on", "error", "--tolerance", "0.002",
              "--out", tmp_path / "p", "--json")
    doc = res.json()
    assert doc["verdict"] == "warning" and res.code == 0
    page = (tmp_path / "p" / "compare.html").read_text()
    assert "<svg" in page and "rank x step" in page and "layer x step" in page and "<script" not in page
    assert "blocks.1" in page and "src=" not in page


# ------------------------------------------------------------------ different layouts
def test_dp2_against_gradient_accumulation_under_global_names(ddp_runs, tmp_path):
    """DDP on 2 ranks against one process accumulating the same two batches: merged under
    global names, the per-dp rows pooled (DP sizes differ), ``unreduced`` not comparable
    (1 vs 2 micro-batches), ``reduced`` aligned although its micro_step differs (1 vs 2)."""
    out = tmp_path / "cmp"
    res = cli("compare", ddp_runs / "ref", ddp_runs / "accum", "--out", out, "--json")
    doc = res.json()
    assert res.code == 0 and doc["verdict"] == "pass"
    assert doc["settings"]["collapse_dp"] is True
    assert (out / "merged_ref" / "merge.json").is_file() and (out / "merged_cand" / "merge.json").is_file()
    assert set(doc["not_comparable"]) == {"weight_grad/unreduced"}
    assert doc["provenance"]["ref"]["micro_batches"] == 1 and doc["provenance"]["cand"]["micro_batches"] == 2
    assert any("world_size: 2 vs 1" in d for d in doc["provenance"]["config_differences"])
    got = compare_csv(out / "compare.csv")
    reduced = {k: r for k, r in got.items() if k[1] == "weight_grad"}
    assert {k[4] for k in reduced} == {"reduced"}
    # independently: rank 0's reduced gradients (replicas) against the accumulated ones
    a, b = read_run(ddp_runs / "ref"), read_run(ddp_runs / "accum")
    keys = [k for k in a if k[0] == 0 and k[1] == "weight_grad" and k[4] == "reduced"]
    assert len(keys) == len(reduced) == 6 * 5
    for k in keys:
        x, y = a[k]["norm"], b[k]["norm"]
        row = reduced[(0, "weight_grad", k[2], k[3], "reduced", "")]
        assert float(row["ref_norm"]) == x and float(row["cand_norm"]) == y
        assert float(row["error"]) == pytest.approx(abs(y - x) / max(abs(x), abs(y)), abs=1e-15)
        assert abs(y - x) <= FP32_TOL * max(abs(x), abs(y))
    # the perturbed DDP run against it: reduced parts at the perturbed step; unreduced cannot say more
    res = cli("compare", ddp_runs / "cand", ddp_runs / "accum", "--out", tmp_path / "p")
    assert res.code == 1
    assert f"Where they part: step {PERTURB_STEP}, reduced" in res.out
    assert "no unreduced rows at that step" in res.out
    assert "Not comparable: weight_grad/unreduced" in res.out


# ------------------------------------------------------------------ the two paths
def _same(a, b, path=""):
    """Equal documents; pooled sums (another summation order) within 1e-12."""
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            if k not in ("files", "path", "merged_from", "notes"):
                _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == b or math.isclose(float(a), float(b), rel_tol=1e-12,
                                      abs_tol=1e-12 if "pooled" in path else 0.0), (path, a, b)
    else:
        assert a == b, (path, a, b)


@needs("polars", "compare's columnar path (the one for millions of rows) is Polars")
@pytest.mark.parametrize("case", ["bf16_baseline", "defect", "reduced", "layouts", "map_offset_steps"])
def test_columnar_and_python_paths_agree(runs, ddp_runs, tmp_path, case):
    if case == "map_offset_steps":
        cand = shifted_renamed_run(runs["fp32"], tmp_path / "cand")
        (tmp_path / "map.txt").write_text("blocks.0.ffn blocks.0.mlp\nblocks.1 blocks.1\n")
    argv = {"bf16_baseline": (runs["fp32"], runs["bf16"], "--dtype", "bf16", "--baseline", runs["seed"]),
            "defect": (runs["fp32"], runs["defect"]),
            "reduced": (ddp_runs / "ref", ddp_runs / "cand"),
            "layouts": (ddp_runs / "ref", ddp_runs / "accum"),
            "map_offset_steps": (runs["bf16"], tmp_path / "cand", "--step-offset", "-1", "--map",
                                 tmp_path / "map.txt", "--steps", "1:4")}[case]
    docs, csvs = {}, {}
    for engine in ("python", "columnar"):
        res = cli("compare", *argv, "--compare-engine", engine, "--out", tmp_path / engine, "--json", "--limit", "0")
        docs[engine] = res.json()
        csvs[engine] = compare_csv(tmp_path / engine / "compare.csv")
    _same(docs["python"], docs["columnar"])
    assert set(csvs["python"]) == set(csvs["columnar"])
    for k, row in csvs["python"].items():
        other = csvs["columnar"][k]
        assert set(row) == set(other)
        for col, v in row.items():
            if v in ("", other[col]) or not v[:1].isdigit() and v[:1] not in "-.n":
                assert v == other[col], (k, col)
            else:
                x, y = float(v), float(other[col])
                # Polars' float division may differ in the last bit
                assert math.isclose(x, y, rel_tol=1e-14) or (x != x and y != y), (k, col, v, other[col])


def test_nonfinite_mismatch_is_named_and_an_error(runs, tmp_path):
    """A NaN on one side only is a non-finite mismatch (an error, no number); NaN on both
    sides agrees."""
    import shutil

    sides = {}
    for name in ("ref", "cand"):
        d = tmp_path / name
        shutil.copytree(runs["fp32"], d)
        sides[name] = d

    def poison(root, tensor, step=2):
        path = root / "rank_0" / f"weight_grad_step{step}-{step}.csv"
        with open(path, newline="") as fh:
            recs = list(csv.reader(fh))
        col = recs[0].index("norm")
        for r in recs[1:]:
            if r[2] == tensor and r[3] == "reduced":
                r[col] = "nan"
                r[recs[0].index("nans")] = "3"
        with open(path, "w", newline="") as fh:
            csv.writer(fh, lineterminator="\n").writerows(recs)

    poison(sides["cand"], "blocks.0.mlp.fc.weight")
    poison(sides["ref"], "blocks.1.mlp.fc.weight")
    poison(sides["cand"], "blocks.1.mlp.fc.weight")
    res = cli("compare", sides["ref"], sides["cand"], "--out", tmp_path / "o", "--json")
    doc = res.json()
    assert res.code == 1 and doc["counts"]["nonfinite_mismatch"] == 1 and doc["counts"]["error"] == 1
    part = doc["where_they_part"]
    assert (part["step"], part["phase"]) == (2, "reduced")
    assert part["first_row"]["tensor"] == "blocks.0.mlp.fc.weight"
    assert part["first_row"]["class"] == "nonfinite_mismatch"
    got = compare_csv(tmp_path / "o" / "compare.csv")
    row = got[(0, "weight_grad", 2, "blocks.0.mlp.fc.weight", "reduced", "")]
    assert row["class"] == "nonfinite_mismatch" and row["level"] == "error" and math.isnan(float(row["error"]))
    both = got[(0, "weight_grad", 2, "blocks.1.mlp.fc.weight", "reduced", "")]
    assert both["class"] == "compared" and both["level"] == "pass" and float(both["error"]) == 0.0


def test_module_rule_error_level(runs, tmp_path):
    """msProbe's error rule: a module whose input agrees (error < 0.1) and whose output is
    off by more than 0.5 (here its norm x 3: 2/3)."""
    import shutil

    cand = tmp_path / "cand"
    shutil.copytree(runs["fp32"], cand)
    path = cand / "rank_0" / "module_step4-4.csv"
    with open(path, newline="") as fh:
        recs = list(csv.reader(fh))
    col = recs[0].index("norm")
    for r in recs[1:]:
        if r[2] == "blocks.2.mlp.output.0" and r[3] == "forward":
            r[col] = repr(3 * float(r[col]))
    with open(path, "w", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerows(recs)
    doc = cli("compare", runs["fp32"], cand, "--out", tmp_path / "o", "--json").json()
    born = doc["where_they_part"]["born_at"]
    assert (doc["where_they_part"]["step"], doc["where_they_part"]["phase"]) == (4, "forward")
    assert born["module"] == "blocks.2.mlp" and born["level"] == "error"
    assert born["input_error"] == 0.0 and born["output_error"] == pytest.approx(2 / 3, rel=1e-6)


def test_merged_views_given_directly(ddp_runs, tmp_path):
    """Two merged views (msprobe-monitor merge's DEST) compare as the runs they were merged from."""
    for name in ("ref", "accum"):
        assert cli("merge", ddp_runs / name, tmp_path / f"m_{name}").code == 0
    direct = cli("compare", tmp_path / "m_ref", tmp_path / "m_accum", "--out", tmp_path / "a", "--json").json()
    auto = cli("compare", ddp_runs / "ref", ddp_runs / "accum", "--out", tmp_path / "b", "--json").json()
    assert direct["provenance"]["ref"]["kind"] == "merged view" and not (tmp_path / "a" / "merged_ref").exists()
    for k in ("verdict", "counts", "not_comparable", "only_in_one", "first_step"):
        assert direct[k] == auto[k], k


def test_merged_views_keep_the_runs_scalars(runs, tmp_path):
    """A merged view has no scalars files: compare reads the loss and grad norm from the run
    its merge.json names, so two merged views get the verdict the runs get."""
    for name in ("fp32", "bf16"):
        assert cli("merge", runs[name], tmp_path / f"m_{name}").code == 0
        assert not list((tmp_path / f"m_{name}").rglob("scalars_*.csv"))
    direct = cli("compare", tmp_path / "m_fp32", tmp_path / "m_bf16", "--dtype", "bf16", "--out", tmp_path / "a",
                 "--json").json()
    runs_doc = cli("compare", runs["fp32"], runs["bf16"], "--dtype", "bf16", "--out", tmp_path / "b", "--json").json()
    assert direct["provenance"]["cand"]["kind"] == "merged view"
    assert direct["scalars"] is not None and direct["scalars"] == runs_doc["scalars"]
    assert direct["provenance"]["cand"]["scalars"]["path"] == str((runs["bf16"] / "rank_0").resolve())
