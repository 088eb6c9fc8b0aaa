#!/usr/bin/env bash
# The prepared checks of one lent GPU (issue 45), as one command: the CUDA tests that run on one GPU (the Triton
# kernels compiled, against the eager reference), the SyncBN benchmark on a 1-rank NCCL group (the layer's CUDA
# path -- its Triton kernels --, the eager and the compiled kernel against torch's own SyncBatchNorm Function and
# cuDNN BN; fp32 and bf16; ResNet stage shapes), then ResNet-18 bf16 devices=1 fits of custom_ddp (defaults)
# and ddp, interleaved. Records land under $OUT (default /tmp/one_gpu): copy them to benchmarks/results/ and name
# the device in the commit.
#
#     OUT=/tmp/gpu bash benchmarks/one_gpu.sh            # ~5 minutes on one H200 before the fits, ~2 more (est.)
#     OUT=/tmp/gpu bash benchmarks/one_gpu.sh --quick    # under a minute
#     DEVICE=cpu OUT=/tmp/dry bash benchmarks/one_gpu.sh --quick   # the dry run on CPU: no GPU test, gloo rows
#
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=.
out=${OUT:-/tmp/one_gpu}
device=${DEVICE:-cuda}
quick=${1:-}
mkdir -p "$out"
status=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
  python -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"; } \
  > "$out/machine.txt" 2>&1
if [ "$device" = cuda ]; then  # the tests that need a GPU (skipped, so absent, without one)
  python -m pytest -m gpu -n 0 -p no:cacheprovider -q -rs tests/test_custom_ddp.py tests/test_grad_sync.py \
    tests/test_syncbn_distributed.py tests/test_metric_sync.py > "$out/gpu_tests.txt" 2>&1 || status=1
  python -m pytest -n 0 -p no:cacheprovider -q -m "not distributed" tests/test_syncbn_fused.py \
    >> "$out/gpu_tests.txt" 2>&1 || status=1
fi
# torch's CUDA BN kernels need no warm machine; the ResNet-18 stage shapes first (the issue's table).
shapes=(32x128 1024x2048 32x64x16x16 128x64x32x32 256x64x56x56 256x256x14x14)
[ -n "$quick" ] && shapes=(32x128 32x64x16x16)
for dtype in float32 bfloat16; do
  python -m benchmarks.batchnorm.syncbn --device "$device" --world-size 1 --dtype "$dtype" --shapes "${shapes[@]}" \
    --max-wait-s 0 $quick --out "$out/syncbn_one_gpu_$dtype" > "$out/syncbn_$dtype.log" 2>&1 || status=1
done
# One GPU, one process: custom_ddp (its SyncBatchNorm: the Triton kernels) against ddp, fits interleaved.
python -m benchmarks.fits.compare --device "$device" --nets resnet18 --variants custom_ddp ddp_default --accumulate 1 \
  --timing-only --rounds 3 --max-wait-s 0 $quick --out "$out/compare_one_gpu" > "$out/compare.log" 2>&1 || status=1
tail -n 3 "$out"/*.log "$out/gpu_tests.txt" 2>/dev/null
exit $status
