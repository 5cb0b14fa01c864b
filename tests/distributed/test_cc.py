"""The ``cc`` monitor with real 2-rank torchrun jobs (gloo, CPU).

The worker (workers/cc_ops.py) calls every collective and point-to-point op gloo
supports, sync and async, with different values on each rank, and saves clones of
the tensors each call was given (before it) and produced (after it, after ``wait()``
for async ops), with the line of the call. The test compares every ``pre``/``post``
row of both ranks with NumPy statistics of those tensors; tags sharing a step are
compared with the statistics of all their tensors together (the aggregation rule).

Three launches, shared by the tests of this file: ``ops`` (all ops, ``cc_pre_hook``,
``start_step: 1``), ``features`` (``cc_codeline``, ``cc_log_only``, ``module_ranks``)
and ``ddp`` (``enable_ddp_comm_visibility``). The last test needs no torchrun.
"""

import logging
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from support import assert_row_matches, numpy_stats, rows_of, run_torchrun

WORKER = Path(__file__).parent / "workers" / "cc_ops.py"
WORKER_LINES = WORKER.read_text(encoding="utf-8").splitlines()
RANKS = (0, 1)
SITE = re.compile(r"^(?P<op>\w+)\.(?P<dir>pre|post)\.(?P<idx>\d+)@(?P<site>.+)$")
OPS = [
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "gather", "scatter",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
]
RTOL, ATOL = 1e-5, 1e-6


# ----------------------------------------------------------------------- helpers
def launch(mode, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"cc_{mode}")
    run_torchrun(WORKER, mode, out)
    return out, [torch.load(out / f"{mode}_rank{r}.pt", weights_only=False) for r in RANKS]


@pytest.fixture(scope="module")
def ops_run(tmp_path_factory):
    return launch("ops", tmp_path_factory)


@pytest.fixture(scope="module")
def features_run(tmp_path_factory):
    return launch("features", tmp_path_factory)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return launch("ddp", tmp_path_factory)


def tag(op, direction, idx, line):
    return f"{op}.{direction}.{idx}@cc_ops.py[{line}]"


def expected(calls, step, pre=True):
    """tag -> NumPy statistics of every tensor of that tag in ``step`` (merged)."""
    tensors = defaultdict(list)
    for c in calls:
        if c["step"] != step:
            continue
        for direction in ("pre", "post") if pre else ("post",):
            for i, t in enumerate(c[direction]):
                tensors[tag(c["op"], direction, i, c["line"])].append(t.reshape(-1))
    return {k: numpy_stats(torch.cat(v)) for k, v in tensors.items()}


def by_tag(rows, step):
    """tag -> row for ``step``; a tag written twice in one step is an error."""
    out = {}
    for r in rows:
        if r["step"] == str(step):
            assert r["scope"] == "comm", r
            assert r["module_name"] not in out, f"tag {r['module_name']} has two rows in step {step}"
            out[r["module_name"]] = r
    return out


def check_rows(got, want, what):
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    assert not missing and not extra, f"{what}: missing rows {missing}, unexpected rows {extra}"
    for t, stats in want.items():
        try:
            assert_row_matches(got[t], stats, rtol=RTOL, atol=ATOL)
        except AssertionError as exc:
            raise AssertionError(f"{what}: row {t}: {exc}") from None


def op_of(t):
    return SITE.match(t).group("op")


def line_of_tag(t):
    return int(re.search(r"\[(\d+)\]$", t).group(1))


