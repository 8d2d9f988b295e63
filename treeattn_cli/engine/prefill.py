"""Prefill across ranks (docs/architecture.md §4): how a segment is cut, and causal attention across the cut.

**Sharding.** A segment of ``n`` tokens at global positions ``start .. start + n`` is cut into
``2p`` chunks and rank ``r`` holds chunks ``r`` and ``2p - 1 - r`` (*balanced*): under a causal
mask the early chunk sees little and the late one much, so every rank does the same attention
work within one chunk pair. *Contiguous* (chunk ``r`` of ``p``) makes causal prefill a pipeline:
rank p-1 attends p blocks, rank 0 one. A rank's piece is a list of position ranges; its queries,
keys and values are those ranges concatenated, in order.

**Attention across ranks.** *Pass-KV* (:func:`ring_prefill`): every rank's keys and values go
around the ring; a rank attends each arriving block with its queries, pair of ranges by pair of
ranges — whole (all keys before all queries), causal (the same range), or not at all (all keys
after) — and merges the partials (``parallel/merge.py``). A block is sent on only while a rank further
along still needs it (with contiguous pieces that is the pipeline of old). With tokens already
cached (an earlier segment, a document), pass-KV sends every rank's cache shard along too; *pass-Q*
(:func:`ring_pass_q`) instead sends the queries (and their running partials) around the cached
shards, which stay put. :func:`plan` picks the one that moves fewer bytes.

Every computed pair adds its FLOPs to the communicator's counters (``comm.Stats``), as every
transfer adds its bytes.
"""

from __future__ import annotations

import torch

from treeattn_kernels import partial_attention

from ..parallel.comm import Comm
from ..parallel.merge import merge_pair
from ..parallel.ring import chunk_bounds

Pieces = list  # per rank: [(a, b), ...] global position ranges, in order


def shard(start: int, n: int, p: int, balanced: bool = True) -> Pieces:
    """Each rank's position ranges of the segment ``[start, start + n)``."""
    if not balanced or p == 1:
        b = [start + x for x in chunk_bounds(n, p)]
        return [[(b[r], b[r + 1])] for r in range(p)]
    b = [start + x for x in chunk_bounds(n, 2 * p)]
    return [[(b[r], b[r + 1]), (b[2 * p - 1 - r], b[2 * p - r])] for r in range(p)]


def size(ranges) -> int:
    return sum(b - a for a, b in ranges)


def positions(ranges, device=None) -> torch.Tensor:
    """The global positions of a piece, in its order: ``[n]``."""
    parts = [torch.arange(a, b, device=device) for a, b in ranges if b > a]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)


def _offsets(ranges):
    out, o = [], 0
    for a, b in ranges:
        out.append(o)
        o += b - a
    return out


def pairs(qr, kr, window=None):
    """``(query range index, key range index, kind)`` for every pair of ranges with a visible
    key: ``"full"`` (every key visible to every query), ``"causal"`` (the same range: the
    diagonal block) or ``"masked"`` (a mask by position: windows, partial overlaps)."""
    for i, (qa, qb) in enumerate(qr):
        for j, (ka, kb) in enumerate(kr):
            if qb <= qa or kb <= ka or ka >= qb:
                continue  # empty, or every key after every query
            if window is not None and kb - 1 < qa - window + 1:
                continue  # every key out of every query's window
            if (ka, kb) == (qa, qb):
                yield i, j, "masked" if window is not None else "causal"
            elif kb <= qa and (window is None or qb - 1 - ka < window):
                yield i, j, "full"
            else:
                yield i, j, "masked"


def flops(batch: int, heads: int, head_dim: int, nq: int, nk: int, kind: str) -> int:
    """Attention FLOPs of one pair (QKᵀ and PV, 2 per multiply-add); causal counts the visible
    triangle, a masked pair is priced as dense (what it computes)."""
    if kind == "causal":
        return 4 * batch * heads * head_dim * nq * (nq + 1) // 2
    return 4 * batch * heads * head_dim * nq * nk


def _needs(pieces: Pieces, window) -> list[list[bool]]:
    """``need[s][x]``: rank x's queries see some of rank s's keys."""
    return [
        [any(True for _ in pairs(pieces[x], pieces[s], window)) for x in range(len(pieces))] for s in range(len(pieces))
    ]


