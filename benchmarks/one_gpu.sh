#!/usr/bin/env bash
# The prepared checks of one lent GPU (issue 45), as one command: the ResNet-18 bf16 devices=1 fits of custom_ddp
# (defaults) and ddp, interleaved; the SyncBN benchmark on a 1-rank NCCL group (the layer's CUDA path -- its Triton
# kernels --, the eager and the compiled kernel against torch's own SyncBatchNorm Function and cuDNN BN; fp32 and
# bf16; ResNet stage shapes); where one layer call's time goes (host against device, torch.profiler); then the CUDA
# tests that run on one GPU (the Triton kernels compiled, against the eager reference). Records land under $OUT
# (default /tmp/one_gpu): copy them to benchmarks/results/ and name the device in the commit.
#
#     OUT=/tmp/gpu bash benchmarks/one_gpu.sh            # 317 s on one H200 (2026-11-28, torch 2.11), before the
#                                                        # profile phase and 20 SyncBN rounds (expected ~360 s)
#     OUT=/tmp/gpu bash benchmarks/one_gpu.sh --quick    # under a minute
#     DEVICE=cpu OUT=/tmp/dry bash benchmarks/one_gpu.sh --quick   # the dry run on CPU: no GPU test, gloo rows
#
# BUDGET_S (default: none) bounds the whole run: a lent machine's minutes are few, so each phase also has its own
# cap and a phase that runs past it is stopped (its log says so) rather than eating the phases after it.
# The fits run first, on a machine not yet loaded by the SyncBN benchmark's compile workers (the records' quiet
# check reads the 1-minute load).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"  # keep what is there: carried wheels (the device README)
py=${PYTHON:-python3}
out=${OUT:-/tmp/one_gpu}
device=${DEVICE:-cuda}
quick=${1:-}
deadline=$((SECONDS + ${BUDGET_S:-86400}))
mkdir -p "$out"
status=0

# within CAP_S LOG COMMAND...: COMMAND with its output in LOG, stopped after CAP_S or at the deadline.
within() {
  local cap=$1 log=$2 left=$((deadline - SECONDS))
  shift 2
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 15 ]; then echo "skipped: the budget is spent: $*" >> "$log"; status=1; return; fi
  timeout -k 10 "$cap" "$@" >> "$log" 2>&1
  local rc=$?
  [ "$rc" -eq 124 ] && echo "stopped after its cap of ${cap} s: $*" >> "$log"
  [ "$rc" -eq 0 ] || status=1
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
  $py -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"; } \
  > "$out/machine.txt" 2>&1
# One GPU, one process: custom_ddp (one rank: torch's native batch norm) against ddp, fits interleaved.
within 260 "$out/compare.log" $py -m benchmarks.fits.compare --device "$device" --nets resnet18 \
  --variants custom_ddp ddp_default --accumulate 1 --timing-only --rounds 3 --max-wait-s 0 $quick \
  --out "$out/compare_one_gpu"
# torch's CUDA BN kernels need no warm machine; the ResNet-18 stage shapes (the issue's table). The second
# dtype waits (30 s at most) for the first one's compile workers' load to fall.
shapes=(32x128 1024x2048 32x64x16x16 128x64x32x32 256x64x56x56 256x256x14x14)
# 20 rounds, not the CPU default's 10: on the H200 the host's noise left 256x256x14x14's CI at [0.769, 1.05] with 10,
# and the rounds cost ~1.5 s a shape and dtype (the compiled method's compiles take most of the phase).
rounds=(--rounds 20)
[ -n "$quick" ] && shapes=(32x128 32x64x16x16) && rounds=()
wait_s=0
for dtype in float32 bfloat16; do
  within 200 "$out/syncbn_$dtype.log" $py -m benchmarks.batchnorm.syncbn --device "$device" --world-size 1 \
    --dtype "$dtype" --shapes "${shapes[@]}" "${rounds[@]}" --max-wait-s "$wait_s" $quick \
    --out "$out/syncbn_one_gpu_$dtype"
  wait_s=30
done
# Where a layer call's time goes (the host's share, torch.profiler's tables): what the next change should cut.
profile_shapes=(32x128 1024x2048 256x64x56x56 256x256x14x14)
[ -n "$quick" ] && profile_shapes=(32x128)
within 90 "$out/syncbn_profile.log" $py -m benchmarks.batchnorm.syncbn_profile --device "$device" \
  --shapes "${profile_shapes[@]}" --max-wait-s 0 $quick --out "$out/syncbn_profile_one_gpu"
if [ "$device" = cuda ]; then  # the tests that need a GPU (skipped, so absent, without one)
  within 150 "$out/gpu_tests.txt" $py -m pytest -m gpu -n 0 -p no:cacheprovider -q -rs tests/strategy/test_custom_ddp.py \
    tests/gradients/test_grad_sync.py tests/batchnorm/test_syncbn_distributed.py tests/evaluation/test_metric_sync.py
  within 90 "$out/gpu_tests.txt" $py -m pytest -n 0 -p no:cacheprovider -q -m "not distributed" \
    tests/batchnorm/test_syncbn_fused.py
fi
tail -n 3 "$out"/*.log "$out/gpu_tests.txt" 2>/dev/null
exit $status
