"""Keys and values into a block pool (``engine/pool.py``'s layout), as torch writes them: the
reference of ``write_triton`` (same signature; issue 51 item 2).

A pool's layer is ``[blocks, H_kv, page, d]``; a token's flat slot is ``block * page + offset``.
A plain store casts each row to its dtype. An fp8 store (docs/architecture.md §11) holds each row
rotated (``x R``, ``R`` orthogonal ``[d, d]`` fp32), in ``G`` groups of ``d / G`` channels with
one bfloat16 scale each: the smallest bf16 at or above ``amax / max`` (shrunk by ``SHRINK``), so a
group's largest element lands within one bf16 step below the format's largest value and rounds
onto it. Quantizing what the cache holds gives back the same rows and scales (a prefill attends
its own keys as stored, then stores them)."""

from __future__ import annotations

import torch

# keeps the rotation's fp32 round-off (~1e-7) from pushing a scale one step up
SHRINK = 1 - 2**-12


def ceil_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 >= ``x`` (positive, finite)."""
    y = x.to(torch.bfloat16)
    below = (y.float() < x).to(torch.int16)
    return (y.view(torch.int16) + below).view(torch.bfloat16)  # the next bf16 up: one step of its bits


def quantize_ref(x: torch.Tensor, rotation: torch.Tensor, dtype: torch.dtype, groups: int):
    """``x [..., d]`` -> ``(x8 [..., d] dtype, scale [..., groups] bf16)`` of ``x R``."""
    big = torch.finfo(dtype).max
    xr = (x.float() @ rotation).unflatten(-1, (groups, -1))  # [..., G, d / G]
    scale = ceil_bf16((xr.abs().amax(dim=-1) * (SHRINK / big)).clamp(min=1e-30))
    x8 = (xr / scale.float()[..., None]).clamp(-big, big).to(dtype)
    return x8.flatten(-2), scale


def write_kv_ref(k_store, v_store, slots, k, v, ks_store=None, vs_store=None, rotation=None) -> None:
    """``k, v [n, H_kv, d]`` of ``n`` tokens into ``k_store, v_store [blocks, H_kv, page, d]``
    at flat ``slots [n]``: cast to the stores' dtype, or, with ``ks_store, vs_store [blocks,
    H_kv, page, G]`` (bf16) and ``rotation [d, d]``, rounded to fp8 with their scales."""
    page = k_store.shape[2]
    b, o = slots // page, slots % page
    if ks_store is None:
        k_store[b, :, o] = k.to(k_store.dtype)
        v_store[b, :, o] = v.to(v_store.dtype)
        return
    groups = ks_store.shape[-1]
    k8, ks = quantize_ref(k, rotation, k_store.dtype, groups)
    v8, vs = quantize_ref(v, rotation, v_store.dtype, groups)
    k_store[b, :, o], ks_store[b, :, o] = k8, ks
    v_store[b, :, o], vs_store[b, :, o] = v8, vs
