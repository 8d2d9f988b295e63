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

from treeattn_kernels import (
    Partials,
    add_sink,
    dequantize,
    gather_pages,
    gpu_path,
    merge_two,
    partial_attention,
    partial_attention_paged,
    reference_only,
    takes_triton,
    triton_available,
)

from ..model import invariance
from ..parallel.comm import Comm
from ..parallel.merge import merge_pair
from .prefill import flops, ring_pass_q, ring_prefill
from ..parallel.ring import ring_decode

ATTN_NAME = "treeattn"


@dataclass
class AttentionContext:
    """What our attention needs beyond the layer's q/k/v (one per rank, reused every step).

    ``phase``: ``"prefill"`` (this rank's piece of a prompt segment, cut as ``pieces``, global
    positions), ``"replicated"`` (a segment shorter than the sequence shards, or a speculative
    step, every rank computing all of it at ``positions``, each token kept by one rank: an
    extension of the cache, ``cache.begin_extend``), ``"decode"`` (one new token per
    sequence, every rank computing it) or ``"cascade"`` (many sequences over one shared
    document: ``cache`` holds the document, ``tail`` each sequence's own tokens; ``rows`` of the
    tail at ``positions [R, T]``, one token each (``step``) or several (an extension)).
    """

    comm: Comm
    cache: object = None  # prefill: the shard the tokens join (paged_shard.PagedShard)
    phase: str = "decode"
    pieces: list = field(default_factory=list)  # prefill: every rank's position ranges (prefill.shard)
    positions: object = None  # prefill: this rank's positions [n_r]
    cache_lens: list = field(default_factory=list)  # prefill: every rank's cached tokens before the segment
    method: str = "pass-kv"  # prefill with a cache: "pass-kv" (the cache travels) or "pass-q" (queries do)
    on_layer: object = None  # prefill progress callback(layer_index)
    decode_method: str = "tree"  # "ring": the KV-rotating baseline (bench)
    tail: object = None  # cascade: every sequence's own tokens, batch = slots
    rows: list = field(default_factory=list)  # cascade: the tail rows (sequences) of this forward
    step: bool = True  # cascade: one token per sequence (tail.plan_step) or an extension (begin_extend)
    groups: list = field(default_factory=list)  # cascade: (document cache, its rows [R_g] or None: all, the same
    # rows as a host list)
    eager: bool = True  # decode: the step is not captured in a CUDA graph (it merges with comm.eager_scheme)
    cite: object = None  # decode/replicated: the answer's cite.Citation (its rows' attention per span), or None
    cites: list = field(default_factory=list)  # cascade: each row's cite.Citation or None (documents only)
    paged: tuple | None = None  # cascade: the documents' (block tables, lengths) on the device, for every layer
    ext: tuple | None = None  # verify (and a cascade's fixed-shape verify): each new token's slot here or the
    # write-off slot [R·T], each row's keys with the ones it keeps here [R], on the device


# Arguments of a model's forward that transformers passes on to every attention call and that
# change nothing here: positions, the cache and the outputs come from our own context.
PASSING = frozenset({"position_ids", "use_cache", "output_router_logits", "output_attentions", "cache_position"})


class UnsupportedAttention(ValueError):
    """A model hands our attention an argument treeattn does not honour: refused, never ignored
    (an ignored argument is a wrong answer with exit status 0)."""


def _model_type(module) -> str:
    cfg = getattr(module, "config", None)
    return getattr(cfg, "model_type", None) or type(module).__name__


