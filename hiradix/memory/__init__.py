"""KV memory: the paged slot allocator and the device (L1) and host (L2) KV pools."""

from hiradix.memory.allocator import PagedSlotAllocator
from hiradix.memory.pools import (
    HOST_LAYOUTS,
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    KVShape,
    MHAShape,
    MLAShape,
    fp8_dtypes,
    read_meminfo,
)

__all__ = [
    "HOST_LAYOUTS",
    "DeviceKVPool",
    "HostKVPool",
    "HostLayout",
    "KVShape",
    "MHAShape",
    "MLAShape",
    "PagedSlotAllocator",
    "fp8_dtypes",
    "read_meminfo",
]
