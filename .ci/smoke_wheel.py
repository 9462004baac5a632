"""Smoke test of an installed hiradix wheel, run by .ci/wheel (and cibuildwheel's test step)
with the wheel's venv, from a folder outside the checkout:

1. ``import hiradix`` resolves to the installed package, not a source tree;
2. the compiled core serves: every compiled module of ``hiradix._native.TWINS`` loads,
   except the libibverbs binding where the host has no libibverbs (the wheel does not
   bundle it) and nothing else is allowed to be missing; and each was built as intended
   (``hiradix._native.build_problems``: the Cython pyproject.toml pins, ``-O3``);
3. SGLang would find the plugin: the ``sglang.srt.plugins`` entry point ``hiradix`` is
   discovered and loads ``hiradix._sglang_plugin.register`` (SGLang itself is not needed);
4. the CUDA copy kernel ``libhiradix_kvcopy.so`` is in the wheel (the wheels are built with
   ``HIRADIX_CUDA=1``), with no CUDA library bundled beside it; it loads with no GPU and no
   driver (``library_abi()`` is the ABI ``hiradix.memory.kernel`` expects) without opening
   the driver (libcuda), and ``cuda_kernel_available()`` answers False without raising
   where torch sees no CUDA device;
5. ``hiradix sim`` runs on the bundled trace excerpt and prints its report.

Exits non-zero, saying which check failed.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path
from typing import NoReturn


def fail(message: str) -> NoReturn:
    print(f"smoke_wheel: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def main() -> None:
    import hiradix
    from hiradix._native import TWINS, load, pure_python
    from hiradix.tree import HiRadixTree

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(hiradix.__file__).resolve()
    if site not in where.parents:
        fail(f"hiradix was imported from {where}, not from the installed wheel under {site}")
    if pure_python():
        fail("HIRADIX_PUREPYTHON is set: the smoke test checks the compiled modules")
    for twin in TWINS:
        module = load(twin.compiled)
        if module is not None:
            continue
        if twin.compiled == "hiradix.transport._verbs" and ctypes.util.find_library("ibverbs") is None:
            print(f"smoke_wheel: {twin.compiled} not loaded: this host has no libibverbs (expected)")
            continue
        fail(f"{twin.compiled} did not load from the wheel; its twin would serve")
    check_build([t.compiled for t in TWINS if load(t.compiled) is not None])
    if HiRadixTree.__module__ != "hiradix.tree._core":
        fail(f"hiradix.tree.HiRadixTree is {HiRadixTree.__module__}.HiRadixTree, not the compiled core")
    print(f"smoke_wheel: hiradix {metadata.version('hiradix')} from {where.parent}, compiled core in use")

    plugins = [ep for ep in metadata.entry_points(group="sglang.srt.plugins") if ep.name == "hiradix"]
    if len(plugins) != 1:
        fail(f"SGLang's plugin group sglang.srt.plugins has {len(plugins)} entry points named hiradix, not 1")
    register = plugins[0].load()
    if not callable(register) or register.__module__ != "hiradix._sglang_plugin":
        fail(f"the hiradix plugin entry point loads {register!r}, not hiradix._sglang_plugin.register")
    print(f"smoke_wheel: SGLang plugin entry point found: {plugins[0].value}")

    check_kernel()

    exe = shutil.which("hiradix", path=str(Path(sys.executable).parent))
    if exe is None:
        fail(f"the hiradix command is not installed beside {sys.executable}")
    env = {k: v for k, v in os.environ.items() if k != "HIRADIX_TRACE"}
    run = subprocess.run(
        [exe, "sim", "--limit", "200"], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    if run.returncode != 0:
        fail(f"hiradix sim exited {run.returncode}:\n{run.stdout}\n{run.stderr}")
    if "bundled excerpt" not in run.stderr or "conversation_excerpt.jsonl" not in run.stdout:
        fail(f"hiradix sim did not say it read the bundled excerpt:\n{run.stdout}\n{run.stderr}")
    print("smoke_wheel: hiradix sim on the bundled excerpt:")
    print("\n".join("    " + line for line in run.stdout.splitlines()[:12]))
    print("smoke_wheel: OK")


def check_build(modules: list[str]) -> None:
    from hiradix._native import build_info, build_problems, pinned_cython

    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    info = build_info()
    if info is None:
        fail("the wheel has no hiradix/_build.json: how its compiled modules were built is unknown")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    cython = pinned_cython(tomllib.loads(pyproject.read_text())["build-system"]["requires"])
    problems = build_problems(info, cython, modules)
    if problems:
        fail("the wheel's compiled modules were not built as intended: " + "; ".join(problems))
    print(f"smoke_wheel: {len(modules)} compiled modules built as intended: Cython {cython}, -O3")


def _driver_mapped() -> bool:
    """Whether the NVIDIA driver's user-space library is loaded in this process."""
    maps = Path("/proc/self/maps")
    return maps.exists() and "/libcuda.so" in maps.read_text()


def check_kernel() -> None:
    import torch

    from hiradix.memory import kernel

    files = [str(f) for f in metadata.files("hiradix") or []]
    if f"hiradix/memory/{kernel.LIBRARY.name}" not in files:
        fail(f"the wheel has no hiradix/memory/{kernel.LIBRARY.name}: the CUDA kernel was not built into it")
    bundled = [f for f in files if "libcuda" in Path(f).name]
    if bundled:
        fail(f"the wheel bundles CUDA libraries {bundled}: the kernel must link the CUDA runtime statically")
    driver_before = _driver_mapped()
    try:
        abi = kernel.library_abi()
    except kernel.KernelError as exc:
        fail(f"{kernel.LIBRARY} is in the wheel but does not load: {exc}")
    if abi != kernel.ABI:
        fail(f"{kernel.LIBRARY.name} has ABI {abi}, hiradix.memory.kernel expects {kernel.ABI}")
    if not driver_before and _driver_mapped():
        fail(f"loading {kernel.LIBRARY.name} opened the NVIDIA driver: loading must do no CUDA work")
    try:
        available = kernel.cuda_kernel_available()
    except Exception as exc:  # any exception is the failure this check is for
        fail(f"cuda_kernel_available() raised {exc!r}")
    if not torch.cuda.is_available() and available:
        fail("cuda_kernel_available() is True where torch sees no CUDA device")
    where = "a CUDA device" if torch.cuda.is_available() else "no CUDA device"
    print(f"smoke_wheel: {kernel.LIBRARY.name} in the wheel, ABI {abi}; {where}: cuda_kernel_available() {available}")


if __name__ == "__main__":
    main()
