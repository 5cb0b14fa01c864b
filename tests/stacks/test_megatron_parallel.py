"""Megatron-Core 0.16 under model parallelism (4 gloo ranks on the CPU, through
benchmarks/megatron_cpu_shim.py): TP=2 x DP=2, PP=2 x DP=2 with 1F1B and interleaved
PP=2 with 2 model chunks per rank x DP=2, each without and with the distributed
optimizer, trained by Megatron's own schedules with the monitor on, in one torchrun
launch (workers/megatron_parallel.py).

What is checked:
- each rank's ``layout.json`` (MegatronStack.layout): its coordinates against the rank
  arithmetic of Megatron's default order (tp fastest, then dp, then pp), each chunk's
  global layers against the ``TransformerLayer.layer_number`` the worker read;
- ``merge_run`` on every run: every parameter's merged ``reduced`` gradient,
  ``param_origin`` and ``exp_avg`` equal NumPy on the FULL tensor (the worker's own
  all-gather of tp shards and distributed-optimizer slices) within 1e-5 relative; names
  carry the model's layer numbers (``layer_number - 1``) and no chunk prefix; nothing is
  left out and no replica disagrees; ``unreduced`` and module rows keep one row per
  data-parallel rank, and a column-parallel output / row-parallel input merged over tp
  equals NumPy on the tensor gathered by the worker's own hooks;
- a disagreement planted in one data-parallel replica's row is reported.
"""

import csv
import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from support import assert_row_matches, numpy_stats, run_torchrun
from support.extras import require

require("megatron.core", "the Megatron-Core model-parallel tests train its GPT model on 4 gloo ranks")

from msprobe.core.monitor_v2.analysis.merge import merge_run  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "megatron_parallel.py"
CONFIGS = {"tp": (2, 1, None), "tp-distopt": (2, 1, None), "pp": (1, 2, None), "pp-distopt": (1, 2, None),
           "vpp": (1, 2, 2), "vpp-distopt": (1, 2, 2)}  # name: (tp, pp, chunks per rank)
STEPS, WORLD, RTOL = 2, 4, 1e-5
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_parallel")
    started = time.time()
    run_torchrun(WORKER, out / "runs", nproc=WORLD, timeout=900)
    print(f"megatron_parallel launch: {time.time() - started:.1f} s")
    for config in CONFIGS:
        REPORTS[config] = merge_run(str(out / "runs" / config), str(out / "merged" / config))
    return out


REPORTS = {}  # config: the MergeReport of its run
# The one thing a pipeline-parallel layout says it does not know: the rows of the modules
# above the transformer layers (GPTModel, decoder), each stage's own tensors under one name.
STAGED = ("module rows of the modules above the transformer layers under pipeline parallelism "
          "(each stage's own tensors under one name)")


def layout(out, config, rank):
    return json.loads((out / "runs" / config / f"rank_{rank}" / "layout.json").read_text())


def meta(out, config, rank):
    return torch.load(out / "runs" / config / f"meta_rank{rank}.pt", weights_only=False)


def full(out, config):
    """Per statistic kind and step, every parameter's full tensor by global name (the
    ranks with tp and dp rank 0 of each pipeline stage saved their stage's)."""
    merged = {"grad": [{} for _ in range(STEPS)], "param": [{} for _ in range(STEPS)],
              "exp_avg": [{} for _ in range(STEPS)]}
    for path in sorted((out / "runs" / config).glob("full_rank*.pt")):
        saved = torch.load(path, weights_only=False)
        for kind, steps in saved.items():
            for s, tensors in enumerate(steps):
                assert not set(tensors) & set(merged[kind][s]), "two stages saved the same parameter"
                merged[kind][s].update(tensors)
    return merged


