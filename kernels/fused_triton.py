"""The small operations of a Llama-style layer as one Triton launch each (``fused_ref`` holds
their references, same signatures; issue 51):

* :func:`rms_norm_triton`: a program per row, the row in registers, in fp32 as the reference,
  rounded to the input's dtype before the weight (transformers' order): one launch where the
  reference takes eight (two casts, pow, mean, add, rsqrt, two multiplies);
* :func:`add_rms_norm_triton`: the residual's add and the next RMS norm in one launch (both
  outputs: the norm for the next projection, the sum for the residual after it);
* :func:`silu_mul_triton`: ``silu(gate) * up`` elementwise, rounded where the reference rounds:
  one launch for two;
* :func:`rope_triton`: the rotary embedding of the queries and the keys, a program per row of
  either, each product and the sum rounded as the reference's own launches round them (no
  fused multiply-add): one launch where the reference takes ten.

A row's numbers depend on that row alone, in any batch (issue 49)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .targets import launch


@triton.jit
def _normed(x, W, cols, ok, N, eps, XT: tl.constexpr, YT: tl.constexpr):
    """A row ``x`` (fp32, of an ``XT`` tensor) RMS-normed and weighed, rounded to ``YT``."""
    variance = tl.sum(x * x, axis=0) / N
    h = (x * tl.rsqrt(variance + eps)).to(XT)  # (rounded to the input's dtype, as the reference)
    w = tl.load(W + cols, mask=ok, other=0.0)
    return (w.to(tl.float32) * h.to(tl.float32)).to(YT)


@triton.jit(do_not_specialize=["eps"])
def _rms_norm_kernel(X, W, Y, sx, sy, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * sy + cols, _normed(x, W, cols, ok, N, eps, X.dtype.element_ty, Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["eps"])
def _add_rms_norm_kernel(X, R, W, Y, S, sx, sr, sy, ss, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(R + row * sr + cols, mask=ok, other=0.0).to(tl.float32)
    s = (r + x).to(S.dtype.element_ty)  # the residual's sum, rounded as torch's add rounds it
    tl.store(S + row * ss + cols, s, mask=ok)
    y = _normed(s.to(tl.float32), W, cols, ok, N, eps, S.dtype.element_ty, Y.dtype.element_ty)
    tl.store(Y + row * sy + cols, y, mask=ok)


def _row_tile(n: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` of a norm's program: the row of ``n`` in registers."""
    block = triton.next_power_of_2(n)
    return block, 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, empty=torch.empty) -> torch.Tensor:
    """:func:`fused_ref.rms_norm_ref` in one launch: ``x [..., n]`` (rows of unit stride),
    ``weight [n]``. ``empty(shape, dtype=, device=)`` makes the output (a caller's rows padded for
    the linear layer they feed)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block, warps = _row_tile(n)
    if rows.shape[0]:
        launch(
            _rms_norm_kernel,
            (rows.shape[0],),
            rows,
            weight,
            out,
            rows.stride(0),
            out.stride(0),
            n,
            eps,
            BLOCK=block,
            num_warps=warps,
        )
    return out.reshape(*x.shape[:-1], n)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, empty=torch.empty):
    """:func:`fused_ref.add_rms_norm_ref` in one launch: ``(rms_norm(residual + x), residual +
    x)`` of ``x, residual [..., n]`` (one shape and dtype; rows of unit stride); ``empty`` makes
    the normed output (:func:`rms_norm_triton`)."""
    n = x.shape[-1]
    rows, res = x.reshape(-1, n), residual.reshape(-1, n)
    rows, res = (t if t.stride(-1) == 1 else t.contiguous() for t in (rows, res))
    out = empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block, warps = _row_tile(n)
    if rows.shape[0]:
        launch(
            _add_rms_norm_kernel,
            (rows.shape[0],),
            rows,
            res,
            weight,
            out,
            total,
            rows.stride(0),
            res.stride(0),
            out.stride(0),
            total.stride(0),
            n,
            eps,
            BLOCK=block,
            num_warps=warps,
        )
    return out.reshape(*x.shape[:-1], n), total.reshape(x.shape)


@triton.jit
def _silu_mul_kernel(G, U, Y, n, sg, su, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(G + row * sg + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=ok, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(U.dtype.element_ty)  # silu, rounded as the reference's own launch
    tl.store(Y + row * n + cols, (s.to(tl.float32) * u.to(tl.float32)).to(Y.dtype.element_ty), mask=ok)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, empty=torch.empty) -> torch.Tensor:
    """:func:`fused_ref.silu_mul_ref` in one launch (``gate`` and ``up`` of one shape and dtype;
    rows of any stride, as the columns of a fused gate-and-up product are); ``empty`` makes the
    output (:func:`rms_norm_triton`)."""
    n = up.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)
    if g.stride(-1) != 1:
        g = g.contiguous()
    if u.stride(-1) != 1:
        u = u.contiguous()
    out = empty(u.shape, dtype=up.dtype, device=up.device)
    if out.numel():
        block = 1024
        launch(
            _silu_mul_kernel,
            (u.shape[0], triton.cdiv(n, block)),
            g,
            u,
            out,
            n,
            g.stride(0),
            u.stride(0),
            BLOCK=block,
            num_warps=4,
        )
    return out.reshape(up.shape)


@triton.jit
def _rope_kernel(
    Q, K, C, S, QO, KO, H, T, sqb, sqh, sqt, skb, skh, skt, scb, sct, sob, soh, sot, skob, skoh, skot, D: tl.constexpr
):
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = bt // T
    t = bt % T
    cols = tl.arange(0, D)
    half: tl.constexpr = D // 2
    other = (cols + half) % D  # the channel each one's rotation takes
    sign = tl.where(cols < half, -1.0, 1.0)
    if h < H:
        src = Q + b * sqb + h * sqh + t * sqt
        dst = QO + b * sob + h * soh + t * sot
    else:
        src = K + b * skb + (h - H) * skh + t * skt
        dst = KO + b * skob + (h - H) * skoh + t * skot
    x = tl.load(src + cols)
    xr = tl.load(src + other).to(tl.float32) * sign
    c = tl.load(C + b * scb + t * sct + cols).to(tl.float32)
    s = tl.load(S + b * scb + t * sct + cols).to(tl.float32)
    dt = x.dtype
    a = (x.to(tl.float32) * c).to(dt)  # q * cos, rounded as its own launch rounds it
    r = (xr * s).to(dt)  # rotate_half(q) * sin
    tl.store(dst + cols, (a.to(tl.float32) + r.to(tl.float32)).to(dt))


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """:func:`fused_ref.rope_ref` in one launch: ``q [B, H, T, d]``, ``k [B, H_kv, T, d]`` (any
    strides, unit along ``d``; ``d`` a power of two), ``cos, sin [B, T, d]`` (one layout)."""
    B, H, T, d = q.shape
    Hk = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos = cos.expand(B, T, d)
    sin = sin.expand(B, T, d)
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    qo, ko = (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )
    if B * T:
        launch(
            _rope_kernel,
            (B * T, H + Hk),
            q,
            k,
            cos,
            sin,
            qo,
            ko,
            H,
            T,
            *q.stride()[:3],
            *k.stride()[:3],
            *cos.stride()[:2],
            *qo.stride()[:3],
            *ko.stride()[:3],
            D=d,
            num_warps=1 if d <= 128 else 2,
            enable_fp_fusion=False,
        )
    return qo, ko