def ring_prefill(
    comm: Comm, q, k, v, pieces: Pieces, *, scale=None, window=None, softcap=None, cache=None, cache_lens=None
):
    """Causal attention of a segment sharded as ``pieces``, KV travelling (pass-KV).

    Args:
        q: ``[B, H, n_r, d]`` this rank's queries (its ranges, concatenated in order);
            ``k, v [B, H_kv, n_r, d]`` its keys and values.
        pieces: :func:`shard` of the segment (every rank's ranges, the same on every rank).
        cache: this rank's cached ``(k, v)`` ``[B, H_kv, c_r, d]`` (all before the segment) to send
            around as well (pass-KV with a cache); ``cache_lens``: every rank's ``c_r``.
    Returns:
        ``(o [B, H, n_r, d] fp32, lse [B, H, n_r] fp32)`` for this rank's queries.
    """
    if cache is not None and window is not None:
        raise ValueError("a cache travelling with pass-KV is attended whole: sliding windows must pass queries")
    p, r = comm.world, comm.rank
    B, H, nq, d = q.shape
    mine = pieces[r]
    q_off = _offsets(mine)
    o = lse = None  # [B, H, nq, d], [B, H, nq] fp32: made at the first partial (or empty at the end)
    fresh = [True] * len(mine)  # a query range no partial reached yet: its first is written, not merged
    stats = comm.stats

    def made():
        nonlocal o, lse
        if o is None:
            o = torch.zeros(B, H, nq, d, dtype=torch.float32, device=q.device)
            lse = torch.full((B, H, nq), float("-inf"), dtype=torch.float32, device=q.device)
        return o, lse

    def attend(kb, vb, kr, *, whole=False):
        """Merge this rank's attention to a block: ranges ``kr`` of keys (or, ``whole``, a
        cached shard every query sees). A range's first partial is kept as it is: its merge with
        the empty partial ``(0, -inf)`` would give it back bit for bit (weights 0 and exactly 1)."""
        nonlocal o, lse
        todo = [(i, None, "full") for i in range(len(mine))] if whole else pairs(mine, kr, window)
        k_off = None if whole else _offsets(kr)
        for i, j, kind in todo:
            (qa, qb), qs = mine[i], q_off[i]
            if whole:
                ks, ke = 0, kb.shape[2]
            else:
                ks, ke = k_off[j], k_off[j] + kr[j][1] - kr[j][0]
            if ke == ks or qb == qa:
                continue
            kw = {}
            if kind != "full":
                kw = dict(
                    q_pos=torch.arange(qa, qb, device=q.device),
                    k_pos=torch.arange(kr[j][0], kr[j][1], device=q.device),
                    window=window,
                )
            po, pl = partial_attention(
                q[:, :, qs : qs + qb - qa],
                kb[:, :, ks:ke],
                vb[:, :, ks:ke],
                scale=scale,
                softcap=softcap,
                out_dtype=torch.float32,
                **kw,
            )
            if fresh[i] and o is None and qb - qa == nq:  # every query of this rank: no copy at all
                o, lse = po, pl
            elif fresh[i]:
                made()
                o[:, :, qs : qs + qb - qa], lse[:, :, qs : qs + qb - qa] = po, pl
            else:
                mo, ml = merge_pair(o[:, :, qs : qs + qb - qa], lse[:, :, qs : qs + qb - qa], po, pl)
                o[:, :, qs : qs + qb - qa], lse[:, :, qs : qs + qb - qa] = mo, ml
            fresh[i] = False
            if stats.enabled:
                stats.add_flops(flops(B, H, d, qb - qa, ke - ks, kind))

    with_cache = cache is not None and cache_lens is not None and any(cache_lens)
    attend(k, v, mine)
    if with_cache and cache_lens[r]:
        attend(cache[0], cache[1], None, whole=True)
    if p == 1:
        return made()
    need = _needs(pieces, window)
    if with_cache:  # every rank sees every cached shard
        need = [[need[s][x] or (cache_lens[s] > 0 and size(pieces[x]) > 0) for x in range(p)] for s in range(p)]

    def forwarded(s, t):  # the block of rank s, held at step t by rank s + t, goes on
        return t < p - 1 and any(need[s][(s + u) % p] for u in range(t + 1, p))

    Bk, H_kv, _, dk = k.shape
    cur = [k.contiguous(), v.contiguous()]
    if with_cache:
        cur += [cache[0].contiguous(), cache[1].contiguous()]
    for t in range(p):  # at step t this rank holds the block of rank r - t
        s = (r - t) % p
        src = (r - t - 1) % p  # the block arriving for step t + 1
        send, recv = forwarded(s, t), forwarded(src, t)
        nxt = []
        if recv:
            n_in = size(pieces[src])
            nxt = [k.new_empty(Bk, H_kv, n_in, dk) for _ in range(2)]
            if with_cache:
                nxt += [k.new_empty(Bk, H_kv, cache_lens[src], dk) for _ in range(2)]
        pending = comm.shift(cur, nxt, dst=(r + 1) % p if send else None, src=(r - 1) % p if recv else None)
        if t > 0 and need[s][r]:
            attend(cur[0], cur[1], pieces[s])
            if with_cache and cache_lens[s]:
                attend(cur[2], cur[3], None, whole=True)
        pending.wait()
        if recv:
            cur = nxt
    return made()