def treeattn_attention(
    module,
    query,
    key,
    value,
    attention_mask=None,
    *,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    is_causal=None,
    treeattn_ctx=None,
    **rest,
):
    """``query [B, H, T, d]``, ``key/value [B, H_kv, T, d]`` (RoPE applied) -> ``([B, T, H, d], None)``.

    Every argument transformers hands over is honoured or refused: ``scaling``, ``sliding_window``,
    ``softcap`` (logit soft-capping) and ``s_aux`` (learned sink logits, one per query head:
    gpt-oss) are honoured; ``dropout`` must be 0 and ``is_causal`` not False; the flags in
    :data:`PASSING` change nothing; anything else raises :class:`UnsupportedAttention`."""
    unknown = sorted(set(rest) - PASSING)
    if unknown:
        raise UnsupportedAttention(
            f"model type '{_model_type(module)}' passes the attention argument "
            f"'{unknown[0]}', which treeattn does not support (refused rather than ignored)"
        )
    if is_causal is False:
        raise UnsupportedAttention(
            f"model type '{_model_type(module)}' asks for bidirectional attention "
            "(is_causal=False); treeattn decodes causal language models"
        )
    ctx: AttentionContext = treeattn_ctx
    if ctx is None:
        raise RuntimeError("treeattn attention called without its context (treeattn_ctx)")
    if dropout:
        raise ValueError("treeattn is inference-only: attention dropout must be 0")
    layer = module.layer_idx
    window = sliding_window or None
    sink = _sinks(module, s_aux, query.shape[1])
    cache, comm = ctx.cache, ctx.comm
    if ctx.phase == "prefill":
        key, value = cache.as_stored(key), cache.as_stored(value)  # fp8 or another dtype: as they will be kept
        cached = any(ctx.cache_lens)  # known on every rank: they all take the same path
        travel = cached and ctx.method == "pass-kv" and cache.quant is None  # fp8 shards stay with their scales
        if cached:
            k, v, kv_len, pos = cache.view(layer)
        o, lse = ring_prefill(
            comm,
            query,
            key,
            value,
            ctx.pieces,
            scale=scaling,
            window=window,
            softcap=softcap,
            cache=(k.to(key.dtype), v.to(key.dtype)) if travel else None,
            cache_lens=ctx.cache_lens if travel else None,
        )
        if cached and not travel:  # the cache stays; queries visit every rank's shard
            po, pl = ring_pass_q(
                comm,
                query,
                k,
                v,
                kv_len,
                ctx.pieces,
                k_pos=pos,
                scale=scaling,
                window=window,
                softcap=softcap,
                attend=_stored(cache, layer),
            )
            o, lse = merge_pair(o, lse, po, pl)
        if sink is not None:  # these queries' partials over every key are merged: the sink joins once
            o, lse = add_sink(o, lse, sink)
        cache.append_chunk(layer, key, value, ctx.positions)
        if ctx.on_layer is not None:
            ctx.on_layer(layer)
    elif ctx.phase == "cascade":
        return _cascade(ctx, layer, query, key, value, scaling, window, softcap, sink), None
    elif ctx.phase == "replicated":
        o, lse = _replicated(ctx, layer, query, key, value, scaling, window, softcap, sink)
        B, H, T, d = query.shape
        out = torch.empty(B, T, H, d, dtype=query.dtype, device=query.device)  # the layer's layout
        comm.merge(o, lse, out=out.transpose(1, 2), eager=True)  # a short segment: never captured
        if ctx.on_layer is not None:
            ctx.on_layer(layer)
        return out, None
    else:
        raise RuntimeError(f"treeattn attention: unknown phase {ctx.phase!r}")
    return o.to(query.dtype).transpose(1, 2).contiguous(), None


def _stored(cache, layer: int, rows=None, extension: bool = False):
    """``partial_attention`` over ``cache``'s own views as stored (``extension``: over the
    extension this rank keeps, ``cache.extension_view``). An fp8 cache: the queries turn into
    its rotated basis, its per-token scales come along, and the output turns back. A cache in
    another dtype than the model's: its rows are read in the model's dtype (lossless: they were
    computed in it)."""
    quant = cache.quant

    def attend(q, k, v, **kw):
        if quant is None:
            return partial_attention(q, k.to(q.dtype), v.to(q.dtype), **kw)  # no copy when they agree
        ks, vs = cache.extension_scales(layer, 0) if extension else cache.scales(layer, k.shape[2], rows)
        o, lse = partial_attention(quant.rotate(q), k, v, k_scale=ks, v_scale=vs, **kw)
        return quant.unrotate(o), lse

    return attend


