#!/usr/bin/env bash
# The whole test suite on the GPU machine (after `source bench/gpu/setup.sh`), CUDA tests
# listed one by one; logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
timeout "${SUITE_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider -n "${SUITE_WORKERS:-12}" --timeout 240 -rfEs \
    >"$OUT/suite.log" 2>&1
echo "suite rc=$?"; tail -5 "$OUT/suite.log"
grep -E "^(FAILED|ERROR)" "$OUT/suite.log" | head -40
timeout 200 python3 -m pytest -q -p no:cacheprovider -rA -k "cuda or Cuda or CUDA or kernel" tests \
    >"$OUT/cuda_tests.log" 2>&1
echo "cuda tests rc=$?"; grep -E "passed|failed|PASSED|FAILED|ERROR" "$OUT/cuda_tests.log" | tail -60
