#!/usr/bin/env bash
# Set up hiradix on a bare GPU machine with no package registry (the workplace's lent
# H100/H200): install the carried wheels (.whl/, see bench/gpu/README.md) into /tmp/site,
# then build the extensions in place, the CUDA copy kernel included (nvcc is there).
# Source it: it exports PYTHONPATH.
set -u
if compgen -G ".whl/*.whl" >/dev/null; then
    if [ ! -e /tmp/site/.installed ]; then  # run.sh installs them first, for the JIT build beside ours
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
        touch /tmp/site/.installed
    fi
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
mkdir -p "${OUT:-/tmp/out}"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
    nvcc --version | tail -2
    python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
    nproc
} 2>&1 | tee "${OUT:-/tmp/out}/machine.txt"
t0=$SECONDS
python3 setup.py build_ext --inplace -j "$(nproc)" >"${OUT:-/tmp/out}/build.log" 2>&1 || { tail -40 "${OUT:-/tmp/out}/build.log"; return 1; }
echo "build: $((SECONDS - t0)) s"
