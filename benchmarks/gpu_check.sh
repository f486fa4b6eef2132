#!/usr/bin/env bash
# Every check that needs a GPU, in one run on one CUDA GPU, within 9 minutes; each step's log and
# JSON go to one folder (default results/gpu_check), with summary.txt: the GPU, the versions, and
# each step's exit status and seconds. A step past its time limit is stopped and the next runs.
#
#   1. benchmarks/gpu_kernels.py            the block kernel candidates, checked, then timed
#   2. benchmarks/gpu.py --quick            ours against FlexAttention, eager and dense flash
#   3. the demo's first steps on one GPU    examples/train_longnet.py --device cuda, one rank
#   4. tests/test_cuda.py                   the CUDA entry against float64; a transfer over NCCL
#
#   bash benchmarks/gpu_check.sh [FOLDER]     (PYTHON=... picks the interpreter; default: .venv's
#                                             if there is one, else python3)
set -u
cd "$(dirname "$0")/.."
out=${1:-results/gpu_check}
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
summary="$out/summary.txt"
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' 2>&1
    git rev-parse HEAD 2>/dev/null
} > "$summary"
cat "$summary"

step() {  # step NAME SECONDS COMMAND...: run it into NAME.log, record its status and time
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (at most $limit s)"
    start=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc, $(($(date +%s) - start)) s" | tee -a "$summary"
    tail -n 30 "$out/$name.log"
}

step gpu_kernels 90 "$py" benchmarks/gpu_kernels.py --out "$out"
step gpu 240 "$py" benchmarks/gpu.py --quick --profile --out "$out"
step demo 75 "$py" -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_longnet.py \
    --device cuda --steps 20 --out /tmp/gpu_check_demo_loss.png
xdist=$("$py" -c 'import xdist' 2>/dev/null && echo "-n 8")
TORCHINDUCTOR_COMPILE_THREADS=2 step test_cuda 120 "$py" -m pytest -q -s -rA $xdist tests/test_cuda.py
