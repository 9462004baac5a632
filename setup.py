"""Build script: the Cython extensions, with directives set once for the project.

Environment switches:
- ``HIRADIX_PUREPYTHON=1``: build no extension; ``hiradix`` falls back to ``_reference``.
- ``HIRADIX_CYTHON_DEBUG=1``: bounds checks, initialized checks and line tracing on.
- ``HIRADIX_ANNOTATE=1``: write Cython's annotated HTML next to the sources.
"""

import os

from setuptools import Extension, setup

# (module, sources). Every extension is built with the same directives and flags.
EXTENSIONS: list[tuple[str, list[str]]] = [
    ("hiradix._core", ["hiradix/_core.pyx"]),
    ("hiradix.memory._gather", ["hiradix/memory/_gather.pyx"]),
    ("hiradix.peer._verify", ["hiradix/peer/_verify.pyx"]),
    ("hiradix.peer._hash", ["hiradix/peer/_hash.pyx"]),
    ("hiradix.transport._tcpio", ["hiradix/transport/_tcpio.pyx"]),
]


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
    exts = [
        Extension(
            name,
            sources,
            include_dirs=[numpy.get_include(), "hiradix"],
            define_macros=macros,
            extra_compile_args=["-O0", "-g"] if debug else ["-O3"],
        )
        for name, sources in EXTENSIONS
    ]
    return cythonize(exts, compiler_directives=directives, annotate=_flag("HIRADIX_ANNOTATE"))


setup(ext_modules=extensions())
