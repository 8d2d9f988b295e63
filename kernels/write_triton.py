"""Keys and values into a block pool in one launch (``write_ref`` holds the reference, same
signature; issue 51 item 2).

A decode step writes every layer's new keys and values into the pool. In torch that is two
indexed copies a layer, and with an fp8 cache ~34 launches (the rotation, the groups' largest
magnitudes, the scales, the division, the cast: for K and for V, then four indexed copies). Here
a program takes one token's K and V rows, of every KV head (fp8: of 16 heads, one product shape
for every write), rotated by ``(16, d) x (d, d / G)`` fp32 products, one per scale group (IEEE,
not TF32), scaled and rounded as the reference rounds (a correctly rounded division, the scale
the smallest bf16 at or above its bound), stored with their scales.
A token's numbers depend on that token alone, in any batch (issue 49)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .targets import launch
from .write_ref import SHRINK


@triton.jit
def _store_quantized(X, ST, SS, R, row, srow, h_ok, big, shrink, D: tl.constexpr, G: tl.constexpr):
    """The rows ``X (BLOCK_H, D)`` (fp32) rotated by ``R [D, D]``, a group of ``D / G`` columns at a
    time (one ``(BLOCK_H, D) x (D, D / G)`` product each: a group's scale needs only its own
    columns), scaled and rounded to fp8 (``write_ref.quantize_ref``), stored at ``ST + row`` with
    their bf16 scales at ``SS + srow``."""
    W: tl.constexpr = D // G
    dd = tl.arange(0, D)
    cc = tl.arange(0, W)
    for g in range(G):
        r = tl.load(R + dd[:, None] * D + (g * W + cc)[None, :])  # (D, W) fp32
        xr = tl.dot(X, r, input_precision="ieee")  # (BLOCK_H, W)
        bound = tl.maximum(tl.max(tl.abs(xr), axis=1) * shrink, 1e-30)  # (BLOCK_H,)
        nearest = bound.to(tl.bfloat16)
        up = (nearest.to(tl.float32) < bound).to(tl.int16)
        scale = (nearest.to(tl.int16, bitcast=True) + up).to(tl.bfloat16, bitcast=True)  # ceil to bf16
        y = tl.div_rn(xr, tl.broadcast_to(scale.to(tl.float32)[:, None], xr.shape))
        y = tl.minimum(tl.maximum(y, -big), big)
        tl.store(ST + row + (g * W + cc)[None, :], y.to(ST.dtype.element_ty), mask=h_ok)
        tl.store(SS + srow + g, scale[:, None], mask=h_ok)


@triton.jit(do_not_specialize=["H"])
def _write_kernel(
    K,
    V,
    KST,
    VST,
    KSS,
    VSS,
    R,
    SLOTS,
    skn,
    skh,
    svn,
    svh,
    stb,
    sth,
    stp,
    ssb,
    ssh,
    ssp,
    H,
    big,
    shrink,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    G: tl.constexpr,
    FP8: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + i).to(tl.int64)
    blk = slot // PAGE
    off = slot % PAGE
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (fp8: heads in tiles of 16, one product shape)
    dd = tl.arange(0, D)
    h_ok = (hh < H)[:, None]
    k = tl.load(K + i * skn + hh[:, None] * skh + dd[None, :], mask=h_ok, other=0.0)  # (BLOCK_H, D)
    v = tl.load(V + i * svn + hh[:, None] * svh + dd[None, :], mask=h_ok, other=0.0)
    row = blk * stb + hh.to(tl.int64)[:, None] * sth + off * stp  # (BLOCK_H, 1): the slot's row
    if FP8:
        srow = blk * ssb + hh.to(tl.int64)[:, None] * ssh + off * ssp  # (BLOCK_H, 1): its scales
        _store_quantized(k.to(tl.float32), KST, KSS, R, row, srow, h_ok, big, shrink, D, G)
        _store_quantized(v.to(tl.float32), VST, VSS, R, row, srow, h_ok, big, shrink, D, G)
    else:
        tl.store(KST + row + dd[None, :], k.to(KST.dtype.element_ty), mask=h_ok)
        tl.store(VST + row + dd[None, :], v.to(VST.dtype.element_ty), mask=h_ok)


def quantizable(d: int, groups: int, rotation) -> bool:
    """Whether the kernel rounds rows of ``d`` channels in ``groups`` scale groups: powers of
    two, groups of at least 16 channels (a product's smallest width), a ``[d, d]`` rotation."""
    return (
        d >= 16
        and d & (d - 1) == 0
        and groups & (groups - 1) == 0
        and d // groups >= 16
        and rotation is not None
        and tuple(rotation.shape) == (d, d)
    )


def writable(k_store, k, ks_store=None, rotation=None, v_store=None, v=None, vs_store=None) -> bool:
    """Whether :func:`write_kv_triton` takes this write: a power-of-two head dim (fp8:
    :func:`quantizable`), rows and stores of unit stride along ``d`` (and the groups), the same
    layout for K's and V's stores."""
    d = k.shape[-1]
    if d & (d - 1) or d < 16 or k_store.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    if v is not None and v.stride(-1) != 1 or v_store is not None and v_store.stride() != k_store.stride():
        return False
    if ks_store is None:
        return True
    return (
        quantizable(d, ks_store.shape[-1], rotation)
        and ks_store.stride(-1) == 1
        and (vs_store is None or vs_store.stride() == ks_store.stride())
    )


def quantize_triton(x: torch.Tensor, rotation: torch.Tensor, dtype: torch.dtype, groups: int):
    """:func:`write_ref.quantize_ref` by the write's own kernel: ``x [..., d]`` -> ``(x8 [..., d],
    scale [..., groups] bf16)``, the bits :func:`write_kv_triton` stores for the same rows (its
    rows in tiles of 16 through the same compiled kernel; a row's numbers are its own). A
    prefill attends its fresh keys as stored (``pool.as_stored``): on a GPU, these."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    n = rows.shape[0]
    tiles = -(-n // 16)
    pad = torch.zeros(tiles * 16, d, dtype=x.dtype, device=x.device)
    pad[:n] = rows
    pad = pad.view(tiles, 16, d)
    x8 = torch.empty(tiles, 16, 1, d, dtype=dtype, device=x.device)
    scale = torch.empty(tiles, 16, 1, groups, dtype=torch.bfloat16, device=x.device)
    slots = torch.arange(tiles, device=x.device)
    write_kv_triton(x8, x8, slots, pad, pad, scale, scale, rotation)  # (K and V alike: written twice)
    return x8.view(-1, d)[:n].reshape(x.shape), scale.view(-1, groups)[:n].reshape(*x.shape[:-1], groups)


def write_kv_triton(k_store, v_store, slots, k, v, ks_store=None, vs_store=None, rotation=None) -> None:
    """:func:`write_ref.write_kv_ref` in one launch (where :func:`writable`)."""
    n, H, d = k.shape
    if n == 0:
        return
    assert k_store.stride() == v_store.stride() and k.stride(-1) == 1 and v.stride(-1) == 1
    slots = slots.contiguous()
    fp8 = ks_store is not None
    if fp8:
        assert ks_store.stride() == vs_store.stride() and rotation.dtype == torch.float32
        r = rotation.contiguous()
        big = torch.finfo(k_store.dtype).max
        scales = (ks_store, vs_store, ks_store.stride(0), ks_store.stride(1), ks_store.stride(2))
    else:
        r, big = k_store, 0.0  # (unused)
        scales = (k_store, v_store, 0, 0, 0)
    block_h = 16 if fp8 else triton.next_power_of_2(H)  # fp8: every write's products (BLOCK_H, d) x (d, d / G)
    launch(
        _write_kernel,
        (n, triton.cdiv(H, block_h)),
        k,
        v,
        k_store,
        v_store,
        scales[0],
        scales[1],
        r,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_store.stride(0),
        k_store.stride(1),
        k_store.stride(2),
        *scales[2:],
        H,
        float(big),
        SHRINK / big if fp8 else 0.0,
        PAGE=k_store.shape[2],
        D=d,
        BLOCK_H=block_h,
        G=ks_store.shape[-1] if fp8 else 1,
        FP8=fp8,
        num_warps=4 if fp8 or H * d >= 2048 else 1,
    )
