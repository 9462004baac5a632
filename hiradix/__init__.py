"""hiradix: a multi-tier (GPU / host / storage) radix KV cache for LLM serving.

The layers are folders: :mod:`hiradix.tree` (the radix tree, compiled, and its pure-Python
twin), :mod:`hiradix.cache` (the cache over it: controller, L3 pipeline, rank agreement),
:mod:`hiradix.memory` (KV pools and copies), :mod:`hiradix.storage` (L3 backends),
:mod:`hiradix.net` (authenticated connections and the RPC), :mod:`hiradix.transport`,
:mod:`hiradix.peer` (the peer cache), :mod:`hiradix.sglang` (the adapter) and
:mod:`hiradix.sim` (the simulator). Every compiled module and its twin: ``hiradix._native``.

The tree comes from the compiled core :mod:`hiradix.tree._core` unless
``HIRADIX_PUREPYTHON=1`` is set or the extension was not built, in which case the
pure-Python twin :mod:`hiradix.tree._reference` (same API) is used.
``hiradix.IMPLEMENTATION`` says which.
"""

from __future__ import annotations

# The tree layer's public names are the package's (hiradix.tree.__all__ lists them).
from hiradix.tree import *  # noqa: F403
from hiradix.tree import __all__ as __all__

__version__ = "0.1.0"
