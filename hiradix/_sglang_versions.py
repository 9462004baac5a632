"""The SGLang versions :mod:`hiradix.sglang` supports, and the check of the installed one.

Outside :mod:`hiradix.sglang` on purpose (importing that package imports SGLang): the
plugin entry point (:mod:`hiradix._sglang_plugin`) checks the version before it imports
anything of SGLang's, and :mod:`hiradix.sglang` checks it first thing on import.
"""

from __future__ import annotations

from importlib import metadata

from hiradix import envvars

__all__ = ["SUPPORTED_VERSIONS", "TESTED_VERSIONS", "UnsupportedSGLang", "check_sglang_version"]

#: Versions whose scheduler, pools and ``register_radix_cache_backend`` the adapter is
#: written against (0.5.15 added the radix-cache registry; 0.5.18 is the last release whose
#: default hierarchical cache is its own HiRadixCache; 0.5.20 keeps 0.5.18's request calls
#: on a new request record; 0.5.23 has a new request API: :mod:`hiradix.sglang.api`).
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.5.15", "0.5.16", "0.5.17", "0.5.18", "0.5.20", "0.5.23")
#: Versions CI runs SGLang tests on (0.5.18 and 0.5.20: ``tests/sglang/v18``, see the README
#: for which of them run on 0.5.20; 0.5.23: ``tests/sglang/v23``).
TESTED_VERSIONS: tuple[str, ...] = ("0.5.18", "0.5.20", "0.5.23")

_OVERRIDE = "HIRADIX_SGLANG_ANY_VERSION"


class UnsupportedSGLang(ImportError):
    """SGLang is missing, or its version is not one :mod:`hiradix.sglang` supports."""


def check_sglang_version() -> str:
    """The installed SGLang's version; raises :class:`UnsupportedSGLang` naming the
    supported versions when SGLang is missing or another version (set
    ``HIRADIX_SGLANG_ANY_VERSION=1`` to try an unsupported one anyway)."""
    want = ", ".join(SUPPORTED_VERSIONS)
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise UnsupportedSGLang(
            f"hiradix.sglang needs SGLang ({want}); it is not installed: pip install 'sglang=={SUPPORTED_VERSIONS[-1]}'"
        ) from None
    base = version.split("+")[0]
    if base not in SUPPORTED_VERSIONS and not envvars.flag(_OVERRIDE):
        raise UnsupportedSGLang(
            f"hiradix.sglang supports SGLang {want} (tested: {', '.join(TESTED_VERSIONS)}); "
            f"SGLang {version} is installed. Set {_OVERRIDE}=1 to try it anyway."
        )
    return version
