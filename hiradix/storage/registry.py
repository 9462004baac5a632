"""Storage backends by name, and dynamic loading of third-party ones.

``create_backend("file", config)`` builds a registered backend. The name ``"dynamic"``
loads a class from a module instead, the way SGLang's ``--hicache-storage-backend
dynamic`` does: the extra config (a JSON object given as a string or a file path, as
``--hicache-storage-backend-extra-config``) names ``module_path`` and ``class_name``, and
the rest of it reaches the backend as ``config.extra_config``.

>>> from hiradix.storage import StorageConfig
>>> b = create_backend("memory", StorageConfig(extra_config={"capacity_bytes": 1 << 20}))
>>> b.name, b.capacity_bytes
('memory', 1048576)
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from hiradix.storage.base import StorageBackend, StorageConfig

__all__ = [
    "BackendFactory",
    "StorageConfigError",
    "backend_names",
    "create_backend",
    "import_class",
    "load_backend_class",
    "parse_extra_config",
    "register_backend",
]

BackendFactory = Callable[..., StorageBackend]
_REGISTRY: dict[str, BackendFactory] = {}
_LOCK = threading.Lock()


class StorageConfigError(ValueError):
    """A backend name, extra config or dynamic backend that cannot be used."""


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Register ``factory(config, **kwargs) -> StorageBackend`` under ``name`` (a
    :class:`StorageBackend` subclass is such a factory). Registering a taken name raises
    unless ``replace``. ``O(1)``."""
    if not isinstance(name, str) or not name or name == "dynamic":
        raise StorageConfigError(f"backend name must be a non-empty str other than 'dynamic', got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    with _LOCK:
        if name in _REGISTRY and not replace:
            raise StorageConfigError(f"storage backend {name!r} is already registered (pass replace=True)")
        _REGISTRY[name] = factory


def backend_names() -> list[str]:
    """Registered names, sorted, plus ``"dynamic"``."""
    with _LOCK:
        return sorted(_REGISTRY) + ["dynamic"]


def parse_extra_config(source: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """A backend extra config from a JSON object string, the path of a JSON file
    (optionally written ``@path``), a mapping, or ``None`` (empty).
    ``StorageConfigError`` says what is wrong otherwise. ``O(size of the JSON)``.

    >>> parse_extra_config('{"path": "/tmp/x"}')
    {'path': '/tmp/x'}
    """
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, str | os.PathLike):
        raise StorageConfigError(
            f"extra config must be a JSON string, a path or a mapping, got {type(source).__name__}"
        )
    text = os.fspath(source)
    where = "extra config JSON"
    if not text.lstrip().startswith("{"):
        path = text[1:] if text.startswith("@") else text
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise StorageConfigError(
                f"extra config {path!r} is neither a JSON object nor a readable file: {exc}"
            ) from exc
        where = f"extra config file {path!r}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StorageConfigError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise StorageConfigError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def load_backend_class(module_path: str, class_name: str) -> type[StorageBackend]:
    """Import ``module_path`` and return its ``class_name``, which must be a
    :class:`StorageBackend` subclass. ``StorageConfigError`` on each way this can fail."""
    cls = import_class(module_path, class_name)
    if not isinstance(cls, type) or not issubclass(cls, StorageBackend):
        raise StorageConfigError(f"{module_path}.{class_name} is not a subclass of hiradix.storage.StorageBackend")
    return cls


def import_class(module_path: str, class_name: str) -> Any:
    """Import ``module_path`` and return its attribute ``class_name`` (any kind: the
    caller checks it). ``StorageConfigError`` when either is not a non-empty string, the
    import fails or the name is missing."""
    if not isinstance(module_path, str) or not module_path:
        raise StorageConfigError(f"dynamic backend needs a 'module_path' string, got {module_path!r}")
    if not isinstance(class_name, str) or not class_name:
        raise StorageConfigError(f"dynamic backend needs a 'class_name' string, got {class_name!r}")
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise StorageConfigError(f"cannot import storage backend module {module_path!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise StorageConfigError(f"module {module_path!r} has no class {class_name!r}")
    return cls


def create_backend(
    name: str,
    config: StorageConfig | None = None,
    *,
    extra_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    mem_pool_host: Any = None,
    **kwargs: Any,
) -> StorageBackend:
    """Build the backend registered as ``name`` (or ``"dynamic"``, module docstring).

    ``extra_config`` (JSON string, file path or mapping) is merged over
    ``config.extra_config``; ``kwargs`` go to the factory; ``mem_pool_host``, if given,
    is registered on the new backend.
    """
    config = config if config is not None else StorageConfig()
    if not isinstance(config, StorageConfig):
        raise TypeError(f"config must be a StorageConfig, got {type(config).__name__}")
    if extra_config is not None:
        config = replace(config, extra_config={**config.extra_config, **parse_extra_config(extra_config)})
    if name == "dynamic":
        extra = dict(config.extra_config)
        cls = load_backend_class(extra.pop("module_path", None), extra.pop("class_name", None))
        extra.pop("backend_name", None)
        backend = cls(replace(config, extra_config=extra), **kwargs)
    else:
        with _LOCK:
            factory = _REGISTRY.get(name)
        if factory is None:
            raise StorageConfigError(f"unknown storage backend {name!r}; known: {', '.join(backend_names())}")
        backend = factory(config, **kwargs)
        if not isinstance(backend, StorageBackend):
            raise StorageConfigError(f"factory of {name!r} returned {type(backend).__name__}, not a StorageBackend")
    if mem_pool_host is not None:
        backend.register_mem_pool_host(mem_pool_host)
    return backend


# The built-in backends, by where they live, each imported on its first use (the peer cache
# pulls in msgpack, the transports and metrics; the Mooncake wheel is imported only when a
# backend is built, with a StorageError saying how to install it when it is missing). Named,
# not imported: the peer cache is a layer above storage (tests/repo/test_layers.py).
_BUILTINS: dict[str, tuple[str, str]] = {
    "memory": ("hiradix.storage.memory", "MemoryStorage"),
    "file": ("hiradix.storage.file", "FileStorage"),
    "peer": ("hiradix.peer.store", "PeerCacheStore"),
    "mooncake": ("hiradix.storage.mooncake", "MooncakeStorage"),
}


def _builtin(module_path: str, class_name: str) -> BackendFactory:
    def build(config: StorageConfig, **kwargs: Any) -> StorageBackend:
        return load_backend_class(module_path, class_name)(config, **kwargs)

    build.__qualname__ = build.__name__ = f"{class_name} ({module_path})"
    return build


def _register_builtins() -> None:
    for name, (module_path, class_name) in _BUILTINS.items():
        register_backend(name, _builtin(module_path, class_name), replace=True)


_register_builtins()
