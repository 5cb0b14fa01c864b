"""The reading commands on a merged view (``msprobe-monitor merge``'s DEST: merge.json and
``<monitor>.csv``, columns ``step,module_name,scope[,micro_step][,dp_rank],<ops>``):
summary, anomalies, plot (and its HTML report), diff and ``analysis.load`` read it as
one pseudo-rank, keep the rows of each data-parallel rank apart by ``dp_rank``, order
events by the merged files' row order (execution order across pipeline stages), and
both engines say the same.

The views here are written by hand in exactly the merge's format: a pipeline of two
stages (layers 0-1 on stage 0, 2-3 on stage 1) and two data-parallel ranks, so that
the backward rows of layers 3 and 2 come before those of layers 1 and 0 in the file.
"""

import csv
import json
import math
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest

from analysis_helpers import cli
from support.extras import MATPLOTLIB_PLOT, POLARS_ENGINE, require

LAYERS = 4
STAGE_OF = {0: 0, 1: 0, 2: 1, 3: 1}
DP = 2
STEPS = range(1, 13)
OPS = ("min", "max", "mean", "norm", "nans")

Values = Tuple[float, float, float, float, int]
# (monitor, step, name, scope, micro_step, dp_rank) -> values, or None for the default
Override = Callable[[str, int, str, str, Optional[int], Optional[int]], Optional[Values]]


def _num(v: float) -> str:
    return "nan" if v != v else repr(float(v))


def _values(seed: float, step: int) -> Values:
    """A smooth series (no spike): a tensor's norm grows slowly with the step."""
    norm = seed * (1.0 + 0.01 * step)
    return (-0.5 * norm, 0.5 * norm, 0.001 * seed, norm, 0)


def write_view(dest: Path, override: Override = lambda *a: None, steps=STEPS, disagreements: int = 0,
               micros=(1,)) -> Path:
    """A merged view in the contract's format, rows in execution order: forward-like rows
    by stage ascending, backward-like rows (module backward, unreduced) descending."""
    dest.mkdir(parents=True)
    forward_layers = list(range(LAYERS))
    backward_layers = sorted(range(LAYERS), key=lambda l: (-STAGE_OF[l], -l))  # 3, 2, 1, 0
    rows: Dict[str, List[List[str]]] = {"module": [], "weight_grad": [], "param": [], "optimizer": []}

    def add(monitor: str, step: int, name: str, scope: str, micro: Optional[int], dp: Optional[int],
            seed: float, extra: List[str]) -> None:
        vals = override(monitor, step, name, scope, micro, dp) or _values(seed, step)
        lead = [str(step), name, scope] + extra
        rows[monitor].append(lead + [_num(v) for v in vals[:4]] + [str(int(vals[4]))])

    for step in steps:
        for layer in forward_layers:
            add("param", step, f"decoder.layers.{layer}.mlp.linear_fc1.weight", "param_origin", None, None,
                3.0 + layer, [])
        for dp in range(DP):
            for layer in forward_layers:
                add("module", step, f"decoder.layers.{layer}.mlp.output.0", "forward", None, dp, 1.0 + layer + 0.1 * dp,
                    [str(dp)])
        for dp in range(DP):
            for layer in backward_layers:
                add("module", step, f"decoder.layers.{layer}.mlp.grad_input.0", "backward", None, dp,
                    0.2 + 0.05 * layer + 0.01 * dp, [str(dp)])
        for layer in backward_layers:  # (the merge: by virtual stage, then each rank file's order)
            for micro in micros:
                for dp in range(DP):
                    # dp rank 1's local gradient is 50 times rank 0's, every step: only separate
                    # histories see a tenfold jump of rank 0's
                    add("weight_grad", step, f"decoder.layers.{layer}.mlp.linear_fc1.weight", "unreduced", micro,
                        dp, (0.1 + 0.01 * layer) * (50.0 if dp else 1.0), [str(micro), str(dp)])
        for layer in forward_layers:
            add("weight_grad", step, f"decoder.layers.{layer}.mlp.linear_fc1.weight", "reduced", micros[-1], None,
                0.3 + 0.01 * layer, [str(micros[-1]), ""])
        for layer in forward_layers:
            for state, seed in (("exp_avg", 0.01), ("exp_avg_sq", 0.0001)):
                add("optimizer", step, f"decoder.layers.{layer}.mlp.linear_fc1.weight.{state}", state, None, None,
                    seed * (1 + layer), [])
        for layer in forward_layers:
            add("param", step, f"decoder.layers.{layer}.mlp.linear_fc1.weight", "param_updated", None, None,
                3.0 + layer, [])
    lead = {"module": ["step", "module_name", "scope", "dp_rank"],
            "weight_grad": ["step", "module_name", "scope", "micro_step", "dp_rank"],
            "param": ["step", "module_name", "scope"], "optimizer": ["step", "module_name", "scope"]}
    for monitor, body in rows.items():
        with open(dest / f"{monitor}.csv", "w", newline="") as fh:
            w = csv.writer(fh, lineterminator="\n")
            w.writerow(lead[monitor] + list(OPS))
            w.writerows(body)
    n = sum(len(b) for b in rows.values())
    (dest / "merge.json").write_text(json.dumps({
        "format": "msprobe-monitor-merged", "version": 1, "source": "/runs/pp2_dp2", "world_size": 4,
        "ranks": [0, 1, 2, 3], "groups": {"dp": 2, "pp": 2}, "rows_read": 2 * n, "rows_written": n,
        "left_out": {"unknown": 0, "partial": 0, "incomplete": 0, "cc": 24, "no_layout": 0}, "disagreements": disagreements}))
    (dest / "disagreements.csv").write_text("step,monitor,module_name,scope,micro_step,dp_rank,stat,ranks,values\n"
                                            + "4,param,decoder.layers.0.mlp.linear_fc1.weight,param_updated,,,norm,"
                                              "0;2,3.1;3.2\n" * disagreements)
    return dest