def merged_rows(out, config, monitor):
    with open(out / "merged" / config / f"{monitor}.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def index(rows, *keys):
    out = {}
    for r in rows:
        key = tuple(r[k] for k in keys)
        assert key not in out, f"two merged rows for {key}"
        out[key] = r
    return out


@pytest.mark.parametrize("config", CONFIGS)
def test_layout_coordinates_and_chunks(out, config):
    tp, pp, vpp = CONFIGS[config]
    dp = WORLD // (tp * pp)
    for rank in range(WORLD):
        doc = layout(out, config, rank)
        assert doc["stack"] == "megatron" and doc["rank"] == rank and doc["world_size"] == WORLD
        assert doc["unknown"] == ([STAGED] if pp > 1 else [])
        # Megatron's default order "tp-cp-ep-dp-pp": tp varies fastest, pp slowest
        want = {"tp": (rank % tp, tp), "dp": (rank // tp % dp, dp), "pp": (rank // (tp * dp), pp)}
        got = {g: (doc["groups"][g]["rank"], doc["groups"][g]["size"]) for g in want}
        assert got == want
        numbers = meta(out, config, rank)["layer_numbers"]  # per chunk {local name: layer_number}
        assert len(doc["chunks"]) == (vpp or 1)
        for chunk, seen in zip(doc["chunks"], numbers):
            assert chunk["layers"] == len(seen) and chunk["layer_offset"] == min(seen.values()) - 1
        # where the layers of this rank are in the model (Megatron's interleaved assignment)
        per_chunk = 4 // (pp * (vpp or 1))
        for v, chunk in enumerate(doc["chunks"]):
            assert chunk["layer_offset"] == (v * pp + want["pp"][0]) * per_chunk
        # every piece of a tensor-parallel weight is this rank's part over tp
        name = ("0:" if vpp else "") + "decoder.layers.0.mlp.linear_fc1.weight"
        entry = doc["params"][name]
        assert entry["shape"] == [256, 64]
        assert entry["pieces"]["unreduced"] == {"numel": 256 * 64 // tp,
                                                "split": [["tp", want["tp"][0], tp]] if tp > 1 else []}
        sharded = config.endswith("distopt")
        assert all((["dp", want["dp"][0], dp] in entry["pieces"][c]["split"]) == sharded
                   for c in ("reduced", "param", "optimizer"))


@pytest.mark.parametrize("config", CONFIGS)
def test_merged_statistics_are_those_of_the_full_tensors(out, config):
    report = json.loads((out / "merged" / config / "merge.json").read_text())
    assert report["world_size"] == WORLD and report["ranks"] == list(range(WORLD))
    assert report["disagreements"] == 0, (out / "merged" / config / "disagreements.csv").read_text()[:2000]
    left = {k: v for k, v in report["left_out"].items() if v}
    if CONFIGS[config][1] > 1:  # only the module rows of GPTModel and decoder, said to be unknown
        assert set(left) == {"unknown"}, left
        examples = REPORTS[config].examples["unknown"]
        assert examples and all(e["monitor"] == "module" and e["module_name"].split(".")[0] in ("GPTModel", "decoder")
                                and e["module_name"].split(".")[1] != "layers" for e in examples), examples
    else:
        assert left == {}, left
    ref = full(out, config)
    names = set(ref["grad"][0])
    assert len(names) == 4 * 12 + 2 + 3  # 4 layers of 12 tensors, 2 embeddings, final norm (2), output layer
    wg = index([r for r in merged_rows(out, config, "weight_grad") if r["scope"] == "reduced"], "step", "module_name")
    par = index([r for r in merged_rows(out, config, "param") if r["scope"] == "param_origin"], "step", "module_name")
    opt = index([r for r in merged_rows(out, config, "optimizer") if r["scope"] == "exp_avg"], "step", "module_name")
    for s in range(STEPS):
        assert {n for (st, n) in wg if st == str(s)} == names
        for name in names:
            for rows, kind, key in ((wg, "grad", name), (par, "param", name), (opt, "exp_avg", f"{name}.exp_avg")):
                row = rows[(str(s), key)]
                expected = numpy_stats(ref[kind][s][name])
                # a mean near zero: the fp32 sums of the ranks' pieces, at the tensor's scale
                scale = float(ref[kind][s][name].abs().max())
                assert_row_matches(row, expected, rtol=RTOL, atol=1e-6 * scale)
                assert row.get("dp_rank", "") == ""  # combined over data parallelism


@pytest.mark.parametrize("config", CONFIGS)
def test_merged_names_are_global_layers_without_chunk_prefix(out, config):
    numbers = set()
    for rank in range(WORLD):
        for chunk in meta(out, config, rank)["layer_numbers"]:
            numbers.update(n - 1 for n in chunk.values())
    assert numbers == {0, 1, 2, 3}
    for monitor in ("weight_grad", "param", "optimizer", "module"):
        names = {r["module_name"] for r in merged_rows(out, config, monitor)}
        assert names and not [n for n in names if ":" in n]
        layers = {int(m.group(1)) for n in names if (m := LAYER.match(n))}
        assert layers == numbers, (monitor, layers)
    # the worker's own renaming of every parameter (layer_number - 1 of its TransformerLayer)
    expected = {n for rank in range(WORLD) for n in meta(out, config, rank)["global_names"]}
    assert {r["module_name"] for r in merged_rows(out, config, "param")} == expected


@pytest.mark.parametrize("config", CONFIGS)
def test_unreduced_and_module_rows_keep_one_row_per_dp_rank(out, config):
    tp, pp, _ = CONFIGS[config]
    dp = WORLD // (tp * pp)
    ref = full(out, config)
    unreduced = [r for r in merged_rows(out, config, "weight_grad") if r["scope"] == "unreduced"]
    keys = {(r["step"], r["module_name"], r["dp_rank"]) for r in unreduced}
    assert len(keys) == len(unreduced) == STEPS * len(ref["grad"][0]) * dp
    module = index(merged_rows(out, config, "module"), "step", "module_name", "dp_rank")
    assert {k[2] for k in module} == {str(d) for d in range(dp)}
    # a column-parallel output and a row-parallel input merged over tp: NumPy on the
    # worker's own gather of every call of the step (pipeline stage 0's layer 0)
    checked = 0
    for rank in range(WORLD):
        for row_name, steps in meta(out, config, rank)["modules"].items():
            d = layout(out, config, rank)["groups"]["dp"]["rank"]
            for s, whole in enumerate(steps):
                assert_row_matches(module[(str(s), row_name, str(d))], numpy_stats(whole), rtol=RTOL,
                                   atol=1e-6 * float(whole.abs().max()))
                checked += 1
    assert checked == 2 * STEPS * dp


def test_what_the_layout_cannot_tell_is_unknown(out):
    """Parameters carrying Megatron's attributes by hand (TP=2 x DP=2): a strided
    tensor-parallel split is "unknown" with a reason, an expert parameter (EP=1 here) is
    whole on every rank (issue 49: expert parallelism is described, test_megatron_ep.py); a
    sequence-parallel norm's unreduced piece is partial over tp; without an initialised
    parallel_state every piece is unknown and the document says why."""
    for rank in range(WORLD):
        docs = torch.load(out / "runs" / f"edge_rank{rank}.pt", weights_only=False)
        doc, tp = docs["initialized"], rank % 2
        params = doc["params"]
        assert params["column"]["shape"] == [4, 6]
        assert params["column"]["pieces"]["reduced"] == {"numel": 12, "split": [["tp", tp, 2]]}
        for name, word in (("strided", "partition_stride"),):
            assert params[name] == {"shape": "unknown", "pieces": {c: "unknown" for c in
                                                                 ("unreduced", "reduced", "param", "optimizer")}}
            assert [line for line in doc["unknown"] if word in line and name in line], doc["unknown"]
        assert params["expert"] == {"shape": [4, 3], "pieces": {c: {"numel": 12, "split": []} for c in
                                                                ("unreduced", "reduced", "param", "optimizer")}}
        assert params["norm"]["pieces"]["unreduced"] == {"numel": 12, "split": [["tp", tp, 2]], "partial": True}
        assert params["norm"]["pieces"]["reduced"] == {"numel": 12, "split": []}
        gone = docs["destroyed"]
        assert all(e["pieces"]["reduced"] == "unknown" for e in gone["params"].values())
        assert [line for line in gone["unknown"] if "not initialized" in line], gone["unknown"]
        assert gone["groups"] == {"dp": {"rank": rank, "size": WORLD}}


def test_disagreeing_replica_is_reported(out, tmp_path):
    """Rank 2 (tp 0, dp 1) holds the same reduced gradient as rank 0 (tp 0, dp 0): one
    norm changed in its CSV is reported by merge, not averaged away."""
    run = tmp_path / "tp"
    shutil.copytree(out / "runs" / "tp", run)
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    path = next((run / "rank_2").glob("weight_grad_step0-*.csv"))
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    changed = 0
    for i, line in enumerate(lines[1:], 1):
        cells = line.split(",")
        row = dict(zip(header, cells))
        if row["module_name"] == name and row["scope"] == "reduced":
            cells[header.index("norm")] = repr(float(row["norm"]) * 1.01)
            lines[i] = ",".join(cells)
            changed += 1
    assert changed == 1
    path.write_text("\n".join(lines) + "\n")
    report = merge_run(str(run), str(tmp_path / "merged"))
    assert report.disagreements >= 1
    with open(tmp_path / "merged" / "disagreements.csv", newline="") as fh:
        said = list(csv.DictReader(fh))
    assert {(r["step"], r["module_name"], r["scope"], r["stat"]) for r in said} == {("0", name, "reduced", "norm")}
    assert "0" in said[0]["ranks"] and "2" in said[0]["ranks"]
