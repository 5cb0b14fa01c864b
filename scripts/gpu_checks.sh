#!/usr/bin/env bash
# Device checks, run as they are on a machine with an NVIDIA GPU and no network access:
#
#   bash scripts/gpu_checks.sh                 # results in gpu_results/ (or $OUT)
#   GPU_CHECKS_DRY=1 bash scripts/gpu_checks.sh  # every command on the CPU at tiny sizes
#
# It installs nothing: it uses the machine's own python3 (a GPU image has torch and Triton;
# $PYTHON names another interpreter) with the checkout's src/ on PYTHONPATH, and builds the
# native C kernel into a writable cache under the results ($MSPROBE_MONITOR_CACHE_DIR). Where
# pytest or numpy is missing it says so and runs what does not need them. In order, each part
# with a timeout so that the whole stays under 8 minutes ($GPU_CHECKS_BUDGET seconds, 460 by
# default):
#   1. the machine, the package imported from src/, the C kernel built;
#   2. the no-synchronisation tests (tests/pytorch/test_gpu_no_sync.py: hooks under
#      torch.cuda.set_sync_debug_mode("error")) and the zeros count kept on the device;
#   3. the Triton statistics kernel against float64 on the GPU (tests/pytorch/test_triton_stats.py,
#      where it exists);
#   4. the overhead benchmarks, monitored and plain training alternating in one process:
#      benchmarks/overhead.py (default model), benchmarks/deep_overhead.py (1,000 and 4,000
#      tensors), and a 1B-parameter bf16 GPT where the GPU has the memory;
#   5. the device-cost benchmark (benchmarks/device_cost.py: counts on fake tensors, an H100
#      estimate). It needs no GPU, so it comes last: the budget goes to what only a GPU measures.
# Every part's output goes to ${OUT:-gpu_results}/<part>.txt; one table of all parts is printed
# last (and written to summary.md).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out=${OUT:-gpu_results}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
dry=${GPU_CHECKS_DRY:-0}
# the dry mode checks the commands, not the time: a loaded CPU machine gets ten times the limits
if [ "${GPU_CHECKS_DRY:-0}" = 1 ]; then
    scale=10
else
    scale=1
fi
budget=${GPU_CHECKS_BUDGET:-$((460 * scale))}
start=$(date +%s)
export PYTHONPATH="$repo/src:$repo/tests${PYTHONPATH:+:$PYTHONPATH}"
export MSPROBE_MONITOR_CACHE_DIR=${MSPROBE_MONITOR_CACHE_DIR:-$out/cache}
export PYTHONDONTWRITEBYTECODE=1
mkdir -p "$MSPROBE_MONITOR_CACHE_DIR"
: > "$out/parts.tsv"

if [ "$dry" = 1 ]; then
    device=cpu
else
    device=cuda
fi

# run <part> <seconds> <command...>: the command's output in $out/<part>.txt, its status and time
# in parts.tsv; its timeout is the part's or what is left of the budget (less a reserve for the
# summary), whichever is smaller
run() {
    local part=$1 limit=$(($2 * scale))
    shift 2
    local now left rc t0
    now=$(date +%s)
    left=$((budget - (now - start) - 15))
    if [ "$left" -lt 10 ]; then
        echo "== $part: skipped, the time budget is spent" | tee "$out/$part.txt"
        printf '%s\tskipped (budget spent)\t0\n' "$part" >> "$out/parts.tsv"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $part (at most ${limit}s): $*"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$out/$part.txt" 2>&1
    rc=$?
    tail -n 25 "$out/$part.txt"
    local status="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="timed out after ${limit}s"
    elif [ "$rc" -ne 0 ]; then
        status="failed (exit $rc)"
    fi
    printf '%s\t%s\t%s\n' "$part" "$status" "$(($(date +%s) - t0))" >> "$out/parts.tsv"
    return 0
}

# what the machine has (never installed here)
have() { "$py" -c "import $1" > /dev/null 2>&1; }
if ! have torch; then
    echo "$py has no torch: nothing can run (this script installs nothing)" | tee "$out/device.txt"
    exit 1
fi
missing=""
have pytest || missing="$missing pytest"
have numpy || missing="$missing numpy"
[ -n "$missing" ] && echo "not installed:$missing: the tests that need them are not run (the benchmarks are)" \
    | tee "$out/missing.txt"

run environment 40 "$py" - "$device" "$repo" <<'EOF'
import os, sys
import torch
device, repo = sys.argv[1], sys.argv[2]
import msprobe.core.monitor_v2 as mv2
from msprobe.core.monitor_v2 import native
where = os.path.realpath(mv2.__file__)
assert where.startswith(os.path.realpath(os.path.join(repo, "src")) + os.sep), f"msprobe imported from {where}"
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton not installed: the statistics kernel cannot be used")
if device == "cuda":
    assert torch.cuda.is_available(), "no CUDA device visible"
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB")
print("msprobe from", os.path.dirname(where))
kernel = native.load()
print("C kernel:", "built in " + os.environ["MSPROBE_MONITOR_CACHE_DIR"] if kernel is not None else "NOT built")
print("extension:", "built" if native.extension() is not None else "not built")
assert kernel is not None, "the native C kernel did not build into MSPROBE_MONITOR_CACHE_DIR"
EOF

