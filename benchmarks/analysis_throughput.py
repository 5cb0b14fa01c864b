"""Throughput and peak memory of the ``msprobe-monitor`` commands on a synthetic output.

    .venv/bin/python benchmarks/analysis_throughput.py                  # 6 M rows (4 x 250 x 6,000)
    .venv/bin/python benchmarks/analysis_throughput.py --steps 2084 --engines columnar   # ~50 M rows
    .venv/bin/python benchmarks/analysis_throughput.py --smoke          # tiny, checks the findings (CI)
    .venv/bin/python benchmarks/analysis_throughput.py --commands merge --merge-steps 1000   # 64 x 1,000 x 200

Writes ``ranks x steps x 2*tensors`` ``weight_grad`` rows (one CSV file per rank and
step by default; see ``analysis_synthetic.py``: a NaN, a spike and a rank disagreement
at known places), then runs each command in a fresh process, once per engine:
``columnar`` (Polars, the default) and ``reference`` (the previous pure-Python
implementation, ``--engine reference``). Also ``export`` to Parquet and ``summary`` /
``anomalies`` on that dataset. For each run: wall time, rows per second, CPU time of
the process (user + system, all threads), rows per CPU second (a steadier figure on a
shared machine), peak resident memory (``ru_maxrss``), and whether the findings are the
injected ones. The findings of the two engines must be identical (exit 1 otherwise).

``merge`` runs on a model-parallel output of its own (``analysis_synthetic.
write_parallel_output``: ``--merge-layout TPxPPxDP`` ranks, default 4x2x8 = 64, each
with its ``layout.json``, ``--merge-steps`` steps, ``--merge-params`` parameters per
pipeline stage, an ``unreduced`` and a ``reduced`` row each; linear weights split over
tp, layernorm weights replicated), once per implementation (``--merge-engines``: Polars,
and the pure-Python one used without it); ``summary`` runs on the same output with each
engine, for the rows/s of a reading command on the same rows. The findings of ``merge``:
the merged norms of watched parameters equal the whole tensors' (1e-5), every row is
merged, and the one injected replica disagreement is reported (exit 1).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from analysis_synthetic import Expected, ParallelExpected, write_output, write_parallel_output  # noqa: E402

_CHILD = r"""
import io, json, resource, sys, time
sys.path.insert(0, {src!r})
from msprobe.core.monitor_v2.analysis.cli import main
t0 = time.perf_counter()
out = io.StringIO()
code = main({argv!r}, out=out, err=io.StringIO())
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
json.dump({{"code": code, "wall": wall, "cpu": ru.ru_utime + ru.ru_stime, "peak_mb": ru.ru_maxrss / 1024,
           "out": out.getvalue()}}, sys.stdout)
"""


def run_command(argv: List[str]) -> Dict[str, Any]:
    code = _CHILD.format(src=os.path.join(ROOT, "src"), argv=argv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed: {' '.join(argv)}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def findings(out: str) -> Dict[str, Any]:
    """The findings of ``anomalies --json`` without what names the input directory."""
    data = json.loads(out)
    data.pop("out_dir", None)
    return data


def check_findings(data: Dict[str, Any], exp: Expected) -> List[str]:
    """What is wrong with the findings of ``anomalies --json`` (empty: they are the injected ones)."""
    errors = []
    first = data["nonfinite"]["first"] or {}
    got = (first.get("rank"), first.get("step"), first.get("tensor"), first.get("scope"))
    if got != (exp.nan_rank, exp.nan_step, exp.nan_tensor, "unreduced"):
        errors.append(f"first NaN {got}, expected {(exp.nan_rank, exp.nan_step, exp.nan_tensor, 'unreduced')}")
    spikes = [(s["rank"], s["step"], s["tensor"], s["scope"]) for s in data["spikes"]["items"]]
    if spikes != [(exp.spike_rank, exp.spike_step, exp.spike_tensor, "unreduced")]:
        errors.append(f"spikes {spikes}, expected only {(exp.spike_rank, exp.spike_step, exp.spike_tensor)}")
    mm = [(m["rank"], m["step"], m["tensor"]) for m in data["rank_check"]["items"]]
    want = [(exp.desync_rank, exp.desync_step, exp.desync_tensor)] if exp.desync_rank is not None else []
    if mm != want:
        errors.append(f"rank disagreement {mm}, expected {want}")
    return errors


def check_merge(data: Dict[str, Any], code: int, dest: str, exp: ParallelExpected) -> List[str]:
    """What is wrong with ``merge --json``'s result and DEST (empty: as injected)."""
    import csv

    errors = []
    if code != 1:
        errors.append(f"exit {code}, expected 1 (a disagreement)")
    if data["rows_written"] != exp.merged_rows or any(data["left_out"].values()):
        errors.append(f"rows written {data['rows_written']} (expected {exp.merged_rows}), left out {data['left_out']}")
    step, name, scope, rank = exp.disagreement
    got = [(d["step"], d["module_name"], d["scope"], tuple(d["differing_ranks"])) for d in data["first_disagreements"]]
    # min, max, mean and norm of that one row: the injected error scales them all
    if data["disagreeing_rows"] != 1 or not got or set(got) != {(step, name, scope, (rank,))}:
        errors.append(f"{data['disagreeing_rows']} disagreeing rows: {sorted(set(got))}, expected "
                      f"{[(step, name, scope, (rank,))]}")
    want = dict(exp.values)
    with open(os.path.join(dest, "weight_grad.csv"), newline="") as fh:
        for row in csv.DictReader(fh):
            key = (int(row["step"]), row["module_name"], row["scope"], row["dp_rank"])
            if key in want:
                v = want.pop(key)
                if abs(float(row["norm"]) - v) > 1e-5 * abs(v):
                    errors.append(f"{key}: merged norm {row['norm']}, whole tensor {v:.9g}")
    if want:
        errors.append(f"{len(want)} watched rows missing from the merged file, e.g. {next(iter(want))}")
    return errors


