"""Import-only stub of torchvision (for hiradix's tests; bench/setup_sglang.sh copies it).

The PyPI torchvision wheel cannot load against the CPU build of torch, but
sglang imports it at module import time (e.g. ``from torchvision.io import
decode_jpeg``).  The radix-tree benchmarks never call into it, so every
``torchvision.*`` submodule resolves to a stub whose attributes are
placeholders that raise if actually called.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Placeholder:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision stub: {self._name} is not available")

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


def __getattr__(item):
    if item.startswith("__"):
        raise AttributeError(item)
    return _Placeholder(f"torchvision.{item}")
