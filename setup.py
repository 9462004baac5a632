"""Build script: the Cython extensions, with directives set once for the project.

Environment switches:
- ``HIRADIX_PUREPYTHON=1``: build no extension; ``hiradix`` falls back to ``_reference``.
- ``HIRADIX_CYTHON_DEBUG=1``: bounds checks, initialized checks and line tracing on.
- ``HIRADIX_ANNOTATE=1``: write Cython's annotated HTML next to the sources.
- ``HIRADIX_CUDA=0``: do not build the CUDA copy kernel even where ``nvcc`` is found;
  ``HIRADIX_CUDA=1``: fail the build if it cannot be built (the wheels CI and cibuildwheel
  make). Unset: build it when ``nvcc`` is found, skip it quietly otherwise. ``nvcc`` is
  ``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``) where that variable is set, else the one on the
  ``PATH``, else ``/usr/local/cuda/bin/nvcc``: the toolkit found decides which NVIDIA driver
  the library needs (docs/install.md).
- ``HIRADIX_CUDA_ARCHS``: the GPU architectures to compile for (default ``80;90;100``,
  plus PTX of the last for newer GPUs).
- ``HIRADIX_VERBS=0``: do not build the libibverbs binding (``hiradix.transport._verbs``)
  even where ``infiniband/verbs.h`` is found; ``HIRADIX_VERBS=1``: fail the build if the
  header is missing. Unset: build it when the header is found (Debian: ``libibverbs-dev``),
  skip it quietly otherwise; the RDMA transport then reports why it is unavailable.
"""

import json
import os
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# (module, sources). Every extension is built with the same directives and flags.
EXTENSIONS: list[tuple[str, list[str]]] = [
    ("hiradix.tree._core", ["hiradix/tree/_core.pyx"]),
    ("hiradix.tree._unified", ["hiradix/tree/_unified.pyx"]),
    ("hiradix.memory._gather", ["hiradix/memory/_gather.pyx"]),
    ("hiradix.memory._kvcopy_emu", ["hiradix/memory/_kvcopy_emu.pyx"]),
    ("hiradix.peer._verify", ["hiradix/peer/_verify.pyx"]),
    ("hiradix.peer._hash", ["hiradix/peer/_hash.pyx"]),
    ("hiradix.transport._tcpio", ["hiradix/transport/_tcpio.pyx"]),
    ("hiradix.sglang._match", ["hiradix/sglang/_match.pyx"]),
    ("hiradix.sglang._insert", ["hiradix/sglang/_insert.pyx"]),
]


# The libibverbs binding, built only where the verbs headers are installed.
VERBS_EXTENSION = ("hiradix.transport._verbs", ["hiradix/transport/_verbs.pyx"])
VERBS_HEADER = "infiniband/verbs.h"


def _verbs_header() -> bool:
    """Whether ``infiniband/verbs.h`` is on the compiler's usual include path."""
    dirs = ["/usr/include", "/usr/local/include", *os.environ.get("CPATH", "").split(os.pathsep)]
    return any(d and Path(d, VERBS_HEADER).exists() for d in dirs)


def _want_verbs() -> bool:
    wanted = os.environ.get("HIRADIX_VERBS", "")
    if wanted == "0":
        return False
    found = _verbs_header()
    if wanted and not found:
        raise RuntimeError(f"HIRADIX_VERBS=1 but {VERBS_HEADER} was not found (apt-get install libibverbs-dev)")
    return found


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def extensions() -> list:
    if _flag("HIRADIX_PUREPYTHON"):
        return []
    import numpy
    from Cython.Build import cythonize

    debug = _flag("HIRADIX_CYTHON_DEBUG")
    directives = {
        "language_level": 3,
        "boundscheck": debug,
        "wraparound": False,
        "initializedcheck": debug,
        "cdivision": True,
        "embedsignature": True,
        "freethreading_compatible": True,
        "linetrace": debug,
    }
    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    if debug:
        macros.append(("CYTHON_TRACE_NOGIL", "1"))
    wanted = EXTENSIONS + ([VERBS_EXTENSION] if _want_verbs() else [])
    exts = [
        Extension(
            name,
            sources,
            include_dirs=[numpy.get_include(), "hiradix", "hiradix/memory"],
            define_macros=macros,
            extra_compile_args=["-O0", "-g"] if debug else ["-O3"],
            libraries=["ibverbs"] if name == VERBS_EXTENSION[0] else [],
        )
        for name, sources in wanted
    ]
    return cythonize(exts, compiler_directives=directives, annotate=_flag("HIRADIX_ANNOTATE"))


