#!/usr/bin/env bash
# The GPU checks as one script, for a lent CUDA machine: the CUDA-only tests, AMP x channels_last
# throughput, and the profile of both recipes (GPU busy fraction, Tensor Core share, trials) on
# synthetic data. Everything it prints is also written under $OUT (default bench_out/gpu).
#
#   OUT=/tmp/gpu bash bench/gpu_checks.sh          # ~5 min on one H200; needs torch with CUDA, timm
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out/gpu}
PY=${PYTHON:-python}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
status=0
run() {  # run NAME CMD...: tee the output to $OUT/NAME.txt, remember a failure, keep going
    local name=$1; shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "== $name FAILED"; status=1; }
}
run device bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'"
run test_gpu "$PY" -m pytest tests/test_gpu.py -ra -p no:cacheprovider
run throughput "$PY" bench/throughput.py --device cuda --sizes 64 224 --batch 256 --steps 6
run profile "$PY" bench/device_profile.py --device cuda --size 64 --out "$OUT/profile"
exit $status
