"""Typed stub of the compiled row copy (:mod:`hiradix.memory._gather`)."""

from typing import Any

NOGIL_MIN_BYTES: int
PARALLEL_MIN_BYTES: int
MAX_THREADS: int

def copy_rows(
    dst: Any,
    dst_offsets: Any,
    dst_base: int,
    src: Any,
    src_offsets: Any,
    src_base: int,
    row_bytes: int,
    align: int = ...,
    threads: int = ...,
) -> int: ...
def slot_offsets(slots: Any, limit: int, page_size: int, page_stride: int, slot_stride: int, name: str) -> Any: ...
def is_sorted(slots: Any) -> bool: ...
def copy_runs(
    dst: Any,
    dst_offsets: Any,
    dst_base: int,
    src: Any,
    src_offsets: Any,
    src_base: int,
    run_bytes: Any,
    align: int = ...,
    threads: int = ...,
) -> int: ...
def pair_runs(
    dev: Any,
    host: Any,
    dev_limit: int,
    host_limit: int,
    host_page_size: int,
    components: tuple[tuple[int, int, int, int, int], ...],
) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]: ...