def _sinks(module, s_aux, heads: int):
    """``s_aux`` as ``[H]`` fp32 logits of the query heads this rank attends with, or None."""
    if s_aux is None:
        return None
    s = s_aux.to_local() if hasattr(s_aux, "to_local") else s_aux  # a tensor-parallel shard
    s = s.detach().reshape(-1).float()
    if s.numel() != heads:
        raise UnsupportedAttention(
            f"model type '{_model_type(module)}': {s.numel()} attention sink logits "
            f"for {heads} query heads on this rank"
        )
    return s


def _cascade(ctx: AttentionContext, layer: int, q, k_new, v_new, scale, window, softcap, sink):
    """Cascade attention (docs/architecture.md §11): ``q [R, H, T, d]`` of R sequences, each continuing a
    document (``ctx.groups``: each document's cache and its rows; none: ``ctx.cache`` for all).
    A document's rows go against this rank's shard of it in one call — the query rows of a KV
    head meet each K/V tile once, so the shard is read once for all of them — and each
    sequence's rows against its own tokens in the tail (causal; on the GPU's path a pooled tail's
    rows through their block tables in one more launch, :func:`_tail_paged`); the two partials merge by LSE,
    then across ranks in one merge for the whole batch, whatever documents its rows read.
    Returns ``[R, T, H, d]``."""
    if ctx.decode_method == "ring":
        return _ring(ctx, layer, q, k_new, v_new, scale, window, softcap, sink)
    R, H, T, d = q.shape
    tail, comm = ctx.tail, ctx.comm
    pos = ctx.positions  # [R, T] global positions of the queries (-1: padding)
    groups = ctx.groups or [(ctx.cache, None, list(range(R)))]
    cites = [c if c is not None and c.wants(layer) else None for c in ctx.cites] if ctx.cites else []
    cited = []  # (citation, row, block_lse [H, T, N] of its document's shard, the shard, its keys' positions)
    o_d = l_d = None
    docs_paged = gpu_path(q) and pooled_documents([doc for doc, _, _ in groups])
    tail_paged = gpu_path(q) and getattr(tail, "pool", None) is not None
    # an fp8 pool on the GPU's path: q turns into its rotated basis once for both partials, and
    # their merge turns back once (a merge is linear in o), where each partial turned both ways
    quant = tail.pool.quant if tail_paged and docs_paged and groups[0][0].pool is tail.pool else None
    qa = quant.rotate(q) if quant is not None else q
    fuse = takes_triton(q)  # the GPU's merge: the two calls' splits reduced and merged in one launch
    if docs_paged:  # the GPU's path: one launch through the tables
        d_part = _documents_paged(ctx, groups, layer, qa, pos, scale, window, softcap, cites, cited, quant, fuse)
        groups = []
    for doc, idx, members in groups:
        qg, pg = (q, pos) if idx is None else (q[idx], pos[idx])
        Rg = qg.shape[0]
        dk, dv, dlen, dpos = doc.view(layer)  # [1, H_kv, N, d]: the document, never copied per sequence
        rows = qg.transpose(0, 1).reshape(1, H, Rg * T, d)  # [1, H, Rg·T, d]: sequences as query rows
        kw = dict(q_pos=pg.reshape(Rg * T), k_pos=dpos, window=window, k_pos_sorted=True) if window is not None else {}
        asking = [i for i in members if cites[i] is not None] if cites else []
        blocks = {}
        if asking:  # the rows that cite: each key's log-sum-exp (their sequences' rows only)
            want = torch.tensor([i in asking for i in members], device=q.device).repeat_interleave(T)[None]
            blocks = _blocks(rows, dk.shape[2], want)
        o, lse = _stored(doc, layer)(
            rows,
            dk,
            dv,
            scale=scale,
            kv_len=dlen,
            softcap=softcap,
            out_dtype=torch.float32,
            impl=shared_impl(q),
            **kw,
            **blocks,
        )
        for j, i in enumerate(members):
            if i in asking:
                cited.append(
                    (cites[i], i, blocks["block_lse"][0, :, j * T : (j + 1) * T], doc, lambda dpos=dpos: dpos[0])
                )
        o = o.view(H, Rg, T, d).transpose(0, 1)  # [Rg, H, T, d]
        lse = lse.view(H, Rg, T).transpose(0, 1)  # [Rg, H, T]
        if idx is None:
            o_d, l_d = o, lse
            continue
        if o_d is None:
            o_d = torch.zeros(R, H, T, d, dtype=o.dtype, device=o.device)
            l_d = torch.full((R, H, T), float("-inf"), dtype=lse.dtype, device=lse.device)
        o_d[idx], l_d[idx] = o, lse
    if not docs_paged:
        d_part = (o_d, l_d)
    if tail_paged:  # the GPU's path: each row's tail through its blocks, one launch
        t_part = _tail_paged(ctx, layer, qa, k_new, v_new, scale, window, softcap, quant, fuse)
    else:
        t_part = _tail_dense(ctx, layer, q, k_new, v_new, scale, window, softcap)
    out = invariance.empty_rows((R, T, H, d), q.dtype, q.device, width=H * d)  # the layer's layout, o_proj's rows
    if fuse:  # (one launch on a GPU, an fp8 pool's unrotation in it; alone, into the layer's output)
        last = comm.world == 1 and sink is None
        rotation = None if quant is None else quant.rt
        o, lse = merge_two(d_part, t_part, out=out.transpose(1, 2) if last else None, rotation=rotation)
    else:
        last = False
        o, lse = merge_pair(*d_part, *t_part)
        if quant is not None:
            o = quant.unrotate(o)
    if sink is not None and comm.rank == 0:  # the same queries on every rank: the sink joins once
        o, lse = add_sink(o, lse, sink)
    if not last:
        _, lse = comm.merge(o, lse, out=out.transpose(1, 2), eager=ctx.eager)  # a batch's step may be captured
    for cite, i, bl, doc, positions in cited:  # each row's share of its merged attention, per key
        cite.add(layer, bl, lse[i], cite.bins_of(doc, bl.shape[-1], positions))
    return out


