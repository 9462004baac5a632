"""hiradix: a multi-tier (GPU / host / storage) radix KV cache for LLM serving.

The layers are folders: :mod:`hiradix.tree` (the radix tree, compiled and its pure-Python
twin), :mod:`hiradix.memory`, :mod:`hiradix.storage`, :mod:`hiradix.peer`,
:mod:`hiradix.transport`, :mod:`hiradix.sglang` and :mod:`hiradix.sim`.

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
