#!/usr/bin/env bash
# The whole GPU check in one call (about 6 minutes on an H100/H200), most important first:
#   1. machine facts: the GPU's PCIe link, MaxReadReq, IOMMU, NUMA (machine.txt);
#   2. build with nvcc (the CUDA copy kernel required), SGLang 0.5.23's JIT transfer kernels
#      compiled beside it, then the CUDA tests of the copy path: every path's bytes against
#      the CPU torch path and the kernel's CPU emulation (tests.log);
#   3. bench/transfer_gpu.py: GPU time alone with the host's submit time (Q: random and
#      identity order, 1 GiB, 1,024 pages), the grid of both kernel modes (G), and page
#      copies of every hiradix path beside SGLang's own kernels on the same pools (A);
#   4. bench/layer_wait_gpu.py: the wait through SGLang's KV pool with its control (W) and
#      the overlap with a forward pass at compute/load 0.5, 1, 2, with contention alone and
#      the host's submit time (D), for hiradix's paths and SGLang's kernels.
# Each step has its own time limit and the later steps run whatever the earlier ones gave.
# Carry: .whl (bench/gpu/README.md) and .gpu (SGLang's source tarball). Writes 8 files
# under $OUT (the device tool's limit): machine.txt, build.log, tests.log, run.log,
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

step "machine facts"
{
    echo "-- PCIe link, MaxPayload/MaxReadReq of the GPU (lspci)"
    for bdf in $(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | sed 's/^0000//; s/^0*\([0-9a-fA-F]*:\)/\1/'); do
        lspci -vvv -s "$bdf" 2>/dev/null | grep -E "LnkCap:|LnkSta:|MaxPayload|MaxReadReq" | sed 's/^\s*//'
    done
    echo "-- IOMMU"
    grep -oE "(intel_iommu|amd_iommu|iommu)[=.][^ ]*" /proc/cmdline || echo "no iommu= on the kernel command line"
    echo "iommu groups: $(find /sys/kernel/iommu_groups -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)"
    echo "-- NUMA"
    lscpu 2>/dev/null | grep -E "^(Model name|NUMA node|Socket|Thread)" || true
    nvidia-smi topo -m 2>/dev/null | head -8
    echo "gpu numa node: $(cat /sys/bus/pci/devices/*/numa_node 2>/dev/null | sort | uniq -c | tr '\n' ' ')"
} >"$OUT/machine.facts" 2>&1
cat "$OUT/machine.facts"

step "setup and build, SGLang's JIT kernels beside it"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.installed && export PYTHONPATH=/tmp/site:$PWD
(timeout "${JIT_TIMEOUT:-150}" python3 bench/sglang_kernels.py --compile-only --source .gpu/sglang-0.5.23.tar.gz \
    >"$OUT/jit.log" 2>&1; echo "sglang jit rc=$?" >>"$OUT/jit.log") &
jit=$!
# shellcheck source=bench/gpu/setup.sh
source bench/gpu/setup.sh || { echo "build failed"; exit 1; }
cat "$OUT/machine.facts" >>"$OUT/machine.txt" && rm -f "$OUT/machine.facts"

step "CUDA tests of the copy path"
timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -n 8 -rA \
    tests/memory/test_kernel.py tests/memory/test_copy.py tests/memory/test_pools.py tests/cache/test_cache.py \
    >"$OUT/tests.log" 2>&1
echo "tests rc=$?"
tail -1 "$OUT/tests.log"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
echo "CUDA tests passed: $(grep -cE "^PASSED .*(cuda|Cuda|CUDA)" "$OUT/tests.log"), of which parity:" \
    "$(grep -cE "^PASSED .*test_cuda_kernel_matches" "$OUT/tests.log"); skipped: $(grep -cE "^SKIPPED" "$OUT/tests.log")"
grep -E "^SKIPPED" "$OUT/tests.log" | head -10

wait "$jit"
echo "-- SGLang's JIT kernels"; cat "$OUT/jit.log"; rm -f "$OUT/jit.log"

step "GPU time alone (Q), the kernel grid (G), page copies beside SGLang's kernels (A)"
timeout "${TRANSFER_TIMEOUT:-170}" python3 bench/transfer_gpu.py --sglang-src .gpu/sglang-0.5.23.tar.gz \
    --total-mib 256 --repeats 5 --json "$OUT/transfer_gpu.json" --md "$OUT/transfer_gpu.md"
echo "transfer_gpu rc=$?"

step "layer waits through SGLang's KV pool (W) and overlap (D)"
timeout "${WAIT_TIMEOUT:-150}" python3 bench/layer_wait_gpu.py --sglang-src .gpu/sglang-0.5.23.tar.gz \
    --rounds 100 --repeats 5 \
    --json "$OUT/layer_wait.json" --md "$OUT/layer_wait.md" 2>&1 | grep -vE "UserWarning|warnings.warn"
echo "layer_wait rc=${PIPESTATUS[0]}"
step "done"
