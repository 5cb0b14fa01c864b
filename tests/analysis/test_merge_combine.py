"""``merge_run`` on synthetic runs written here: layout.json files and CSV rows of the
pieces of full arrays this test splits itself. Every merged value is checked against
NumPy on the full array (within 1e-5 relative); what cannot be merged (partial,
unknown, incomplete, a rank without layout, cc rows) is left out and counted; pipeline
stages and virtual chunks get global names and execution order."""

import csv
import json
import math
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest

from msprobe.core.monitor_v2 import layout as lay
from support.extras import POLARS_ENGINE, require

from msprobe.core.monitor_v2.analysis.merge import MergeReport, merge_run
from msprobe.core.monitor_v2.analysis.reader import InputError

OPS = ("min", "max", "mean", "norm", "nans", "zeros")
RTOL = 1e-5


@pytest.fixture(params=["python", "polars"])
def engine(request) -> str:
    if request.param == "polars":
        require("polars", POLARS_ENGINE)
    return request.param


def merge(src: Path, dest: Path, engine: str) -> MergeReport:
    """``merge_run`` with ``engine``; with Polars, the pure-Python merge of the same run
    must write the same files and report the same."""
    rep = merge_run(str(src), str(dest), engine=engine)
    if engine == "polars":
        ref_dest = dest.parent / (dest.name + "_python")
        ref = merge_run(str(src), str(ref_dest), engine="python")
        assert sorted(os.listdir(dest)) == sorted(os.listdir(ref_dest))
        for name in os.listdir(dest):
            if name.endswith(".csv"):
                assert (dest / name).read_text() == (ref_dest / name).read_text(), name
        a, b = json.loads((dest / "merge.json").read_text()), json.loads((ref_dest / "merge.json").read_text())
        assert a == b
        assert (rep.examples, rep.first_disagreements, rep.notes) == (ref.examples, ref.first_disagreements,
                                                                      ref.notes)
    return rep


# ----------------------------------------------------------------------- writing a synthetic run
def stats(a: np.ndarray) -> Dict[str, float]:
    """The monitor's statistics of ``a``, by NumPy (float64): NaN wins min/max, as in the monitor."""
    a = np.asarray(a, dtype=np.float64).ravel()
    nans = int(np.isnan(a).sum())
    return {"min": float(np.min(a)) if not nans else math.nan, "max": float(np.max(a)) if not nans else math.nan,
            "mean": float(np.mean(a)), "norm": float(np.sqrt(np.sum(a * a))), "nans": nans,
            "zeros": int((a == 0).sum())}


def cell(op: str, v: float) -> str:
    return str(int(v)) if op in ("nans", "zeros") else format(v, ".9g")


