"""The reading tools on the new-user scenario of docs/incident.md (real runs of
:mod:`incident_runs`): the "cannot localise" message when every gradient of a step went
non-finite at once, the bracket of a sampled run, the online alert's tensor against the
report's, and the evidence files (``anomalies.jsonl``, dump manifests) read back. Every
expected message is rebuilt from the CSV files read with the ``csv`` module; both
engines must print the same."""

import csv
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from analysis_helpers import cli, training_runs
from incident_runs import BAD_LAYER, NAN_STEP, RUNS, TRANSIENT_STEP, train

from support.extras import POLARS_ENGINE, require

require("polars", POLARS_ENGINE)

ENGINES = ((), ("--engine", "reference"))
ORDER = {("param", "param_origin"): 0, ("module", "forward"): 1, ("module", "backward"): 2,
         ("weight_grad", "unreduced"): 3, ("weight_grad", "reduced"): 5, ("param", "param_updated"): 7}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("incident")
    logger = logging.getLogger("msprobe.monitor_v2")
    alerts: List[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            alerts.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        for run in RUNS:
            train(run, root / run)
    finally:
        logger.removeHandler(handler)
    return root, [a for a in alerts if a.startswith("monitor_v2 alert:")]


def csv_rows(run: Path) -> List[Dict[str, Any]]:
    """Every row of rank 0, with its monitor and line, read with the csv module."""
    out = []
    for f in sorted((run / "rank_0").glob("*.csv")):
        monitor = f.name.split("_step")[0]
        with open(f, newline="") as fh:
            for line, row in enumerate(csv.DictReader(fh), 2):
                vals = [float(row[k]) for k in ("min", "max", "mean", "norm")]
                row.update(monitor=monitor, step=int(row["step"]), line=line, file=f.name,
                           bad=int(row["nans"]) > 0 or any(not math.isfinite(v) for v in vals))
                out.append(row)
    return out


def first_bad_step(rows: List[Dict[str, Any]]) -> int:
    return min(r["step"] for r in rows if r["bad"])


def expected_message(rows: List[Dict[str, Any]], evidence: str) -> Tuple[str, Dict[str, Any]]:
    """The "cannot localise" sentence, from the rows of the first bad step."""
    step = first_bad_step(rows)
    in_step = [r for r in rows if r["step"] == step]
    phases: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for r in in_step:
        phases.setdefault((r["monitor"], r["scope"]), []).append(r)
    full = sorted((k for k, rs in phases.items() if all(r["bad"] for r in rs)), key=ORDER.__getitem__)
    full = [k for k in full if ORDER[k] <= 5] or full  # what follows from the gradients is not named
    groups: Dict[Tuple[str, str], List[str]] = {}
    for m, s in full:
        groups.setdefault((m, s if m == "module" else ""), []).append(s)
    nouns = {"weight_grad": "gradients", "param": "parameters", "module": "module gradients"}
    parts = []
    for (m, _), scopes in groups.items():
        rs = [r for s in scopes for r in phases[(m, s)]]
        parts.append(f"all {len({r['module_name'] for r in rs})} {nouns[m]} ({m} {', '.join(scopes)}: "
                     f"{len(rs)} rows)")
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    who = f"the {nouns[full[0][0]]}" if len(groups) == 1 else "they"
    first_full = ORDER[full[0]]
    earlier = sorted((r for r in in_step if r["bad"] and ORDER[(r["monitor"], r["scope"])] < first_full),
                     key=lambda r: (ORDER[(r["monitor"], r["scope"])], r["line"]))
    return (f"{listed} went non-finite in step {step}: {who} cannot localise this; the earliest evidence is "
            f"{evidence}"), (earlier[0] if earlier else None)


def both(*argv: Any):
    """The result of both engines (which must print the same)."""
    ref = cli(*argv, "--engine", "reference")
    new = cli(*argv)
    assert (new.code, new.out, new.err) == (ref.code, ref.out, ref.err)
    return new


def test_every_gradient_nonfinite_at_once_cannot_localise(runs):
    run = runs[0] / "always_on"
    rows = csv_rows(run)
    assert {r["monitor"] for r in rows} == {"weight_grad"} and first_bad_step(rows) == NAN_STEP
    want, earlier = expected_message(rows, "none in this output: turn on `module` (see docs/incident.md)")
    assert earlier is None and want.startswith("all 16 gradients (weight_grad unreduced, reduced: 32 rows)")
    summary = both("summary", run)
    assert f"  localisation:      {want}\n" in summary.out
    assert "began:" not in summary.out  # every step is written: no gap to bracket
    anomalies = both("anomalies", run)
    assert anomalies.code == 1 and f"\n  {want}\n" in anomalies.out
    loc = both("anomalies", run, "--json").json()["localisation"]["per_rank"][0]
    assert loc["message"] == want and not loc["localised"] and loc["evidence"] is None
    assert loc["last_clean_step"] == NAN_STEP - 1 and loc["began_in"] == [NAN_STEP, NAN_STEP]
    assert [g["tensors"] for g in loc["all_nonfinite"]] == [16]


def test_a_sampled_run_gives_the_bracket(runs):
    run = runs[0] / "interval"
    rows = csv_rows(run)
    written = sorted({r["step"] for r in rows})
    bad = first_bad_step(rows)
    last = max(s for s in written if s < bad)
    assert (last, bad) == (15, 20) and last < NAN_STEP <= bad
    bracket = f"last clean written step {last}, first bad written step {bad}: it began in {last + 1}..{bad}"
    summary = both("summary", run)
    assert f"  began:             {bracket}\n" in summary.out
    assert "  localisation:      all 16 gradients (weight_grad unreduced, reduced: 32 rows) went non-finite in " \
           f"step {bad}" in summary.out
    assert f"\n  {bracket}\n" in both("anomalies", run).out
    loc = both("summary", run, "--json").json()["localisation"]["per_rank"][0]
    assert (loc["last_clean_step"], loc["first_bad_step"], loc["began_in"], loc["bracket"]) == \
        (last, bad, [last + 1, bad], bracket)


def test_clean_parameters_at_the_first_bad_step_close_the_bracket(runs):
    run = runs[0] / "transient"
    rows = csv_rows(run)
    bad = first_bad_step(rows)
    last = max(r["step"] for r in rows if r["step"] < bad)
    origin = [r for r in rows if r["step"] == bad and r["monitor"] == "param" and r["scope"] == "param_origin"]
    assert (last, bad) == (15, TRANSIENT_STEP) and origin and not any(r["bad"] for r in origin)
    bracket = (f"last clean written step {last}, first bad written step {bad}; the parameters step {bad} started "
               f"from are finite (param param_origin): it began in step {bad}")
    assert f"  began:             {bracket}\n" in both("summary", run).out
    loc = both("anomalies", run, "--json").json()["localisation"]["per_rank"][0]
    assert (loc["clean_start"], loc["began_in"], loc["bracket"]) == (True, [bad, bad], bracket)


def test_a_selection_of_steps_brackets_with_the_steps_it_reads(runs):
    out = both("summary", runs[0] / "interval", "--steps", "16:", "--json").json()
    loc = out["localisation"]["per_rank"][0]
    assert loc["last_clean_step"] is None and loc["began_in"] == [None, 20]
    assert loc["bracket"] == "no step before step 20 is in this output for rank 0: it began in step 20 or earlier"


def test_module_rows_give_the_earliest_evidence(runs):
    run = runs[0] / "module"
    rows = csv_rows(run)
    want, earlier = expected_message(rows, "")
    assert (earlier["monitor"], earlier["scope"], earlier["module_name"]) == \
        ("param", "param_origin", f"{BAD_LAYER}.weight")
    want += f"{BAD_LAYER}.weight (param, parameters at step start: nan): it was already non-finite before step " \
            f"{NAN_STEP}"
    assert f"  localisation:      {want}\n" in both("summary", run).out
    # without param rows, the forward pass is the earliest evidence
    rows = [r for r in rows if r["monitor"] != "param"]
    want, earlier = expected_message(rows, "")
    fwd = sorted((r for r in rows if r["bad"] and r["monitor"] == "module" and r["scope"] == "forward"
                  and r["step"] == NAN_STEP), key=lambda r: r["line"])[0]
    assert earlier is fwd and fwd["module_name"] == f"{BAD_LAYER}.output.0"
    want += f"{BAD_LAYER}.output.0 (module, forward: nan)"
    summary = both("summary", run, "--monitors", "module,weight_grad")
    assert f"  localisation:      {want}\n" in summary.out
    assert f"first NaN/Inf:     rank 0, step {NAN_STEP}, forward: {BAD_LAYER}.output.0 (module forward)" in summary.out


def alert_record(step: int, monitor: str, name: str, scope: str, first: bool) -> Dict[str, Any]:
    """One line of rank_<r>/anomalies.jsonl, in the documented format."""
    return {"rank": 0, "step": step, "micro_step": None, "monitor": monitor, "module_name": name, "scope": scope,
            "vpp_stage": 0, "kind": "nonfinite",
            "stats": {"min": "nan", "max": "nan", "mean": "nan", "norm": "nan", "nans": 4},
            "order": ["forward"], "rows_nonfinite": 94, "rows_total": 150, "first": first}


@pytest.fixture
def with_evidence(runs, tmp_path):
    """The module run plus evidence files in their documented format: an alert record that
    names the forward output (what the alert of a run without ``param`` rows names) and a
    dump of the failing step. The real alert of this run names, like the report, the
    earliest non-finite row in execution order: the parameter itself."""
    run = tmp_path / "module"
    shutil.copytree(runs[0] / "module", run)
    logged = runs[1][0]
    assert logged.startswith(f"monitor_v2 alert: rank 0 step {NAN_STEP}: first non-finite value of the run in "
                             f"param {BAD_LAYER}.weight (scope param_origin")
    lines = [alert_record(NAN_STEP, "module", f"{BAD_LAYER}.output.0", "forward", True),
             alert_record(NAN_STEP, "module", "blocks.3.fc.output.0", "forward", False), {"truncated": 92}]
    (run / "rank_0" / "anomalies.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    dump = run / "rank_0" / f"dump_step{NAN_STEP}"
    dump.mkdir()
    tensors = [{"name": f"{BAD_LAYER}.weight", "kind": "param", "file": "tensors.pt", "shape": [16, 16],
                "dtype": "float32", "bytes": 1024},
               {"name": f"{BAD_LAYER}.weight", "kind": "grad", "file": "tensors.pt", "shape": [16, 16],
                "dtype": "float32", "bytes": 1024},
               {"name": "input.0", "kind": "input", "file": "tensors.pt", "shape": [4, 8], "dtype": "float32",
                "bytes": 128}]
    (dump / "manifest.json").write_text(json.dumps({
        "step": NAN_STEP, "rank": 0, "reason": "nonfinite", "max_bytes": 268435456, "bytes": 2176,
        "tensors": tensors, "skipped": [{"name": "inp.weight", "kind": "param", "bytes": 512, "why": "budget"}]}))
    return run


def test_the_alert_and_the_report_name_tensors_of_one_layer(with_evidence):
    run = with_evidence
    want = (f"the alert named {BAD_LAYER}.output.0 (module, forward) and this report names {BAD_LAYER}.weight "
            f"(param, parameters at step start): the same layer {BAD_LAYER}; {BAD_LAYER}.weight (parameters at step "
            f"start) comes first in execution order")
    summary = both("summary", run)
    assert f"  online alert:      rank 0: {want} [rank_0/anomalies.jsonl:1]\n" in summary.out
    anomalies = both("anomalies", run)
    assert f"  rank 0: {want}\n" in anomalies.out
    alert = both("anomalies", run, "--json").json()["alerts"]["per_rank"][0]
    assert (alert["explanation"], alert["records"], alert["truncated"]) == (want, 2, 92)
    assert alert["first"]["module_name"] == f"{BAD_LAYER}.output.0" and alert["first"]["first"] is True


def test_the_alert_names_the_forward_output_where_the_gradients_cannot_localise(with_evidence):
    run = with_evidence
    first = min((r for r in csv_rows(run) if r["bad"] and r["monitor"] == "weight_grad"),
                key=lambda r: (r["step"], ORDER[(r["monitor"], r["scope"])], r["line"]))
    out = both("summary", run, "--monitors", "weight_grad").out
    assert (f"the alert named {BAD_LAYER}.output.0 (module, forward) and this report names {first['module_name']} "
            f"(weight_grad, local gradient): both name the first non-finite row in execution order, the alert over "
            f"every monitor its rank wrote in that step, this report over the monitors, steps and ranks it reads; {BAD_LAYER}.output.0 (forward) comes "
            f"first in execution order; this report's rows of step {NAN_STEP} cannot localise it (see above): start "
            f"from the alert's tensor") in out
    same = both("summary", run, "--monitors", "module,weight_grad").out
    assert (f"online alert:      rank 0: the alert and this report name the same tensor, {BAD_LAYER}.output.0 "
            f"(module, forward), in step {NAN_STEP}") in same


def test_a_dump_manifest_is_shown(with_evidence):
    run = with_evidence
    out = both("summary", run).out
    dump_line = next(line for line in out.splitlines() if line.startswith("  dump:"))
    assert dump_line == (f"  dump:              rank 0 step {NAN_STEP}: rank_0/dump_step{NAN_STEP}, 3 tensor(s), "
                         "2.12 KiB of a 256 MiB budget, 1 skipped (nonfinite)")
    assert f"  rank 0 step {NAN_STEP}: rank_0/dump_step{NAN_STEP}, 3 tensor(s)" in both("anomalies", run).out
    d = both("anomalies", run, "--json").json()["dumps"][0]
    assert (d["step"], d["tensors"], d["bytes"], d["skipped"], d["max_bytes"], d["reason"]) == \
        (NAN_STEP, 3, 2176, 1, 268435456, "nonfinite")
    assert d["kinds"] == {"param": 1, "grad": 1, "input": 1}
    assert d["manifest"].endswith(f"rank_0/dump_step{NAN_STEP}/manifest.json")


def test_malformed_evidence_files_are_reported_not_fatal(with_evidence):
    run = with_evidence
    path = run / "rank_0" / "anomalies.jsonl"
    path.write_text("{not json\n" + path.read_text())
    (run / "rank_0" / f"dump_step{NAN_STEP}" / "manifest.json").write_text("[]")
    res = both("summary", run, "--json")
    data = res.json()
    assert data["alerts"]["per_rank"][0]["first"]["line"] == 2 and data["dumps"] == []
    assert data["problems"]["count"] == 2
    assert "anomalies.jsonl:1: not a JSON object" in res.err and "a dump manifest needs a list" in res.err


def test_an_exported_dataset_localises_the_same(runs, tmp_path):
    run = runs[0] / "interval"
    assert cli("export", run, tmp_path / "pq").code == 0
    want = cli("summary", run, "--json").json()["localisation"]["per_rank"][0]
    got = cli("summary", tmp_path / "pq", "--json").json()["localisation"]["per_rank"][0]
    for key in ("message", "bracket", "last_clean_step", "first_bad_step", "all_nonfinite"):
        assert got[key] == want[key]


def test_two_ranks_each_localise_their_own_first_bad_step(tmp_path_factory):
    """The 2-rank DDP run whose rank 1 alone got a NaN in fc2's output: each rank's first
    bad step and phases, from its own CSV files."""
    root = training_runs(tmp_path_factory) / "nan"
    data = both("anomalies", root, "--json").json()
    per_rank = {loc["rank"]: loc for loc in data["localisation"]["per_rank"]}
    for rank in (0, 1):
        rows = []
        for f in sorted((root / f"rank_{rank}").glob("*.csv")):
            with open(f, newline="") as fh:
                for row in csv.DictReader(fh):
                    vals = [float(row[k]) for k in ("min", "max", "mean", "norm")]
                    if int(row["nans"]) > 0 or any(not math.isfinite(v) for v in vals):
                        rows.append(int(row["step"]))
        if not rows:
            assert rank not in per_rank
            continue
        loc = per_rank[rank]
        assert loc["first_bad_step"] == min(rows) and loc["last_clean_step"] == min(rows) - 1
        assert sum(p["nonfinite"] for p in loc["phases"]) == sum(1 for s in rows if s == min(rows))
    assert 1 in per_rank
