"""KV memory: the paged slot allocator, the device (L1) and host (L2) KV pools, and the
copy engine between them."""

from hiradix.memory.allocator import PagedSlotAllocator
from hiradix.memory.copy import (
    CopyEngine,
    CopyError,
    CopyHandle,
    CudaCopyEngine,
    LoadHandle,
    ThreadCopyEngine,
    make_copy_engine,
)
from hiradix.memory.pools import (
    HOST_LAYOUTS,
    PAGE_ORDERS,
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    KVShape,
    MHAShape,
    MLAShape,
    PageOrder,
    fp8_dtypes,
    read_meminfo,
)

__all__ = [
    "HOST_LAYOUTS",
    "PAGE_ORDERS",
    "CopyEngine",
    "CopyError",
    "CopyHandle",
    "CudaCopyEngine",
    "DeviceKVPool",
    "HostKVPool",
    "HostLayout",
    "KVShape",
    "LoadHandle",
    "MHAShape",
    "MLAShape",
    "PageOrder",
    "PagedSlotAllocator",
    "ThreadCopyEngine",
    "fp8_dtypes",
    "make_copy_engine",
    "read_meminfo",
]