def _ring(ctx: AttentionContext, layer: int, q, k_new, v_new, scale, window, softcap, sink):
    """The ring baseline of ``treeattn bench`` (``decode_method="ring"``): one sequence's step
    (``q [1, H, 1, d]``), this rank's shard of its document and its own tokens in the tail one
    block of KV that rotates over the ranks (``parallel.ring.ring_decode``: p - 1 passes), every
    rank merging all p partials itself. Returns ``[1, 1, H, d]``."""
    if window is not None:
        raise ValueError("the ring decode baseline does not support sliding-window layers")
    if len(ctx.groups) != 1 or q.shape[0] != 1 or q.shape[2] != 1 or not ctx.step:
        raise ValueError("the ring decode baseline decodes one sequence a token at a time (no batch, no drafts)")
    ((doc, _, _),) = ctx.groups
    tail, comm = ctx.tail, ctx.comm
    lens = (tail.counts[0] + tail.beside[0]).tolist()  # every rank's block: its document shard and tail tokens
    n_t = int(tail.counts[0, comm.rank])  # (host bookkeeping: no collective)
    dk, dv, _, _ = doc.view(layer)  # [1, H_kv, N, d]
    tk, tv, _ = tail.update(layer, k_new, v_new)  # the step's token written; [1, H_kv, L, d]
    parts = [(dk, dv, doc.scales(layer, dk.shape[2])), (tk[:, :, :n_t], tv[:, :, :n_t], tail.scales(layer, n_t))]
    quant = tail.quant
    if quant is not None:  # the baseline rotates plain blocks: dequantized, in the rotated basis
        q = quant.rotate(q)
        k = torch.cat([dequantize(k, ks, q.dtype) for k, _, (ks, _) in parts], dim=2)
        v = torch.cat([dequantize(v, vs, q.dtype) for _, v, (_, vs) in parts], dim=2)
    else:  # another storage dtype: read in the model's
        k = torch.cat([k.to(q.dtype) for k, _, _ in parts], dim=2)
        v = torch.cat([v.to(q.dtype) for _, v, _ in parts], dim=2)
    kv_len = torch.tensor([k.shape[2]], dtype=torch.int64, device=q.device)
    o, lse = ring_decode(comm, q, k, v, kv_len, shard_lens=lens, scale=scale, softcap=softcap)
    if quant is not None:
        o = quant.unrotate(o)
    if sink is not None:  # every rank merged all p partials itself
        o, _ = add_sink(o, lse, sink)
    return o.to(q.dtype).transpose(1, 2).contiguous()


