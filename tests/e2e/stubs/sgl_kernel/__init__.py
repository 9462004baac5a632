"""A stand-in for ``sgl_kernel`` on a CPU machine, for the real-server tests only.

SGLang's CPU mode (``SGLANG_USE_CPU_ENGINE=1``) imports two kernels from ``sgl_kernel`` at
module level, and no CPU build of ``sgl_kernel`` is on PyPI: this module implements those
two in torch, with the semantics of SGLang's own Triton kernels of the same names
(``assign_req_to_token_pool`` and ``copy_all_layer_kv_cache``). Everything else the model
runs takes SGLang's ``forward_native`` paths. Only ``tests/e2e`` puts this folder on a
server's ``PYTHONPATH``; nothing else imports it.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+hiradix.e2e.stub"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` takes the next
    ``end_offset[i] - start_offset[i]`` slots of ``out_cache_loc``, request by request in
    batch order (``out_cache_loc`` is the batch's new slots, concatenated)."""
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        if n <= 0:
            continue
        if end > max_context_len:
            raise IndexError(f"request row {row}: slots [{start}, {end}) past the row's {max_context_len}")
        req_to_token[row, start:end] = out_cache_loc[at : at + n].to(req_to_token.dtype)
        at += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every KV buffer ``b`` (its base address ``data_ptrs[b]``, ``strides[b]`` bytes a
    slot), copy slot ``src_loc[i]`` to slot ``tgt_loc[i]``: all sources are read before
    any target is written, as the kernel reads a tile before it stores it."""
    src = src_loc.tolist()
    tgt = tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)


def _unused(name: str):
    """A name SGLang's CPU mode imports at module level for a path the e2e servers never
    take (speculative decoding, quantized or fused CPU kernels): importable, and an error
    naming it if a test ever reaches it."""

    def kernel(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"sgl_kernel.{name} is not in the CPU stand-in (tests/e2e/stubs)")

    kernel.__name__ = name
    return kernel


# Every other ``*_cpu`` name SGLang 0.5.18, 0.5.20 and 0.5.23 import from sgl_kernel, and
# the activation / int8 kernels their CPU layers import.
for _name in (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "sgl_build_tree_kernel_efficient_cpu",
    "sgl_verify_tree_greedy_cpu",
    "verify_tree_greedy_cpu",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "silu_and_mul",
    "int8_scaled_mm",
):
    globals()[_name] = _unused(_name)
del _name
