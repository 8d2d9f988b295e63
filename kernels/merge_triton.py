"""Fused kernels around the merges (the device side of ``treeattn_cli.parallel.merge``).

Per layer the allreduce scheme needs: the partial's lse (already written by the partial
kernel's epilogue) for the MAX; then ``packed = [o·w, w]`` with ``w = exp(lse - m)`` for the SUM;
then ``o = Σo·w / Σw`` in the model's dtype, written straight into the layer's output layout.
Two launches replace the chain of elementwise ops (exp, mul, cat, div, cast, transpose).
Oracles with the same meaning: ``merge.weigh`` and ``merge.unweigh``.

The allgather scheme (one collective: what a step that is not captured in a CUDA graph uses,
``comm.Comm.eager_scheme``) gathers every rank's packed ``[o, lse]`` and merges them where it
stands: one launch, :func:`merge_gathered_fused` (oracle: ``merge.merge_partials``).

A decode step's two partials on a rank (the documents' rows and the tail's) merge in one launch
too, :func:`merge_pair_fused` (oracle: ``merge.merge_pair``), where torch takes ~16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import partial_triton
from .partial_triton import REDUCE_BLOCK_S, _reduce_splits
from .targets import launch, target_of


@triton.jit
def _merge_two(oa, la, ob, lb):
    """Two partials of disjoint keys (``o`` fp32 rows, their lse) as one: ``(o, lse)``."""
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)  # (a row empty on both sides: weights 0, not NaN)
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    den = wa + wb
    return (oa * wa + ob * wb) / tl.where(den > 0, den, 1.0), m + tl.log(den)


@triton.jit
def _merge_pair_kernel(OA, LA, OB, LB, O, L, sa, sb, sla, slb, so, H, T, D: tl.constexpr, BLOCK_D: tl.constexpr):
    # sa, sb, so: (b, h, t) strides of the o's (unit stride along d); sla, slb: of the lse's
    r = tl.program_id(0).to(tl.int64)  # one (b, h, t) row
    b, h, t = r // (H * T), r // T % H, r % T
    dd = tl.arange(0, BLOCK_D)
    ok = dd < D
    la = tl.load(LA + b * sla[0] + h * sla[1] + t * sla[2]).to(tl.float32)
    lb = tl.load(LB + b * slb[0] + h * slb[1] + t * slb[2]).to(tl.float32)
    oa = tl.load(OA + b * sa[0] + h * sa[1] + t * sa[2] + dd, mask=ok, other=0.0).to(tl.float32)
    ob = tl.load(OB + b * sb[0] + h * sb[1] + t * sb[2] + dd, mask=ok, other=0.0).to(tl.float32)
    o, lse = _merge_two(oa, la, ob, lb)
    tl.store(O + b * so[0] + h * so[1] + t * so[2] + dd, o.to(O.dtype.element_ty), mask=ok)
    tl.store(L + r, lse)


@triton.jit
def _split_row(r, h, t, H, B, Q, S, step, cb, cq):
    """Where the splits of merge row ``(r, h, t)`` start in a call's ``Partials`` (in splits):
    its ``(b, q)`` by ``b = r·cb``, ``q = r·cq + t``, in slice ``q // step`` of ``[B, H, q_i, S]``."""
    b = r * cb
    q = r * cq + t
    i = q // step
    qn = tl.minimum(step, Q - i * step)  # the slice's rows
    return i * (B * H * step * S) + ((b * H + h) * qn + (q - i * step)) * S


_SIDE = ("B", "Q", "S", "step", "cb", "cq")
_SIDES = [f"{x}_a" for x in _SIDE] + [f"{x}_b" for x in _SIDE]