def _tail_dense(ctx: AttentionContext, layer: int, q, k_new, v_new, scale, window, softcap):
    """The tail's partials of a cascade (``q [R, H, T, d]``): the new tokens written, each row
    against its own tokens (causal by position), read from the tail's dense views (a pooled
    tail's gathered into them). Returns ``(o [R, H, T, d] fp32, lse [R, H, T])``."""
    tail, pos = ctx.tail, ctx.positions
    T = q.shape[2]
    if ctx.step:  # one token per sequence, placed by tail.plan_step
        tk, tv, tlen = tail.update(layer, k_new, v_new)
        tpos = tail.pos[:, : tk.shape[2]]
    elif ctx.ext is not None:  # a fixed-shape verify (every row, every token written: here or written off)
        slots, tlen = ctx.ext
        tail.put_rows(layer, slots, k_new, v_new)
        tk, tv, tpos = tail.full(layer)
    else:
        tail.extend(layer, k_new, v_new)
        tk, tv, tlen, tpos = tail.view_rows(layer, ctx.rows, extended=True)
    kw = dict(q_pos=pos, k_pos=tpos, window=window) if (T > 1 or window is not None) else {}
    every = ctx.step or ctx.ext is not None  # every row of the tail (else the extension's rows)
    return _stored(tail, layer, None if every else ctx.rows)(
        q, tk, tv, scale=scale, kv_len=tlen, softcap=softcap, out_dtype=torch.float32, **_tail_kernel(q), **kw
    )


def shared_impl(q) -> str:
    """The kernel of a cascade's document partials, whose query rows are several requests'
    (issue 49: a row's bits must not depend on its neighbours): on the GPU's path the Triton
    split kernel, whatever the rows (ATen's, which takes long query blocks elsewhere, would
    change with their number; its splits and tile are fixed); on a CPU ATen's fused kernel in
    fp32 (row-invariant under MKL's strict mode: its matmuls are, measured) and the reference in
    bf16 and fp16 (the fused kernel packs its tiles by the problem's size there)."""
    if gpu_path(q):  # (the reference where the fast kernels failed their self-check: use_reference)
        return "triton" if triton_available() and not reference_only() else "torch"
    return "auto" if q.dtype == torch.float32 else "torch"


def _tail_kernel(q) -> dict:
    """The kernel of a cascade's tail partials: keys that grow at the end (a verify's later
    drafts, the next steps' tokens) in splits of one fixed length, so a row's bits do not depend
    on the tail's width either: the Triton kernel's ``fixed_splits`` on the GPU's path, the
    reference (always so) elsewhere."""
    return dict(impl=shared_impl(q) if gpu_path(q) else "torch", fixed_splits=True)


def _tail_paged(
    ctx: AttentionContext, layer: int, q, k_new, v_new, scale, window, softcap, rotated=None, partials=False
):
    """:func:`_tail_dense` read where the tail lies: a pooled tail (``paged_tail.PagedTail``)
    hands each row's blocks as a table, and one paged call reads every row's own tokens from
    the pool (nothing gathered; the positions for masks and windows are the pool's). Same
    return (``rotated``, ``partials``: :func:`_pooled`'s)."""
    tail, pos = ctx.tail, ctx.positions
    pool = tail.pool
    if ctx.step:
        tables, kv_len = tail.step_tables(layer, k_new, v_new)
    elif ctx.ext is not None:  # a fixed-shape verify (every row, every token written: here or written off)
        slots, kv_len = ctx.ext
        tail.put_rows(layer, slots, k_new, v_new)
        tables = tail.full_tables()
    else:
        tail.extend(layer, k_new, v_new)
        tables, kv_len = tail.rows_tables(ctx.rows, extended=True)
    kw = dict(q_pos=pos, pos_pool=pool.pos, window=window) if (q.shape[2] > 1 or window is not None) else {}
    return _pooled(
        pool, layer, q, tables, kv_len, rotated, partials, scale=scale, softcap=softcap, **_tail_kernel(q), **kw
    )


