"""Ring paths: the KV-rotating decode baseline and causal ring prefill (DESIGN.md §3–§4).

Both move K/V blocks between neighbours with :meth:`Comm.shift` (the send of the next block
overlaps the attention over the current one) and merge partials with ``merge.py``. GQA is kept:
blocks carry ``H_kv`` heads, never ``H``.
"""

from __future__ import annotations

import torch

from treeattn_kernels import partial_attention

from .comm import Comm
from .merge import merge_pair, merge_partials


def _padded(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t [B, H_kv, N, d]`` as a contiguous ``[B, H_kv, n, d]`` block (zero padding, n >= N)."""
    if t.shape[2] == n and t.is_contiguous():
        return t
    out = t.new_zeros(t.shape[0], t.shape[1], n, t.shape[3])
    out[:, :, : t.shape[2]] = t
    return out


def ring_decode(comm: Comm, q, k, v, kv_len=None, *, shard_lens=None, scale=None, softcap=None):
    """Ring-attention decode: every rank attends ``q`` to all p KV shards as they rotate.

    Args:
        q: ``[B, H, Q, d]`` the same queries on every rank.
        k, v: ``[B, H_kv, N_r, d]`` this rank's shard; ``kv_len [B]`` its valid lengths.
        shard_lens: every rank's ``N_r`` if known (saves one all_gather per call).
    Returns:
        ``(o [B, H, Q, d] fp32, lse [B, H, Q] fp32)``, bit-identical on every rank: the p
        partials are merged in source-rank order, not in arrival order.
    """
    p, r = comm.world, comm.rank
    B = q.shape[0]
    if kv_len is None:
        kv_len = torch.full((B,), k.shape[2], dtype=torch.int64, device=k.device)
    if p == 1:
        return tuple(x.float() for x in partial_attention(q, k, v, scale=scale, kv_len=kv_len,
                                                          softcap=softcap))
    if shard_lens is None:
        shard_lens = comm.all_gather(torch.tensor([k.shape[2]], device=k.device)).flatten().tolist()
    cap = max(shard_lens)
    # The own block is only read (it may be the cache's storage); arriving blocks alternate
    # between two buffers of their own: the one being sent is never the one received into.
    cur = [_padded(k, cap), _padded(v, cap), kv_len.to(torch.int64).contiguous()]
    bufs = [[torch.empty_like(t) for t in cur] for _ in range(min(2, p - 1))]
    block_bytes = sum(t.numel() * t.element_size() for t in cur)
    if comm.stats.enabled:
        comm.stats.hold(len(bufs) * block_bytes)
    parts_o, parts_l = [None] * p, [None] * p
    for t in range(p):
        last = t == p - 1
        nxt = bufs[t % 2] if not last else None
        pending = None if last else comm.shift(cur, nxt, dst=(r + 1) % p, src=(r - 1) % p)
        o, lse = partial_attention(q, cur[0], cur[1], scale=scale, kv_len=cur[2], softcap=softcap)
        parts_o[(r - t) % p], parts_l[(r - t) % p] = o, lse
        if pending is not None:
            pending.wait()
            cur = nxt
    if comm.stats.enabled:
        comm.stats.hold(-len(bufs) * block_bytes)
    return merge_partials(torch.stack(parts_o), torch.stack(parts_l))


def chunk_bounds(n: int, p: int) -> list[int]:
    """Cut points of ``n`` tokens into ``p`` contiguous, balanced chunks (the first ``n % p``
    chunks one token longer); chunk r is ``[b[r], b[r + 1])``."""
    q, rem = divmod(n, p)
    out = [0]
    for r in range(p):
        out.append(out[-1] + q + (1 if r < rem else 0))
    return out


def ring_prefill(comm: Comm, q, k, v, bounds, *, scale=None, window=None, softcap=None):
    """Causal attention of a prompt cut into contiguous chunks, chunk r on rank r.

    Args:
        q: ``[B, H, C_r, d]`` this rank's chunk of queries; ``k, v [B, H_kv, C_r, d]`` its keys.
        bounds: :func:`chunk_bounds` of the prompt (global positions ``bounds[r]..bounds[r+1]``).
    Returns:
        ``(o [B, H, C_r, d] fp32, lse [B, H, C_r] fp32)`` for this rank's queries.

    Blocks of later chunks are entirely in the future: they are never sent, so the ring is a
    pipeline, block s flowing s -> s+1 -> ... -> p-1, rank r computing r + 1 blocks. Empty
    chunks (a prompt shorter than p) are neither sent nor received, nor blocks that no later
    rank has queries for.
    """
    p, r = comm.world, comm.rank
    dev = q.device
    pos = torch.arange(bounds[r], bounds[r + 1], device=dev)
    o, lse = partial_attention(q, k, v, scale=scale, q_pos=pos, k_pos=pos, window=window,
                               softcap=softcap)
    o = o.float()
    if p == 1:
        return o, lse
    lens = [bounds[i + 1] - bounds[i] for i in range(p)]
    B, H_kv, _, d = k.shape
    cur = [k.contiguous(), v.contiguous()]
    for t in range(r + 1):  # at step t this rank holds the block of chunk r - t
        src_next = r - 1 - t  # the chunk arriving for step t + 1
        send = r + 1 < p and lens[r - t] > 0 and any(lens[r + 1:])  # someone later has queries
        recv = src_next >= 0 and lens[src_next] > 0 and any(lens[r:])
        nxt = [k.new_empty(B, H_kv, lens[src_next], d) for _ in range(2)] if recv else []
        pending = comm.shift(cur, nxt, dst=r + 1 if send else None, src=r - 1 if recv else None)
        if t > 0 and lens[r - t] > 0 and q.shape[2] > 0:
            kpos = torch.arange(bounds[r - t], bounds[r - t + 1], device=dev)
            masked = window is not None  # earlier chunks are fully visible unless windowed
            bo, bl = partial_attention(q, cur[0], cur[1], scale=scale,
                                       q_pos=pos if masked else None,
                                       k_pos=kpos if masked else None,
                                       window=window, softcap=softcap)
            o, lse = merge_pair(o, lse, bo, bl)
        pending.wait()
        if recv:
            cur = nxt
    return o, lse


def ring_pass_q(comm: Comm, q, k, v, kv_len, bounds, *, k_pos=None, scale=None, window=None,
                softcap=None):
    """Attention of every rank's queries to every rank's *cached* shard: queries travel, KV stays.

    Used by chunked prefill, where the earlier segments' K/V is spread over all ranks: each
    query block (with its running ``(o, lse)``) visits every rank once and comes home, so
    p transfers of ``q + o`` per layer instead of rotating the whole cache.

    Args:
        q: ``[B, H, S_r, d]`` this rank's queries, global positions ``bounds[r]..bounds[r+1]``.
        k, v: ``[B, H_kv, N_r, d]`` this rank's cache, ``kv_len [B]`` valid lengths,
            ``k_pos [B, N_r]`` positions (needed with a sliding window).
    Returns:
        ``(o [B, H, S_r, d] fp32, lse [B, H, S_r] fp32)`` over all ranks' caches.
    """
    p, r = comm.world, comm.rank
    lens = [bounds[i + 1] - bounds[i] for i in range(p)]

    def local(qb, src):
        qpos = torch.arange(bounds[src], bounds[src + 1], device=qb.device) if window else None
        return partial_attention(qb, k, v, scale=scale, kv_len=kv_len, softcap=softcap,
                                 window=window, q_pos=qpos, k_pos=k_pos if window else None)

    o, lse = local(q, r)
    held = [q.contiguous(), o.float().contiguous(), lse.contiguous()]
    if p == 1:
        return held[1], held[2]
    B, H, _, d = q.shape
    for t in range(p):  # round t: pass the block of rank r - t on; receive that of r - t - 1
        src_in = (r - t - 1) % p
        last = t == p - 1  # the last hop brings each block home: its queries are no longer needed
        send = held[1:] if last else held
        n_in = lens[src_in]
        recv = [q.new_empty(B, H, n_in, d), q.new_empty(B, H, n_in, d, dtype=torch.float32),
                q.new_empty(B, H, n_in, dtype=torch.float32)]
        recv = recv[1:] if last else recv
        pending = comm.shift(send if lens[(r - t) % p] else [], recv if n_in else [],
                             dst=(r + 1) % p, src=(r - 1) % p)
        pending.wait()
        if last:
            return tuple(recv) if n_in else (held[1][:, :, :0], held[2][:, :, :0])
        if n_in:
            bo, bl = local(recv[0], src_in)
            mo, ml = merge_pair(recv[1], recv[2], bo, bl)
            held = [recv[0], mo.contiguous(), ml.contiguous()]
        else:
            held = [x[:, :, :0] for x in held]
