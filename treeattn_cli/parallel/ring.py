"""The ring decode baseline (docs/architecture.md §3): KV blocks rotate p - 1 steps (the paper's baseline,
GQA-native), and the balanced contiguous cut of tokens over ranks. Prefill's ring lives in
``engine/prefill.py``.

Blocks move between neighbours with :meth:`Comm.shift` (the send of the next block overlaps the
attention over the current one); partials merge with ``merge.py``. Blocks carry ``H_kv`` heads,
never ``H``.
"""

from __future__ import annotations

import torch

from treeattn_kernels import partial_attention

from .comm import Comm
from .merge import merge_partials


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
        return partial_attention(q, k, v, scale=scale, kv_len=kv_len, softcap=softcap, out_dtype=torch.float32)
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
        o, lse = partial_attention(
            q, cur[0], cur[1], scale=scale, kv_len=cur[2], softcap=softcap, out_dtype=torch.float32
        )
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