def _pooled(pool, layer: int, q, tables, kv_len, rotated=None, partials=False, **kw):
    """``partial_attention_paged`` over ``pool``'s layer as stored (:func:`_stored`'s twin for
    block tables): an fp8 pool's queries turn into its rotated basis, its per-block scales come
    along, and the output turns back; ``rotated`` (the pool's ``KVQuant``): ``q`` is in that
    basis already and the output stays in it. Returns ``(o fp32, lse)``; with ``partials``, where
    the Triton kernel runs and nothing turns back, its splits unreduced (``Partials``)."""
    quant = pool.quant
    if quant is not None:
        kw.update(k_scale=pool.ks[layer], v_scale=pool.vs[layer])
    turn = quant is not None and rotated is None
    got = partial_attention_paged(
        quant.rotate(q) if turn else q,
        pool.k[layer],
        pool.v[layer],
        tables,
        kv_len,
        out_dtype=torch.float32,
        partials=partials and not turn,
        **kw,
    )
    if isinstance(got, Partials):
        return got
    o, lse = got
    return (quant.unrotate(o) if turn else o), lse


def pooled_documents(shards) -> bool:
    """Whether every document of a cascade lives in the same block pool (``paged_shard``)."""
    pools = {id(getattr(doc, "pool", None)) for doc in shards}
    return len(pools) == 1 and getattr(shards[0], "pool", None) is not None


def _documents_paged(
    ctx, groups, layer: int, q, pos, scale, window, softcap, cites, cited, rotated=None, partials=False
):
    """The documents' partials of a cascade in one paged call (``q [R, H, T, d]``, ``pos [R, T]``):
    each document is a row of the call, its sequences' T-token rows its query rows (padded to
    the longest group; padding at position -1), read through its block table. Returns
    ``(o [R, H, T, d] fp32, lse [R, H, T])``, or with ``partials``, where every row reads one
    document, the call's splits unreduced as ``[R, H, T]`` rows (:func:`_pooled`). ``cites``:
    each row's citation (or none); the rows that cite get their per-key log-sum-exp over their
    document's blocks, appended to ``cited`` as :func:`_cascade` reads them; ``rotated``:
    :func:`_pooled`'s."""
    from .pool import tables_tensor

    R, H, T, d = q.shape
    shards = [doc for doc, _, _ in groups]
    pool = shards[0].pool
    idxs = [range(R) if idx is None else idx for _, idx, _ in groups]  # (None: one group of every row)
    width = max(len(i) for i in idxs) * T
    whole = len(groups) == 1 and groups[0][1] is None  # every row over one document: no gather, no scatter
    if whole:
        qq = q.transpose(0, 1).reshape(1, H, width, d)  # [1, H, R·T, d]
        qp = pos.reshape(1, width).to(torch.int64)
    else:
        qq = q.new_zeros(len(groups), H, width, d)
        qp = torch.full((len(groups), width), -1, dtype=torch.int64, device=q.device)
        for g, idx in enumerate(idxs):
            qq[g, :, : len(idx) * T] = q[idx].transpose(0, 1).reshape(H, len(idx) * T, d)
            qp[g, : len(idx) * T] = pos[idx].reshape(-1)
    if ctx.paged is not None:  # sent once for the forward (batch.BatchDecoder._forward)
        tables, kv_len = ctx.paged
    else:
        tables, _ = tables_tensor([s.table for s in shards], device=q.device)
        kv_len = torch.tensor([s.n for s in shards], dtype=torch.int64, device=q.device)
    kw = dict(q_pos=qp, pos_pool=pool.pos, window=window) if window is not None else {}
    asking = [[i for i in members if cites[i] is not None] if cites else [] for _, _, members in groups]
    if any(asking):  # the rows that cite: each key's log-sum-exp, in table order
        want = torch.zeros(len(groups), width, dtype=torch.bool)
        for g, (_, _, members) in enumerate(groups):
            for j, i in enumerate(members):
                if i in asking[g]:
                    want[g, j * T : (j + 1) * T] = True
        kw.update(_blocks(qq, tables.shape[1] * pool.page, want.to(q.device)))
    got = _pooled(
        pool,
        layer,
        qq,
        tables,
        kv_len,
        rotated,
        partials and whole,
        scale=scale,
        softcap=softcap,
        impl=shared_impl(q),
        **kw,
    )
    unreduced = isinstance(got, Partials)  # (every row over one document: returned as [R, H, T] rows)
    if whole and not unreduced:  # (views of the call's rows: [R, H, T, d], [R, H, T])
        o, lse = got
        o_d, l_d = o[0].view(H, R, T, d).transpose(0, 1), lse[0].view(H, R, T).transpose(0, 1)
    elif not whole:
        o, lse = got
        o_d = torch.zeros(R, H, T, d, dtype=torch.float32, device=q.device)
        l_d = torch.full((R, H, T), float("-inf"), dtype=torch.float32, device=q.device)
    for g, idx in enumerate(idxs):
        for j, i in enumerate(groups[g][2]):
            if i in asking[g]:  # the document's keys in table order: their positions through its table
                table = tables[g : g + 1]
                cited.append(
                    (
                        cites[i],
                        i,
                        kw["block_lse"][g, :, j * T : (j + 1) * T],
                        shards[g],
                        lambda table=table: gather_pages(pool.pos, table)[0],
                    )
                )
        if not whole:
            n = len(idx)
            o_d[idx] = o[g, :, : n * T].reshape(H, n, T, d).transpose(0, 1).to(o_d.dtype)
            l_d[idx] = lse[g, :, : n * T].reshape(H, n, T).transpose(0, 1)
    return got.of_rows(T) if unreduced else (o_d, l_d)


