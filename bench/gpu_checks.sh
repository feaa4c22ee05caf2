#!/usr/bin/env bash
# The GPU checks as one script for a lent CUDA machine (limits add to 12.3 min; SKIP_COMPILE=1: 10.5 min):
#   1. device  (45 s): does the GPU path work at all? torch sees the GPU, a bf16 matmul and one
#                      ResNet-50 training step run; printed in the first minute.
#   2. tests   (100 s): tests/test_gpu.py (CUDA only) and tests/test_gpu_ready.py.
#   3. throughput (50 s): ResNet-50 at 224 px, 3 channels, batch 256: fp32/bf16/fp16 x NCHW/channels_last.
#   4. profile (180 s): both recipes' profile at 224 px on synthetic Fashion-MNIST-shaped data, with a
#                       75 s time box each: step breakdown, GPU busy share, Tensor Core share, trials.
#   5. nvml    (50 s): NVML busy sampled every 20 ms over 200 un-profiled steps of the tuned optimized
#                      recipe, beside the profile's busy share, and the host's microseconds per step
#                      (the loop's time when it does not wait for the GPU).
#   6. jpeg    (60 s): the CUDA tests of the codec (nvJPEG against the CPU decoder) and nvJPEG's batch
#                      decode img/s at 224 px (`bench/store_encoding.py --device cuda`).
#   7. jpeg_train (100 s): ResNet-50 training img/s at 224 px (bf16, channels_last, the fast loader
#                      and its device transform, 8 workers) from a raw store, from a JPEG store decoded
#                      by the workers, and from the JPEG store decoded by nvJPEG (`bench/jpeg_loader.py`).
#   8. compile (2 x 55 s): bf16 + channels_last under torch.compile, mode "default" and
#                      "reduce-overhead" (CUDA graphs) timed apart.
# Steps 6-7 add 3.7 min of limits; SKIP_COMPILE=1 leaves step 8 out.
# Only small summaries (.json, .md, .txt) go to the output folder; data and traces stay in $WORK.
#
#   OUT=/tmp/gpu bash bench/gpu_checks.sh        # needs torch with CUDA and timm; no network
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out/gpu}
WORK=${WORK:-/tmp/cnnpipe_gpu_work}
PY=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TIMM_OFFLINE=1   # no network there: never wait on a hub
mkdir -p "$OUT" "$WORK"
status=0
step() {  # step NAME SECONDS CMD...: time-limited, output teed to $OUT/checks.txt; a failure is noted, the rest runs
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/checks.txt"   # one file: few come back
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}

step device 45 "$PY" - <<'EOF'
import json, os, subprocess, time
import torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as exc:
    info["nvidia_smi"] = f"failed: {exc}"
ok = False
if info["available"]:
    from cnnpipe.train.precision import gpu_has_native_bf16, math_mode
    dev = torch.device("cuda", 0)
    info.update(name=torch.cuda.get_device_name(0), capability=torch.cuda.get_device_capability(0),
                native_bf16=gpu_has_native_bf16(dev), fp32_math=math_mode("off", dev))
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    a @ a; torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    info["bf16_matmul_tflops"] = 10 * 2 * 8192**3 / (time.perf_counter() - t0) / 1e12
    import timm
    m = timm.create_model("resnet50", num_classes=10).to(dev).to(memory_format=torch.channels_last)
    x = torch.randn(64, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        m(x).float().mean().backward()
    torch.cuda.synchronize()
    ok = True
info["gpu_path_works"] = ok
print(json.dumps(info, indent=1))
print("GPU PATH:", "WORKS" if ok else "DOES NOT WORK")
json.dump(info, open(os.path.join(os.environ.get("OUT", "."), "device.json"), "w"), indent=1)
raise SystemExit(0 if ok else 1)
EOF
export OUT
step tests 100 "$PY" -m pytest tests/test_gpu.py tests/test_gpu_ready.py -ra -q -p no:cacheprovider -p no:randomly
step throughput 50 "$PY" bench/throughput.py --device cuda --sizes 224 --batch 256 --steps 15 --warmup 5
step profile 180 "$PY" bench/device_profile.py --device cuda --size 224 --train-images 20000 --time-box 75 \
    --prepare-workers 8 --work "$WORK" --out "$WORK/profile" --encoding raw
for f in baseline.json optimized.json; do  # (at most 8 files come back from a lent machine)
    [ -f "$WORK/profile/$f" ] && cp "$WORK/profile/$f" "$OUT/profile_$f"
done
step nvml 50 "$PY" bench/nvml_busy.py --device cuda --prepared "$WORK/prepared" --profile "$WORK/profile/optimized.json" \
    --steps 200 --interval 0.02
step jpeg 60 "$PY" -m pytest tests/test_codec.py tests/test_encoded.py -q -p no:cacheprovider -p no:randomly -k "cuda or nvjpeg"
step nvjpeg 60 "$PY" bench/store_encoding.py --device cuda --sizes 224
step jpeg_train 100 "$PY" bench/jpeg_loader.py --sizes 224 --workers 8 --train 30 --batch-size 256 --images 8192 \
    --device cuda --decode cpu device
[ -n "${SKIP_COMPILE:-}" ] && exit $status
step compile_default 55 "$PY" bench/throughput.py --device cuda --sizes 224 --batch 256 --steps 15 --warmup 5 \
    --compile default
step compile_reduce_overhead 55 "$PY" bench/throughput.py --device cuda --sizes 224 --batch 256 --steps 15 --warmup 5 \
    --compile reduce-overhead
exit $status