def _rows_by_csv(view: Path, monitor: str) -> List[Dict[str, str]]:
    with open(view / f"{monitor}.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def both(*argv):
    """The command's result with each engine; they must agree exactly."""
    ref = cli(*argv, "--engine", "reference")
    new = cli(*argv)
    assert (new.code, new.out, new.err) == (ref.code, ref.out, ref.err)
    return new


@pytest.fixture(autouse=True)
def _polars():
    require("polars", POLARS_ENGINE)


# ------------------------------------------------------------------------------ summary
def test_summary_reads_the_merged_view_as_one_pseudo_rank(tmp_path):
    view = write_view(tmp_path / "view")
    res = both("summary", view, "--json")
    assert res.code == 0
    data = res.json()
    assert data["ranks"] == [0]
    assert data["merged"]["world_size"] == 4 and data["merged"]["groups"] == {"dp": 2, "pp": 2}
    # every row of every file, counted independently with the csv module
    for monitor in ("module", "weight_grad", "param", "optimizer"):
        rows = _rows_by_csv(view, monitor)
        got = data["monitors"][monitor]
        assert got["rows"] == len(rows)
        assert got["steps"] == [1, 12] or sorted(set(int(r["step"]) for r in rows)) == list(STEPS)
    assert data["problems"]["count"] == 0
    assert data["anomalies_found"] is False
    assert data["appended"]["files"] == 0  # a dp rank's row repeating (step, name, scope) is no re-run
    assert data["spikes"]["count"] == 0  # dp rank 1's gradients (50x rank 0's) have a history of their own
    text = both("summary", view).out
    assert "merged view of 4 rank(s) (dp=2 pp=2) from /runs/pp2_dp2" in text
    assert "cc 24" in text  # what the merge left out is said


def test_the_disagreements_merge_found_are_anomalies_of_the_merged_view(tmp_path):
    clean = both("anomalies", write_view(tmp_path / "clean"), "--json")
    assert clean.code == 0 and clean.json()["rank_check"]["note"] == "replicas compared by merge: 0 disagreement(s)"
    view = write_view(tmp_path / "view", disagreements=2)
    res = both("anomalies", view)
    assert res.code == 1
    assert f"rank disagreement: replicas compared by merge: 2 disagreement(s), listed in " \
           f"{view / 'disagreements.csv'}" in both("summary", view).out


def test_a_rank_selection_other_than_the_pseudo_rank_is_refused(tmp_path):
    view = write_view(tmp_path / "view")
    res = both("summary", view, "--ranks", "1")
    assert res.code == 2 and "one pseudo-rank, 0" in res.err


# ------------------------------------------------------------------------------ anomalies
def _nan_in(targets: Dict[Tuple[str, int, str, str], Optional[int]]) -> Override:
    def override(monitor, step, name, scope, micro, dp):
        key = (monitor, step, name, scope)
        if key in targets and targets[key] in (None, dp):
            return (math.nan, math.nan, math.nan, math.nan, 7)
        return None
    return override


def test_anomalies_follow_the_file_order_across_pipeline_stages(tmp_path):
    # NaN at step 8 in the backward of layer 1 (stage 0) and of layer 3 (stage 1), dp rank 1:
    # in execution order (and in the file) layer 3's backward comes first, though its name sorts last
    view = write_view(tmp_path / "view", _nan_in({
        ("module", 8, "decoder.layers.1.mlp.grad_input.0", "backward"): 1,
        ("module", 8, "decoder.layers.3.mlp.grad_input.0", "backward"): 1,
    }))
    rows = _rows_by_csv(view, "module")
    lines = {(r["module_name"], r["dp_rank"]): i + 2 for i, r in enumerate(rows) if r["step"] == "8"}
    assert lines[("decoder.layers.3.mlp.grad_input.0", "1")] < lines[("decoder.layers.1.mlp.grad_input.0", "1")]
    res = both("anomalies", view, "--json")
    assert res.code == 1
    first = res.json()["nonfinite"]["first"]
    assert (first["tensor"], first["dp_rank"], first["step"], first["scope"]) == \
        ("decoder.layers.3.mlp.grad_input.0", 1, 8, "backward")
    assert first["line"] == lines[("decoder.layers.3.mlp.grad_input.0", "1")]
    text = both("anomalies", view).out
    assert "merged view, step 8, backward: decoder.layers.3.mlp.grad_input.0 [dp_rank 1]" in text


def test_a_forward_nan_precedes_the_backward_and_stage_0_precedes_stage_1(tmp_path):
    # forward of layer 2 (stage 1) and of layer 0 (stage 0), plus a backward NaN of layer 3:
    # the forward of stage 0 ran first
    view = write_view(tmp_path / "view", _nan_in({
        ("module", 5, "decoder.layers.2.mlp.output.0", "forward"): 0,
        ("module", 5, "decoder.layers.0.mlp.output.0", "forward"): 0,
        ("module", 5, "decoder.layers.3.mlp.grad_input.0", "backward"): 0,
    }))
    first = both("anomalies", view, "--json").json()["nonfinite"]["first"]
    assert (first["tensor"], first["scope"]) == ("decoder.layers.0.mlp.output.0", "forward")


def test_local_gradients_are_ordered_by_micro_batch_then_by_the_file(tmp_path):
    # two micro-batches: the file holds layer 3's micro-batches 1 and 2 before layer 1's; a NaN
    # in layer 3's micro-batch 2 and one in layer 1's micro-batch 1: micro-batch 1's backward
    # ran first, whatever the stage
    def override(monitor, step, name, scope, micro, dp):
        if monitor == "weight_grad" and scope == "unreduced" and step == 7 and dp == 0 and (
                (name, micro) in (("decoder.layers.3.mlp.linear_fc1.weight", 2),
                                  ("decoder.layers.1.mlp.linear_fc1.weight", 1))):
            return (math.nan, math.nan, math.nan, math.nan, 3)
        return None
    view = write_view(tmp_path / "view", override, micros=(1, 2))
    rows = [r for r in _rows_by_csv(view, "weight_grad") if r["step"] == "7" and r["scope"] == "unreduced"]
    order = [(r["module_name"].split(".")[2], r["micro_step"]) for r in rows if r["dp_rank"] == "0"]
    assert order.index(("3", "2")) < order.index(("1", "1"))
    first = both("anomalies", view, "--json").json()["nonfinite"]["first"]
    assert (first["tensor"], first["micro_step"]) == ("decoder.layers.1.mlp.linear_fc1.weight", 1)
    # and within a micro-batch, the file order: layer 3 before layer 1
    view2 = write_view(tmp_path / "view2", lambda m, st, n, sc, mi, dp: (math.nan,) * 4 + (3,) if (
        m == "weight_grad" and sc == "unreduced" and st == 7 and dp == 0 and mi == 1
        and n in ("decoder.layers.3.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc1.weight")) else None,
        micros=(1, 2))
    first = both("anomalies", view2, "--json").json()["nonfinite"]["first"]
    assert (first["tensor"], first["micro_step"]) == ("decoder.layers.3.mlp.linear_fc1.weight", 1)


def test_spikes_are_listed_in_execution_order_across_stages(tmp_path):
    # the same step: a tenfold jump in dp rank 0's local gradient of layer 0 (stage 0) and of
    # layer 2 (stage 1); backward runs stage 1 first, so layer 2's is listed first. Each dp
    # rank has its own history: mixed with dp rank 1's (50x), the jump would not stand out
    def override(monitor, step, name, scope, micro, dp):
        if monitor == "weight_grad" and scope == "unreduced" and step == 12 and dp == 0 and \
                name in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.2.mlp.linear_fc1.weight"):
            layer = int(name.split(".")[2])
            return _values(10 * (0.1 + 0.01 * layer), step)
        return None
    view = write_view(tmp_path / "view", override)
    data = both("anomalies", view, "--json").json()
    items = [(i["tensor"], i["dp_rank"], i["step"]) for i in data["spikes"]["items"]]
    assert items == [("decoder.layers.2.mlp.linear_fc1.weight", 0, 12),
                     ("decoder.layers.0.mlp.linear_fc1.weight", 0, 12)]


# ------------------------------------------------------------------------------ load
def test_load_gives_the_rows_of_the_merged_files_in_their_order(tmp_path):
    from msprobe.core.monitor_v2.analysis import load

    view = write_view(tmp_path / "view")
    df = load(str(view))
    assert df.columns == ["monitor", "step", "module_name", "scope", "micro_step", "dp_rank",
                          "min", "max", "mean", "norm", "nans", "zeros"]
    for monitor in ("module", "weight_grad", "param", "optimizer"):
        want = _rows_by_csv(view, monitor)
        got = df.filter(df["monitor"] == monitor)
        assert len(got) == len(want)
        for rec, row in zip(got.iter_rows(named=True), want):
            assert (rec["step"], rec["module_name"], rec["scope"]) == (int(row["step"]), row["module_name"],
                                                                        row["scope"])
            assert rec["dp_rank"] == (int(row["dp_rank"]) if row.get("dp_rank") else None)
            assert rec["micro_step"] == (int(row["micro_step"]) if row.get("micro_step") else None)
            assert rec["norm"] == float(row["norm"]) and rec["nans"] == int(row["nans"])
            assert rec["zeros"] is None


def test_a_malformed_line_of_a_merged_file_is_named_and_skipped(tmp_path):
    view = write_view(tmp_path / "view")
    path = view / "weight_grad.csv"
    lines = path.read_text().splitlines(keepends=True)
    lines[3] = lines[3].replace(",1,", ",x,", 1)  # micro_step not an integer
    path.write_text("".join(lines))
    res = both("summary", view, "--json")
    assert f"weight_grad.csv:4: column 'micro_step' = 'x' is not an integer; line skipped" in res.err
    assert res.json()["monitors"]["weight_grad"]["rows"] == len(lines) - 2


# ------------------------------------------------------------------------------ diff
def test_diff_of_a_merged_view_with_itself_and_with_a_changed_copy(tmp_path):
    view = write_view(tmp_path / "view")
    same = both("diff", view, view, "--json")
    assert same.code == 0 and same.json()["differing_rows"] == 0
    # the same run but dp rank 1's local gradient of layer 2 differs at step 6
    def override(monitor, step, name, scope, micro, dp):
        if (monitor, step, name, scope, dp) == ("weight_grad", 6, "decoder.layers.2.mlp.linear_fc1.weight",
                                                "unreduced", 1):
            return _values((0.1 + 0.02) * 50.0 * 1.5, step)
        return None
    other = write_view(tmp_path / "other", override)
    res = both("diff", view, other, "--json")
    assert res.code == 1
    data = res.json()
    assert data["differing_rows"] == 1 and data["compared_rows"] == same.json()["compared_rows"]
    first = data["first"]
    assert (first["tensor"], first["dp_rank"], first["step"], first["scope"]) == \
        ("decoder.layers.2.mlp.linear_fc1.weight", 1, 6, "unreduced")
    assert "[dp_rank 1]" in both("diff", view, other).out


def test_diff_of_a_merged_view_with_an_output_dir_is_refused(tmp_path):
    view = write_view(tmp_path / "view")
    run = tmp_path / "run" / "rank_0"
    run.mkdir(parents=True)
    (run / "param_step1-12.csv").write_text("vpp_stage,step,module_name,scope,min,max,mean,norm,nans\n"
                                            "0,1,w,param_origin,0.0,1.0,0.5,1.0,0\n")
    res = both("diff", view, tmp_path / "run")
    assert res.code == 2 and "merge the other run too" in res.err


def test_export_refuses_a_merged_view(tmp_path):
    view = write_view(tmp_path / "view")
    res = cli("export", view, tmp_path / "parquet")
    assert res.code == 2 and "a merged view (merge.json)" in res.err


# ------------------------------------------------------------------------------ plot
def test_plot_and_its_report_on_a_merged_view(tmp_path):
    require("matplotlib", MATPLOTLIB_PLOT)
    view = write_view(tmp_path / "view", _nan_in({("module", 9, "decoder.layers.3.mlp.grad_input.0", "backward"): 0}))
    res = both("plot", view, "--out", tmp_path / "plots", "--json")
    assert res.code == 0
    data = res.json()
    assert data["images"] and (tmp_path / "plots" / "report.html").is_file()
    html = (tmp_path / "plots" / "report.html").read_text()
    assert "merged view" in html and "decoder.layers.3.mlp.grad_input.0 [dp_rank 0]" in html
    # one line per data-parallel rank where the rows differ per dp rank
    tensor = both("plot", view, "--out", tmp_path / "by_tensor", "--by", "tensor", "--no-html",
                  "--match", "layers.2.mlp.linear_fc1", "--monitors", "weight_grad", "--json").json()
    assert tensor["images"]


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Path:
    """The 2-rank gloo DDP runs of tests/analysis (module, weight_grad per micro-batch,
    optimizer and param monitors; see workers/train_runs.py), launched once per session."""
    from analysis_helpers import training_runs

    return training_runs(tmp_path_factory)


def _keyed(df, merged: bool) -> Dict[tuple, dict]:
    out = {}
    for rec in df.iter_rows(named=True):
        who = rec["dp_rank"] if merged else rec["rank"]
        out[(rec["monitor"], rec["step"], rec["module_name"], rec["scope"], rec["micro_step"], who)] = rec
    return out


def test_a_real_ddp_run_merged_reads_as_its_ranks_say(ddp_runs, tmp_path):
    from msprobe.core.monitor_v2.analysis import load
    from msprobe.core.monitor_v2.analysis.merge import merge_run

    src = ddp_runs / "nan"
    assert (src / "rank_0" / "layout.json").is_file() and (src / "rank_1" / "layout.json").is_file()
    dest = tmp_path / "merged"
    merge_run(str(src), str(dest))
    assert (dest / "merge.json").is_file()

    # load: every merged row against the rank files it comes from. Rows kept per dp rank are
    # that rank's rows (DDP: dp coordinate = rank); rows combined over dp (reduced gradient,
    # parameters, optimizer state) are rank 0's, which rank 1 replicates
    merged = load(str(dest))
    per_rank = load(str(src))
    assert len(merged) and merged["dp_rank"].null_count() < len(merged)
    want = _keyed(per_rank, merged=False)
    got = _keyed(merged, merged=True)
    per_dp = {"forward", "backward", "unreduced"}
    for (monitor, step, name, scope, micro, dp), rec in got.items():
        assert (dp is not None) == (scope in per_dp), (monitor, name, scope, dp)
        src_rec = want[(monitor, step, name, scope, micro, 0 if dp is None else dp)]
        for op in ("min", "max", "mean", "norm"):
            a, b = rec[op], src_rec[op]
            assert (a != a and b != b) or a == pytest.approx(b, rel=1e-6, abs=1e-12), (monitor, name, scope, op)
        assert rec["nans"] == src_rec["nans"]
    # and nothing of the ranks' rows is missing from the merged view (cc is not merged)
    expected = {(m, st, n, sc, mi, (r if sc in per_dp else None)) for (m, st, n, sc, mi, r) in want if m != "cc"}
    assert set(got) == expected

    # summary: the same steps and tensors as the per-rank view, one pseudo-rank
    s_merged = both("summary", dest, "--json").json()
    s_ranks = both("summary", src, "--json", "--no-rank-check").json()
    assert s_merged["ranks"] == [0] and s_merged["merged"]["world_size"] == 2
    for monitor, col in s_merged["monitors"].items():
        assert col["steps"] == s_ranks["monitors"][monitor]["steps"]
        assert col["tensors"] == s_ranks["monitors"][monitor]["tensors"]

    # anomalies: the first NaN is where the per-rank view puts it (rank 1's fc2 forward at
    # the NaN step), on the merged view's dp_rank 1
    a_merged = both("anomalies", dest, "--json").json()["nonfinite"]["first"]
    a_ranks = both("anomalies", src, "--json").json()["nonfinite"]["first"]
    assert a_ranks["rank"] == 1
    assert (a_merged["step"], a_merged["monitor"], a_merged["scope"], a_merged["tensor"], a_merged["dp_rank"]) == \
        (a_ranks["step"], a_ranks["monitor"], a_ranks["scope"], a_ranks["tensor"], a_ranks["rank"])

    # plot and the HTML report
    require("matplotlib", MATPLOTLIB_PLOT)
    res = both("plot", dest, "--out", tmp_path / "plots", "--json")
    assert res.code == 0 and res.json()["images"] and (tmp_path / "plots" / "report.html").is_file()
    # diff of the merged view with itself
    assert both("diff", dest, dest).code == 0

    # replicas that diverged (rank 1 alone changed fc1.weight after an update): merge reports
    # them, and anomalies on the merged view says so and exits 1
    diverged = tmp_path / "diverged"
    merge_run(str(ddp_runs / "desync"), str(diverged))
    n = json.loads((diverged / "merge.json").read_text())["disagreements"]
    assert n > 0
    res = both("anomalies", diverged)
    assert res.code == 1 and f"replicas compared by merge: {n} disagreement(s)" in res.out
