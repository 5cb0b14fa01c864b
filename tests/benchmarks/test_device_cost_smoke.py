"""The device-cost benchmark (benchmarks/device_cost.py) at small shapes: it prints the one
table of issue 48's measures, and what it counts agrees with the shapes it traced. The
tracer itself is checked on ops whose bytes are known from their shapes alone."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "device_cost.py"
sys.path.insert(0, str(BENCH.parent))
import device_cost  # noqa: E402

MEASURES = [
    "bytes per element, tensors >= 64K elements, kernel path",
    "same, ATen fallback",
    "launches per tensor in module hooks",
    "launches for batched `reduced`/`param`/`optimizer`/`unreduced` reads",
    "launches for one 2M-element tensor",
    "peak temporary of one read",
    "host syncs in hooks / blocking copies in `step()` with `async_write`",
    "estimated H100: 7B `weight_grad` / `module` 4 of 32 layers / 3,072 experts",
    "weight_grad 7B: launches / bytes moved (measured)",
    "module 4 layers: launches / bytes moved (measured)",
    "3,072 experts: launches / bytes moved (measured)",
    "on a GPU: `weight_grad` / all monitors on a 1B model",
]


def test_smoke_mode_prints_the_targets_table_and_counts_that_follow_the_shapes(tmp_path):
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert lines[0] == "| measure | today (issue 48) | target | this engine |"
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[0] for c in cells] == MEASURES
    assert all(len(c) == 4 and all(c) for c in cells)
    assert cells[7][1] == "185-276 ms / 46-70 ms / 0.39-0.73 s" and cells[7][2] == "<= 15 ms / <= 5 ms / <= 30 ms"

    got = json.loads(out.read_text())
    s = device_cost.SMOKE
    reads = got["reads"]
    # the weight_grad workload read every gradient of the Llama twice (unreduced, reduced)
    per_layer = 4 * s.hidden * s.hidden + 3 * s.inter * s.hidden + 2 * s.hidden
    llama = 2 * s.vocab * s.hidden + s.layers * per_layer + s.hidden
    wg = got["workloads"]["weight_grad 7B"]
    assert wg["tensors"] == 2 * (2 + 9 * s.layers + 1)
    assert wg["elements"] == 2 * llama
    assert wg["monitored_bytes"] == 2 * 2 * llama  # bf16
    ex = got["workloads"]["3,072 experts"]
    assert ex["elements"] == 2 * s.experts * s.expert_shape[0] * s.expert_shape[1]
    mod = got["workloads"]["module 4 layers"]
    assert mod["elements"] == s.module_layers * (
        (22 + 5 * 2 + 5) * s.tokens * s.hidden + 8 * s.tokens * s.inter + 2 * s.tokens * s.rope_dim)
    for r in reads:
        if r["phase"] == "step":
            assert r["tensors"] == 0
            continue
        assert r["monitored_bytes"] == 2 * r["elements"] > 0
        # every statistic needs the data: each tensor is read at least once, by at least one launch
        assert r["kernels"] >= r["ops"] + r["triton_launches"] > 0
        assert r["bytes_read"] >= r["monitored_bytes"]
        assert r["bytes_written"] > 0
        assert r["peak_temporary"] >= 0
        assert r["syncs"] == 0, r  # none in hooks or the optimizer step's reads
        assert r["gpu_us"] >= device_cost.TINY_KERNEL_US * r["kernels"] - 1e-9
    # the same workloads at the same shapes through the engine's test seam, on real CPU tensors
    for name in ("weight_grad 7B", "module 4 layers", "3,072 experts", "one big tensor"):
        seam = got["workloads"][name + device_cost.SEAM_SUFFIX]
        assert (seam["tensors"], seam["elements"]) == (got["workloads"][name]["tensors"],
                                                       got["workloads"][name]["elements"])
        assert seam["kernels"] > 0
    # the kernel path: the fake tensors' reads with the kernel's launches modelled (full
    # shapes in a real run), and the seam's with the Triton kernel run under its interpreter
    for suffix in (device_cost.KERNEL_SUFFIX, device_cost.SEAM_SUFFIX):
        for name in ("weight_grad 7B", "module 4 layers", "3,072 experts", "one big tensor"):
            kernel = got["workloads"][name + suffix]
            assert (kernel["tensors"], kernel["elements"]) == (got["workloads"][name]["tensors"],
                                                               got["workloads"][name]["elements"])
            assert kernel["triton_launches"] > 0 and kernel["hook_syncs"] == 0
            assert kernel["step_blocking_copies"] == 0, (name, suffix)
        for r in reads:
            if not r["workload"].endswith(suffix) or r["phase"] == "step":
                continue
            if r["phase"] == device_cost.SUM_OF_PARTS:  # the module monitor's sum of a gradient's parts
                assert r["triton_launches"] == 0
                continue
            # one fused call: two launches, whatever the number of tensors; each element read once
            assert r["triton_launches"] == r["kernels"] == 2, r
            assert r["monitored_bytes"] <= r["bytes_read"] <= 1.3 * r["monitored_bytes"] + 4096, r
            assert r["peak_temporary"] <= 8 << 20, r
    # the ATen path's copies to the host are non-blocking too (pinned memory and an event)
    assert all(w["step_blocking_copies"] == 0 for w in got["workloads"].values())
    big = [r for r in reads if r["workload"] == "one big tensor" and r["phase"] == "hooks"]
    assert big[0]["elements"] == s.big_shape[0] * s.big_shape[1]
    for w in got["workloads"].values():
        assert w["kernels"] > 0 and w["bytes_moved"] > 0
        lo, hi = w["added_ms"]
        assert hi == w["gpu_ms"] + w["host_ms"] and lo == max(w["gpu_ms"], w["host_ms"])
        assert abs(w["host_ms"] - w["kernels"] * device_cost.HOST_US_PER_LAUNCH / 1e3) < 1e-9


def test_the_tracer_counts_bytes_from_shapes_launches_and_temporaries():
    """Known ops on fake cuda tensors: a cast, a sum, a dot of a tensor with itself (one read),
    views (no launch), a blocking copy to the host and a host read (syncs)."""
    tracer = device_cost.DeviceCostTracer()
    with FakeTensorMode(), tracer:
        t = torch.empty(1000, dtype=torch.bfloat16, device="cuda")
        with tracer.read("w", "hooks", [t]) as read:
            wide = t.view(10, 100).reshape(-1).to(torch.float64)
            total = wide.sum()
            sumsq = torch.dot(wide, wide)
            del wide
        with tracer.read("w", "step", []) as step:
            host = torch.stack((total, sumsq)).cpu()
            host.tolist()
            total.item()
    assert read.ops == 3 and read.kernels == 4  # dot: two cuBLAS kernels
    assert read.names == {"_to_copy": 1, "sum": 1, "dot": 1}
    assert read.bytes_read == 2000 + 8000 + 8000
    assert read.bytes_written == 8000 + 8 + 8
    assert read.peak_temporary == 8000 + 8 + 8
    assert read.syncs == 0
    assert step.blocking_copies == 1
    assert step.syncs == 2  # the copy and the device scalar's item(); the host copy's tolist() is none
    assert step.bytes_read == 16 + 16 and step.bytes_written == 16 + 16