if have pytest && have numpy; then
    run no_sync_tests 80 "$py" -m pytest -q -rs -p no:cacheprovider tests/pytorch/test_gpu_no_sync.py \
        tests/pytorch/test_zeros.py::test_zeros_on_a_gpu_stay_on_the_device_until_to_host
    if [ -f tests/pytorch/test_triton_stats.py ]; then
        if [ "$dry" = 1 ]; then
            TRITON_INTERPRET=1 run triton_kernel 80 "$py" -m pytest -q -rs -p no:cacheprovider -x \
                tests/pytorch/test_triton_stats.py
        else
            run triton_kernel 80 "$py" -m pytest -q -rs -p no:cacheprovider -x tests/pytorch/test_triton_stats.py
        fi
    else
        echo "tests/pytorch/test_triton_stats.py is not in this checkout: the kernel's check is not run" \
            | tee "$out/triton_kernel.txt"
        printf 'triton_kernel\tnot in this checkout\t0\n' >> "$out/parts.tsv"
    fi
else
    printf 'no_sync_tests\tnot run (needs pytest and numpy)\t0\n' >> "$out/parts.tsv"
    printf 'triton_kernel\tnot run (needs pytest and numpy)\t0\n' >> "$out/parts.tsv"
fi

if [ "$dry" = 1 ]; then
    run overhead_default 60 "$py" benchmarks/overhead.py --device cpu --smoke --skip-engine \
        --only weight_grad --only "all monitors"
    run deep_overhead 60 "$py" benchmarks/deep_overhead.py --device cpu --smoke --tensors 40 \
        --only weight_grad --only all
    run overhead_1b_bf16 60 "$py" benchmarks/overhead.py --device cpu --smoke --skip-engine --dtype bfloat16 \
        --only weight_grad --only "all monitors"
    run device_cost 60 "$py" benchmarks/device_cost.py --smoke --json "$out/device_cost.json"
else
    run overhead_default 80 "$py" benchmarks/overhead.py --device cuda --threads 4 --rounds 3 --skip-engine \
        --only weight_grad --only "module (every module)" --only "all monitors"
    run deep_overhead 70 "$py" benchmarks/deep_overhead.py --device cuda --threads 4 --rounds 3 \
        --tensors 1000 --tensors 4000 --only weight_grad --only all
    # a 1B-parameter GPT in bf16 (20 layers, d_model 2048, vocabulary 32000: 1.07B parameters;
    # with AdamW about 10 GiB before activations), where the GPU has 40 GiB
    if "$py" -c "import torch, sys; sys.exit(torch.cuda.get_device_properties(0).total_memory < 40 * 2**30)"; then
        run overhead_1b_bf16 90 "$py" benchmarks/overhead.py --device cuda --threads 4 --rounds 3 --skip-engine \
            --dtype bfloat16 --layers 20 --d-model 2048 --heads 16 --vocab 32000 --context 1024 --batch 4 \
            --steps-per-window 2 --warmup 2 --only weight_grad --only "all monitors"
    else
        printf 'overhead_1b_bf16\tnot run (less than 40 GiB of GPU memory)\t0\n' >> "$out/parts.tsv"
    fi
    run device_cost 70 "$py" benchmarks/device_cost.py --seam-timeout 30 --json "$out/device_cost.json"
fi

# one table last: each part's status, and each benchmark's rows (ratios with / without the monitor)
"$py" - "$out" <<'EOF' | tee "$out/summary.md"
import os, sys
out = sys.argv[1]
rows = []
for line in open(os.path.join(out, "parts.tsv")):
    part, status, seconds = line.rstrip("\n").split("\t")
    detail = ""
    path = os.path.join(out, part + ".txt")
    text = open(path, errors="replace").read().splitlines() if os.path.exists(path) else []
    if part in ("no_sync_tests", "triton_kernel"):
        detail = next((l.strip() for l in reversed(text) if " passed" in l or " failed" in l or " skipped" in l
                       or " error" in l), "")
    elif part == "environment":
        detail = "; ".join(l for l in text if l.startswith(("torch", "device", "C kernel", "triton")))
    rows.append((part, status, seconds, detail))
    if part.startswith(("overhead", "deep_overhead", "device_cost")):
        header = None
        for l in text:
            if not l.startswith("|") or l.startswith("|---"):
                continue
            cells = [c.strip() for c in l.strip("|").split("|")]
            if header is None:
                header = cells
                continue
            if part == "device_cost":
                rows.append((f"  {cells[0]}", "", "", f"today {cells[1]}; target {cells[2]}; now {cells[3]}"))
            elif part == "deep_overhead":
                rows.append((f"  {cells[0]} tensors, {cells[1]}", "", "", f"ratio {cells[2]} ({cells[3]})"))
            else:
                rows.append((f"  {cells[0]}", "", "", f"ratio {cells[1]} ({cells[2]})"))
print()
print("| part | status | seconds | result |")
print("|---|---|---|---|")
for part, status, seconds, detail in rows:
    print(f"| {part} | {status} | {seconds} | {detail} |")
EOF
echo "results in $out (total $(($(date +%s) - start)) s)"