def ring_pass_q(
    comm: Comm,
    q,
    k,
    v,
    kv_len,
    pieces: Pieces,
    *,
    k_pos=None,
    scale=None,
    window=None,
    softcap=None,
    attend=partial_attention,
):
    """Attention of every rank's queries to every rank's *cached* shard: queries travel, KV stays.

    Each query block (with its running ``(o, lse)``) visits every rank once and comes home:
    p transfers of ``q + o`` per layer instead of rotating the whole cache.

    Args:
        q: ``[B, H, n_r, d]`` this rank's queries (its ranges of ``pieces``, concatenated).
        k, v: ``[B, H_kv, N_r, d]`` this rank's cache, ``kv_len [B]`` valid lengths,
            ``k_pos [B, N_r]`` positions (needed with a sliding window).
        attend: ``partial_attention`` or a stand-in with its signature that reads this rank's
            cache as it is stored (an fp8 cache's scales and rotation).
    Returns:
        ``(o [B, H, n_r, d] fp32, lse [B, H, n_r] fp32)`` over all ranks' caches.
    """
    p, r = comm.world, comm.rank
    lens = [size(pc) for pc in pieces]
    stats = comm.stats
    n_cache = k.shape[2]  # a cache's view is cut at its longest sequence: max(kv_len), read from no device

    def local(qb, src):
        qpos = positions(pieces[src], qb.device) if window else None
        if stats.enabled:
            stats.add_flops(flops(qb.shape[0], qb.shape[1], qb.shape[3], qb.shape[2], n_cache, "full"))
        return attend(
            qb,
            k,
            v,
            scale=scale,
            kv_len=kv_len,
            softcap=softcap,
            window=window,
            q_pos=qpos,
            k_pos=k_pos if window else None,
            out_dtype=torch.float32,
        )

    o, lse = local(q, r)
    held = [q.contiguous(), o.contiguous(), lse.contiguous()]
    if p == 1:
        return held[1], held[2]
    B, H, _, d = q.shape
    for t in range(p):  # round t: pass the block of rank r - t on; receive that of r - t - 1
        src_in = (r - t - 1) % p
        last = t == p - 1  # the last hop brings each block home: its queries are no longer needed
        send = held[1:] if last else held
        n_in = lens[src_in]
        recv = [
            q.new_empty(B, H, n_in, d),
            q.new_empty(B, H, n_in, d, dtype=torch.float32),
            q.new_empty(B, H, n_in, dtype=torch.float32),
        ]
        recv = recv[1:] if last else recv
        pending = comm.shift(send if lens[(r - t) % p] else [], recv if n_in else [], dst=(r + 1) % p, src=(r - 1) % p)
        pending.wait()
        if last:
            return tuple(recv) if n_in else (held[1][:, :, :0], held[2][:, :, :0])
        if n_in:
            bo, bl = local(recv[0], src_in)
            mo, ml = merge_pair(recv[1], recv[2], bo, bl)
            held = [recv[0], mo.contiguous(), ml.contiguous()]
        else:
            held = [x[:, :, :0] for x in held]


def plan(
    segment: int,
    cached: int,
    *,
    p: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    esize: int,
    window=None,
    quantized: bool = False,
) -> tuple[str, dict]:
    """``("pass-kv" | "pass-q", bytes each would move per rank per layer)`` for a segment of
    ``segment`` tokens after ``cached`` tokens spread over ``p`` ranks. Pass-KV sends every
    rank's cache shard and segment piece around the ring (p - 1 hops); pass-Q sends each
    rank's queries and running partials (fp32) around all p ranks, on top of the segment's own
    pass-KV. Windows always pass queries (a cache shard is not all in a window), and so does an
    fp8 cache (its shards stay where they are stored, with their scales)."""
    kv_tok = 2 * kv_heads * head_dim * esize
    q_tok = heads * head_dim * esize + heads * head_dim * 4 + heads * 4
    seg_kv = (p - 1) * segment / p * kv_tok
    cost = {"pass-kv": seg_kv + (p - 1) * cached / p * kv_tok, "pass-q": seg_kv + p * segment / p * q_tok}
    if cached == 0:
        return "pass-kv", cost
    if window is not None or quantized:  # even on one rank: ring_prefill sees a cache shard whole, as stored
        return "pass-q", cost
    if p == 1:
        return "pass-kv", cost
    return min(cost, key=cost.get), cost