# ------------------------------------------------------------------ ops: values
@pytest.mark.parametrize("op", OPS)
def test_pre_and_post_rows_match_the_tensors_passed_and_received(ops_run, op):
    """Every call of ``op`` (sync and async) on both ranks: one ``pre`` row per input
    and one ``post`` row per result, tagged with the worker's line, equal to NumPy
    statistics of the tensors the worker saw before and after the call."""
    out, results = ops_run
    for r in RANKS:
        calls = [c for c in results[r]["calls"] if c["op"] == op]
        assert any(c["step"] == 1 for c in calls), f"the worker made no {op} call on rank {r}"
        for c in calls:  # the recorded line is the line of the call itself
            assert f".{op}(" in WORKER_LINES[c["line"] - 1], (op, c["line"], WORKER_LINES[c["line"] - 1])
        rows = by_tag(rows_of(out / "ops", "cc", rank=r), step=1)
        got = {t: row for t, row in rows.items() if op_of(t) == op}
        check_rows(got, expected(calls, step=1), f"rank {r} {op}")


def test_async_op_returns_before_its_result_exists(ops_run):
    """With the monitor on, ``all_reduce(async_op=True)`` on rank 0 returns while rank 1
    has not even joined (0.5 s later): the monitor does not wait for the result."""
    _, results = ops_run
    assert [i["async_returned_before_done"] for i in results[0]["infos"]] == [True, True]


def test_deprecated_names_are_recorded_once_under_the_name_called(ops_run):
    out, results = ops_run
    for r in RANKS:
        rows = by_tag(rows_of(out / "ops", "cc", rank=r), step=1)
        for old, new in (("all_gather_into_tensor", "all_gather_single"), ("reduce_scatter_tensor", "reduce_scatter_single")):
            old_lines = {c["line"] for c in results[r]["calls"] if c["op"] == old}
            assert len(old_lines) == 2  # sync and async
            at_lines = sorted(t for t in rows if line_of_tag(t) in old_lines)
            assert at_lines and all(op_of(t) == old for t in at_lines), (r, at_lines)
            # the forwarded call is not a second record anywhere: the new name's rows are
            # exactly those of the lines that call the new name
            new_lines = {c["line"] for c in results[r]["calls"] if c["op"] == new}
            assert {line_of_tag(t) for t in rows if op_of(t) == new} <= new_lines
            # pre rows of the old name: one per call (sync+async), not two
            assert len([t for t in at_lines if ".pre." in t]) == 2, at_lines


def test_every_call_site_is_the_worker(ops_run):
    out, _ = ops_run
    for r in RANKS:
        for row in rows_of(out / "ops", "cc", rank=r):
            assert SITE.match(row["module_name"]).group("site").startswith("cc_ops.py["), row


def test_calls_through_distributed_c10d_are_seen(ops_run):
    out, results = ops_run
    for r in RANKS:
        calls = [c for c in results[r]["calls"] if "c10d.all_reduce(" in WORKER_LINES[c["line"] - 1]]
        assert len(calls) == 2  # steps 0 and 1
        rows = by_tag(rows_of(out / "ops", "cc", rank=r), step=1)
        want = expected(calls, step=1)
        assert set(want) == {tag("all_reduce", "pre", 0, calls[0]["line"]), tag("all_reduce", "post", 0, calls[0]["line"])}
        check_rows({t: rows.get(t) for t in want if t in rows}, want, f"rank {r} c10d.all_reduce")


def test_calls_of_one_tag_in_one_step_are_merged_into_one_row(ops_run):
    """The same all_reduce line called 3 times in one step (3, 5 and 8 elements): one row
    per tag, min of mins, max of maxes, mean weighted by element count, norm from summed
    squares; and NaN counts summed (a second line, one NaN per call, 2 calls)."""
    out, results = ops_run
    for r in RANKS:
        step1 = [c for c in results[r]["calls"] if c["step"] == 1 and c["op"] == "all_reduce"]
        per_line = defaultdict(list)
        for c in step1:
            per_line[c["line"]].append(c)
        loops = {ln: cs for ln, cs in per_line.items() if len(cs) > 1}
        assert sorted(len(cs) for cs in loops.values()) == [2, 3], loops.keys()
        rows = by_tag(rows_of(out / "ops", "cc", rank=r), step=1)
        for ln, cs in loops.items():
            want = expected(cs, step=1)
            check_rows({t: rows[t] for t in want if t in rows}, want, f"rank {r} line {ln}")
            if len(cs) == 3:  # the weighted mean differs from the mean of the means
                means = [numpy_stats(c["pre"][0])["mean"] for c in cs]
                assert abs(sum(means) / 3 - want[tag("all_reduce", "pre", 0, ln)]["mean"]) > 1e-3
            else:
                for direction in ("pre", "post"):
                    assert rows[tag("all_reduce", direction, 0, ln)]["nans"] == "2"


