"""L3 storage: the backend interface (SGLang's ``HiCacheStorage`` calls), namespaced page
keys, a registry with dynamic loading, and the built-in backends.

============ ==================================================================
``memory``   :class:`MemoryStorage`: in-process dict with an LRU byte bound
``file``     :class:`FileStorage`: append-only segment files of checksummed
             records, optional lz4, LRU byte bound, index rebuilt on restart
``peer``     ``hiradix.peer.store.PeerCacheStore``: the peer cache (imported on use)
``mooncake`` ``hiradix.storage.mooncake.MooncakeStorage``: Mooncake Store, zero copy
             against the host pool (imported on use; needs the Mooncake wheel)
============ ==================================================================
"""

from hiradix.storage.base import (
    Capabilities,
    StorageBackend,
    StorageConfig,
    StorageError,
    StorageExtraInfo,
    StorageStats,
)
from hiradix.storage.file import FileStorage
from hiradix.storage.keys import KeyNamespace, page_byte_order, page_keys, sglang_key_suffix, storage_keys
from hiradix.storage.memory import MemoryStorage
from hiradix.storage.registry import (
    StorageConfigError,
    backend_names,
    create_backend,
    load_backend_class,
    parse_extra_config,
    register_backend,
)

HiCacheStorage = StorageBackend  # SGLang's name for the interface

__all__ = [
    "Capabilities",
    "FileStorage",
    "HiCacheStorage",
    "KeyNamespace",
    "MemoryStorage",
    "StorageBackend",
    "StorageConfig",
    "StorageConfigError",
    "StorageError",
    "StorageExtraInfo",
    "StorageStats",
    "backend_names",
    "create_backend",
    "load_backend_class",
    "page_byte_order",
    "page_keys",
    "parse_extra_config",
    "register_backend",
    "sglang_key_suffix",
    "storage_keys",
]
