"""torch FSDP2 + tensor parallel on a 2-D ``DeviceMesh`` (dp=2 x tp=2, 4 gloo ranks):
each rank's ``layout.json`` says where it sits on the mesh and which piece of each
parameter its rows are of, and ``merge_run`` combines the four ranks' rows into the
statistics of the whole tensors.

References are independent of the monitor: ``full_tensor()`` of every parameter, reduced
gradient and AdamW ``exp_avg`` (saved by the worker at each step), each dp rank's own
gradient from an unsharded, unmonitored twin (``workers/fsdp2_tensor_parallel.py``), and
the mesh coordinates torch itself reports. The same launch also runs FSDP2 hybrid
sharding (HSDP) on a (dp_replicate, dp_shard) mesh and tensor parallelism alone.
"""

import math
from pathlib import Path

import pytest
import torch

from msprobe.core.monitor_v2.analysis.merge import merge_run
from msprobe.core.monitor_v2.layout import load_layout
from support import assert_row_matches, numpy_stats, read_csv, run_torchrun

WORKER = Path(__file__).parent / "workers" / "fsdp2_tensor_parallel.py"
STEPS = 3
# How each parameter is cut: fc1 column-parallel (Shard(0) on tp), fc2 row-parallel
# (weight Shard(1) on tp, bias replicated over tp), the rest plain; fully_shard cuts every
# parameter over dp as well (FSDP2's Shard(0), strided under a tp Shard(0)).
TP_SPLIT = {"fc1.weight", "fc1.bias", "fc2.weight"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_tp")
    run_torchrun(WORKER, out, nproc=4, timeout=600)
    refs = [torch.load(out / f"ref_rank{r}.pt") for r in range(4)]
    return out, refs


def test_layout_gives_each_rank_its_mesh_coordinates_and_pieces(run):
    out, refs = run
    shapes = {n: list(t.shape) for n, t in refs[0]["steps"][0]["param"].items()}
    docs = [load_layout(str(out / "mon" / f"rank_{r}" / "layout.json")) for r in range(4)]
    for r, doc in enumerate(docs):
        dp, tp = refs[r]["dp_rank"], refs[r]["tp_rank"]  # DeviceMesh.get_coordinate() on that rank
        assert (dp, tp) == divmod(r, 2)  # init_device_mesh((2, 2)) is row-major
        assert doc["groups"] == {"dp": {"rank": dp, "size": 2}, "tp": {"rank": tp, "size": 2}}, doc["groups"]
        assert (doc["rank"], doc["world_size"], doc["stack"], doc["unknown"]) == (r, 4, "torch", [])
        assert set(doc["params"]) == set(shapes)
        # the module rows tensor parallelism cuts: fc1's output (and its gradient), fc2's
        # input (and its gradient); fc1's gradient to its replicated input is partial
        cut = {"split": [["tp", tp, 2]]}
        assert doc["modules"] == {"fc1.output.0": cut, "fc1.grad_output.0": cut, "fc2.input.0": cut,
                                  "fc2.grad_input.0": cut, "fc1.grad_input.0": dict(cut, partial=True)}
        for name, entry in doc["params"].items():
            assert entry["shape"] == shapes[name], (name, entry)
            pieces = entry["pieces"]
            tp_split = [["tp", tp, 2]] if name in TP_SPLIT else []
            # FSDP2's unreduced gradient is the unsharded (all-gathered) parameter's: whole over dp
            numel = math.prod(shapes[name])
            assert pieces["unreduced"] == {"numel": numel // (2 if tp_split else 1), "split": tp_split}, (name, pieces)
            assert pieces["reduced"]["split"] == [["dp", dp, 2]] + tp_split, (name, pieces)
            assert pieces["param"] == pieces["optimizer"] == pieces["reduced"]
    # distinct pieces (one per (dp, tp) for tensor-parallel parameters, one per dp rank
    # for the others) add up to the whole tensor; ranks 0 and 1 (tp replicas) of a plain
    # parameter hold the same piece
    for name, shape in shapes.items():
        pieces = {}
        for doc in docs:
            p = doc["params"][name]["pieces"]["reduced"]
            pieces[tuple(tuple(s) for s in p["split"])] = p["numel"]
        assert len(pieces) == (4 if name in TP_SPLIT else 2), (name, pieces)
        assert sum(pieces.values()) == math.prod(shape), (name, pieces)
    # uneven shards: emb (5 rows) is cut 3 + 2 over dp
    assert [docs[r]["params"]["emb.weight"]["pieces"]["reduced"]["numel"] for r in (0, 2)] == [18, 12]


def check_merged(src, dest, refs, dp_ranks, partial=0):
    """``merge_run(src, dest)`` leaves nothing out (but ``partial`` rows), finds no
    disagreement, and writes per step and parameter the reduced gradient, param_origin
    and exp_avg of the whole tensor and one unreduced row per dp rank (``dp_ranks``:
    ``{dp rank: its reference}``) of that rank's own gradient of the whole tensor."""
    summary = merge_run(str(src), str(dest)).to_json()
    assert summary["left_out"] == {"unknown": 0, "partial": partial, "incomplete": 0, "cc": 0, "no_layout": 0, "moe": 0}, summary
    assert summary["disagreements"] == 0, summary
    names = list(refs[0]["steps"][0]["param"])
    grad = read_csv(dest / "weight_grad.csv")
    param = read_csv(dest / "param.csv")
    optim = read_csv(dest / "optimizer.csv")
    # per step and parameter: 1 reduced + 1 unreduced per dp rank, param_origin and
    # param_updated, exp_avg and exp_avg_sq
    n = STEPS * len(names)
    assert (len(grad), len(param), len(optim)) == (n * (1 + len(dp_ranks)), n * 2, n * 2)

    def one(rows, **match):
        found = [x for x in rows if all(x[k] == str(v) for k, v in match.items())]
        assert len(found) == 1, (match, found)
        return found[0]

    for s in range(STEPS):
        ref = refs[0]["steps"][s]
        for name in names:
            reduced = one(grad, step=s, module_name=name, scope="reduced")
            assert reduced["dp_rank"] == ""  # combined over dp
            assert_row_matches(reduced, numpy_stats(ref["grad"][name]), rtol=1e-5)
            assert_row_matches(one(param, step=s, module_name=name, scope="param_origin"),
                               numpy_stats(ref["param"][name]), rtol=1e-5)
            assert_row_matches(one(optim, step=s, module_name=f"{name}.exp_avg", scope="exp_avg"),
                               numpy_stats(ref["exp_avg"][name]), rtol=1e-5)
            for dp, dp_ref in dp_ranks.items():
                row = one(grad, step=s, module_name=name, scope="unreduced", dp_rank=dp)
                assert_row_matches(row, numpy_stats(dp_ref["steps"][s]["local"][name]), rtol=1e-5)
        # the dp ranks trained on different data: their own gradients differ
        norms = {one(grad, step=s, module_name="fc1.weight", scope="unreduced", dp_rank=dp)["norm"] for dp in dp_ranks}
        assert len(norms) == len(dp_ranks)


def test_merge_gives_the_full_tensors_statistics(run):
    out, refs = run
    dp_refs = {dp: next(x for x in refs if x["dp_rank"] == dp) for dp in (0, 1)}
    # the gradient fc1 sends to its replicated input is a partial sum on each tp rank:
    # left out, one merged row per step and dp rank
    check_merged(out / "mon", out / "merged", refs, dp_refs, partial=STEPS * 2)
    # module rows, per dp rank: fc1's output and fc2's input are cut along tp (their
    # halves combined), fc1's input and fc2's output replicated; the gradients likewise
    module = read_csv(out / "merged" / "module.csv")
    for s in range(STEPS):
        for dp, ref in dp_refs.items():
            for name, want in ref["steps"][s]["act"].items():
                scope = "backward" if ".grad_" in name else "forward"
                found = [x for x in module if (x["step"], x["module_name"], x["scope"], x["dp_rank"]) == (
                    str(s), name, scope, str(dp))]
                assert len(found) == 1, (s, name, dp, found)
                assert_row_matches(found[0], numpy_stats(want), rtol=1e-5)
        assert not [x for x in module if x["step"] == str(s) and x["module_name"] == "fc1.grad_input.0"]


def test_hybrid_sharding_layout_and_merge(run):
    """FSDP2 HSDP on a (dp_replicate=2, dp_shard=2) mesh, same launch: both dimensions
    are data parallel (dp is their product, every rank its own dp rank), pieces are cut
    along dp_shard and replicated along dp_replicate, and the replicas agree."""
    out, _ = run
    refs = [torch.load(out / f"hsdp_rank{r}.pt") for r in range(4)]
    shapes = {n: list(t.shape) for n, t in refs[0]["steps"][0]["param"].items()}
    for r in range(4):
        doc = load_layout(str(out / "hsdp" / f"rank_{r}" / "layout.json"))
        rep, shard = refs[r]["coordinate"]
        assert doc["groups"] == {"dp": {"rank": r, "size": 4}, "dp_replicate": {"rank": rep, "size": 2},
                                 "dp_shard": {"rank": shard, "size": 2}}, doc["groups"]
        for name, entry in doc["params"].items():
            assert entry["pieces"]["unreduced"] == {"numel": math.prod(shapes[name]), "split": []}
            assert entry["pieces"]["reduced"]["split"] == [["dp_shard", shard, 2]], (name, entry)
    check_merged(out / "hsdp", out / "hsdp_merged", refs, dict(enumerate(refs)))


def test_tensor_parallel_alone(run):
    """``parallelize_module`` on a 1-D ("tp",) mesh of the 4 ranks, no FSDP: the mesh
    spans the world and names no data-parallel dimension, so dp is a group of one;
    fc1/fc2 parameters are cut 4 ways along tp, emb/head whole on every rank (replicas
    that agree), and the merged rows are the whole tensors'."""
    out, _ = run
    refs = [torch.load(out / f"tp_rank{r}.pt") for r in range(4)]
    for r in range(4):
        doc = load_layout(str(out / "tp" / f"rank_{r}" / "layout.json"))
        assert refs[r]["tp_rank"] == r
        assert doc["groups"] == {"dp": {"rank": 0, "size": 1}, "tp": {"rank": r, "size": 4}}, doc["groups"]
        for name, entry in doc["params"].items():
            split = [["tp", r, 4]] if name in TP_SPLIT else []
            assert entry["pieces"]["reduced"]["split"] == entry["pieces"]["unreduced"]["split"] == split, (name, entry)
    check_merged(out / "tp", out / "tp_merged", refs, {0: refs[0]}, partial=STEPS)
