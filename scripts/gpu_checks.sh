#!/usr/bin/env bash
# Device checks, prepared to run in one go on a machine with an NVIDIA GPU:
# the no-synchronisation tests (hooks; grouped reads; the zeros count on the device), then the overhead benchmarks
# (the default model and the per-tensor one) on the GPU.
# Writes its results to ${OUT:-gpu_results}/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_results}
mkdir -p "$out"
python3 -m venv .venv-gpu
.venv-gpu/bin/python -m pip install -q torch numpy pytest 2>&1 | grep -v "is ignored" || true
.venv-gpu/bin/python -m pip install -q --no-deps -e . 2>&1 | grep -v "is ignored" || true
.venv-gpu/bin/python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
.venv-gpu/bin/python -m pytest -q -rs tests/pytorch/test_gpu_no_sync.py \
    tests/pytorch/test_zeros.py::test_zeros_on_a_gpu_stay_on_the_device_until_to_host 2>&1 | tee "$out/no_sync_test.txt"
.venv-gpu/bin/python benchmarks/overhead.py --device cuda --threads 4 --rounds 5 2>&1 | tee "$out/overhead_cuda.txt"
# the per-tensor axis on the GPU: grouped reads at the optimizer step, per-tensor reductions in the module hooks
.venv-gpu/bin/python benchmarks/deep_overhead.py --device cuda --threads 4 --rounds 5 --tensors 1000 --tensors 4000 \
    2>&1 | tee "$out/deep_overhead_cuda.txt"
# under DDP (one-process NCCL group): the local gradients of each backward pass in one grouped read
.venv-gpu/bin/python benchmarks/deep_overhead.py --device cuda --threads 4 --rounds 5 --tensors 1000 --ddp \
    --only weight_grad 2>&1 | tee "$out/deep_overhead_ddp_cuda.txt"
