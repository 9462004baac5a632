"""Smoke test of an installed hiradix wheel, run by .ci/wheel (and cibuildwheel's test step)
with the wheel's venv, from a folder outside the checkout:

1. ``import hiradix`` resolves to the installed package, not a source tree;
2. the compiled core serves: every compiled module of ``hiradix._native.TWINS`` loads,
   except the libibverbs binding where the host has no libibverbs (the wheel does not
   bundle it) and nothing else is allowed to be missing;
3. SGLang would find the plugin: the ``sglang.srt.plugins`` entry point ``hiradix`` is
   discovered and loads ``hiradix._sglang_plugin.register`` (SGLang itself is not needed);
4. ``hiradix sim`` runs on the bundled trace excerpt and prints its report.

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


def fail(message: str) -> None:
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


if __name__ == "__main__":
    main()