@triton.jit(do_not_specialize=["sor", "soh", "sot", "H", "T"] + _SIDES)
def _reduce_pair_kernel(
    OA,
    LA,
    OB,
    LB,
    O,
    L,
    RT,
    sor,
    soh,
    sot,
    H,
    T,
    B_a,
    Q_a,
    S_a,
    step_a,
    cb_a,
    cq_a,
    B_b,
    Q_b,
    S_b,
    step_b,
    cb_b,
    cq_b,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # *_a, *_b: each call's Partials (B, Q, S, step, rows); so*: (r, h, t) strides of the output;
    # BLOCK_C > 0: the merged row turned by RT [D, D] fp32 (o @ RT), BLOCK_C output channels at a
    # time. Runtime integers are not specialized: one kernel for every batch, length and split count
    r = tl.program_id(0).to(tl.int64)  # one (r, h, t) row
    b, h, t = r // (H * T), r // T % H, r % T
    dd = tl.arange(0, BLOCK_D)
    ra = _split_row(b, h, t, H, B_a, Q_a, S_a, step_a, cb_a, cq_a)
    rb = _split_row(b, h, t, H, B_b, Q_b, S_b, step_b, cb_b, cq_b)
    oa, la = _reduce_splits(OA, LA, ra, S_a, 0.0, D, BLOCK_S, BLOCK_D, False)
    ob, lb = _reduce_splits(OB, LB, rb, S_b, 0.0, D, BLOCK_S, BLOCK_D, False)
    o, lse = _merge_two(oa, la, ob, lb)
    row = O + b * sor + h * soh + t * sot
    if BLOCK_C > 0:
        for c0 in tl.static_range(0, BLOCK_D, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            rt = tl.load(RT + dd[:, None] * D + cc[None, :], mask=(dd < D)[:, None] & (cc < D)[None, :], other=0.0)
            tl.store(row + cc, tl.sum(o[:, None] * rt, 0).to(O.dtype.element_ty), mask=cc < D)
    else:
        tl.store(row + dd, o.to(O.dtype.element_ty), mask=dd < D)
    tl.store(L + r, lse)


@triton.jit
def _weigh_kernel(O, LSE, M, P, so_r, so_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # one (b, h, q) row
    dd = tl.arange(0, BLOCK_D)
    ok = dd < D
    m = tl.load(M + r)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(tl.load(LSE + r) - m)  # 0 for an empty partial
    o = tl.load(O + r * so_r + dd * so_d, mask=ok, other=0.0).to(tl.float32)
    tl.store(P + r * (D + 1) + dd, o * w, mask=ok)
    tl.store(P + r * (D + 1) + D, w)


@triton.jit
def _unweigh_kernel(
    P, M, OUT, LSE_OUT, sb, sh, sq, sd, H, NQ, D: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64)
    b = r // (H * NQ)
    h = (r // NQ) % H
    q = r % NQ
    dd = tl.arange(0, BLOCK_D)
    ok = dd < D
    den = tl.load(P + r * (D + 1) + D)
    num = tl.load(P + r * (D + 1) + dd, mask=ok, other=0.0)
    o = num / tl.where(den > 0.0, den, 1.0)
    tl.store(OUT + b * sb + h * sh + q * sq + dd * sd, o.to(OUT.dtype.element_ty), mask=ok)
    if WRITE_LSE:
        m = tl.load(M + r)
        m = tl.where(m == float("-inf"), 0.0, m)
        tl.store(LSE_OUT + r, tl.where(den > 0.0, m + tl.log(tl.where(den > 0.0, den, 1.0)), float("-inf")))


@triton.jit
def _gathered_kernel(
    P,
    OUT,
    LSE_OUT,
    sp,
    sb,
    sh,
    sq,
    sd,
    H,
    NQ,
    WORLD,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)  # one (b, h, q) row of every rank's partial
    b = r // (H * NQ)
    h = (r // NQ) % H
    q = r % NQ
    ww = tl.arange(0, BLOCK_W)
    dd = tl.arange(0, BLOCK_D)
    w_ok = ww < WORLD
    base = P + ww.to(tl.int64) * sp + r * (D + 1)  # (BLOCK_W,): rank w's row
    lse = tl.load(base + D, mask=w_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(w_ok, tl.exp(lse - m), 0.0)  # 0 for an empty partial
    den = tl.sum(w, 0)
    o = tl.load(base[:, None] + dd[None, :], mask=w_ok[:, None] & (dd < D)[None, :], other=0.0)  # (W, D)
    num = tl.sum(o * w[:, None], 0)
    res = num / tl.where(den > 0.0, den, 1.0)
    tl.store(OUT + b * sb + h * sh + q * sq + dd * sd, res.to(OUT.dtype.element_ty), mask=dd < D)
    if WRITE_LSE:
        tl.store(LSE_OUT + r, tl.where(den > 0.0, m + tl.log(tl.where(den > 0.0, den, 1.0)), float("-inf")))


def merge_gathered_fused(every, *, out=None, dtype=torch.float32):
    """Merge ``every [world, B, H, Q, d + 1]`` (each rank's ``[o, lse]``, an all-gather's result) in
    one launch: ``o`` into ``out`` (any strides) in ``dtype``, and the lse ``[B, H, Q]`` fp32; the
    same on every rank (see merge.merge_partials)."""
    W, B, H, Q, d1 = every.shape
    d = d1 - 1
    every = every.contiguous()
    out = torch.empty(B, H, Q, d, dtype=dtype, device=every.device) if out is None else out
    lse = torch.empty(B, H, Q, dtype=torch.float32, device=every.device)
    launch(
        _gathered_kernel,
        (B * H * Q,),
        every,
        out,
        lse,
        every.stride(0),
        *out.stride(),
        H,
        Q,
        W,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_W=triton.next_power_of_2(max(W, 2)),
        WRITE_LSE=True,
        num_warps=1,
    )
    return out, lse


def merge_pair_fused(o_a, lse_a, o_b, lse_b, *, out=None):
    """Two partials of disjoint key sets, ``o [B, H, T, d]`` and ``lse [B, H, T]`` each (any
    strides but along d: views of a step's rows are read where they lie), merged in one launch
    (``merge.merge_pair``): ``(o [B, H, T, d] fp32, lse [B, H, T] fp32)``; with ``out`` (any
    strides along B, H, T and any dtype: the layer's ``[B, T, H, d]`` output seen as ``[B, H,
    T, d]``) the merged ``o`` is written there, rounded to its dtype, and ``out`` returned."""
    B, H, T, d = o_a.shape
    assert o_b.shape == o_a.shape and lse_a.shape == lse_b.shape == (B, H, T), (o_a.shape, o_b.shape, lse_a.shape)
    o_a, o_b = (x if x.stride(-1) == 1 else x.contiguous() for x in (o_a, o_b))
    o = out if out is not None else torch.empty(B, H, T, d, dtype=torch.float32, device=o_a.device)
    assert o.shape == o_a.shape and o.stride(-1) == 1
    lse = torch.empty(B, H, T, dtype=torch.float32, device=o_a.device)
    if o.numel():
        launch(
            _merge_pair_kernel,
            (B * H * T,),
            o_a,
            lse_a,
            o_b,
            lse_b,
            o,
            lse,
            o_a.stride()[:3],
            o_b.stride()[:3],
            lse_a.stride(),
            lse_b.stride(),
            o.stride()[:3],
            H,
            T,
            D=d,
            BLOCK_D=triton.next_power_of_2(d),
            num_warps=1,
        )
    return o, lse


def reduce_pair(a, b, *, out=None, rotation=None):
    """Two calls' unreduced splits (``Partials`` of ``partial_attention_triton*(...,
    partials=True)``), as ``[R, H, T]`` rows by their ``rows``, each call's splits reduced as its
    own reduce would and the two merged as :func:`merge_pair_fused` would: one launch where those
    took three, the same ``(o [R, H, T, d] fp32, lse [R, H, T])``; ``out`` as
    :func:`merge_pair_fused`'s. ``b`` None: ``a``'s alone (a merge with no splits is exact).
    ``rotation [d, d]`` (fp32): the merged ``o`` turned by it, ``o @ rotation``, before it is
    written (an fp8 pool's unrotation: the merge is linear in ``o``; summed in the kernel's
    order, not a GEMM's)."""
    B, H, Q, S, d = a.shape
    R, T = (B, Q) if a.rows[1] == 0 else (Q // a.rows[1], a.rows[1])
    if b is None:  # (no splits: o = 0, lse = -inf, weighed 0)
        b = type(a)(a.op[:0], a.lp[:0], (R, H, T, 0, d), max(T, 1))
    sides = []
    for p in (a, b):
        pB, pH, pQ, pS, pd = p.shape
        rows = (pB, pQ) if p.rows == (1, 0) else (pQ // T, T) if p.rows == (0, T) and pB == 1 else None
        assert rows == (R, T) and (pH, pd) == (H, d) and p.lp.numel() >= pB * H * pQ * pS, (p.shape, p.rows, R, T)
        sides.append((pB, pQ, pS, p.step, *p.rows))
    if (
        rotation is None
        and a.shape[3] == b.shape[3] == 1
        and partial_triton.ONE_SPLIT_COPY["on"]
        and target_of(a.op.device).backend == "interpreter"
    ):
        # one split a side: each reduce is the identity (partial_triton._attend's shortcut: a weight
        # of exp(0) = 1, a sum of one term, + 0.0 as its sum starts), and the pair merge is this
        # kernel's own formula. Triton's interpreter (the tests' CPU) runs a Python program per
        # row, ~3x the merge's: there, the same numbers by the merge alone
        (oa, la), (ob, lb) = (_one_split(p, R, T) for p in (a, b))
        return merge_pair_fused(oa + 0.0, la, ob + 0.0, lb, out=out)
    o = out if out is not None else torch.empty(R, H, T, d, dtype=torch.float32, device=a.op.device)
    assert o.shape == (R, H, T, d) and o.stride(-1) == 1, (o.shape, R, H, T, d)
    if rotation is not None:
        rotation = rotation.to(device=o.device, dtype=torch.float32).contiguous()
        assert rotation.shape == (d, d), rotation.shape
    lse = torch.empty(R, H, T, dtype=torch.float32, device=a.op.device)
    if o.numel():
        launch(
            _reduce_pair_kernel,
            (R * H * T,),
            a.op,
            a.lp,
            b.op,
            b.lp,
            o,
            lse,
            rotation if rotation is not None else lse,  # (a placeholder: BLOCK_C = 0 compiles it out)
            *o.stride()[:3],
            H,
            T,
            *sides[0],
            *sides[1],
            D=d,
            BLOCK_D=triton.next_power_of_2(d),
            BLOCK_S=REDUCE_BLOCK_S,
            BLOCK_C=0 if rotation is None else min(32, triton.next_power_of_2(d)),
            num_warps=4,
        )
    return o, lse


def _one_split(p, R, T):
    """A one-split call's ``(o [R, H, T, d], lse [R, H, T])``, as its ``rows`` see them."""
    op, lp = p.dense()
    if p.rows == (1, 0):
        return op[:, :, :, 0], lp[:, :, :, 0]
    H, d = op.shape[1], op.shape[4]
    return op[0, :, :, 0].view(H, R, T, d).transpose(0, 1), lp[0, :, :, 0].view(H, R, T).transpose(0, 1)


def weigh_fused(o, lse, m):
    """``o [B, H, Q, d]``, ``lse, m [B, H, Q]`` -> ``packed [B, H, Q, d + 1]`` fp32 (see merge.weigh)."""
    B, H, Q, d = o.shape
    rows = o.reshape(B * H * Q, d)
    packed = torch.empty(B, H, Q, d + 1, dtype=torch.float32, device=o.device)
    launch(
        _weigh_kernel,
        (B * H * Q,),
        rows,
        lse.contiguous().float(),
        m.contiguous().float(),
        packed,
        rows.stride(0),
        rows.stride(1),
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=1,
    )
    return packed


def unweigh_fused(packed, m, *, out=None, dtype=torch.float32, want_lse=True):
    """Finish a SUM-reduced ``packed [B, H, Q, d + 1]``: ``o`` into ``out`` (any strides, e.g. a
    ``[B, Q, H, d]`` buffer viewed as ``[B, H, Q, d]``) in ``dtype``, and the lse (see merge.unweigh)."""
    B, H, Q, d1 = packed.shape
    d = d1 - 1
    out = torch.empty(B, H, Q, d, dtype=dtype, device=packed.device) if out is None else out
    lse = torch.empty(B, H, Q, dtype=torch.float32, device=packed.device) if want_lse else packed
    launch(
        _unweigh_kernel,
        (B * H * Q,),
        packed.contiguous(),
        m.contiguous().float(),
        out,
        lse,
        *out.stride(),
        H,
        Q,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        WRITE_LSE=want_lse,
        num_warps=1,
    )
    return out, (lse if want_lse else None)
