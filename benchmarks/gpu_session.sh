#!/usr/bin/env bash
# Everything in this repository that needs an NVIDIA GPU, in one run that fits a short GPU lease:
#   1. the GPU and software versions, for the report;
#   2. tests/test_kernels.py: the Triton kernels compiled for this GPU and checked against PyTorch
#      (values and gradients, float16/bfloat16/float32, odd lengths, NaN-padded strided inputs);
#   3. benchmarks/flash_attention.py: TFLOP/s and peak memory against every SDPA backend and
#      naive attention, written as CSV and PNG.
# It installs nothing: it needs python with torch and triton, and uses pytest and matplotlib if
# they are there. Results go to $OUT (default benchmarks/results). Arguments are passed to the
# benchmark; `--small` runs the whole thing on a CPU, in Triton's interpreter, as a dry run.
#
#   OUT=/tmp/results bash benchmarks/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD/code${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

{
    date -u
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
        --format=csv,noheader
    python -c "import torch, triton; print('torch', torch.__version__, '| triton',
triton.__version__, '| cuda', torch.version.cuda, '| gpu', torch.cuda.is_available())"
} 2>&1 | tee "$out/versions.txt"

if python -c "import pytest" 2>/dev/null; then
    python -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tee "$out/kernel_tests.txt"
    status=$(( status | PIPESTATUS[0] ))
else
    echo "pytest is not installed here: the kernel tests did not run" | tee "$out/kernel_tests.txt"
    status=1
fi

python benchmarks/flash_attention.py --out "$out" "$@" 2>&1 | tee "$out/benchmark.txt"
status=$(( status | PIPESTATUS[0] ))
echo "gpu_session: exit status $status; results in $out"
exit "$status"