def test_steps_outside_the_schedule_record_nothing(ops_run):
    """start_step 1: step 0 made the same calls, none is written or leaks into step 1
    (step 1's rows equal step 1's tensors alone, checked above)."""
    out, _ = ops_run
    for r in RANKS:
        files = sorted(p.name for p in (out / "ops" / f"rank_{r}").glob("cc_*.csv"))
        assert files == ["cc_step1-1.csv"], files
        assert {row["step"] for row in rows_of(out / "ops", "cc", rank=r)} == {"1"}


# ------------------------------------------------------------- stop() and errors
def test_stop_puts_every_original_function_back(ops_run, features_run, ddp_run):
    """Identity of every callable of torch.distributed and distributed_c10d after each
    stop(); the functions were really replaced while running (except where cc is off)."""
    sessions = []
    for r in RANKS:
        sessions += [(f"ops rank {r}", ops_run[1][r], True), (f"ddp rank {r}", ddp_run[1][r], True)]
        for name in ("codeline", "log_only", "module_ranks"):
            sessions.append((f"{name} rank {r}", features_run[1][r][name], not (name == "module_ranks" and r == 0)))
    for what, s, patched in sessions:
        assert s["not_restored_after_stop"] == [], (what, s["not_restored_after_stop"])
        assert s["patched_while_running"] is patched, what
        assert s["contained_errors"] == 0, what


# -------------------------------------------------------------------- features
def test_cc_codeline_keeps_only_the_calls_of_the_listed_line(features_run):
    """Two all_reduce lines (and a broadcast line): only the listed line is recorded
    (post only: cc_pre_hook is off)."""
    out, results = features_run
    for r in RANKS:
        lines = results[r]["lines"]
        calls = results[r]["codeline"]["calls"]
        keep = [c for c in calls if c["line"] == lines["cc-codeline-keep"]]
        assert len(keep) == 2
        rows_all = rows_of(out / "codeline", "cc", rank=r)
        for step in (0, 1):
            rows = by_tag(rows_all, step)
            direct = {t: row for t, row in rows.items() if line_of_tag(t) != lines["cc-helper-inner"]}
            check_rows(direct, expected(keep, step, pre=False), f"rank {r} step {step}")
        dropped = {lines["cc-codeline-dropped"], lines["cc-codeline-dropped-op"]}
        assert not [row for row in rows_all if line_of_tag(row["module_name"]) in dropped]


def test_cc_codeline_matches_a_line_anywhere_in_the_call_stack(features_run):
    """The listed line calls a helper whose all_reduce is on another line: that call is
    kept (tagged with the helper's line); the same helper called from an unlisted line
    is not."""
    out, results = features_run
    for r in RANKS:
        lines = results[r]["lines"]
        inner = [c for c in results[r]["codeline"]["calls"] if c["line"] == lines["cc-helper-inner"]]
        assert len(inner) == 4  # 2 steps x (listed caller, unlisted caller)
        kept = inner[0::2]  # the listed caller runs first in each step
        rows_all = rows_of(out / "codeline", "cc", rank=r)
        for step in (0, 1):
            rows = by_tag(rows_all, step)
            got = {t: row for t, row in rows.items() if line_of_tag(t) == lines["cc-helper-inner"]}
            check_rows(got, expected(kept, step, pre=False), f"rank {r} step {step}")


