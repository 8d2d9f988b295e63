"""The attention function Hugging Face calls per layer: local partial -> comm merge.

Registered through transformers' ``AttentionInterface`` under the name ``"treeattn"``. Models
are run with ``use_cache=False`` so the layer hands us the new token(s)' RoPE'd K/V; the
sharded cache, the communicator and the phase live in an :class:`AttentionContext` that travels
through the model's ``**kwargs`` as ``treeattn_ctx``. Masks are built from global positions
here, so transformers' mask (None for an unregistered implementation) is never needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treeattn_kernels import partial_attention

from .cache import ShardedKVCache
from .comm import Comm
from .merge import merge_pair
from .prefill import ring_pass_q, ring_prefill
from .ring import ring_decode

ATTN_NAME = "treeattn"


@dataclass
class AttentionContext:
    """What our attention needs beyond the layer's q/k/v (one per rank, reused every step).

    ``phase``: ``"prefill"`` (this rank's piece of a prompt segment, cut as ``pieces``, global
    positions) or ``"decode"`` (one new token per sequence, every rank computing it).
    """

    comm: Comm
    cache: ShardedKVCache
    phase: str = "decode"
    pieces: list = field(default_factory=list)  # prefill: every rank's position ranges (prefill.shard)
    positions: object = None  # prefill: this rank's positions [n_r]
    cache_lens: list = field(default_factory=list)  # prefill: every rank's cached tokens before the segment
    method: str = "pass-kv"  # prefill with a cache: "pass-kv" (the cache travels) or "pass-q" (queries do)
    on_layer: object = None  # prefill progress callback(layer_index)
    decode_method: str = "tree"  # "ring": the KV-rotating baseline (bench)


def treeattn_attention(module, query, key, value, attention_mask=None, *, scaling=None,
                       dropout=0.0, sliding_window=None, softcap=None, treeattn_ctx=None, **_):
    """``query [B, H, T, d]``, ``key/value [B, H_kv, T, d]`` (RoPE applied) -> ``([B, T, H, d], None)``."""
    ctx: AttentionContext = treeattn_ctx
    if ctx is None:
        raise RuntimeError("treeattn attention called without its context (treeattn_ctx)")
    if dropout:
        raise ValueError("treeattn is inference-only: attention dropout must be 0")
    layer = module.layer_idx
    window = sliding_window or None
    cache, comm = ctx.cache, ctx.comm
    if ctx.phase == "prefill":
        cached = any(ctx.cache_lens)  # known on every rank: they all take the same path
        travel = cached and ctx.method == "pass-kv"
        if cached:
            k, v, kv_len, pos = cache.view(layer)
        o, lse = ring_prefill(comm, query, key, value, ctx.pieces, scale=scaling, window=window, softcap=softcap,
                              cache=(k, v) if travel else None, cache_lens=ctx.cache_lens if travel else None)
        if cached and not travel:  # the cache stays; queries visit every rank's shard
            po, pl = ring_pass_q(comm, query, k, v, kv_len, ctx.pieces, k_pos=pos, scale=scaling,
                                 window=window, softcap=softcap)
            o, lse = merge_pair(o, lse, po, pl)
        cache.append_chunk(layer, key, value, ctx.positions)
        if ctx.on_layer is not None:
            ctx.on_layer(layer)
    else:
        k, v, kv_len = cache.update(layer, key, value)
        if ctx.decode_method == "ring":
            if window is not None:
                raise ValueError("the ring decode baseline does not support sliding-window layers")
            lens = cache.shard_lens()  # every rank's block length, known without a collective
            n = lens[comm.rank]
            o, _ = ring_decode(comm, query, k[:, :, :n], v[:, :, :n], kv_len, shard_lens=lens,
                               scale=scaling, softcap=softcap)
            return o.to(query.dtype).transpose(1, 2).contiguous(), None
        q_pos = k_pos = None
        if window is not None:
            q_pos, k_pos = cache.step_positions[:, None], cache.pos[:, : k.shape[2]]
        o, lse = partial_attention(query, k, v, scale=scaling, kv_len=kv_len, window=window,
                                   softcap=softcap, q_pos=q_pos, k_pos=k_pos, out_dtype=torch.float32)
        B, H, T, d = query.shape
        out = torch.empty(B, T, H, d, dtype=query.dtype, device=query.device)  # the layer's layout
        comm.merge(o, lse, out=out.transpose(1, 2))
        return out, None
    return o.to(query.dtype).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register our attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, treeattn_attention)
    return ATTN_NAME
