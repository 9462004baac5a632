#!/usr/bin/env bash
# Create the SGLang baseline virtual environments for bench/sglang_baselines.py.
#
#   bash bench/setup_sglang.sh            # both venvs (0.5.18 and 0.5.23)
#   bash bench/setup_sglang.sh 0.5.18     # only one version
#
# Environment overrides:
#   HIRADIX_BENCH_VENVS parent folder of the venvs        (default .bench-venvs in the checkout;
#                      bench/tree_ops.py and bench/peer.py look there too)
#   SGLANG_018_VENV    venv for sglang 0.5.18             (default $HIRADIX_BENCH_VENVS/sglang-0.5.18)
#   SGLANG_023_VENV    venv for sglang 0.5.23             (default $HIRADIX_BENCH_VENVS/sglang-0.5.23)
#   SGLANG_STUBS       folder holding the torchvision stub (default $HIRADIX_BENCH_VENVS/stubs)
#   PYTHON             base interpreter                    (default python3)
#
# Idempotent: an existing venv is reused, and pip skips what is already installed.
# torch is always pinned to 2.13.0 (the CPU wheel on local disk), both directly and
# through a constraints file for every other install, so that nothing pulls a CUDA torch.
# sglang itself is installed with --no-deps; only its import-time dependencies are added.
set -euo pipefail

ROOT="${HIRADIX_BENCH_VENVS:-$(cd "$(dirname "$0")/.." && pwd)/.bench-venvs}"
V018="${SGLANG_018_VENV:-$ROOT/sglang-0.5.18}"
V023="${SGLANG_023_VENV:-$ROOT/sglang-0.5.23}"
STUBS="${SGLANG_STUBS:-$ROOT/stubs}"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"

mkdir -p "$ROOT" "$STUBS"
CONSTRAINTS="$ROOT/constraints-torch.txt"
echo "$TORCH_PIN" > "$CONSTRAINTS"

# Import names sglang's mem_cache modules need at import time -> pip names.
# Versions pinned in sglang's own metadata are applied automatically (see pin_from_metadata).
IMPORT_DEPS="numpy orjson psutil pybase64 requests triton packaging pillow fastapi tqdm
ipython pydantic aiohttp msgspec pyzmq transformers dill openai partial_json_parser
xgrammar sentencepiece compressed-tensors gguf"

# Import name -> pip name, for the fallback loop below.
declare -A PIPNAME=([PIL]=pillow [yaml]=pyyaml [google]=protobuf [zmq]=pyzmq
  [sklearn]=scikit-learn [cv2]=opencv-python-headless [attr]=attrs
  [dateutil]=python-dateutil [IPython]=ipython [compressed_tensors]=compressed-tensors)

write_torchvision_stub() {
  # The same import-only stub the tests use (tests/stubs/torchvision).
  mkdir -p "$STUBS"
  cp -r "$(dirname "$0")/../tests/stubs/torchvision" "$STUBS/"
}

# Print "name<spec>" for each name, taking the version spec from sglang's METADATA
# when sglang pins it (markers and extras dropped), else the bare name.
pin_from_metadata() {
  local venv="$1"; shift
  "$venv/bin/python" - "$@" <<'PYEOF'
import re, sys
from importlib.metadata import requires
reqs = {}
for r in requires("sglang") or []:
    if "extra ==" in r:
        continue
    r = r.split(";")[0].strip()
    m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", r)
    reqs[m.group(1).lower().replace("_", "-")] = m.group(3).strip()
for name in sys.argv[1:]:
    spec = reqs.get(name.lower().replace("_", "-"), "")
    print(name + spec)
PYEOF
}

# Modules the benchmark imports, per version.
check_imports() {
  local venv="$1" mods="$2"
  (cd /tmp && PYTHONPATH="$STUBS" "$venv/bin/python" -W ignore -c "import $mods" 2>&1) || return 1
}

# pip's noise on this kind of machine (extra local indexes that do not exist,
# and resolver complaints about sglang's deliberately missing dependencies).
PIP_NOISE="WARNING: Location .* is ignored|dependency resolver|requires .*which is not installed|^sglang .* requires|but you have"

# pip install, filtering the noise; the pipeline keeps pip's exit status.
pip_install() {
  local venv="$1"; shift
  "$venv/bin/python" -m pip --disable-pip-version-check install -q "$@" 2>&1 \
    | { grep -v -E "$PIP_NOISE" || true; }
}

setup_one() {
  local ver="$1" venv="$2" mods="$3"
  echo "== sglang $ver in $venv"
  if [ ! -x "$venv/bin/python" ]; then
    "$PY" -m venv "$venv"
  fi
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    pip_install "$venv" "$TORCH_PIN"
  fi
  if [ "$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('sglang'))" 2>/dev/null)" != "$ver" ]; then
    pip_install "$venv" --no-deps "sglang==$ver"
  fi
  # shellcheck disable=SC2086
  mapfile -t reqs < <(pin_from_metadata "$venv" $IMPORT_DEPS)
  pip_install "$venv" -c "$CONSTRAINTS" "${reqs[@]}"
  # A real torchvision wheel (pulled in by something) cannot load with CPU torch.
  "${pip[@]}" uninstall -q -y torchvision 2>/dev/null || true
  # Fallback: install whatever else the import chain still misses (new sglang versions).
  local i out m pkg
  for i in $(seq 1 30); do
    if out=$(check_imports "$venv" "$mods"); then break; fi
    m=$(echo "$out" | grep -o "No module named '[^']*'" | head -1 | sed "s/No module named '\([^'.]*\).*/\1/")
    if [ -z "$m" ] || [ "$m" = torch ] || [ "$m" = torchvision ]; then
      echo "$out" | tail -20; echo "setup failed for sglang $ver" >&2; return 1
    fi
    pkg="${PIPNAME[$m]:-$m}"
    pkg=$(pin_from_metadata "$venv" "$pkg")
    echo "   installing missing import dependency: $pkg"
    pip_install "$venv" -c "$CONSTRAINTS" "$pkg"
    "${pip[@]}" uninstall -q -y torchvision 2>/dev/null || true
  done
  check_imports "$venv" "$mods" >/dev/null || { echo "imports still fail for sglang $ver" >&2; return 1; }
  "$venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('   torch', torch.__version__)"
  echo "   ok: sglang $ver imports ($mods)"
}

write_torchvision_stub

WANT="${1:-all}"
MODS_018="sglang.srt.mem_cache.radix_cache, sglang.srt.mem_cache.hiradix_cache, sglang.srt.mem_cache.memory_pool, sglang.srt.mem_cache.memory_pool_host"
MODS_023="sglang.srt.mem_cache.unified_radix_cache, sglang.srt.mem_cache.rust_tree_core.adapter"
if [ "$WANT" = all ] || [ "$WANT" = 0.5.18 ]; then setup_one 0.5.18 "$V018" "$MODS_018"; fi
if [ "$WANT" = all ] || [ "$WANT" = 0.5.23 ]; then setup_one 0.5.23 "$V023" "$MODS_023"; fi

cat <<MSG

Done. Run the baselines with the venv's python and the stub on PYTHONPATH, one impl at a time:
  PYTHONPATH=$STUBS $V018/bin/python bench/sglang_baselines.py --impl radix   --page-size 1 --repeats 3 --json radix.json
  PYTHONPATH=$STUBS $V018/bin/python bench/sglang_baselines.py --impl hiradix --page-size 1 --repeats 3 --json hiradix.json
  PYTHONPATH=$STUBS $V023/bin/python bench/sglang_baselines.py --impl unified --page-size 1 --repeats 3 --json unified.json
MSG