def _replicated(ctx: AttentionContext, layer: int, q, k_new, v_new, scale, window, softcap, sink):
    """This rank's partial for a segment every rank computes (``q [1, H, n, d]``): its cached
    shard, and the segment's tokens this rank keeps (causal; written now). Rank 0 carries the
    sink (the same queries on every rank: it joins the merge once)."""
    cache, pos = ctx.cache, ctx.positions
    k, v, kv_len, k_pos = cache.view(layer)  # the shard before this segment
    kw = dict(q_pos=pos, k_pos=k_pos, window=window, k_pos_sorted=True) if window is not None else {}
    o, lse = _stored(cache, layer)(
        q,
        k,
        v,
        scale=scale,
        kv_len=kv_len,
        softcap=softcap,
        out_dtype=torch.float32,
        sink=sink if ctx.comm.rank == 0 else None,
        **kw,
    )
    stats = ctx.comm.stats
    B, H, n, d = q.shape
    if stats.enabled:
        stats.add_flops(flops(B, H, d, n, k.shape[2], "full"))
    cache.extend(layer, k_new, v_new)
    nk, nv, npos = cache.extension_view(layer, 0)  # the new tokens this rank keeps: [1, H_kv, m, d]
    if nk.shape[2]:
        po, pl = _stored(cache, layer, extension=True)(
            q,
            nk,
            nv,
            scale=scale,
            q_pos=pos,
            k_pos=npos,
            window=window,
            k_pos_sorted=True,
            softcap=softcap,
            out_dtype=torch.float32,
        )
        o, lse = merge_pair(o, lse, po, pl)
        if stats.enabled:
            stats.add_flops(flops(B, H, d, n, nk.shape[2], "full"))
    return o, lse


def _blocks(q, N: int, rows=None) -> dict:
    """The kernels' arguments for this call's per-key log-sum-exp (``cite.LSE_BLOCK`` keys a
    block) of ``q [B, H, T, d]``'s rows over ``N`` keys; ``rows [B, T]`` bool: only those."""
    from .cite import LSE_BLOCK

    B, H, T, _ = q.shape
    out = torch.empty(B, H, T, -(-N // LSE_BLOCK), dtype=torch.float32, device=q.device)
    return dict(block_lse=out, lse_block=LSE_BLOCK, **({"lse_rows": rows} if rows is not None else {}))


def register() -> str:
    """Register our attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, treeattn_attention)
    return ATTN_NAME
