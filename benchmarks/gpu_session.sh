#!/usr/bin/env bash
# Everything in this repository that needs an NVIDIA GPU, in one run that fits a short GPU lease.
#
#   bash benchmarks/gpu_session.sh              # the kernels and their speed (under 8 minutes on
#                                               # an H100-class GPU):
#     1. the GPU and software versions (versions.txt);
#     2. tests/test_kernels.py with the Triton kernels compiled for this GPU (kernel_tests.txt),
#        among them the row offsets past 2**31 elements (a 5 GB buffer) and CUDA's grid limits,
#        and tests/test_kernel_operator.py: models on the Triton backend under torch.compile;
#     2b. with two GPUs or more, the device guard: inputs on cuda:1 while cuda:0 is current
#        (two_gpus.txt; skipped, and said so, on one GPU or none);
#     3. benchmarks/flash_attention.py: ours against every SDPA backend and naive attention,
#        float16 and bfloat16, D = 64 and 128, N = 512 ... 16384, causal and not, forward and
#        forward + backward, peak memory (flash_attention.csv, flash_attention.png);
#     4. the roofline bound of this GPU for the same sizes (roofline.csv).
#   bash benchmarks/gpu_session.sh --chapters   # every chapter as a plain Python script, so that
#                                               # its GPU path runs (chapters.csv; 6 minutes)
#   ... --small                                 # either mode as a dry run on a CPU
#   ... --chapters 3 12                        # only the chapters whose names start so
#
# It installs nothing and needs no network: python (or $PYTHON) with torch and triton (pytest,
# and matplotlib for part 3's plot). The package is taken from code/ (PYTHONPATH). Results go
# to $OUT, by default benchmarks/results/<gpu-name>/. Each part prints its elapsed time; the exit status is
# non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
python=${PYTHON:-python}
mode=kernels small=""
chapters=()
for arg in "$@"; do
    case "$arg" in
        --chapters) mode=chapters ;;
        --small) small=--small ;;
        -*) echo "gpu_session.sh: unknown option $arg" >&2; exit 2 ;;
        *) chapters+=("$arg") ;;
    esac
done
gpu=$("$python" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available()
else 'cpu')" 2>/dev/null | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9._-')
out="${OUT:-benchmarks/results/${gpu:-unknown}}"
mkdir -p "$out"
export PYTHONPATH="$PWD/code${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
status=0

part() {  # part NAME LOG COMMAND...: run COMMAND, its output also in $out/LOG, and time it
    local name=$1 log=$2 t0=$SECONDS
    shift 2
    echo "== $name"
    "$@" 2>&1 | tee "$out/$log"
    local rc=${PIPESTATUS[0]}
    status=$(( status | (rc != 0) ))
    echo "== $name: exit status $rc, $(( SECONDS - t0 )) s (total $(( SECONDS - start )) s)"
}

versions() {
    date -u
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
        --format=csv,noheader
    "$python" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch',
torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda, '| gpu',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
    git rev-parse HEAD 2>/dev/null || true
}

kernel_tests() {
    if ! "$python" -c "import pytest" 2>/dev/null; then
        echo "pytest is not installed here: the kernel tests did not run"
        return 1
    fi
    "$python" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_operator.py
}

two_gpus() {
    "$python" -m pytest -q -p no:cacheprovider -rs tests/test_kernels.py -k "second_gpu or guard"
}

part versions versions.txt versions
if [ "$mode" = chapters ]; then
    part chapters chapters.txt "$python" benchmarks/run_chapters.py --out "$out" $small \
        ${chapters[@]+"${chapters[@]}"}
else
    part "kernel tests" kernel_tests.txt kernel_tests
    gpus=$("$python" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)
    if [ "${gpus:-0}" -ge 2 ]; then
        part "two GPUs" two_gpus.txt two_gpus
    else
        echo "== two GPUs: skipped, ${gpus:-0} GPU here (the device guard's check needs two)"
    fi
    part benchmark benchmark.txt "$python" benchmarks/flash_attention.py --out "$out" $small
    part roofline roofline.txt "$python" benchmarks/flash_attention.py --roofline --out "$out" $small
fi
echo "gpu_session: exit status $status after $(( SECONDS - start )) s; results in $out"
exit "$status"