class Run:
    """A synthetic output_dir: ``rows(rank, monitor, ...)`` then ``write()``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.rows: Dict[int, Dict[str, List[str]]] = {}

    def layout(self, rank: int, doc: dict) -> None:
        d = self.root / f"rank_{rank}"
        d.mkdir(parents=True, exist_ok=True)
        lay.write_layout(str(d), doc)

    def row(self, rank: int, monitor: str, step: int, name: str, scope: str, values: np.ndarray,
            micro: Optional[int] = None, vpp: int = 0) -> None:
        s = stats(values)
        cells = [str(vpp), str(step), name, scope]
        if monitor == "weight_grad":
            cells.append(str(1 if micro is None else micro))
        cells += [cell(op, s[op]) for op in OPS]
        self.rows.setdefault(rank, {}).setdefault(monitor, []).append(",".join(cells))

    def write(self, first: int = 0, last: int = 9) -> None:
        for rank, per in self.rows.items():
            d = self.root / f"rank_{rank}"
            d.mkdir(parents=True, exist_ok=True)
            for monitor, lines in per.items():
                lines = sorted(lines, key=lambda line: int(line.split(",")[1]))  # step by step, as the monitor writes
                head = ["vpp_stage", "step", "module_name", "scope"] + (["micro_step"] if monitor == "weight_grad"
                                                                        else []) + list(OPS)
                (d / f"{monitor}_step{first}-{last}.csv").write_text(",".join(head) + "\n" + "\n".join(lines) + "\n")


def doc(rank: int, world: int, groups: Dict[str, Sequence[int]], params: Optional[dict] = None, **extra) -> dict:
    d = lay.new_document("pytorch", "test", rank, world)
    d["groups"] = {g: lay.group(r, n) for g, (r, n) in groups.items()}
    d["params"] = params or {}
    d.update(extra)
    return d


def read_merged(dest: Path, monitor: str) -> List[Dict[str, str]]:
    with open(dest / f"{monitor}.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def assert_stats(row: Dict[str, str], full: np.ndarray, ops: Sequence[str] = OPS) -> None:
    want = stats(full)
    for op in ops:
        got = float(row[op])
        if op in ("nans", "zeros"):
            assert int(row[op]) == want[op], (row, op)
        elif math.isnan(want[op]):
            assert math.isnan(got), (row, op)
        else:
            assert got == pytest.approx(want[op], rel=RTOL, abs=1e-12), (row, op, want[op])


def merged_json(dest: Path) -> dict:
    return json.loads((dest / "merge.json").read_text())


def disagreements(dest: Path) -> List[Dict[str, str]]:
    with open(dest / "disagreements.csv", newline="") as fh:
        return list(csv.DictReader(fh))


# ----------------------------------------------------------------------- tensor parallel, TP=2 x DP=2
def test_tp_split_pieces_combine_to_the_full_tensor_and_unreduced_rows_stay_per_dp_rank(tmp_path, engine):
    rng = np.random.default_rng(0)
    W = rng.standard_normal((8, 6))            # full reduced gradient of w (split along dim 0 over tp)
    W[2, 3] = 0.0
    B = rng.standard_normal(6)                 # b: replicated over tp
    local = {dp: rng.standard_normal((8, 6)) for dp in range(2)}   # each dp replica's local gradient
    P = rng.standard_normal((8, 6))
    M = rng.standard_normal((8, 6)) * 1e-3
    run = Run(tmp_path / "out")
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        split = [["tp", tp, 2]]
        w_piece = lay.piece(24, split)
        b_piece = lay.piece(6)
        params = {"w": {"shape": [8, 6], "pieces": {c: w_piece for c in lay.SCOPE_CLASSES}},
                  "b": {"shape": [6], "pieces": {c: b_piece for c in lay.SCOPE_CLASSES}}}
        run.layout(rank, doc(rank, 4, {"dp": (dp, 2), "tp": (tp, 2)}, params))
        rows_ = slice(4 * tp, 4 * tp + 4)
        for step in (0, 1):
            run.row(rank, "weight_grad", step, "w", "unreduced", local[dp][rows_] * (step + 1))
            run.row(rank, "weight_grad", step, "b", "unreduced", B * (dp + 1) * (step + 1))
            run.row(rank, "weight_grad", step, "w", "reduced", W[rows_] * (step + 1))
            run.row(rank, "weight_grad", step, "b", "reduced", B * (step + 1))
            run.row(rank, "param", step, "w", "param_origin", P[rows_] + step)
            run.row(rank, "optimizer", step, "w.exp_avg", "exp_avg", M[rows_] * (step + 1))
    run.write()
    dest = tmp_path / "merged"
    rep = merge(run.root, dest, engine)
    assert rep.disagreements == 0 and rep.left_out == {"unknown": 0, "partial": 0, "incomplete": 0, "cc": 0,
                                                        "no_layout": 0, "moe": 0}
    wg = read_merged(dest, "weight_grad")
    assert list(wg[0]) == ["step", "module_name", "scope", "micro_step", "dp_rank"] + list(OPS)
    got = {(int(r["step"]), r["module_name"], r["scope"], r["dp_rank"]): r for r in wg}
    assert len(got) == len(wg) == 2 * (2 * 2 + 2)  # per step: w, b unreduced x 2 dp ranks; w, b reduced
    for step in (0, 1):
        for dp in range(2):
            assert_stats(got[(step, "w", "unreduced", str(dp))], local[dp] * (step + 1))
            assert_stats(got[(step, "b", "unreduced", str(dp))], B * (dp + 1) * (step + 1))
        assert_stats(got[(step, "w", "reduced", "")], W * (step + 1))
        assert_stats(got[(step, "b", "reduced", "")], B * (step + 1))
        assert got[(step, "w", "reduced", "")]["micro_step"] == "1"
    (p0, p1) = read_merged(dest, "param")
    assert list(p0) == ["step", "module_name", "scope"] + list(OPS)
    assert_stats(p0, P)
    assert_stats(p1, P + 1)
    o = read_merged(dest, "optimizer")
    assert [r["module_name"] for r in o] == ["w.exp_avg", "w.exp_avg"]
    assert_stats(o[1], M * 2)
    m = merged_json(dest)
    assert m["format"] == "msprobe-monitor-merged" and m["version"] == 1
    assert m["source"] == str(run.root) and m["world_size"] == 4 and m["ranks"] == [0, 1, 2, 3]
    assert m["groups"] == {"dp": 2, "tp": 2}
    assert m["rows_read"] == 4 * 2 * 6 and m["rows_written"] == 12 + 2 + 2
    assert disagreements(dest) == []
    for name in ("weight_grad.csv", "param.csv", "optimizer.csv", "merge.json", "disagreements.csv"):
        assert (dest / name).stat().st_mode & 0o777 == 0o640
    assert dest.stat().st_mode & 0o777 == 0o750


# ------------------------------------------------------------- flat ranges (ZeRO/FSDP), a rank holding nothing
def test_flat_range_pieces_of_unequal_size_with_a_rank_holding_none(tmp_path, engine):
    rng = np.random.default_rng(1)
    full = rng.standard_normal((2, 5))
    full[1, 1] = np.nan  # a NaN in the second piece: min/max NaN, one NaN counted
    flat = full.ravel()
    ranges = [(0, 6), (6, 10), (10, 10)]  # rank 2 holds none of this parameter: writes no row
    E = rng.standard_normal(3)            # e: split into 3 equal ranges, one per rank
    run = Run(tmp_path / "out")
    for rank, (a, b) in enumerate(ranges):
        pieces = {c: lay.piece(b - a, [["dp", rank, 3]]) for c in ("reduced", "param", "optimizer")}
        pieces["unreduced"] = lay.piece(10)
        e_pieces = {c: lay.piece(1, [["dp", rank, 3]]) for c in ("reduced", "param", "optimizer")}
        run.layout(rank, doc(rank, 3, {"dp": (rank, 3)}, {"x": {"shape": [2, 5], "pieces": pieces},
                                                          "e": {"shape": [3], "pieces": e_pieces}}))
        if b > a:
            run.row(rank, "weight_grad", 5, "x", "reduced", flat[a:b])
            run.row(rank, "param", 5, "x", "param_updated", flat[a:b] * 2)
        run.row(rank, "weight_grad", 5, "e", "reduced", E[rank:rank + 1])
    run.write(5, 5)
    dest = tmp_path / "merged"
    rep = merge(run.root, dest, engine)
    assert rep.left_out["incomplete"] == 0 and rep.disagreements == 0
    wg = {r["module_name"]: r for r in read_merged(dest, "weight_grad")}
    assert_stats(wg["x"], full)
    assert int(wg["x"]["nans"]) == 1 and wg["x"]["min"] == "nan" and wg["x"]["norm"] == "nan"
    assert_stats(wg["e"], E)
    (p,) = read_merged(dest, "param")
    assert_stats(p, full * 2)


# ----------------------------------------------------------------------- what is left out
def test_partial_unknown_incomplete_no_layout_and_cc_rows_are_left_out_and_counted(tmp_path, engine):
    rng = np.random.default_rng(2)
    W = rng.standard_normal((4, 4))
    run = Run(tmp_path / "out")
    for rank in range(2):
        params = {
            "w": {"shape": [4, 4], "pieces": {c: lay.piece(8, [["tp", rank, 2]]) for c in lay.SCOPE_CLASSES}},
            "norm.weight": {"shape": [4], "pieces": {c: lay.piece(4, [["tp", rank, 2]], partial=True)
                                                     for c in lay.SCOPE_CLASSES}},
            "u": {"shape": "unknown", "pieces": {c: "unknown" for c in lay.SCOPE_CLASSES}},
            "v": {"shape": [4], "pieces": {"reduced": "unknown"}},
        }
        run.layout(rank, doc(rank, 3, {"dp": (0, 1), "tp": (rank, 2)}, params,
                             unknown=["u: the stack does not say how it is split"]))
        run.row(rank, "weight_grad", 0, "w", "reduced", W[2 * rank:2 * rank + 2])
        if rank == 0:  # step 1: rank 1's row of w is missing
            run.row(rank, "weight_grad", 1, "w", "reduced", W[:2])
        run.row(rank, "weight_grad", 0, "norm.weight", "reduced", W[0])
        run.row(rank, "weight_grad", 0, "u", "reduced", W[1])
        run.row(rank, "weight_grad", 0, "v", "reduced", W[1])
        run.row(rank, "weight_grad", 0, "not_in_layout", "reduced", W[3])
        run.row(rank, "cc", 0, "all_reduce.pre.0@train.py[3]", "comm", W[0])
    # rank 2 writes rows but no layout.json
    run.row(2, "weight_grad", 0, "w", "reduced", W)
    run.row(2, "weight_grad", 1, "w", "reduced", W)
    run.write()
    dest = tmp_path / "merged"
    rep = merge(run.root, dest, engine)
    assert rep.left_out == {"unknown": 3, "partial": 1, "incomplete": 1, "cc": 2, "no_layout": 2, "moe": 0}
    assert rep.no_layout_ranks == [2]
    assert any("rank(s) 2" in n and "no_layout" in n for n in rep.notes)
    assert rep.layout_unknown == ["rank 0: u: the stack does not say how it is split"]
    (w,) = read_merged(dest, "weight_grad")
    assert (w["step"], w["module_name"]) == ("0", "w")
    assert_stats(w, W)
    inc = rep.examples["incomplete"][0]
    assert inc["step"] == 1 and inc["module_name"] == "w" and "8 of 16" in inc["why"]
    assert {e["module_name"] for e in rep.examples["unknown"]} == {"u", "v", "not_in_layout"}
    m = merged_json(dest)
    assert m["left_out"] == rep.left_out and m["rows_read"] == 7 + 6 + 2 and m["rows_written"] == 1


# ----------------------------------------------------------------------- replicas that disagree
def test_a_replica_that_disagrees_is_reported_and_the_lowest_rank_is_used(tmp_path, engine):
    rng = np.random.default_rng(3)
    P = rng.standard_normal((3, 3))
    run = Run(tmp_path / "out")
    for rank in range(3):
        run.layout(rank, doc(rank, 3, {"dp": (rank, 3)}, {"w": {"shape": [3, 3], "pieces": {
            c: lay.piece(9) for c in lay.SCOPE_CLASSES}}}))
        for step in range(3):
            off = P * (1.01 if (rank == 2 and step == 1) else 1.0)
            run.row(rank, "param", step, "w", "param_origin", off + step)
            run.row(rank, "weight_grad", step, "w", "unreduced", P * (rank + 1))  # per dp: never compared
    run.write()
    dest = tmp_path / "merged"
    rep = merge(run.root, dest, engine)
    rows_ = disagreements(dest)
    assert rep.disagreements == len(rows_) > 0 and rep.disagreeing_rows == 1
    assert {r["stat"] for r in rows_} <= {"min", "max", "mean", "norm"} and "norm" in {r["stat"] for r in rows_}
    for r in rows_:
        assert (r["step"], r["monitor"], r["module_name"], r["scope"], r["ranks"]) == (
            "1", "param", "w", "param_origin", "0;1;2")
        vals = [float(v) for v in r["values"].split(";")]
        assert vals[0] == vals[1] != vals[2]
    p = read_merged(dest, "param")
    assert_stats(p[1], P + 1)  # the lowest rank's values, not an average
    assert merged_json(dest)["disagreements"] == len(rows_)
    wg = read_merged(dest, "weight_grad")
    assert sorted(r["dp_rank"] for r in wg if r["step"] == "0") == ["0", "1", "2"]


# ----------------------------------------------------------------------- pipeline stages and chunks
def test_pipeline_chunks_get_global_names_and_rows_come_in_execution_order(tmp_path, engine):
    """PP=2 with 2 virtual chunks: rank p holds chunk c's layer 0 = global layer c*2 + p
    (v = c * pp + p); forward rows by v ascending, backward and unreduced by v descending."""
    rng = np.random.default_rng(4)
    full = {L: rng.standard_normal(5) for L in range(4)}
    run = Run(tmp_path / "out")
    for p in range(2):
        rename = [[f"{c}:layers.0.", f"layers.{c * 2 + p}."] for c in range(2)] + [["0:", ""], ["1:", ""]]
        params = {f"{c}:layers.0.w": {"shape": [5], "pieces": {k: lay.piece(5) for k in lay.SCOPE_CLASSES}}
                  for c in range(2)}
        chunks = [{"vpp_stage": c, "layer_offset": c * 2 + p, "layers": 1} for c in range(2)]
        run.layout(p, doc(p, 2, {"dp": (0, 1), "pp": (p, 2)}, params, rename=rename, chunks=chunks))
        for c in range(2):
            L = c * 2 + p
            run.row(p, "module", 0, f"{c}:layers.0.output.0", "forward", full[L], vpp=c)
            run.row(p, "module", 0, f"{c}:layers.0.grad_output.0", "backward", full[L] * 2, vpp=c)
            run.row(p, "weight_grad", 0, f"{c}:layers.0.w", "unreduced", full[L] * 3, vpp=c)
            run.row(p, "weight_grad", 0, f"{c}:layers.0.w", "reduced", full[L] * 4, vpp=c)
            run.row(p, "param", 0, f"{c}:layers.0.w", "param_origin", full[L] * 5, vpp=c)
            run.row(p, "param", 0, f"{c}:layers.0.w", "param_updated", full[L] * 6, vpp=c)
            run.row(p, "optimizer", 0, f"{c}:layers.0.w.exp_avg", "exp_avg", full[L] * 7, vpp=c)
    run.write()
    dest = tmp_path / "merged"
    rep = merge(run.root, dest, engine)
    assert rep.left_out["unknown"] == rep.left_out["incomplete"] == 0
    mod = read_merged(dest, "module")
    assert list(mod[0]) == ["step", "module_name", "scope", "dp_rank"] + list(OPS)
    assert [(r["module_name"], r["scope"]) for r in mod] == (
        [(f"layers.{L}.output.0", "forward") for L in range(4)]
        + [(f"layers.{L}.grad_output.0", "backward") for L in (3, 2, 1, 0)])
    for r in mod:
        L = int(r["module_name"].split(".")[1])
        assert_stats(r, full[L] * (1 if r["scope"] == "forward" else 2))
    wg = read_merged(dest, "weight_grad")
    assert [(r["module_name"], r["scope"]) for r in wg] == (
        [(f"layers.{L}.w", "unreduced") for L in (3, 2, 1, 0)] + [(f"layers.{L}.w", "reduced") for L in range(4)])
    assert [r["dp_rank"] for r in wg] == ["0"] * 4 + [""] * 4
    par = read_merged(dest, "param")
    assert [(r["module_name"], r["scope"]) for r in par] == (
        [(f"layers.{L}.w", "param_origin") for L in range(4)] + [(f"layers.{L}.w", "param_updated") for L in range(4)])
    opt = read_merged(dest, "optimizer")
    assert [r["module_name"] for r in opt] == [f"layers.{L}.w.exp_avg" for L in range(4)]
    for r in opt:
        assert_stats(r, full[int(r["module_name"].split(".")[1])] * 7)
    assert "vpp_stage" not in mod[0]


def test_module_rows_split_evenly_over_tp_combine_with_equal_weights(tmp_path, engine):
    rng = np.random.default_rng(5)
    out = {dp: rng.standard_normal((2, 8)) for dp in range(2)}  # a column-parallel output: cut along dim 1
    run = Run(tmp_path / "out")
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        run.layout(rank, doc(rank, 4, {"dp": (dp, 2), "tp": (tp, 2)}, {},
                             modules={"fc1.output.0": {"split": [["tp", tp, 2]]}}))
        run.row(rank, "module", 3, "fc1.output.0", "forward", out[dp][:, 4 * tp:4 * tp + 4])
        run.row(rank, "module", 3, "fc1.input.0", "forward", out[dp][:, 0] * 3)   # replicated over tp
        if not (dp == 1 and tp == 1):
            run.row(rank, "module", 3, "fc1.output.0", "backward", out[dp][:, 4 * tp:4 * tp + 4])
    run.write(3, 3)
    dest = tmp_path / "merged"
    rep = merge(run.root, dest, engine)
    got = {(r["module_name"], r["scope"], r["dp_rank"]): r for r in read_merged(dest, "module")}
    for dp in range(2):
        assert_stats(got[("fc1.output.0", "forward", str(dp))], out[dp])
        assert_stats(got[("fc1.input.0", "forward", str(dp))], out[dp][:, 0] * 3)
    assert_stats(got[("fc1.output.0", "backward", "0")], out[0])
    assert ("fc1.output.0", "backward", "1") not in got
    assert rep.left_out["incomplete"] == 1 and "1 of 2 parts" in rep.examples["incomplete"][0]["why"]


def test_module_rows_the_layout_does_not_describe_are_left_out_where_ranks_differ_never_reported(tmp_path, engine):
    """A module row named by nothing in layout.json is taken for a replica over tp; where the
    tp ranks wrote different values (an activation sharded in a way the stack did not name,
    e.g. a ReLU between column- and row-parallel layers) the row is left out as unknown,
    not reported as a disagreement. Rows named by the layout's own entries (``<module>.*``,
    a row of its own that says replica) keep their meaning."""
    rng = np.random.default_rng(9)
    act = rng.standard_normal((2, 8))   # the full activation; tp rank t holds columns 4t..4t+3
    inp = rng.standard_normal(5)        # truly replicated
    run = Run(tmp_path / "out")
    for tp in range(2):
        run.layout(tp, doc(tp, 2, {"dp": (0, 1), "tp": (tp, 2)}, {},
                           modules={"top.*": "unknown", "fc2.input.0": {"split": []}}))
        part = act[:, 4 * tp:4 * tp + 4]
        run.row(tp, "module", 0, "act.output.0", "forward", part)     # sharded, undescribed
        run.row(tp, "module", 0, "act.input.0", "forward", inp)       # replicated, undescribed
        run.row(tp, "module", 0, "top.output.0", "forward", inp)      # every row of top: unknown
        run.row(tp, "module", 0, "fc2.input.0", "forward", part)      # named a replica: a disagreement
    run.write(0, 0)
    dest = tmp_path / "merged"
    rep = merge(run.root, dest, engine)
    got = {r["module_name"]: r for r in read_merged(dest, "module")}
    assert set(got) == {"act.input.0", "fc2.input.0"}  # a disagreement keeps the lowest rank's values
    assert_stats(got["act.input.0"], inp)
    assert_stats(got["fc2.input.0"], act[:, :4])
    assert rep.left_out["unknown"] == 2
    whys = {e["module_name"]: e["why"] for e in rep.examples["unknown"]}
    assert set(whys) == {"act.output.0", "top.output.0"}
    assert "ranks 0,1 wrote different values" in whys["act.output.0"]
    assert "different values" not in whys["top.output.0"]
    assert {(r["module_name"], r["stat"]) for r in disagreements(dest)} >= {("fc2.input.0", "norm")}
    assert {r["module_name"] for r in disagreements(dest)} == {"fc2.input.0"}


# ----------------------------------------------------------------------- errors
def _small_run(root: Path, with_layout: bool = True) -> Path:
    run = Run(root)
    if with_layout:
        run.layout(0, doc(0, 1, {"dp": (0, 1)}, {"w": {"shape": [2], "pieces": {
            c: lay.piece(2) for c in lay.SCOPE_CLASSES}}}))
    run.row(0, "param", 0, "w", "param_origin", np.ones(2))
    run.write()
    return root


def test_errors_name_the_path_and_what_to_do(tmp_path):
    with pytest.raises(InputError, match="no such directory"):
        merge_run(str(tmp_path / "nope"), str(tmp_path / "d"))
    bare = _small_run(tmp_path / "bare", with_layout=False)
    with pytest.raises(InputError, match=r"bare: no rank_<r>/layout.json .*rerun the training"):
        merge_run(str(bare), str(tmp_path / "d"))
    src = _small_run(tmp_path / "src")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match=r"DEST .*file: exists and is not a directory"):
        merge_run(str(src), str(tmp_path / "file"))
    os.symlink(tmp_path / "real", tmp_path / "link")
    (tmp_path / "real").mkdir()
    with pytest.raises(InputError, match=r"DEST .*link: is a symbolic link"):
        merge_run(str(src), str(tmp_path / "link"))
    with pytest.raises(InputError, match=r"inside the rank directory .*rank_0"):
        merge_run(str(src), str(src / "rank_0" / "merged"))
    with pytest.raises(InputError, match="is OUTPUT_DIR itself"):
        merge_run(str(src), str(src))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a merged view"):
        merge_run(str(src), str(other))
    assert (other / "notes.txt").read_text() == "mine"
    # a DEST inside OUTPUT_DIR but outside its rank directories is fine, and merging again replaces it
    rep = merge_run(str(src), str(src / "merged"))
    assert rep.rows_written == 1
    rep = merge_run(str(src), str(src / "merged"))
    assert rep.rows_written == 1 and sorted(os.listdir(src / "merged")) == ["disagreements.csv", "merge.json",
                                                                          "param.csv"]


def test_the_cli_says_what_it_wrote_left_out_and_found_and_exits_2_on_bad_input(tmp_path):
    from analysis_helpers import cli

    src = _small_run(tmp_path / "src")
    res = cli("merge", src, tmp_path / "merged")
    assert res.code == 0, res.out + res.err
    assert f"-> {tmp_path / 'merged'}: 1 rows read from 1 rank(s)" in res.out
    assert "param.csv (1 rows)" in res.out and "Result: replicas agree (exit 0)" in res.out
    res = cli("merge", src, tmp_path / "merged", "--json")
    data = res.json()
    assert data["command"] == "merge" and data["exit_code"] == 0 and data["rows_written"] == 1
    assert data["files"] == [str(tmp_path / "merged" / f) for f in ("param.csv", "disagreements.csv", "merge.json")]
    for argv, what in [((tmp_path / "nope", tmp_path / "d"), "no such directory"),
                       ((src, src / "rank_0" / "x"), "lies inside the rank directory"),
                       ((src, src), "is OUTPUT_DIR itself")]:
        res = cli("merge", *argv)
        assert res.code == 2 and res.out == "", res.err
        assert res.err.startswith("msprobe-monitor merge: error: ") and what in res.err and str(argv[0]) in res.err
    assert cli("merge", src, tmp_path / "m2", "--rtol", "-1").code == 2  # argparse says why, on the real stderr


def test_non_finite_replicas_nan_equals_nan_and_an_infinity_only_itself(tmp_path, engine):
    run = Run(tmp_path / "out")
    base = np.array([1.0, -2.0, 3.0])
    for rank in range(2):
        run.layout(rank, doc(rank, 2, {"dp": (rank, 2)}, {n: {"shape": [3], "pieces": {
            c: lay.piece(3) for c in lay.SCOPE_CLASSES}} for n in ("a", "b", "c")}))
        run.row(rank, "param", 0, "a", "param_origin", np.array([1.0, np.nan, 3.0]))       # NaN on both: agree
        run.row(rank, "param", 0, "b", "param_origin", np.array([1.0, np.inf, 3.0]))       # inf on both: agree
        run.row(rank, "param", 0, "c", "param_origin", base if rank == 0 else np.array([1.0, -2.0, np.inf]))
    run.write()
    dest = tmp_path / "merged"
    rep = merge(run.root, dest, engine)
    got = {(r["module_name"], r["stat"]): r["values"] for r in disagreements(dest)}
    assert set(got) == {("c", "max"), ("c", "mean"), ("c", "norm")}  # min is -2 on both
    assert got[("c", "max")] == "3;inf" and rep.disagreeing_rows == 1
    p = {r["module_name"]: r for r in read_merged(dest, "param")}
    assert p["a"]["norm"] == "nan" and p["a"]["nans"] == "1" and p["b"]["max"] == "inf"
    assert_stats(p["c"], base)
