"""Pure-torch reference of the local partial attention (no triton import).

Serves CPU ranks and is the oracle of the Triton kernel in ``partial_triton.py``:
same signature, same masking rules, same output contract.
"""

from __future__ import annotations

import math

import torch

# Bound on the fp32 score block materialised per call: [B, H_kv, rows, N] floats.
# Rows are independent, so the reference walks the query rows in slices under it.
_MAX_SCORE_ELEMS = 1 << 26  # 256 MiB of fp32


def check_inputs(q, k, v, q_pos, k_pos, kv_len):
    """Validate shapes of a partial-attention call; returns (B, H, Q, d, H_kv, N)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, Q, d] / [B, H_kv, N, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, Q, d = q.shape
    Bk, H_kv, N, dk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if Bk != B or dk != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({H_kv})")
    if q_pos is not None and q_pos.shape[-1] != Q:
        raise ValueError(f"q_pos has {q_pos.shape[-1]} positions for {Q} queries")
    if k_pos is not None and k_pos.shape[-1] != N:
        raise ValueError(f"k_pos has {k_pos.shape[-1]} positions for {N} keys")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("causal masking needs both q_pos and k_pos")
    if kv_len is not None and kv_len.shape != (B,):
        raise ValueError(f"kv_len must have shape [{B}], got {tuple(kv_len.shape)}")
    return B, H, Q, d, H_kv, N


def key_mask(B, Q, N, device, q_pos=None, k_pos=None, kv_len=None, window=None):
    """Boolean visibility mask [B, Q, N] (True = the query sees the key), or None if all visible.

    A key is visible when its index is < ``kv_len[b]``, and, with positions, when
    ``k_pos <= q_pos`` (causal) and ``q_pos - k_pos < window`` (sliding window).
    """
    mask = None
    if kv_len is not None:
        idx = torch.arange(N, device=device)
        mask = (idx[None, :] < kv_len.to(device)[:, None])[:, None, :].expand(B, Q, N)  # (B, Q, N)
    if q_pos is not None:
        qp = q_pos.to(device).expand(B, Q) if q_pos.dim() == 1 else q_pos.to(device)  # (B, Q)
        kp = k_pos.to(device).expand(B, N) if k_pos.dim() == 1 else k_pos.to(device)  # (B, N)
        diff = qp[:, :, None] - kp[:, None, :]  # (B, Q, N)
        causal = diff >= 0
        if window is not None:
            causal = causal & (diff < window)
        mask = causal if mask is None else mask & causal
    return mask


def partial_attention_ref(q, k, v, *, scale=None, q_pos=None, k_pos=None, kv_len=None,
                          window=None, softcap=None, out=None, lse_out=None):
    """Attention of ``q`` to one KV shard, returning the un-merged partial ``(o, lse)``.

    Args:
        q: ``[B, H, Q, d]`` queries (Q = 1 for decode).
        k, v: ``[B, H_kv, N, d]`` this shard's keys/values; ``H % H_kv == 0`` (GQA, never repeated).
        scale: score multiplier, default ``1/sqrt(d)``.
        q_pos: ``[Q]`` or ``[B, Q]`` global query positions; with ``k_pos`` enables causal masking.
        k_pos: ``[N]`` or ``[B, N]`` global key positions.
        kv_len: ``[B]`` valid keys per sequence (keys at index >= kv_len[b] are ignored).
        window: sliding window; a key is visible only if ``q_pos - k_pos < window``.
        softcap: logit soft-capping, ``s = softcap * tanh(s / softcap)`` (Gemma-2).
        out, lse_out: optional preallocated ``[B, H, Q, d]`` (q's dtype) / ``[B, H, Q]`` fp32
            tensors to write into (any strides, e.g. a view of the layer's output).

    Returns:
        o: ``[B, H, Q, d]`` in q's dtype, softmax-normalised within the shard (0 where no key).
        lse: ``[B, H, Q]`` fp32 natural-log sum of exp of the scores (-inf where no key).
    """
    B, H, Q, d, H_kv, N = check_inputs(q, k, v, q_pos, k_pos, kv_len)
    if window is not None and q_pos is None:
        raise ValueError("a sliding window needs q_pos and k_pos")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    G = H // H_kv
    o = torch.zeros(B, H, Q, d, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, Q), -math.inf, dtype=torch.float32, device=q.device)
    if N == 0 or Q == 0:
        return _emit(o, lse, q.dtype, out, lse_out)
    kf = k.float()  # (B, H_kv, N, d)
    vf = v.float()
    # Query heads of one KV head are contiguous: h = h_kv * G + g.
    qg = q.float().reshape(B, H_kv, G, Q, d)  # (B, H_kv, G, Q, d)
    mask = key_mask(B, Q, N, q.device, q_pos, k_pos, kv_len, window)  # (B, Q, N) or None
    step = max(1, _MAX_SCORE_ELEMS // max(1, B * H * N))
    for q0 in range(0, Q, step):
        q1 = min(Q, q0 + step)
        rows = qg[:, :, :, q0:q1].reshape(B, H_kv, G * (q1 - q0), d)  # (B, H_kv, G*q, d)
        s = torch.matmul(rows, kf.transpose(-1, -2)).mul_(scale)  # (B, H_kv, G*q, N)
        if softcap is not None:
            s = torch.tanh(s / softcap).mul_(softcap)
        s = s.view(B, H_kv, G, q1 - q0, N)
        if mask is not None:
            s.masked_fill_(~mask[:, None, None, q0:q1, :], -math.inf)
        l = torch.logsumexp(s, dim=-1)  # (B, H_kv, G, q)
        l_safe = torch.where(torch.isinf(l), torch.zeros_like(l), l)
        p = torch.exp(s - l_safe[..., None])  # (B, H_kv, G, q, N); rows with no key are all 0
        pv = torch.matmul(p.view(B, H_kv, G * (q1 - q0), N), vf)  # (B, H_kv, G*q, d)
        o[:, :, q0:q1] = pv.view(B, H, q1 - q0, d)
        lse[:, :, q0:q1] = l.reshape(B, H, q1 - q0)
    return _emit(o, lse, q.dtype, out, lse_out)


def _emit(o, lse, dtype, out, lse_out):
    """Return ``(o, lse)`` in their final dtypes, written into ``out``/``lse_out`` when given."""
    if out is None:
        out = o.to(dtype)
    else:
        out.copy_(o)
    if lse_out is None:
        return out, lse
    lse_out.copy_(lse)
    return out, lse_out