def test_cc_log_only_logs_each_stack_once_and_records_no_statistics(features_run):
    out, results = features_run
    for r in RANKS:
        lines = results[r]["lines"]
        rank_dir = out / "log_only" / f"rank_{r}"
        assert list(rank_dir.glob("cc_*.csv")) == []
        log = (rank_dir / "cc_call_stacks.log").read_text(encoding="utf-8")
        heads = [ln for ln in log.splitlines() if ln.startswith("[cc_log_only]")]
        want = {op: lines[f"cc-log-{op}"] for op in ("all_reduce", "broadcast", "all_gather")}
        # 3 steps, all_reduce called for 4 parameters per step: still one entry per stack
        assert len(heads) == 3, heads
        for op, ln in want.items():
            assert len([h for h in heads if h.startswith(f"[cc_log_only] {op} called from cc_ops.py[{ln}]")]) == 1, (op, heads)
            assert f"cc_ops.py\", line {ln}" in log
        s = results[r]["log_only"]
        assert s["steps_done"] == 3 and s["bit_identical"] is True


def test_module_ranks_limits_cc_to_the_listed_ranks(features_run):
    out, results = features_run
    assert list((out / "module_ranks").glob("rank_0/cc_*.csv")) == []
    calls = results[1]["module_ranks"]["calls"]
    rows_all = rows_of(out / "module_ranks", "cc", rank=1)
    for step in (0, 1):
        check_rows(by_tag(rows_all, step), expected(calls, step, pre=False), f"rank 1 step {step}")


# ------------------------------------------------------------------------- DDP
def test_ddp_gradient_all_reduce_is_seen_with_the_comm_hook(ddp_run):
    """DDP's bucket all_reduce, through enable_ddp_comm_visibility: pre = this rank's
    gradient divided by the world size, post = the averaged gradient that DDP leaves in
    ``.grad`` (one bucket), tagged with the loss.backward() line."""
    out, results = ddp_run
    for r in RANKS:
        res = results[r]
        rows_all = rows_of(out / "ddp", "cc", rank=r)
        assert len(res["local"]) == len(res["reduced"]) == 3
        for step in range(3):
            rows = by_tag(rows_all, step)
            assert all(t.startswith("all_reduce.") for t in rows), list(rows)
            pre = tag("all_reduce", "pre", 0, res["backward_line"])
            post = tag("all_reduce", "post", 0, res["backward_line"])
            assert sorted(rows) == sorted([pre, post]), list(rows)
            assert_row_matches(rows[pre], numpy_stats(res["local"][step] / 2), rtol=RTOL, atol=ATOL)
            assert_row_matches(rows[post], numpy_stats(res["reduced"][step]), rtol=RTOL, atol=ATOL)
        # the ranks had different data: local gradients differ, the averaged ones agree
        assert not torch.equal(results[0]["local"][0], results[1]["local"][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0]["reduced"], results[1]["reduced"]))


def test_ddp_with_comm_hook_and_monitor_is_bit_identical_to_plain_ddp(ddp_run):
    _, results = ddp_run
    for r in RANKS:
        assert results[r]["bit_identical"] is True


# ---------------------------------------------------------- no process group
def test_without_process_group_cc_warns_and_does_nothing(tmp_path, caplog, monkeypatch):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    monkeypatch.delenv("RANK", raising=False)
    assert not dist.is_initialized()
    before = {(m.__name__, n): getattr(m, n) for m in (dist, c10d) for n in dir(m) if callable(getattr(m, n, None))}
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"module": {"enabled": False},
                                                                      "cc": {"enabled": True, "cc_pre_hook": True}}})
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        mon.start()
    assert any("not initialized" in rec.getMessage() and rec.levelno == logging.WARNING for rec in caplog.records), \
        [rec.getMessage() for rec in caplog.records]
    assert dist.all_reduce is before[("torch.distributed", "all_reduce")]
    for _ in range(2):
        torch.ones(3).sum()
        mon.step()
    mon.stop()
    assert mon.errors.count == 0
    assert list(tmp_path.rglob("cc_*.csv")) == []
    assert [k for k, v in before.items() if getattr(__import__("sys").modules[k[0]], k[1], None) is not v] == []
