"""Triton split-KV ("flash-decoding") partial attention.

Two launches:
  1. ``_split_kernel``: one program per (batch, KV head, split). It loads each K/V block of
     its split once for all ``G = H / H_kv`` query heads of the group (times Q query rows),
     runs an online softmax in base 2, and writes a per-split partial ``(o, lse)``.
  2. ``_reduce_kernel``: one program per (batch, head, query row) merges the splits with the
     LSE math of DESIGN.md §2 and writes ``o`` in q's dtype and ``lse`` (natural log, fp32).

The torch reference with the same signature is ``partial_ref.partial_attention_ref``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .partial_ref import check_inputs

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

MAX_ROWS = 128  # query rows (G * Q) per program tile
LAST_LAUNCH: dict = {}  # the last compiled split kernel (its resource report, for tuning)

# The CPU interpreter returns garbage from tl.dot on bf16 (an open upstream bug): upcast there.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _split_kernel(
    Q, K, V, QPOS, KPOS, KVLEN, OP, LP,
    sqb, sqh, sqq, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sqpb, sqpq, skpb, skpn,
    N, H_KV, split_len, qk_scale, window, softcap,
    G: tl.constexpr, NQ: tl.constexpr, NSPLIT: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_LEN: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H_KV
    hk = pid_bh % H_KV

    rows = tl.arange(0, BLOCK_M)  # row r = g * NQ + qi (query head g of the group, query qi)
    g = rows // NQ
    qi = rows % NQ
    row_ok = rows < G * NQ
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < HEAD_D
    head = hk * G + g

    q = tl.load(Q + b * sqb + head[:, None] * sqh + qi[:, None] * sqq + dd[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)

    n_end = N
    if HAS_LEN:
        n_end = tl.minimum(N, tl.load(KVLEN + b).to(tl.int32))
    start = pid_s * split_len
    stop = tl.minimum(start + split_len, n_end)
    if HAS_POS:
        qpos = tl.load(QPOS + b * sqpb + qi * sqpq, mask=row_ok, other=0)  # (BLOCK_M,)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, base-2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs < stop
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + b * skb + hk * skh + offs[:, None] * skn + dd[None, :] * skd,
                    mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(V + b * svb + hk * svh + offs[:, None] * svn + dd[None, :] * svd,
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if UPCAST:  # fp32 operands: full precision, not TF32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # (BLOCK_M, BLOCK_N) raw q.k
        else:
            s = tl.dot(q, tl.trans(k))
        if HAS_SOFTCAP:
            # natural units: s = softcap * tanh(scale * q.k / softcap); tanh(x) = 1 - 2/(e^{2x}+1)
            x = s * (qk_scale / LOG2E) / softcap
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * LOG2E
        else:
            s = s * qk_scale  # qk_scale = scale * log2(e): base-2 scores
        vis = row_ok[:, None] & n_ok[None, :]
        if HAS_POS:
            kpos = tl.load(KPOS + b * skpb + offs * skpn, mask=n_ok, other=0)
            diff = qpos[:, None] - kpos[None, :]
            vis = vis & (diff >= 0)
            if HAS_WINDOW:
                vis = vis & (diff < window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    # partials: OP [B, H, NQ, NSPLIT, HEAD_D], LP [B, H, NQ, NSPLIT], contiguous fp32
    prow = ((b * (H_KV * G) + head) * NQ + qi) * NSPLIT + pid_s
    tl.store(OP + prow[:, None] * HEAD_D + dd[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LP + prow, lse, mask=row_ok)


@triton.jit
def _reduce_kernel(OP, LP, O, LSE, sob, soh, soq, sod, slb, slh, slq, H, NQ,
                   NSPLIT: tl.constexpr, HEAD_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)  # flattened (b, h, qi)
    b = r // (H * NQ)
    h = (r // NQ) % H
    qi = r % NQ
    ss = tl.arange(0, BLOCK_S)
    s_ok = ss < NSPLIT
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < HEAD_D
    lse = tl.load(LP + r * NSPLIT + ss, mask=s_ok, other=float("-inf"))  # (BLOCK_S,)
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # 0 for empty splits
    den = tl.sum(w, 0)
    o = tl.load(OP + (r * NSPLIT + ss[:, None]) * HEAD_D + dd[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
    out = tl.sum(o * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(O + b * sob + h * soh + qi * soq + dd * sod, out.to(O.dtype.element_ty), mask=d_ok)
    tl.store(LSE + b * slb + h * slh + qi * slq, tl.where(den > 0.0, m_safe + tl.log(tl.where(den > 0.0, den, 1.0)),
                               float("-inf")))


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few splits, so the split/reduce path is always exercised


def choose_splits(B: int, H_kv: int, N: int, n_sms: int, block_n: int, min_blocks: int = 4) -> int:
    """Split count for the KV axis: enough programs to fill ~2 waves of SMs, no split under
    ``min_blocks`` blocks of keys (below that the reduce costs more than it saves)."""
    if N <= 0:
        return 1
    want = math.ceil(2 * n_sms / max(1, B * H_kv))
    most = max(1, math.ceil(N / (block_n * min_blocks)))
    return int(max(1, min(want, most, 128)))


def partial_attention_triton(q, k, v, *, scale=None, q_pos=None, k_pos=None, kv_len=None,
                             window=None, softcap=None, out=None, lse_out=None,
                             num_splits=None, block_n=None, num_warps=4, num_stages=2):
    """Triton version of :func:`partial_attention_ref` (same arguments and outputs).

    The kernel is built for decode (a group's ``G·Q`` query rows in one tile); more rows than
    ``MAX_ROWS`` are processed in query slices. ``num_splits``, ``block_n``, ``num_warps`` and
    ``num_stages`` override the automatic choice (tests, tuning).
    """
    B, H, Q, d, H_kv, N = check_inputs(q, k, v, q_pos, k_pos, kv_len)
    if window is not None and q_pos is None:
        raise ValueError("a sliding window needs q_pos and k_pos")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    G = H // H_kv
    dev = q.device
    o = torch.empty(B, H, Q, d, dtype=q.dtype, device=dev) if out is None else out
    lse = torch.empty(B, H, Q, dtype=torch.float32, device=dev) if lse_out is None else lse_out
    if o.shape != (B, H, Q, d) or lse.shape != (B, H, Q) or lse.dtype != torch.float32:
        raise ValueError(f"out must be [{B}, {H}, {Q}, {d}] and lse_out [{B}, {H}, {Q}] fp32")
    if B * H * Q == 0:
        return o, lse
    if N == 0:
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    if G * Q > MAX_ROWS:  # long query blocks (prefill): slices of rows the tile can hold
        step = max(1, MAX_ROWS // G)
        kw = dict(scale=scale, k_pos=k_pos, kv_len=kv_len, window=window, softcap=softcap,
                  num_splits=num_splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        for a in range(0, Q, step):
            b = min(Q, a + step)
            partial_attention_triton(q[:, :, a:b], k, v, q_pos=None if q_pos is None else q_pos[..., a:b],
                                     out=o[:, :, a:b], lse_out=lse[:, :, a:b], **kw)
        return o, lse

    block_n = block_n or 64
    block_m = max(16, triton.next_power_of_2(G * Q))
    block_d = max(16, triton.next_power_of_2(d))
    splits = num_splits or choose_splits(B, H_kv, N, _num_sms(dev), block_n)
    split_len = triton.cdiv(triton.cdiv(N, splits), block_n) * block_n
    splits = triton.cdiv(N, split_len)

    op = torch.empty(B, H, Q, splits, d, dtype=torch.float32, device=dev)
    lp = torch.empty(B, H, Q, splits, dtype=torch.float32, device=dev)
    has_pos = q_pos is not None
    if has_pos:
        qp = q_pos.to(device=dev, dtype=torch.int64)
        kp = k_pos.to(device=dev, dtype=torch.int64)
        sqpb, sqpq = (qp.stride(0), qp.stride(1)) if qp.dim() == 2 else (0, qp.stride(0))
        skpb, skpn = (kp.stride(0), kp.stride(1)) if kp.dim() == 2 else (0, kp.stride(0))
    else:
        qp = kp = lp  # unused placeholders
        sqpb = sqpq = skpb = skpn = 0
    kvl = kv_len.to(device=dev, dtype=torch.int64) if kv_len is not None else lp

    LAST_LAUNCH["split"] = _split_kernel[(B * H_kv, splits)](
        q, k, v, qp, kp, kvl, op, lp,
        *q.stride(), *k.stride(), *v.stride(),
        sqpb, sqpq, skpb, skpn,
        N, H_kv, split_len, scale * LOG2E,
        int(window) if window is not None else 0,
        float(softcap) if softcap is not None else 1.0,
        G=G, NQ=Q, NSPLIT=splits, HEAD_D=d,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_POS=has_pos, HAS_LEN=kv_len is not None, HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None, UPCAST=_INTERPRET or q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    _reduce_kernel[(B * H * Q,)](
        op, lp, o, lse, *o.stride(), *lse.stride(), H, Q, NSPLIT=splits, HEAD_D=d,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d, num_warps=1,
    )
    return o, lse
