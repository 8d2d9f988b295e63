"""Pure-torch reference of the local partial attention (no triton import).

Serves CPU ranks and is the oracle of the Triton kernel in ``partial_triton.py``:
same signature, same masking rules, same output contract.
"""

from __future__ import annotations

import math

import torch

# Bound on the fp32 score block materialised at once: [B, H, rows, keys] floats. Rows are
# independent and keys merge by LSE, so the reference walks query rows in slices and keys in
# blocks under it: the fallback after a failed self-check holds any context the cache holds.
_MAX_SCORE_ELEMS = 1 << 26  # 256 MiB of fp32
_KEY_BLOCK = 1 << 14
# Keys are reduced in splits of SPLIT keys fixed by their index in the shard (issue 49): every
# matmul and every sum has the same shape whatever the rows beside a row and however many keys
# follow the ones it sees, so a row's bits are the same alone, in a batch, in a verify of drafts
# (its later drafts masked) or in the decode step that follows. _KEY_BLOCK is a multiple of it.
SPLIT = 64
LSE_BLOCKS = (1, 2, 4, 8, 16)  # keys per block of ``block_lse``: at most the smallest kernel tile


def check_inputs(q, k, v, q_pos, k_pos, kv_len):
    """Validate shapes of a partial-attention call; returns (B, H, Q, d, H_kv, N)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D [B, H, Q, d] / [B, H_kv, N, d]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
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


def key_mask(B, Q, N, device, q_pos=None, k_pos=None, kv_len=None, window=None, k_start: int = 0):
    """Boolean visibility mask [B, Q, N] (True = the query sees the key), or None if all visible.

    A key is visible when its index is < ``kv_len[b]``, and, with positions, when
    ``k_pos <= q_pos`` (causal) and ``q_pos - k_pos < window`` (sliding window). ``k_start``: the
    index of the first of the ``N`` keys (``k_pos`` then holds just these ``N``), for a block of
    keys out of a longer shard.
    """
    mask = None
    if kv_len is not None:
        idx = torch.arange(k_start, k_start + N, device=device)
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


def add_sink(o, lse, sink):
    """Fold learned per-head sink logits into a partial (fp32, in place where it can): a sink
    adds ``exp(sink[h])`` to head h's softmax denominator and nothing to its numerator, i.e. it
    is one more partial ``(o = 0, lse = sink[h])``. ``o [B, H, Q, d]``, ``lse [B, H, Q]``,
    ``sink [H]``; returns ``(o, lse)``."""
    s = sink.to(device=lse.device, dtype=torch.float32).view(1, -1, 1).expand_as(lse)  # (B, H, Q)
    new = torch.logaddexp(lse, s)  # lse = -inf (no key): new = s, and o stays 0
    return o * torch.exp(lse - new)[..., None], new


def dequantize(x8, scale, dtype=torch.float32):
    """fp8 rows ``x8 [..., N, d]`` with their scales ``scale [..., N, G]`` (one per ``d / G``
    channels of each row) as ``dtype``."""
    G = scale.shape[-1]
    x = x8.float().unflatten(-1, (G, -1)) * scale.float()[..., None]  # [..., N, G, d / G]
    return x.flatten(-2).to(dtype)


def check_block_lse(block_lse, lse_block: int, lse_rows, B: int, H: int, Q: int, N: int) -> None:
    """Validate the per-block log-sum-exp output of a partial-attention call (see
    :func:`partial_attention_ref`)."""
    if lse_block not in LSE_BLOCKS:
        raise ValueError(f"lse_block must be one of {LSE_BLOCKS}, got {lse_block}")
    want = (B, H, Q, -(-N // lse_block))
    if tuple(block_lse.shape) != want or block_lse.dtype != torch.float32:
        raise ValueError(
            f"block_lse must be fp32 {list(want)} ({N} keys in blocks of {lse_block}); "
            f"got {block_lse.dtype} {tuple(block_lse.shape)}"
        )
    if lse_rows is not None and (tuple(lse_rows.shape) != (B, Q) or lse_rows.dtype != torch.bool):
        raise ValueError(f"lse_rows must be bool [{B}, {Q}], got {lse_rows.dtype} {tuple(lse_rows.shape)}")


def partial_attention_ref(
    q,
    k,
    v,
    *,
    scale=None,
    q_pos=None,
    k_pos=None,
    kv_len=None,
    window=None,
    softcap=None,
    sink=None,
    k_scale=None,
    v_scale=None,
    out=None,
    lse_out=None,
    block_lse=None,
    lse_block: int = 1,
    lse_rows=None,
):
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
        sink: ``[H]`` learned sink logits (gpt-oss) folded into this partial: each adds
            ``exp(sink[h])`` to head h's denominator. Give them to exactly one partial of a
            merge (they count once per query, not once per shard).
        k_scale, v_scale: ``[B, H_kv, N, G]`` scales of fp8 ``k`` and ``v`` (an fp8 KV cache),
            one per ``d / G`` channels of each row (:func:`dequantize`): dequantized one key
            block at a time.
        out, lse_out: optional preallocated ``[B, H, Q, d]`` (q's dtype) / ``[B, H, Q]`` fp32
            tensors to write into (any strides, e.g. a view of the layer's output).
        block_lse: optional fp32 ``[B, H, Q, ceil(N / lse_block)]`` written with each row's
            natural-log sum of exp of its scores over each block of ``lse_block`` keys (keys
            ``[j·lse_block, (j+1)·lse_block)`` of the shard, in its order; the same scores and
            masks as the attention: scale, soft-capping, kv_len, causality, window), ``-inf``
            where the row sees no key of the block. The sink is in no block. With the merged
            ``lse`` of the row over every shard, ``exp(block_lse - lse)`` is the share of the
            row's attention the block received: exact, on any number of ranks (citations).
        lse_rows: optional bool ``[B, Q]``: only these rows' ``block_lse`` is written (the
            others are left as they are).

    Returns:
        o: ``[B, H, Q, d]`` in q's dtype, softmax-normalised within the shard (0 where no key).
        lse: ``[B, H, Q]`` fp32 natural-log sum of exp of the scores (-inf where no key).

    Memory stays bounded whatever Q and N: query rows in slices, keys in blocks (an online
    softmax across blocks), scores and masks of one (slice, block) at a time.
    """
    B, H, Q, d, H_kv, N = check_inputs(q, k, v, q_pos, k_pos, kv_len)
    if window is not None and q_pos is None:
        raise ValueError("a sliding window needs q_pos and k_pos")
    if sink is not None and sink.numel() != H:
        raise ValueError(f"sink has {sink.numel()} logits for {H} query heads")
    if block_lse is not None:
        check_block_lse(block_lse, lse_block, lse_rows, B, H, Q, N)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    G = H // H_kv
    o = torch.zeros(B, H, Q, d, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, Q), -math.inf, dtype=torch.float32, device=q.device)
    if N > 0 and Q > 0:
        qg = q.float().reshape(B, H_kv, G, Q, d)  # (B, H_kv, G, Q, d): h = h_kv * G + g
        nb = min(N, _KEY_BLOCK)
        step = max(1, _MAX_SCORE_ELEMS // max(1, B * H * nb))
        for q0 in range(0, Q, step):
            q1 = min(Q, q0 + step)
            rows = qg[:, :, :, q0:q1].reshape(B, H_kv, G * (q1 - q0), d)  # (B, H_kv, G*q, d)
            qp = None if q_pos is None else q_pos[..., q0:q1]
            acc_o, acc_l = None, None  # running partial of this slice over the key blocks
            for n0 in range(0, N, nb):
                n1 = min(N, n0 + nb)
                kb, vb = k[:, :, n0:n1], v[:, :, n0:n1]
                if k_scale is not None:
                    kb, vb = dequantize(kb, k_scale[:, :, n0:n1]), dequantize(vb, v_scale[:, :, n0:n1])
                bo, bl, s = _block(
                    rows,
                    kb,
                    vb,
                    scale,
                    softcap,
                    key_mask(
                        B,
                        q1 - q0,
                        n1 - n0,
                        q.device,
                        qp,
                        None if k_pos is None else k_pos[..., n0:n1],
                        kv_len,
                        window,
                        k_start=n0,
                    ),
                    B,
                    H_kv,
                    G,
                    q1 - q0,
                    scores=block_lse is not None,
                )
                if block_lse is not None:
                    _write_blocks(block_lse, lse_rows, s, q0, q1, n0, lse_block, B, H)
                acc_o, acc_l = (bo, bl) if acc_o is None else _merge(acc_o, acc_l, bo, bl)
            o[:, :, q0:q1] = acc_o.view(B, H, q1 - q0, d)
            lse[:, :, q0:q1] = acc_l.reshape(B, H, q1 - q0)
    if sink is not None:
        o, lse = add_sink(o, lse, sink)
    return _emit(o, lse, q.dtype, out, lse_out)


def block_lse_ref(
    q,
    k,
    *,
    block_lse,
    lse_block: int = 1,
    lse_rows=None,
    scale=None,
    q_pos=None,
    k_pos=None,
    kv_len=None,
    window=None,
    softcap=None,
    k_scale=None,
):
    """Only the ``block_lse`` of :func:`partial_attention_ref` (same arguments; no values read):
    what a path that gets ``(o, lse)`` from a fused kernel, which never writes scores, runs for
    the rows that ask. Sequences none of whose rows ask are skipped."""
    B, H, Q, d, H_kv, N = check_inputs(q, k, k, q_pos, k_pos, kv_len)
    check_block_lse(block_lse, lse_block, lse_rows, B, H, Q, N)
    asking = None if lse_rows is None else lse_rows.any(dim=1)  # [B]: sequences with a row that asks
    if asking is not None and not bool(asking.all()):  # the others are skipped
        idx = asking.nonzero().flatten()
        if len(idx) == 0:
            return
        pick = lambda t: t if t is None or t.dim() < 2 else t.index_select(0, idx.to(t.device))  # noqa: E731
        part = block_lse.index_select(0, idx.to(block_lse.device))
        block_lse_ref(
            pick(q),
            pick(k),
            block_lse=part,
            lse_block=lse_block,
            lse_rows=pick(lse_rows),
            scale=scale,
            q_pos=pick(q_pos),
            k_pos=pick(k_pos),
            kv_len=None if kv_len is None else pick(kv_len[:, None])[:, 0],
            window=window,
            softcap=softcap,
            k_scale=pick(k_scale),
        )
        block_lse.index_copy_(0, idx.to(block_lse.device), part)
        return
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    G = H // H_kv
    if N == 0 or Q == 0:
        return
    qg = q.float().reshape(B, H_kv, G, Q, d)  # (B, H_kv, G, Q, d)
    nb = min(N, _KEY_BLOCK)
    step = max(1, _MAX_SCORE_ELEMS // max(1, B * H * nb))
    for q0 in range(0, Q, step):
        q1 = min(Q, q0 + step)
        rows = qg[:, :, :, q0:q1].reshape(B, H_kv, G * (q1 - q0), d)
        qp = None if q_pos is None else q_pos[..., q0:q1]
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            kb = k[:, :, n0:n1] if k_scale is None else dequantize(k[:, :, n0:n1], k_scale[:, :, n0:n1])
            s = _scores(
                rows,
                kb,
                scale,
                softcap,
                key_mask(
                    B,
                    q1 - q0,
                    n1 - n0,
                    q.device,
                    qp,
                    None if k_pos is None else k_pos[..., n0:n1],
                    kv_len,
                    window,
                    k_start=n0,
                ),
                B,
                H_kv,
                G,
                q1 - q0,
            )
            _write_blocks(block_lse, lse_rows, s, q0, q1, n0, lse_block, B, H)


def _scores(rows, k, scale, softcap, mask, B, H_kv, G, nq):
    """Masked scores ``[B, H_kv, G, nq, n]`` of ``rows [B, H_kv, G*nq, d]`` against ``k [B, H_kv,
    n, d]`` (``-inf`` where the mask hides a key)."""
    n = k.shape[2]
    s = torch.matmul(rows, k.float().transpose(-1, -2)).mul_(scale)  # (B, H_kv, G*q, n)
    if softcap is not None:
        s = torch.tanh(s / softcap).mul_(softcap)
    s = s.view(B, H_kv, G, nq, n)
    if mask is not None:
        s.masked_fill_(~mask[:, None, None], -math.inf)
    return s


def _block(rows, k, v, scale, softcap, mask, B, H_kv, G, nq, scores: bool = False):
    """Partial of ``rows [B, H_kv, G*nq, d]`` over one block of keys ``[B, H_kv, n, d]``:
    ``(o [B, H_kv, G*nq, d], lse [B, H_kv, G, nq])`` fp32, natural log, and with ``scores`` the
    masked scores ``s [B, H_kv, G, nq, n]`` (else None).

    The keys go in splits of :data:`SPLIT` (the last padded, its padding masked), each split
    reduced on its own by one fixed-shape batched matmul and sum per step, then the splits
    summed in their order along a dimension of their own (a running sum): a row's result does
    not depend on the other rows, nor on keys it does not see after the ones it sees (they add
    exact zeros), so it is bit for bit the same in any batch and at any later length."""
    n, d = k.shape[2], k.shape[3]
    R = G * nq
    ns = -(-n // SPLIT)
    pad = ns * SPLIT - n
    kf, vf = k.float(), v.float()
    if pad:  # zeros: finite, and masked below
        kf = torch.nn.functional.pad(kf, (0, 0, 0, pad))
        vf = torch.nn.functional.pad(vf, (0, 0, 0, pad))
    Rp = max(R, 2)  # a one-row batched matmul takes another kernel: two rows at least (the second zeros)
    qr = rows.float()
    if Rp != R:
        qr = torch.cat([qr, qr.new_zeros(B, H_kv, Rp - R, d)], 2)
    BH = B * H_kv
    q3 = qr.reshape(BH, 1, Rp, d).expand(BH, ns, Rp, d).reshape(BH * ns, Rp, d)  # (BH·ns, Rp, d)
    s = torch.bmm(q3, kf.reshape(BH * ns, SPLIT, d).transpose(1, 2)).mul_(scale)  # (BH·ns, Rp, SPLIT)
    if softcap is not None:
        s = torch.tanh(s / softcap).mul_(softcap)
    s = s.view(BH, ns, Rp, SPLIT)
    if mask is not None:
        m = torch.nn.functional.pad(mask, (0, pad), value=False).view(B, 1, 1, nq, ns, SPLIT)  # (B, q, n) by split
        m = m.expand(B, H_kv, G, nq, ns, SPLIT).permute(0, 1, 4, 2, 3, 5).reshape(BH, ns, R, SPLIT)
        s[:, :, :R].masked_fill_(~m, -math.inf)
    elif pad:
        s[:, -1, :, SPLIT - pad :] = -math.inf  # the last split's padding
    lowest = torch.finfo(torch.float32).min  # (a split that sees no key: its -inf maximum made finite)
    mx = s.amax(dim=-1)  # (BH, ns, Rp): each split's largest score
    p = torch.exp(s - mx.clamp(min=lowest)[..., None])  # masked keys: 0
    den = p.sum(dim=-1)  # (BH, ns, Rp)
    if Rp != R:
        p[:, :, R:] = 0  # (the zero rows: finite, out of every sum that is kept)
    o = torch.bmm(p.view(BH * ns, Rp, SPLIT), vf.reshape(BH * ns, SPLIT, d)).view(BH, ns, Rp, d)  # p·v per split
    top = mx.amax(dim=1, keepdim=True).clamp(min=lowest)  # (BH, 1, Rp)
    w = torch.exp(mx - top)  # (BH, ns, Rp); an empty split weighs 0
    num = torch.cumsum(o * w[..., None], dim=1)[:, -1, :R]  # (BH, R, d): the splits in order
    tot = torch.cumsum(den * w, dim=1)[:, -1, :R]  # (BH, R)
    o = num / tot.clamp(min=1.0)[..., None]  # (a row that sees a key has tot >= 1; one that sees none: 0 / 1)
    lse = (top[:, 0, :R] + torch.log(tot)).view(B, H_kv, G, nq)  # -inf where no key
    if scores:  # (B, H_kv, G, q, n), as _scores gives them
        s = (
            s[:, :, :R]
            .reshape(B, H_kv, ns, G, nq, SPLIT)
            .permute(0, 1, 3, 4, 2, 5)
            .reshape(B, H_kv, G, nq, ns * SPLIT)[..., :n]
        )
    return o.view(B, H_kv, R, d), lse, s if scores else None


def _write_blocks(block_lse, lse_rows, s, q0, q1, n0, cb, B, H):
    """Write the log-sum-exp of the scores ``s [B, H_kv, G, q, n]`` (rows ``q0:q1``, keys from
    ``n0``, a multiple of ``cb``) per block of ``cb`` keys into ``block_lse [B, H, Q, NB]``."""
    if cb == 1:  # a block of one key: its log-sum-exp is its score
        blk = s.reshape(B, H, q1 - q0, -1)  # (B, H, q, n)
    else:
        pad = -s.shape[-1] % cb
        if pad:
            s = torch.nn.functional.pad(s, (0, pad), value=-math.inf)
        blk = torch.logsumexp(s.unflatten(-1, (-1, cb)), dim=-1).reshape(B, H, q1 - q0, -1)  # (B, H, q, nb)
    j0 = n0 // cb
    dst = block_lse[:, :, q0:q1, j0 : j0 + blk.shape[-1]]
    if lse_rows is None:
        dst.copy_(blk)
    else:
        dst.copy_(torch.where(lse_rows[:, None, q0:q1, None].to(blk.device), blk, dst))


def _merge(o_a, l_a, o_b, l_b):
    """Two partials of one slice over disjoint key blocks, merged (docs/architecture.md §2; the kernel's
    own accumulation, like the Triton kernel's online softmax)."""
    m = torch.maximum(l_a, l_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(l_a - m), torch.exp(l_b - m)  # (B, H_kv, G, q)
    den = w_a + w_b
    shape = o_a.shape
    wa = w_a.reshape(*shape[:-1], 1)
    wb = w_b.reshape(*shape[:-1], 1)
    o = (o_a * wa + o_b * wb) / torch.where(den > 0, den, torch.ones_like(den)).reshape(*shape[:-1], 1)
    return o, m + torch.log(den)


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