def run_merge_case(args: argparse.Namespace, base: str, engines: List[str]) -> Tuple[bool, List[Dict[str, Any]], int]:
    tp, pp, dp = (int(x) for x in args.merge_layout.lower().split("x"))
    out_dir = os.path.join(base, "parallel")
    dest = os.path.join(base, "merged")
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)
    t0 = time.perf_counter()
    exp = write_parallel_output(out_dir, tp, pp, dp, args.merge_steps, args.merge_params, args.steps_per_file)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out_dir) for f in fs)
    print(f"synthetic model-parallel output: {exp.rows:,} rows, {exp.files:,} files, {size / 1e6:.0f} MB "
          f"({tp * pp * dp} ranks = TP {tp} x PP {pp} x DP {dp}, {args.merge_steps} steps x {args.merge_params} "
          f"params x 2 rows), written in {time.perf_counter() - t0:.1f} s", flush=True)
    results = []
    ok = True
    for engine in args.merge_engines.split(","):
        shutil.rmtree(dest, ignore_errors=True)
        r = run_command(["merge", out_dir, dest, "--json", "--limit", "0", "--merge-engine", engine])
        errs = check_merge(json.loads(r["out"]), r["code"], dest, exp)
        ok &= not errs
        r.update(command="merge", engine=engine, input="csv", findings="as injected" if not errs else "; ".join(errs))
        results.append(r)
        _print_row(r, exp.rows)
    for engine in engines:
        r = run_command(["summary", out_dir, "--engine", engine, "--no-rank-check"])
        r.update(command="summary", engine=engine, input="csv (same run)")
        results.append(r)
        _print_row(r, exp.rows)
    for r in results:
        r["rows"] = exp.rows
    return ok, results, exp.rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--tensors", type=int, default=3000, help="tensors per rank (2 rows each per step)")
    p.add_argument("--steps-per-file", type=int, default=1)
    p.add_argument("--engines", default="columnar,reference")
    p.add_argument("--commands", default="summary,anomalies,export,merge")
    p.add_argument("--merge-layout", default="4x2x8", help="merge's run: TPxPPxDP ranks")
    p.add_argument("--merge-steps", type=int, default=100, help="merge's run: steps (1000: the issue's size)")
    p.add_argument("--merge-params", type=int, default=200, help="merge's run: parameters per pipeline stage")
    p.add_argument("--merge-engines", default="polars,python", help="merge's implementations to run")
    p.add_argument("--dir", default=None, help="where to write the synthetic output (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic output")
    p.add_argument("--smoke", action="store_true", help="2 ranks x 24 steps x 40 rows: a quick check of the findings")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.smoke:
        args.ranks, args.steps, args.tensors = 2, 24, 20
        args.merge_layout, args.merge_steps, args.merge_params = "2x2x2", 24, 20
    base = args.dir or tempfile.mkdtemp(prefix="msprobe_analysis_bench_")
    out_dir = os.path.join(base, "out")
    parquet_dir = os.path.join(base, "parquet")
    engines = [e for e in args.engines.split(",") if e]
    commands = [c for c in args.commands.split(",") if c]
    ok = True
    try:
        if "merge" in commands:
            merged_ok, merge_results, merge_rows = run_merge_case(args, base, engines)
            ok &= merged_ok
            commands.remove("merge")
        else:
            merge_results, merge_rows = [], 0
        if not commands:
            print()
            print(_table(merge_results, merge_rows))
            return _finish(ok)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        t0 = time.perf_counter()
        exp = write_output(out_dir, args.ranks, args.steps, args.tensors, args.steps_per_file)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out_dir) for f in fs)
        print(f"synthetic output: {exp.rows:,} rows, {exp.files:,} files, {size / 1e6:.0f} MB "
              f"({args.ranks} ranks x {args.steps} steps x {2 * args.tensors} rows), written in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        results = []
        answers: Dict[str, Any] = {}
        for command in commands:
            for engine in engines:
                if command == "export" and engine != "columnar":
                    continue
                if command == "export":
                    shutil.rmtree(parquet_dir, ignore_errors=True)
                    argv = ["export", out_dir, parquet_dir]
                else:
                    argv = [command, out_dir, "--engine", engine] + (["--json", "--limit", "0"]
                                                                    if command == "anomalies" else [])
                r = run_command(argv)
                r.update(command=command, engine=engine, input="csv")
                if command == "anomalies":
                    answers[engine] = findings(r["out"])
                    errs = check_findings(answers[engine], exp)
                    r["findings"] = "as injected" if not errs else "; ".join(errs)
                    ok &= not errs
                results.append(r)
                _print_row(r, exp.rows)
        if "export" in commands:
            for command in ("summary", "anomalies"):
                argv = [command, parquet_dir] + (["--json", "--limit", "0"] if command == "anomalies" else [])
                r = run_command(argv)
                r.update(command=command, engine="columnar", input="parquet")
                if command == "anomalies":
                    errs = check_findings(findings(r["out"]), exp)
                    r["findings"] = "as injected" if not errs else "; ".join(errs)
                    ok &= not errs
                results.append(r)
                _print_row(r, exp.rows)
        if len(answers) == 2:
            a, b = (json.dumps(v, sort_keys=True) for v in answers.values())
            same = a == b
            ok &= same
            print(f"findings of the two engines: {'identical' if same else 'DIFFERENT'}")
        print()
        print(_table(results + merge_results, exp.rows))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"rows": exp.rows, "files": exp.files, "bytes": size, "ranks": args.ranks,
                           "steps": args.steps, "tensors": args.tensors, "cpus": os.cpu_count(),
                           "load_avg": os.getloadavg(),
                           "merge_rows": merge_rows,
                           "results": [{k: v for k, v in r.items() if k != "out"} for r in results + merge_results]},
                          fh, indent=1)
    finally:
        if not args.keep:
            shutil.rmtree(base if args.dir is None else out_dir, ignore_errors=True)
            for sub in ("parquet", "parallel", "merged"):
                shutil.rmtree(os.path.join(base, sub), ignore_errors=True)
    return _finish(ok)


def _finish(ok: bool) -> int:
    print("OK: findings as injected" if ok else "FAILED: see above")
    return 0 if ok else 1


def _print_row(r: Dict[str, Any], rows: int) -> None:
    print(f"  {r['command']:<10} {r['engine']:<10} {r['input']:<8} {r['wall']:8.2f} s  "
          f"{rows / r['wall']:>12,.0f} rows/s  cpu {r['cpu']:7.2f} s  peak {r['peak_mb']:7.0f} MB  "
          f"{r.get('findings', '')}", flush=True)


def _table(results: List[Dict[str, Any]], rows: int) -> str:
    head = ["command", "engine", "input", "wall s", "rows/s", "CPU s", "rows/CPU-s", "peak MB", "findings"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        n = r.get("rows", rows)
        lines.append(f"| {r['command']} | {r['engine']} | {r['input']} | {r['wall']:.1f} | {n / r['wall']:,.0f} | "
                     f"{r['cpu']:.1f} | {n / r['cpu']:,.0f} | {r['peak_mb']:.0f} | {r.get('findings', '')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
