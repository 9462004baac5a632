"""Page-aligned slot allocator with batched frees.

SGLang's ``PagedTokenToKVPoolAllocator.free`` concatenates its whole free list with the
freed pages on every call (``torch.cat((self.free_pages, free_page_indices))``), so a
burst of ``k`` frees over a free list of ``F`` pages costs ``O(k * F)``. Here a free only
validates its pages, flips their bits in an allocation bitmap and appends the page ids to
a pending list; the pending list is merged into the free list once, by the first
``alloc`` that needs more pages than the free list holds. Freeing is therefore
``O(pages freed)`` and merging is amortized over the frees that fed it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["PagedSlotAllocator"]


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """The distinct values of int64 ``a``, ascending, as a new array: a sort and a mask
    (``np.unique`` measured 10-15x slower on a host eviction's few thousand slots).
    ``O(k log k)``."""
    s = np.sort(a)
    if len(s) > 1:
        keep = np.empty(len(s), dtype=bool)
        keep[0] = True
        np.not_equal(s[1:], s[:-1], out=keep[1:])
        s = s[keep]
    return s


class PagedSlotAllocator:
    """Hands out KV slot indices a whole page at a time.

    Slot ``s`` belongs to page ``s // page_size``. ``alloc`` returns the slots of whole
    pages, so every allocation is page aligned.

    Parameters
    ----------
    size:
        Usable slots. Rounded down to a multiple of ``page_size``.
    page_size:
        Slots per page (``>= 1``).
    device:
        Torch device of the returned indices and of the allocator's state. On CUDA the
        double-free check reads the bitmap back, i.e. one host sync per ``free``.
    reserve_first_page:
        When true (the default, as SGLang's device allocator), page 0 (slots
        ``0 .. page_size - 1``) is never handed out: it is the padding page that
        attention kernels may write to for padded tokens. Usable pages are then
        ``1 .. size // page_size`` and :attr:`total_slots` is ``size + page_size``, the
        number of slots the backing KV buffers must have. Host pools pass ``False``: their
        slots are ``0 .. size - 1``.

    >>> a = PagedSlotAllocator(8, 4)
    >>> a.alloc(4).tolist()
    [4, 5, 6, 7]
    >>> a.available_size()
    4
    """

    def __init__(
        self, size: int, page_size: int, device: str | torch.device = "cpu", reserve_first_page: bool = True
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.page_size = int(page_size)
        self.num_pages = int(size) // self.page_size
        self.size = self.num_pages * self.page_size
        self.device = torch.device(device)
        self.reserve_first_page = bool(reserve_first_page)
        self._first_page = 1 if self.reserve_first_page else 0
        self.total_slots = (self.num_pages + self._first_page) * self.page_size
        self._page_offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        self._page_offsets_np = np.arange(self.page_size, dtype=np.int64)
        self.clear()

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        """Free every page at once.

        Runtime complexity: ``O(num_pages)``.
        """
        n_all = self.num_pages + self._first_page
        # One bool per page, including the reserved one (never set).
        self._allocated = torch.zeros(n_all, dtype=torch.bool, device=self.device)
        self._pending: list[Any] = []
        self._pending_pages = 0
        # On the CPU the state is numpy (the bitmap a view of the tensor's memory): a host
        # pool's alloc and free run on the scheduler thread for every write-through and
        # host eviction, where each small torch operation costs microseconds of dispatch
        # and numpy's a fraction of that.
        self._allocated_np = self._allocated.numpy() if self.device.type == "cpu" else None
        # The free list is the pages never handed out, ``_fresh_lo .. _fresh_hi - 1`` (a
        # range, kept as two numbers: a fresh pool is not an array of millions of pages
        # read from memory on every allocation), followed by ``_free_pages``, the pages
        # freed since, in the order their frees were merged.
        self._fresh_lo, self._fresh_hi = self._first_page, n_all
        self._free_pages: Any = self._arange(0, 0)

    def _arange(self, lo: int, hi: int) -> Any:
        if self._allocated_np is not None:
            return np.arange(lo, hi, dtype=np.int64)
        return torch.arange(lo, hi, dtype=torch.int64, device=self.device)

    def free_pages(self) -> Any:
        """Every free page, in the order they will be handed out (frees not yet merged
        last). A new int64 array (a tensor on a non-CPU device). ``O(free pages)``."""
        fresh = self._arange(self._fresh_lo, self._fresh_hi)
        if self._allocated_np is not None:
            return np.concatenate([fresh, self._free_pages, *self._pending])
        return torch.cat([fresh, self._free_pages, *self._pending])

    def available_size(self) -> int:
        """Free slots, counting frees not yet merged.

        Runtime complexity: ``O(1)``.
        """
        fresh = self._fresh_hi - self._fresh_lo
        return (fresh + len(self._free_pages) + self._pending_pages) * self.page_size

    def _merge_pending(self) -> None:
        # Once per burst of frees, not once per free: the point of batching.
        if self._pending:
            if self._allocated_np is not None:
                self._free_pages = np.concatenate([self._free_pages, *self._pending])
            else:
                self._free_pages = torch.cat([self._free_pages, *self._pending])
            self._pending = []
            self._pending_pages = 0

    # ------------------------------------------------------------------ alloc / free
    def alloc(self, n_tokens: int) -> torch.Tensor | None:
        """Slot indices for ``n_tokens`` tokens, or ``None`` if too few pages are free.

        ``n_tokens`` must be a multiple of ``page_size`` (as SGLang's paged allocator
        asserts): the caller decides how to round, since rounding here would hand out
        slots it does not know about. On ``None`` nothing changes.

        Runtime complexity: ``O(n_tokens)``, plus ``O(free pages)`` when pending frees
        are merged.
        """
        if self._allocated_np is not None:
            slots = self.alloc_array(n_tokens)
            return None if slots is None else torch.from_numpy(slots)
        pages = self._take(n_tokens)
        if pages is None:
            return None
        self._allocated[pages] = True
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def alloc_array(self, n_tokens: int) -> np.ndarray | None:
        """:meth:`alloc` as an int64 numpy array, for an allocator on the CPU (a host
        pool's): the write-through path takes one per scheduler step and slices it, and
        numpy views cost a fraction of torch's. ``O(n_tokens)``."""
        if self._allocated_np is None:
            raise ValueError(f"alloc_array: the allocator is on {self.device}, not the CPU")
        lo = self._fresh_lo
        pages = self._take(n_tokens)
        if pages is None:
            return None
        n = len(pages)
        if self._fresh_lo - lo == n:  # all from the never-used range: consecutive pages
            self._allocated_np[lo : lo + n] = True
            if self.page_size == 1:
                return pages  # made by _take, aliased by nothing
            return np.arange(lo * self.page_size, (lo + n) * self.page_size, dtype=np.int64)
        else:
            self._allocated_np[pages] = True
            if self.page_size == 1:
                return pages.copy()  # a copy: the free list must not be aliased
        return np.add.outer(pages * self.page_size, self._page_offsets_np).reshape(-1)

    def _take(self, n_tokens: Any) -> Any:
        """The first ``n_tokens / page_size`` free pages, off the free list (merging
        pending frees if needed); ``None``, changing nothing, if too few are free."""
        n_tokens = int(n_tokens)
        if n_tokens < 0 or n_tokens % self.page_size:
            raise ValueError(f"n_tokens must be a non-negative multiple of page_size={self.page_size}, got {n_tokens}")
        n_pages = n_tokens // self.page_size
        lo, hi = self._fresh_lo, self._fresh_hi
        if n_pages <= hi - lo:  # the never-used range first, as it heads the free list
            self._fresh_lo = lo + n_pages
            return self._arange(lo, lo + n_pages)
        need = n_pages - (hi - lo)
        if need > len(self._free_pages):
            if need > len(self._free_pages) + self._pending_pages:
                return None
            self._merge_pending()
        taken = self._free_pages[:need]
        self._free_pages = self._free_pages[need:]
        self._fresh_lo = hi
        if lo == hi:
            return taken
        fresh = self._arange(lo, hi)
        return np.concatenate([fresh, taken]) if self._allocated_np is not None else torch.cat([fresh, taken])

    def free(self, indices: Any) -> None:
        """Return the pages holding ``indices`` (any slot of a page frees the page).

        Raises ``ValueError``, changing nothing, when an index is out of range, lies on
        the reserved padding page, or lies on a page that is not allocated (double free).

        Runtime complexity: ``O(k log k)`` for ``k`` indices (the page dedup); the pages
        are merged into the free list later, by an ``alloc`` that needs them.
        """
        bitmap = self._allocated_np
        idx: Any = self._as_array(indices) if bitmap is not None else self._as_indices(indices)
        if len(idx) == 0:
            return
        lo, hi = int(idx.min()), int(idx.max())
        first_slot = self._first_page * self.page_size
        if lo < first_slot or hi >= self.total_slots:
            raise ValueError(f"slot index out of range: min {lo}, max {hi}, valid [{first_slot}, {self.total_slots})")
        pages: Any
        if bitmap is not None:
            pages = _sorted_unique(idx // self.page_size if self.page_size > 1 else idx)
            state: Any = bitmap[pages]
        else:
            pages = torch.unique(idx // self.page_size)
            state = self._allocated[pages]
        if not bool(state.all()):
            bad = pages[~state][:8].tolist()
            raise ValueError(f"double free: pages {bad} are not allocated (page_size={self.page_size})")
        if bitmap is not None:
            bitmap[pages] = False
        else:
            self._allocated[pages] = False
        self._pending.append(pages)
        self._pending_pages += len(pages)

    @property
    def pending_frees(self) -> int:
        """Pages freed but not yet merged into the free list (an ``alloc`` that needs them
        merges them all at once). ``O(1)``."""
        return self._pending_pages

    def allocated_pages(self) -> list[int]:
        """Every allocated page, ascending. ``O(num_pages)``."""
        return [int(p) for p in np.flatnonzero(self._allocated.cpu().numpy())]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless the allocator's state is consistent: the free
        pages (the never-used range, the merged free list and the pending frees) are
        distinct usable pages, none of them allocated; every other usable page is
        allocated; the reserved padding page is neither; the counters agree.
        ``O(num_pages)``: for tests and debugging."""
        n_all = self.num_pages + self._first_page
        allocated = self._allocated.cpu().numpy()
        assert allocated.shape == (n_all,), f"bitmap of {allocated.shape} pages, expected {n_all}"
        assert self._first_page <= self._fresh_lo <= self._fresh_hi == n_all, (
            f"never-used range [{self._fresh_lo}, {self._fresh_hi}) outside [{self._first_page}, {n_all})"
        )
        assert self._pending_pages == sum(len(p) for p in self._pending), "pending-page counter is off"
        pages = self.free_pages()
        free = pages.cpu().numpy() if isinstance(pages, torch.Tensor) else pages
        assert len(np.unique(free)) == len(free), "a page is on the free list twice"
        assert not len(free) or (free.min() >= self._first_page and free.max() < n_all), "a free page out of range"
        assert not allocated[free].any(), f"free pages marked allocated: {free[allocated[free]][:8].tolist()}"
        if self._first_page:
            assert not allocated[0], "the reserved padding page is marked allocated"
        assert int(allocated.sum()) + len(free) == self.num_pages, (
            f"{int(allocated.sum())} allocated + {len(free)} free pages != {self.num_pages}"
        )
        assert self.available_size() == len(free) * self.page_size, "available_size disagrees with the free pages"

    def is_allocated(self, indices: Any) -> torch.Tensor:
        """Per index, whether its page is allocated (bool tensor). ``O(k)``."""
        idx = self._as_indices(indices)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.total_slots):
            raise ValueError(f"slot index out of range [0, {self.total_slots})")
        return self._allocated[idx // self.page_size]

    def _as_indices(self, indices: Any) -> torch.Tensor:
        if isinstance(indices, torch.Tensor):
            if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
                raise TypeError(f"indices must be integers, got dtype {indices.dtype}")
            idx = indices.to(device=self.device, dtype=torch.int64)
        else:
            idx = torch.as_tensor(indices, device=self.device)
            if idx.numel() and (idx.dtype.is_floating_point or idx.dtype == torch.bool):
                raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
            idx = idx.to(torch.int64)
        if idx.ndim != 1:
            if idx.numel() == 0:
                return idx.reshape(0)
            raise ValueError(f"indices must be 1-D, got shape {tuple(idx.shape)}")
        return idx

    def _as_array(self, indices: Any) -> np.ndarray:
        """``indices`` as a 1-D int64 numpy array (a view where it can be), with
        :meth:`_as_indices`'s checks: the CPU allocator's input."""
        if type(indices) is np.ndarray and indices.dtype == np.int64 and indices.ndim == 1:
            return indices
        return self._as_indices(indices).numpy()

    def __repr__(self) -> str:
        return (
            f"PagedSlotAllocator(size={self.size}, page_size={self.page_size}, "
            f"available={self.available_size()}, device={self.device})"
        )
