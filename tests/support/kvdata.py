"""KV contents that can be checked after any number of tier moves.

The KV of a token depends on its whole prefix, so the test data does too: token ``i`` of
a sequence gets the *prefix seed* ``h_i = (h_{i-1} * P + t_i + 1) mod M``. Every element
of every layer and component of that token is then a function of ``(h_i, layer,
component, element)``, written through an integer view of the pool's buffers so that the
check is bitwise (bf16, fp16 and fp8 included) and independent of float rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hiradix.memory import DeviceKVPool

_M = (1 << 61) - 1
_P = 1_000_003
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def prefix_seeds(tokens: Any) -> np.ndarray:
    """``h_i`` for every token (int64). ``O(n)``."""
    out = np.empty(len(tokens), dtype=np.int64)
    h = 0
    for i, t in enumerate(np.asarray(tokens, dtype=np.int64).tolist()):
        h = (h * _P + t + 1) % _M
        out[i] = h
    return out


def _pattern(seeds: np.ndarray, layer: int, comp: int, elems: int, itemsize: int) -> torch.Tensor:
    s = torch.from_numpy(np.asarray(seeds, dtype=np.int64))
    e = torch.arange(elems, dtype=torch.int64)
    v = (s[:, None] * 2654435761 + e[None, :] * 40503 + layer * 977 + comp * 131) & ((1 << (8 * itemsize - 2)) - 1)
    return v.to(_INT_VIEW[itemsize])


def _views(pool: DeviceKVPool, layer: int) -> list[torch.Tensor]:
    return [b.view(_INT_VIEW[pool.itemsize]).reshape(b.shape[0], -1) for b in pool.layer_buffers(layer)]


def fill(pool: DeviceKVPool, slots: Any, seeds: np.ndarray) -> None:
    """Write the KV of tokens with ``seeds`` into device ``slots`` (all layers)."""
    idx = torch.as_tensor(np.asarray(slots), dtype=torch.int64)
    if len(idx) != len(seeds):
        raise ValueError(f"{len(idx)} slots for {len(seeds)} seeds")
    if not len(idx):
        return
    for layer in range(pool.layer_num):
        for comp, view in enumerate(_views(pool, layer)):
            view[idx] = _pattern(seeds, layer, comp, view.shape[1], pool.itemsize)


def mismatches(pool: DeviceKVPool, slots: Any, seeds: np.ndarray, layers: Any = None) -> int:
    """Tokens whose KV in ``slots`` differs from the data for ``seeds`` (0: all good)."""
    idx = torch.as_tensor(np.asarray(slots), dtype=torch.int64)
    if len(idx) != len(seeds):
        raise ValueError(f"{len(idx)} slots for {len(seeds)} seeds")
    if not len(idx):
        return 0
    bad = torch.zeros(len(idx), dtype=torch.bool)
    for layer in range(pool.layer_num) if layers is None else layers:
        for comp, view in enumerate(_views(pool, layer)):
            bad |= (view[idx] != _pattern(seeds, layer, comp, view.shape[1], pool.itemsize)).any(dim=1)
    return int(bad.sum())


def scribble(pool: DeviceKVPool, slots: Any) -> None:
    """Overwrite ``slots`` with a pattern no seed produces (a freed slot being reused)."""
    idx = torch.as_tensor(np.asarray(slots), dtype=torch.int64)
    for layer in range(pool.layer_num):
        for view in _views(pool, layer):
            view[idx] = -1