# The CUDA copy kernel: a plain shared library (C ABI, CUDA runtime linked statically)
# that hiradix.memory.kernel loads with ctypes, so it depends on no torch version.
CUDA_SOURCE = "hiradix/memory/_kvcopy_cuda.cu"
CUDA_LIBRARY = "libhiradix_kvcopy.so"


def _nvcc() -> str | None:
    """The toolkit named by ``$CUDA_HOME`` (or ``$CUDA_PATH``) first, as torch's extension
    builder does, so that a build can pick its toolkit where several are installed."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for found in (Path(home, "bin", "nvcc") if home else None, shutil.which("nvcc"), Path("/usr/local/cuda/bin/nvcc")):
        if found and Path(found).exists():
            return str(found)
    return None


# What a build was made with, written beside the compiled modules (``hiradix/_build.json``,
# in the wheel too): the Cython that generated each module's C and the compiler command it
# was compiled with. ``hiradix._native.build_problems`` compares it with what is intended
# (pyproject.toml's pinned Cython, ``-O3``); tests/repo/test_build.py and the wheel's smoke
# test run that check, so an install path that builds differently fails CI.
BUILD_INFO = "_build.json"
_GENERATED_BY = re.compile(rb"Generated by Cython (\S+)")


def _cython_of(source: str) -> str | None:
    """The Cython version named in the header of a generated C file."""
    try:
        with open(source, "rb") as f:
            found = _GENERATED_BY.search(f.read(400))
    except OSError:
        return None
    return found.group(1).decode() if found else None


class BuildExt(build_ext):
    """Cython extensions, then the CUDA kernel library where CUDA is present."""

    def build_extension(self, ext: Extension) -> None:
        # The compile command's flags, in the order the compiler reads them: the compiler
        # and Python's flags (with $CFLAGS), then the extension's own.
        self._built[ext.name] = {
            "cython": next((v for v in map(_cython_of, ext.sources) if v), None),
            "command": [*self.compiler.compiler_so, *(ext.extra_compile_args or [])],
        }
        super().build_extension(ext)

    def _write_build_info(self) -> None:
        if not self._built:
            return
        import numpy

        info = {
            "python": platform.python_version(),
            "numpy": numpy.__version__,
            "debug": _flag("HIRADIX_CYTHON_DEBUG"),
            "extensions": self._built,
        }
        path = Path(self.get_ext_fullpath("hiradix._native")).parent / BUILD_INFO
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")

    def run(self) -> None:
        self._built: dict[str, dict] = {}
        super().run()
        self._write_build_info()
        wanted = os.environ.get("HIRADIX_CUDA", "")
        if wanted == "0" or _flag("HIRADIX_PUREPYTHON"):
            return
        nvcc = _nvcc()
        if nvcc is None:
            if wanted:
                raise RuntimeError("HIRADIX_CUDA=1 but nvcc was not found (PATH, $CUDA_HOME/bin)")
            return
        out_dir = Path("hiradix/memory") if self.inplace else Path(self.build_lib, "hiradix/memory")
        out_dir.mkdir(parents=True, exist_ok=True)
        archs = [a for a in os.environ.get("HIRADIX_CUDA_ARCHS", "80;90;100").split(";") if a]
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        # -cudart=static (nvcc's default, spelled out): the runtime is linked in, with its
        # symbols hidden, so the library needs no libcudart at run time and loads without a
        # GPU or a driver; the driver (libcuda) is opened only by the first CUDA call.
        cmd = [nvcc, "-O3", "-shared", "-cudart=static", "-Xcompiler", "-fPIC", "-std=c++17", "-Ihiradix/memory",
               *gencode, "-o", str(out_dir / CUDA_LIBRARY), CUDA_SOURCE]
        print(" ".join(cmd))
        start = time.monotonic()
        try:
            version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
            release = [line for line in version.splitlines() if "release" in line] or version.splitlines()[-1:]
            print(f"nvcc: {nvcc}: {' '.join(release).strip()}")
            subprocess.run(cmd, check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            if wanted:
                raise
            print(f"warning: the CUDA copy kernel was not built ({exc}); the torch copy path serves")
            return
        print(f"nvcc: built {out_dir / CUDA_LIBRARY} in {time.monotonic() - start:.1f} s")


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
