#!/usr/bin/env bash
# The GPU benchmark (after `source bench/gpu/setup.sh`): CUDA tests of the copy path, then
# bench/transfer_gpu.py; results and logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -rfEs tests/memory/test_kernel.py tests/memory/test_copy.py \
    tests/memory/test_pools.py tests/cache/test_cache.py >"$OUT/copy_tests.log" 2>&1
echo "copy tests rc=$?"; tail -3 "$OUT/copy_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/copy_tests.log" | head -20
timeout "${BENCH_TIMEOUT:-420}" python3 bench/transfer_gpu.py "$@" --json "$OUT/transfer_gpu.json" --md "$OUT/transfer_gpu.md" \
    2>"$OUT/transfer_gpu.err"
echo "bench rc=$?"; tail -5 "$OUT/transfer_gpu.err"
