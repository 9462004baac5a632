"""SGLang's own KV pool on a GPU machine that cannot install SGLang.

The lent GPU machines have no package registry, and SGLang's wheel pulls in a web server,
a tokenizer service and compiled kernels that cannot travel there. The layer-wait
benchmark needs one thing of it: ``sglang.srt.mem_cache.memory_pool``, whose
``get_key_buffer`` / ``get_value_buffer`` wait on the registered layer counter. So this
module puts SGLang's *source* (a tarball carried beside the tree, see ``bench/gpu/README.md``)
on ``sys.path`` and lets the imports of that module's dependency chain succeed for the
third-party packages the machine lacks (``orjson``, ``zmq``, ``pydantic``, ``sgl_kernel``,
...): each missing top-level package becomes an inert placeholder module, listed in
:data:`PLACEHOLDERS`. Nothing SGLang's KV pool runs on its read path comes from them: the
buffers are torch tensors, the wait is SGLang's own code calling hiradix's counter, and the
benchmark checks the bytes read. A placeholder that is *called* (other than as a
decorator, which keeps the function it decorates) returns another placeholder and is
recorded in :data:`CALLED`, which the benchmark prints, so nothing is used unseen.

Never imported by the package or its tests; only by ``bench/layer_wait_gpu.py`` and
``bench/sglang_kernels.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import tarfile
import types
from pathlib import Path
from typing import Any

__all__ = ["CALLED", "MAY_BE_MISSING", "PLACEHOLDERS", "load_memory_pool", "load_sglang_module"]

#: The packages SGLang 0.5.23's ``memory_pool`` imports (directly or through its chain) that
#: a GPU machine's image may lack; any other missing import is an error as usual (optional
#: imports inside ``try`` keep failing as their authors meant).
MAY_BE_MISSING = frozenset(
    {"gguf", "starlette", "fastapi", "uvicorn", "IPython", "sgl_kernel", "flashinfer", "setproctitle"}
    | {"partial_json_parser", "outlines", "xgrammar", "interegular", "compressed_tensors", "torchao", "decord"}
    | {"soundfile", "openai", "anthropic"}
)

#: Top-level packages that were missing and became placeholders, in import order.
PLACEHOLDERS: list[str] = []


#: Placeholders that were called (not as decorators), by qualified name, in call order.
CALLED: list[str] = []


class _Inert(type):
    """Metaclass of the placeholder classes: attribute access yields more placeholders,
    so ``from x.y import Z`` and ``class A(x.B)`` work at import time."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder_class(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # A decorator applied bare (``@x.jit``) or with arguments (``@x.jit(...)``) keeps
        # the function it decorates, so SGLang's own code stays SGLang's own code.
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        if not args:  # a decorator factory, or a constructor without arguments
            return _Decorator(cls.__qualname__)
        CALLED.append(cls.__qualname__)
        return _placeholder_class(f"{cls.__qualname__}()")

    def __iter__(cls) -> Any:
        return iter(())

    def __bool__(cls) -> bool:
        return False

    def __or__(cls, other: Any) -> Any:  # ``x.A | None`` in annotations evaluated eagerly
        return cls

    __ror__ = __or__

    def __getitem__(cls, item: Any) -> Any:  # ``x.Generic[T]``
        return cls

    def __mro_entries__(cls, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _Decorator:
    """What ``x.f()`` gives: applied to a function it returns the function; used any other
    way, it is a placeholder whose use is recorded."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        CALLED.append(f"{self._qualname}()")
        return _placeholder_class(f"{self._qualname}()()")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        CALLED.append(f"{self._qualname}()")
        return _placeholder_class(f"{self._qualname}().{name}")


def _placeholder_class(qualname: str) -> type:
    return _Inert(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": "placeholder"})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder_class(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: only what no real finder found reaches it."""

    def __init__(self, allowed: set[str]) -> None:
        self._allowed = allowed

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.split(".", 1)[0]
        if top not in self._allowed:
            return None
        if top not in PLACEHOLDERS:
            PLACEHOLDERS.append(top)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _PlaceholderModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _unpack(source: Path, dest: Path) -> Path:
    """SGLang's source tree: ``source`` itself if it is a folder holding ``sglang/``, else the
    tarball unpacked under ``dest`` (once)."""
    if source.is_dir():
        return source
    root = dest / source.name.removesuffix(".tar.gz")
    if not (root / "sglang").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(source) as tar:
            tar.extractall(root, filter="data")
    return root


def load_memory_pool(source: str | Path, *, dest: str | Path = "/tmp/sglang-src") -> types.ModuleType:
    """Import ``sglang.srt.mem_cache.memory_pool`` from SGLang's source at ``source`` (a
    folder or a ``.tar.gz`` of one holding ``sglang/``), with placeholders for the missing
    third-party packages of :data:`MAY_BE_MISSING`. An SGLang that is installed already is
    used as it is."""
    return load_sglang_module(source, "sglang.srt.mem_cache.memory_pool", dest=dest)


def load_sglang_module(source: str | Path, name: str, *, dest: str | Path = "/tmp/sglang-src") -> types.ModuleType:
    """Import the module ``name`` of SGLang from its source at ``source``, as
    :func:`load_memory_pool` does (``bench/sglang_kernels.py`` imports SGLang's JIT HiCache
    kernels, ``sglang.kernels.ops.kvcache.hicache``, this way; that chain needs no
    placeholder beyond :data:`MAY_BE_MISSING`). Calling it again, for the same or another
    module, reuses the source already on ``sys.path``."""
    if importlib.util.find_spec("sglang") is None:
        root = _unpack(Path(source), Path(dest))
        sys.path.insert(0, str(root))
        sys.meta_path.append(_Finder(set(MAY_BE_MISSING)))
    return importlib.import_module(name)


if __name__ == "__main__":  # a dry run: python bench/gpu/sglang_src.py PATH
    mp = load_memory_pool(sys.argv[1])
    print("memory_pool from", mp.__file__, "placeholders:", ", ".join(PLACEHOLDERS) or "none")
    print("placeholders called:", ", ".join(CALLED) or "none")
