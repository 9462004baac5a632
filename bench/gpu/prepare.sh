#!/usr/bin/env bash
# Here (a machine with pip and a package registry), before a device call: fetch what the
# lent GPU machines lack, for their Python 3.12 on x86-64, into two folders git ignores
# (.git/info/exclude) and the call carries (`carry: [".whl", ".gpu"]`):
#   .whl/  wheels: hiradix's own needs the image lacks (isal, lz4, platformdirs), the
#          small packages SGLang's KV-pool module imports for real (bench/gpu/sglang_src.py
#          lists the ones that become placeholders instead), and what SGLang's JIT loader
#          needs to build its HiCache transfer kernels (bench/sglang_kernels.py): apache-tvm-ffi
#          at the version SGLang 0.5.23 pins (0.1.11), and ninja (its executable lands in
#          /tmp/site/bin, which bench/sglang_kernels.py puts on PATH);
#   .gpu/  SGLang's source, as a tarball of the wheel's pure-Python files (no .so: the
#          wheel's Rust extensions are built for CPython 3.11).
# About 25 MiB in all (25.4 MB measured), under the tool's 64 MiB.
set -eu
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
cd "$(git rev-parse --show-toplevel)"
mkdir -p .git/info
for d in /.whl/ /.gpu/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude; done
rm -rf .whl .gpu && mkdir -p .whl .gpu
py=$(command -v python3)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
    isal==1.7.2 lz4==4.4.4 platformdirs==4.14.8 \
    msgspec==0.22.0 orjson==3.13.0 pybase64==1.5.1 dill==0.4.1 pydantic==2.14.3 pydantic_core==2.50.4 \
    annotated-types==0.8.0 typing-inspection==0.4.5 pyzmq==27.3.0 apache-tvm-ffi==0.1.11 ninja==1.13.2
tmp=$(mktemp -d)
"$py" -m pip download -q --no-deps -d "$tmp" "sglang==$SGLANG_VERSION"
(cd "$tmp" && "$py" -m zipfile -e sglang-*.whl src >/dev/null)
tar -C "$tmp/src" --exclude='*.so' --exclude='__pycache__' --exclude='*.pyc' \
    -czf ".gpu/sglang-$SGLANG_VERSION.tar.gz" sglang "sglang-$SGLANG_VERSION.dist-info"
rm -rf "$tmp"
du -sh .whl .gpu
