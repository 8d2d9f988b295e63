"""Partial attention read through block tables: the torch reference (issue 35, first part).

A paged KV cache (``treeattn_cli.engine.pool``) keeps each rank's keys and values in one pool
of blocks, ``[num_blocks, H_kv, page, d]`` per layer; a sequence's shard is a row of block ids
(its block table) and a length. :func:`partial_attention_paged_ref` is
:func:`partial_attention_ref` over the tokens those tables name, so rows of different sequences
(and different documents) are served by one call, and rows whose tables share blocks read the
same storage. It gathers each row's blocks into a dense shard first: exact and simple, the
oracle of a paged kernel, not a fast path.
"""

from __future__ import annotations

import torch

from .partial_ref import partial_attention_ref


def gather_pages(pool: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The blocks of each table, in order, as dense rows: ``pool [num_blocks, H_kv, page, X]``,
    ``block_tables [B, nb]`` -> ``[B, H_kv, nb * page, X]``; ``pool [num_blocks, page]`` (the
    positions) -> ``[B, nb * page]``."""
    g = pool[block_tables.long()]  # [B, nb, H_kv, page, X] or [B, nb, page]
    if g.dim() == 3:
        return g.reshape(g.shape[0], -1)
    B, nb, H, page, X = g.shape
    return g.permute(0, 2, 1, 3, 4).reshape(B, H, nb * page, X)


def partial_attention_paged_ref(
    q,
    k_pool,
    v_pool,
    block_tables,
    kv_len,
    *,
    scale=None,
    q_pos=None,
    pos_pool=None,
    window=None,
    softcap=None,
    sink=None,
    k_scale=None,
    v_scale=None,
    out=None,
    lse_out=None,
):
    """Partial attention of ``q [B, H, Q, d]`` to the shards ``block_tables [B, nb]`` name.

    ``k_pool, v_pool [num_blocks, H_kv, page, d]``: a layer's pool; row b's keys are the first
    ``kv_len[b]`` tokens of its blocks in table order (entries past them are never read, so a
    padded table may hold anything there). ``q_pos [B, Q]`` with ``pos_pool [num_blocks, page]``
    (every token's global position): causal masking and ``window``; ``k_scale, v_scale
    [num_blocks, H_kv, page, G]``: the pool is fp8 with its scales. The rest as
    :func:`partial_attention_ref`. Returns ``(o [B, H, Q, d], lse [B, H, Q])``; a row with no
    key gives ``o = 0, lse = -inf``.
    """
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables must be [B, blocks] with B = {q.shape[0]}, got {tuple(block_tables.shape)}")
    if (q_pos is None) != (pos_pool is None):
        raise ValueError("causal masking needs both q_pos and pos_pool")
    page = k_pool.shape[2]
    if kv_len is not None and kv_len.numel() and int(kv_len.max()) > block_tables.shape[1] * page:
        raise ValueError(f"kv_len {kv_len.tolist()} exceeds the tables' {block_tables.shape[1]} blocks of {page}")
    k, v = gather_pages(k_pool, block_tables), gather_pages(v_pool, block_tables)
    kw = {}
    if k_scale is not None:
        kw.update(k_scale=gather_pages(k_scale, block_tables), v_scale=gather_pages(v_scale, block_tables))
    if q_pos is not None:
        kw.update(q_pos=q_pos, k_pos=gather_pages(pos_pool, block_tables))
    return partial_attention_ref(
        q, k, v, scale=scale, kv_len=kv_len, window=window, softcap=softcap, sink=sink, out=out, lse_out=lse_out, **kw
    )
