#!/usr/bin/env bash
# The whole GPU check in one call (about 6 minutes on an H100/H200), most important first:
#   1. build with nvcc (the CUDA copy kernel required) and the CUDA tests of the copy path
#      (kernel parity against the torch path and the CPU emulation included);
#   2. bench/layer_wait_gpu.py: the wait through SGLang's KV pool (W, bytes) and the
#      layer-wise overlap (D), for the kernel and torch paths;
#   3. bench/transfer_gpu.py: GPU time alone (Q), page copies against the link (A) and the
#      kernel grid (G).
# Each step has its own time limit and the later steps run whatever the earlier ones gave.
# Carry: .whl (bench/gpu/README.md) and .gpu (SGLang's source tarball). Writes at most 8
# files under $OUT (the device tool's limit): machine.txt, build.log, tests.log, run.log,
# layer_wait.{md,json}, transfer_gpu.{md,json}.
set -u
export PYTHONUNBUFFERED=1 HIRADIX_CUDA=1 HIRADIX_CUDA_ARCHS="${HIRADIX_CUDA_ARCHS:-90}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
if ! command -v nvidia-smi >/dev/null || ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "bench/gpu/run.sh: no CUDA GPU here (nvidia-smi missing or torch.cuda.is_available() False); nothing run"
    exit 2
fi
t0=$SECONDS
step() { echo "== $1 (t=$((SECONDS - t0)) s)"; }

step "setup and build"
# shellcheck source=bench/gpu/setup.sh
source bench/gpu/setup.sh || { echo "build failed"; exit 1; }

step "CUDA tests of the copy path"
timeout "${TESTS_TIMEOUT:-180}" python3 -m pytest -q -p no:cacheprovider -n 8 -rA \
    tests/memory/test_kernel.py tests/memory/test_copy.py tests/memory/test_pools.py tests/cache/test_cache.py \
    >"$OUT/tests.log" 2>&1
echo "tests rc=$?"
tail -1 "$OUT/tests.log"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
echo "CUDA tests passed: $(grep -cE "^PASSED .*(cuda|Cuda|CUDA)" "$OUT/tests.log"), of which kernel parity:" \
    "$(grep -cE "^PASSED .*test_cuda_kernel_matches" "$OUT/tests.log"); skipped: $(grep -cE "^SKIPPED" "$OUT/tests.log")"
grep -E "^SKIPPED" "$OUT/tests.log" | head -10

step "layer waits through SGLang's KV pool (W) and overlap (D)"
timeout "${WAIT_TIMEOUT:-260}" python3 bench/layer_wait_gpu.py --sglang-src .gpu/sglang-0.5.23.tar.gz \
    --rounds 200 --repeats 5 \
    --json "$OUT/layer_wait.json" --md "$OUT/layer_wait.md" 2>&1 | grep -vE "UserWarning|warnings.warn"
echo "layer_wait rc=${PIPESTATUS[0]}"

step "GPU time alone (Q), page copies against the link (A), the kernel grid (G)"
timeout "${TRANSFER_TIMEOUT:-160}" python3 bench/transfer_gpu.py --total-mib 256 --repeats 5 \
    --json "$OUT/transfer_gpu.json" --md "$OUT/transfer_gpu.md"
echo "transfer_gpu rc=$?"
step "done"
