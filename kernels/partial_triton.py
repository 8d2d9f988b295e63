"""Triton split-KV ("flash-decoding") partial attention.

Two launches:
  1. ``_split_kernel``: one program per (batch, KV head, split). It loads each K/V block of
     its split once for all ``G = H / H_kv`` query heads of the group (times Q query rows),
     runs an online softmax in base 2, and writes a per-split partial ``(o, lse)``. Splits are
     runs of keys fixed by their index (issue 49): split s of a row covers keys ``[s·L, (s+1)·L)``,
     ``L`` a fixed length (a tail that grows) or a function of the row's own length (a
     document), never of the batch, the grid or the other rows; the tile (``BLOCK_M`` query rows,
     ``BLOCK_N`` keys) is the decode step's for every call (``tile_rows``: taller calls
     in slices of it). A row's numbers are then the same alone, in a
     batch, as a draft of a verify or as the decode step after it. The grid is planned on the host
     from the capacity (CUDA graphs keep their shapes); each program skips the tiles past the
     live length and, with positions sorted, outside the window (a search over the positions, not
     a walk): a skipped tile is one no row sees, which would add exact zeros. The K/V loads are
     software-pipelined (``num_stages=3``: two tiles in flight per CTA; through a block table, 5
     on CUDA: the table's entry is a level of its own, :func:`plan_split`). An fp8 cache
     (``k_scale``/``v_scale``, docs/architecture.md §11) is read as stored: the program loads the fp8 K/V
     tiles and their per-row scales (bf16, ``SCALE_G`` per row, one per ``d / SCALE_G``
     channels) and dequantizes each tile in registers (one rounding to the compute dtype)
     before the 16-bit kernel's dots, for as many query rows as that kernel holds; scores,
     softmax and partials stay fp32. Without scales the flag is off
     and the kernel is the 16/32-bit one, instruction for instruction. Asked for (``block_lse``,
     issue 37), it also writes each row's log-sum-exp per run of ``lse_block`` keys from the
     score tiles as they pass (``LSE_BLOCK``; 0: compiled out, the kernel as without it).
  2. ``_reduce_kernel``: one program per (batch, head, query row) merges the splits with the
     LSE math of docs/architecture.md §2 and writes ``o`` in q's dtype and ``lse`` (natural log, fp32).
     Asked for (``partials=True``), a call skips it and hands back its splits (``Partials``):
     a decode step's two calls are reduced and merged in one launch, ``merge_triton.reduce_pair``,
     with this reduce's own formula (``_reduce_splits``).

The torch reference with the same signature is ``partial_ref.partial_attention_ref``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import Partials, _version_tuple
from .partial_ref import check_block_lse, check_inputs, dequantize
from .targets import Target, launch, target_of

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Inside @triton.jit only tl.constexpr globals may be read (GPU compilers refuse others; the
# interpreter does not check, which is how a plain float here once crashed every GPU launch).
_LOG2E_C = tl.constexpr(LOG2E)
_LN2_C = tl.constexpr(LN2)

MAX_ROWS = 128  # query rows (G * Q) per program tile
REDUCE_BLOCK_S = 16  # splits merged per iteration of the reduce kernel
PARTIALS_CAP = 64 << 20  # bytes: a call's unreduced splits kept for one merge (else reduced per slice)
ONE_SPLIT_COPY = {"on": True}  # the interpreter's copy for a reduce of one split (_attend; tests turn it off)
LAST_LAUNCH: dict = {}  # the last compiled split kernel (its resource report, for tuning)

# The CPU interpreter returns garbage from tl.dot on bf16 (an open upstream bug): upcast there.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Runtime integers that change from call to call (lengths, split counts, group sizes) are
# never specialised: one compiled kernel serves every N, so eager decode does not recompile as
# the cache grows. Strides stay specialised (a unit stride gives vectorised loads).
_RUNTIME_INTS = [
    "N",
    "H_KV",
    "G",
    "NQ",
    "NSPLIT",
    "SPLIT_LEN",
    "SPLIT_MIN",
    "SPLIT_CAP",
    "window",
    "has_len",
    "sorted_pos",
    "sqpb",
    "sqpq",
    "skpb",
    "skpn",
    "stb",  # position strides: 0 or 1 either way
    # block_lse's outer strides follow N and Q; lse_rows' are 0 without it (one kernel)
    "sbb",
    "sbh",
    "sbq",
    "srb",
    "srq",
    "has_rows",
]
SEARCH_FANOUT = 256  # positions one round of the window search reads: 3 rounds reach 16M keys


@triton.jit
def _live_range(KPOS, kp_base, skpn, n_end, lo_pos, hi_pos, use_lo, FANOUT: tl.constexpr):
    """``[lo, hi)``: the keys of ``[0, n_end)`` whose positions (ascending) lie in
    ``[lo_pos, hi_pos]`` (``lo`` is 0 unless ``use_lo``). Two searches run side by side, each a
    ``FANOUT``-way search (one round trip reads ``FANOUT`` sampled positions and narrows the
    range ``FANOUT``-fold): ``ceil(log_FANOUT n)`` dependent loads, not ``log2 n``."""
    jj = tl.arange(0, FANOUT).to(tl.int64)
    a_lo = n_end * 0  # first key with position >= lo_pos
    a_hi = tl.where(use_lo, n_end, a_lo)
    b_lo = n_end * 0  # first key with position > hi_pos
    b_hi = n_end
    while (a_lo < a_hi) | (b_lo < b_hi):
        a_step = tl.maximum((a_hi - a_lo + FANOUT - 1) // FANOUT, 1)
        b_step = tl.maximum((b_hi - b_lo + FANOUT - 1) // FANOUT, 1)
        ia = a_lo + jj * a_step  # (FANOUT,) int64 sample indices
        ib = b_lo + jj * b_step
        oka = ia < a_hi
        okb = ib < b_hi
        pa = tl.load(KPOS + kp_base + ia * skpn, mask=oka, other=0)
        pb = tl.load(KPOS + kp_base + ib * skpn, mask=okb, other=0)
        # sorted: the samples before the target are a prefix of ca (cb) samples, so the first
        # key at the target lies after sample ca - 1 and at or before sample ca
        ca = tl.sum((oka & (pa < lo_pos)).to(tl.int32), 0)
        cb = tl.sum((okb & (pb <= hi_pos)).to(tl.int32), 0)
        a_hi = tl.minimum(a_hi, a_lo + ca * a_step)
        a_lo = tl.where(ca > 0, a_lo + (ca - 1) * a_step + 1, a_lo)
        b_hi = tl.minimum(b_hi, b_lo + cb * b_step)
        b_lo = tl.where(cb > 0, b_lo + (cb - 1) * b_step + 1, b_lo)
    return a_lo, b_lo


@triton.jit
def _query_span(qpos, row_ok):
    """``(q_lo, q_hi)``: the earliest and latest position of the tile's live query rows. A row
    at a negative position (padding of a batch's ragged rows) sees no key and sets no bound;
    counting it would stretch a sliding window's search back to the start of the shard. With
    no live row, ``q_lo > q_hi``: no key is in range."""
    live = row_ok & (qpos >= 0)
    q_hi = tl.max(tl.where(live, qpos, -(1 << 62)), 0)
    q_lo = tl.min(tl.where(live, qpos, 1 << 62), 0)
    return q_lo, q_hi


@triton.jit
def _live_keys(KPOS, kp_base, skpn, offs, n_ok, nn, q_lo, q_hi, window, HAS_POS: tl.constexpr):
    """``(n_ok, kpos)`` of a block of keys ``offs``: in range, and, with positions, visible to
    some query of the tile. A block no query can see (all keys in the future, or all out of the
    sliding window: unsorted positions) has its K/V loads masked off: no bytes move. The loads
    stay unconditional (its math runs, on zeros, masked) because a load under an ``if`` is not
    software-pipelined: two dependent round trips per block. (Compared as (BLOCK_N,) vectors:
    the interpreter mistypes a vector & scalar mask.)"""
    kpos = offs
    if HAS_POS:
        kpos = tl.load(KPOS + kp_base + offs * skpn, mask=n_ok, other=0)
        live = nn * 0 + tl.min(tl.where(n_ok, kpos, 1 << 62), 0) <= q_hi
        if window > 0:
            live = live & (nn * 0 + tl.max(tl.where(n_ok, kpos, -(1 << 62)), 0) > q_lo - window)
        n_ok = n_ok & live
    return n_ok, kpos


@triton.jit
def _page(TABLE, tb, n0, N, PAGE: tl.constexpr):
    """``(block id, offset in it)`` of key ``n0`` of a paged shard: row ``tb`` of the block
    table, ``PAGE`` keys a block (a multiple of BLOCK_N: a tile never straddles two blocks). An
    ``n0`` past the shard (a prefetch beyond the last tile, masked) reads the last entry."""
    idx = tl.minimum(n0 // PAGE, N // PAGE - 1)
    return tl.load(TABLE + tb + idx).to(tl.int64), n0 % PAGE


@triton.jit
def _scale_tile(S, s_base, TABLE, tb, t, o, N, hk, gg, g_ok, nn, stop, ssb, ssh, ssn, ssg, PAGE: tl.constexpr):
    """The ``(BLOCK_N, BLOCK_G)`` scales of the key tile ``o`` starting at ``t`` (0 past
    ``stop``): at ``s_base`` (this (batch, KV head)'s scale rows, computed once: the dense
    kernel's registers are as before), or, paged, in the block the table names."""
    if PAGE > 0:
        blk, off = _page(TABLE, tb, t, N, PAGE)
        ptr = S + blk * ssb + hk * ssh + gg[None, :] * ssg + (off + nn).to(tl.int64)[:, None] * ssn
    else:
        ptr = s_base + o.to(tl.int64)[:, None] * ssn
    return tl.load(ptr, mask=g_ok & (o < stop)[:, None], other=0.0)


@triton.jit
def _dequantize(x8, scale, BLOCK_G: tl.constexpr, dt):
    """An fp8 tile ``x8`` (BLOCK_N, BLOCK_D) times its keys' group scales ``scale`` (BLOCK_N,
    BLOCK_G), each over its ``BLOCK_D / BLOCK_G`` channels, in fp32, rounded once to ``dt``."""
    x = tl.reshape(x8.to(tl.float32), (x8.shape[0], BLOCK_G, x8.shape[1] // BLOCK_G))
    return tl.reshape(x * scale.to(tl.float32)[:, :, None], (x8.shape[0], x8.shape[1])).to(dt)


@triton.jit
def _tile_bases(
    K, V, TABLE, tb, b, hk, n0, N, k_base, v_base, skb, skh, skn, svb, svh, svn, skpb, skpn, PAGE: tl.constexpr
):
    """``(position base, K tile pointer, V tile pointer)`` of the key tile starting at ``n0``:
    in this (batch, KV head)'s rows, or, paged, in the block the table names for it (its
    positions at ``base + offs * skpn``)."""
    if PAGE > 0:
        blk, off = _page(TABLE, tb, n0, N, PAGE)
        kp_b = blk * skpb + (off - n0) * skpn
        k_t = K + blk * skb + hk * skh + tl.cast(off, tl.int64) * skn
        v_t = V + blk * svb + hk * svh + tl.cast(off, tl.int64) * svn
    else:
        kp_b = b * skpb
        k_t = k_base + tl.cast(n0, tl.int64) * skn
        v_t = v_base + tl.cast(n0, tl.int64) * svn
    return kp_b, k_t, v_t


@triton.jit
def _scores(s, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Raw ``q.k`` to base-2 scores (``qk_scale = scale * log2(e)``); soft-capping in natural
    units: ``softcap * tanh(scale * q.k / softcap)``, ``tanh(x) = 1 - 2 / (e^{2x} + 1)``.
    ``SOFTCAP`` (:func:`softcap_mode`): 0 tests the runtime ``softcap`` (one kernel for every
    model), 1 compiles soft-capping in, -1 compiles it out."""
    if SOFTCAP == 0:
        if softcap > 0:
            s = _capped(s, qk_scale, softcap)
        else:
            s = s * qk_scale
    elif SOFTCAP > 0:
        s = _capped(s, qk_scale, softcap)
    else:
        s = s * qk_scale
    return s


@triton.jit
def _capped(s, qk_scale, softcap):
    x = s * (qk_scale / _LOG2E_C) / softcap
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * _LOG2E_C


# Triton releases whose Hopper pipeliner fails on a runtime branch on the scores inside the key
# loop: ``PassManager::run failed`` in TritonGPUPipeline for every wgmma tile (64+ query rows:
# prefill slices, batches of 16+ sequences, verify blocks with block_lse). Seen on an H100 with
# Triton 3.6.0; reproduced offline (``offline_compile --target sm_90``: 194 of 3155 configurations
# under 3.6.0; 3.5.0 fails too, 3.7.0, 3.8.0 and 3.9.0 compile it). They get soft-capping as a
# compile-time flag instead (a second kernel only for soft-capped models). The later releases keep
# the branch: under 3.9 the branch-free kernel of a model without soft-capping spills (fp32 d = 64
# decode: 255 registers and 16 bytes, against 94 and none).
PIPELINER_NEEDS_STATIC_SOFTCAP = _version_tuple(triton.__version__) < (3, 7)


def softcap_mode(softcap) -> int:
    """The split kernel's ``SOFTCAP``: 0 (a runtime test) where this Triton pipelines it, else
    1 or -1 (soft-capping compiled in or out)."""
    if not PIPELINER_NEEDS_STATIC_SOFTCAP:
        return 0
    return 1 if softcap else -1


@triton.jit
def _visible(s, row_ok, n_ok, qpos, kpos, window, HAS_POS: tl.constexpr):
    """The scores ``s`` (BLOCK_M, BLOCK_N) with ``-inf`` where a query does not see a key (a
    padding row, a key out of range, in its future or out of its window)."""
    vis = row_ok[:, None] & n_ok[None, :]
    if HAS_POS:
        diff = qpos[:, None] - kpos[None, :]
        vis = vis & (diff >= 0)
        if window > 0:
            vis = vis & (diff < window)
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One block of the online softmax (base 2) over masked scores ``s`` (BLOCK_M, BLOCK_N,
    :func:`_visible`); returns the block's unnormalised probabilities ``p``, the factor
    ``alpha`` that rescales what was accumulated, and the new running max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at 0
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _store_block_lse(bl_row, sbj, ask, s, n0, NB, BLOCK_N: tl.constexpr, LSE_BLOCK: tl.constexpr):
    """``block_lse`` of the key tile at ``n0``: the natural-log logsumexp of each row's masked
    base-2 scores ``s`` (BLOCK_M, BLOCK_N) over each run of ``LSE_BLOCK`` keys (a run never
    straddles two tiles: LSE_BLOCK <= 16 <= BLOCK_N), ``-inf`` for a run the row sees none of.
    ``bl_row`` (BLOCK_M,): each row's entries; stored for the rows that ``ask`` and the runs
    before ``NB`` (a tile past the shard's end holds none)."""
    NJ: tl.constexpr = BLOCK_N // LSE_BLOCK
    if LSE_BLOCK == 1:
        blk = s * _LN2_C  # (BLOCK_M, BLOCK_N): a key is its own block (-inf stays -inf)
    else:
        s3 = tl.reshape(s, (s.shape[0], NJ, LSE_BLOCK))  # (BLOCK_M, NJ, LSE_BLOCK)
        m = tl.max(s3, 2)  # (BLOCK_M, NJ)
        none = m == float("-inf")  # the row sees no key of the run: no exp2(-inf - -inf) = NaN
        m_safe = tl.where(none, 0.0, m)
        den = tl.sum(tl.exp2(s3 - m_safe[:, :, None]), 2)  # >= 1 where a key is seen
        blk = tl.where(none, float("-inf"), (m_safe + tl.log2(tl.where(none, 1.0, den))) * _LN2_C)
    jj = tl.arange(0, NJ)  # (NJ,) the tile's runs, from its first: n0 // LSE_BLOCK
    ptr = bl_row + tl.cast(n0 // LSE_BLOCK, tl.int64) * sbj  # (BLOCK_M,)
    tl.store(ptr[:, None] + (jj * sbj)[None, :], blk, mask=ask[:, None] & (jj < NB - n0 // LSE_BLOCK)[None, :])


@triton.jit
def _fill_block_lse(bl_row, sbj, ask, lo, cover_end, NB, pid_s, NSPLIT, BLOCK_N: tl.constexpr, LSE_BLOCK: tl.constexpr):
    """``-inf`` in the runs no program's tiles reach: before ``lo`` (out of the window) and
    from ``cover_end`` (past the live length, or the causal end) to the shard's end; each of
    the NSPLIT programs takes an equal share, ``BLOCK_N`` runs a store."""
    j_lo = (lo // LSE_BLOCK).to(tl.int64)  # runs [0, j_lo) and [j_hi, NB)
    j_hi = tl.minimum(cover_end // LSE_BLOCK, NB).to(tl.int64)
    total = j_lo + tl.maximum(NB - j_hi, 0)
    u0 = pid_s * total // NSPLIT
    u1 = (pid_s + 1) * total // NSPLIT
    uu0 = tl.arange(0, BLOCK_N).to(tl.int64)
    for u in range(u0, u1, BLOCK_N):
        uu = u + uu0  # (BLOCK_N,) the share's runs, counted over the two ranges
        j = tl.where(uu < j_lo, uu, uu - j_lo + j_hi)
        tl.store(
            bl_row[:, None] + j[None, :] * sbj,
            tl.full((ask.shape[0], BLOCK_N), float("-inf"), tl.float32),
            mask=ask[:, None] & (uu < u1)[None, :],
        )


# Position and length arrays, block_lse and lse_rows are sliced at any offset (query slices):
# no alignment variants.
@triton.jit(
    do_not_specialize=_RUNTIME_INTS, do_not_specialize_on_alignment=["QPOS", "KPOS", "KVLEN", "TABLE", "BL", "LR"]
)
def _split_kernel(
    Q,
    K,
    V,
    QPOS,
    KPOS,
    KVLEN,
    OP,
    LP,
    KS,
    VS,
    TABLE,
    stb,
    sqb,
    sqh,
    sqq,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sqpb,
    sqpq,
    skpb,
    skpn,
    sksb,
    sksh,
    sksn,
    sksg,
    svsb,
    svsh,
    svsn,
    svsg,
    N,
    H_KV,
    G,
    NQ,
    NSPLIT,
    qk_scale,
    window,
    softcap,
    has_len,
    sorted_pos,
    BL,
    LR,
    sbb,
    sbh,
    sbq,
    sbj,
    srb,
    srq,
    has_rows,  # last: the other arguments keep their places
    SPLIT_LEN,
    SPLIT_MIN,
    SPLIT_CAP,
    HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_POS: tl.constexpr,
    UPCAST: tl.constexpr,
    FANOUT: tl.constexpr,
    SCALE_G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PAGE: tl.constexpr,
    LSE_BLOCK: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # PAGE > 0: a paged shard (issue 35): K, V, KPOS, KS and VS are pools of blocks of PAGE keys
    # ([blocks, H_kv, PAGE, d], [blocks, PAGE], ...: their first stride is the block's), and
    # row b's keys are the blocks TABLE[b, :] names, in order; N = the table's width x PAGE.
    # window (0: none), has_len and sorted_pos are runtime values tested once per program or
    # block: one compiled kernel per tile shape serves every model, and none of them costs a
    # recompile. So is softcap, except under a Triton whose pipeliner fails on it (SOFTCAP:
    # softcap_mode).
    # LSE_BLOCK > 0: also the log-sum-exp of each row's scores per run of LSE_BLOCK keys, from
    # the score tiles as they pass: BL [B, H, NQ, ceil(N / LSE_BLOCK)] fp32, written for the
    # rows LR [B, NQ] (bytes) asks when has_rows; LSE_BLOCK = 0 compiles all of it out.
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    # 64-bit batch and head indices: b * stride_b reaches 2^31 for large caches (batch 3 at 1M
    # tokens, 8 KV heads, d = 128), and an i32 product would wrap to a negative offset.
    b = (pid_bh // H_KV).to(tl.int64)
    hk = (pid_bh % H_KV).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)  # row r = g * NQ + qi (query head g of the group, query qi)
    g = rows // NQ
    qi = rows % NQ
    row_ok = rows < G * NQ
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < HEAD_D
    head = hk * G + g  # (BLOCK_M,) int64

    q = tl.load(
        Q + b * sqb + head[:, None] * sqh + qi[:, None] * sqq + dd[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)

    # The keys this (batch, KV head) attends to: [lo, hi), read on the device (the live
    # length kv_len, not the capacity N a CUDA graph was captured with) ...
    n_end = N
    if has_len:
        n_end = tl.minimum(N, tl.load(KVLEN + b).to(tl.int32))
    # ... in the split of keys this program owns, fixed by key index (issue 49): [s·L, (s+1)·L),
    # L = SPLIT_LEN, or 0: from this row's own length (at least SPLIT_MIN, at most SPLIT_CAP
    # splits of it, in whole tiles). Tiles are aligned to BLOCK_N from key 0: the same tiles, in
    # the same order, whatever else the launch holds; a tile the window or the causal end hides
    # from every row of the program is skipped (below: it would add exact zeros)
    lo = n_end * 0
    hi = n_end
    k_base = K + b * skb + hk * skh  # this (batch, KV head)'s keys; 64-bit offsets
    v_base = V + b * svb + hk * svh
    nn = tl.arange(0, BLOCK_N)
    qpos = qi  # (qpos, q_lo, q_hi: unused without positions)
    q_lo = n_end
    q_hi = n_end
    if HAS_POS:
        qpos = tl.load(QPOS + b * sqpb + qi * sqpq, mask=row_ok, other=0)  # (BLOCK_M,)
        q_lo, q_hi = _query_span(qpos, row_ok)
        if sorted_pos:  # ... narrowed to the window and the causal end by their positions
            lo, hi = _live_range(KPOS, b * skpb, skpn, n_end, q_lo - window + 1, q_hi, window > 0, FANOUT)
    lo = lo // BLOCK_N * BLOCK_N
    # the split, in tiles counted from lo's (int64; measured: the same bounds as a max/min of key
    # offsets leave ptxas at 128 registers and spilling in window, paged and fp8 variants)
    nblk = tl.maximum(tl.cdiv(hi - lo, BLOCK_N), 0).to(tl.int64)
    sb = (SPLIT_LEN // BLOCK_N + n_end * 0).to(tl.int64)  # tiles a split: fixed, or this row's
    if SPLIT_LEN == 0:  # (one division: SPLIT_CAP splits of whole tiles, at least SPLIT_MIN keys)
        sb = tl.maximum(SPLIT_MIN // BLOCK_N, tl.cdiv(n_end, SPLIT_CAP * BLOCK_N)).to(tl.int64)
    first = pid_s * sb - lo // BLOCK_N  # the split's first tile, counted from lo's
    start = lo + tl.minimum(tl.maximum(first, 0), nblk).to(tl.int32) * BLOCK_N
    stop = tl.minimum(lo + tl.minimum(tl.maximum(first + sb, 0), nblk).to(tl.int32) * BLOCK_N, hi)
    if LSE_BLOCK > 0:
        bl_row = BL + b * sbb + head * sbh + qi.to(tl.int64) * sbq  # (BLOCK_M,) each row's runs
        ask = row_ok  # the rows whose runs are stored
        if has_rows:
            ask = row_ok & (tl.load(LR + b * srb + qi * srq, mask=row_ok, other=0) != 0)

    if SCALE_G > 0:
        # fp8 K/V (docs/architecture.md §11): each row's SCALE_G groups of channels carry their own scale.
        # Each tile is dequantized in registers (fp8 -> fp32, times its key's group scale, rounded
        # once to the compute dtype: the reference's dequantize, tile by tile) and goes through
        # the 16-bit kernel's two dots, so all BLOCK_M query rows meet it once: a launch reads
        # the shard once for as many rows as the 16-bit kernel holds.
        gg = tl.arange(0, BLOCK_G)
        ks_base = KS + b * sksb + hk * sksh + gg[None, :] * sksg  # (1, BLOCK_G); paged: unused
        vs_base = VS + b * svsb + hk * svsh + gg[None, :] * svsg
        g_ok = (gg < SCALE_G)[None, :]
        # The scale tiles (BLOCK_N x BLOCK_G, a few bytes a key) are too narrow for the
        # pipeliner's asynchronous copies: each is loaded one block ahead by hand and carried
        # in registers (two ahead would stop the pipelining of the K/V tiles).
        o1 = start + nn
        ks1 = _scale_tile(
            KS, ks_base, TABLE, b * stb, start, o1, N, hk, gg, g_ok, nn, stop, sksb, sksh, sksn, sksg, PAGE
        )
        vs1 = _scale_tile(
            VS, vs_base, TABLE, b * stb, start, o1, N, hk, gg, g_ok, nn, stop, svsb, svsh, svsn, svsg, PAGE
        )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, base-2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        offs = n0 + nn
        kp_b, k_t, v_t = _tile_bases(
            K, V, TABLE, b * stb, b, hk, n0, N, k_base, v_base, skb, skh, skn, svb, svh, svn, skpb, skpn, PAGE
        )  # paged: the tile's block
        n_ok, kpos = _live_keys(KPOS, kp_b, skpn, offs, offs < stop, nn, q_lo, q_hi, window, HAS_POS)
        if SCALE_G > 0:  # this tile's scales, and the next tile's requested
            kst = ks1
            vst = vs1
            o2 = offs + BLOCK_N
            ks1 = _scale_tile(
                KS, ks_base, TABLE, b * stb, n0 + BLOCK_N, o2, N, hk, gg, g_ok, nn, stop, sksb, sksh, sksn, sksg, PAGE
            )
            vs1 = _scale_tile(
                VS, vs_base, TABLE, b * stb, n0 + BLOCK_N, o2, N, hk, gg, g_ok, nn, stop, svsb, svsh, svsn, svsg, PAGE
            )
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_t + nn[:, None] * skn + dd[None, :] * skd, mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_t + nn[:, None] * svn + dd[None, :] * svd, mask=kv_mask, other=0.0)
        if SCALE_G > 0:
            k = _dequantize(k, kst, BLOCK_G, q.dtype)
            v = _dequantize(v, vst, BLOCK_G, q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if UPCAST:  # fp32 operands: full precision, not TF32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # (BLOCK_M, BLOCK_N) raw q.k
        else:
            s = tl.dot(q, tl.trans(k))
        s = _visible(_scores(s, qk_scale, softcap, SOFTCAP), row_ok, n_ok, qpos, kpos, window, HAS_POS)
        if LSE_BLOCK > 0 and HAS_POS:  # block_lse before the PV dot here: see below
            _store_block_lse(bl_row, sbj, ask, s, n0, tl.cdiv(N, LSE_BLOCK), BLOCK_N, LSE_BLOCK)
        p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        if LSE_BLOCK > 0 and not HAS_POS:
            # block_lse after the dots: measured, ptxas then keeps sm_80 at 4 CTAs/SM and sm_90 at
            # ~184 registers (~230 before them); with positions, scores kept live across the PV
            # dot spill on sm_90, so that variant stores before it (above)
            _store_block_lse(bl_row, sbj, ask, s, n0, tl.cdiv(N, LSE_BLOCK), BLOCK_N, LSE_BLOCK)

    if LSE_BLOCK > 0:  # the programs' tiles cover the runs of [lo, lo + nblk * BLOCK_N): the rest
        nblk = tl.maximum(tl.cdiv(hi - lo, BLOCK_N), 0).to(tl.int64)
        _fill_block_lse(
            bl_row, sbj, ask, lo, lo + nblk * BLOCK_N, tl.cdiv(N, LSE_BLOCK), pid_s, NSPLIT, BLOCK_N, LSE_BLOCK
        )

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * _LN2_C, float("-inf"))
    # partials: OP [B, H, NQ, NSPLIT, HEAD_D], LP [B, H, NQ, NSPLIT], contiguous fp32 (measured:
    # an argument more for other layouts spills at d = 256 in fp32 on sm_80 and sm_90)
    prow = ((b * (H_KV * G) + head) * NQ + qi) * NSPLIT + pid_s  # (BLOCK_M,) int64
    tl.store(OP + prow[:, None] * HEAD_D + dd[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LP + prow, lse, mask=row_ok)


@triton.jit(do_not_specialize=["H", "NQ", "NSPLIT"], do_not_specialize_on_alignment=["LSE", "SINK"])
def _reduce_kernel(
    OP,
    LP,
    O,
    LSE,
    SINK,
    sob,
    soh,
    soq,
    sod,
    slb,
    slh,
    slq,
    H,
    NQ,
    NSPLIT,
    HEAD_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)  # flattened (b, h, qi)
    b = r // (H * NQ)
    h = (r // NQ) % H
    qi = r % NQ
    dd = tl.arange(0, BLOCK_D)
    sink = 0.0
    if HAS_SINK:  # a learned sink logit: one more term of the denominator, none of the numerator
        sink = tl.load(SINK + h).to(tl.float32)
    out, lse = _reduce_splits(OP, LP, r * NSPLIT, NSPLIT, sink, HEAD_D, BLOCK_S, BLOCK_D, HAS_SINK)
    tl.store(O + b * sob + h * soh + qi * soq + dd * sod, out.to(O.dtype.element_ty), mask=dd < HEAD_D)
    tl.store(LSE + b * slb + h * slh + qi * slq, lse)


@triton.jit
def _reduce_splits(
    OP,
    LP,
    prow,
    NSPLIT,
    sink,
    HEAD_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """One query row's ``NSPLIT`` partials (``OP + (prow + s) * HEAD_D``, ``LP + prow + s``) merged
    with the LSE math of docs/architecture.md §2: ``(o (BLOCK_D,) fp32, lse)`` (natural log;
    ``sink``: one more term of the denominator where ``HAS_SINK``). The reduce's and
    ``merge_triton.reduce_pair``'s: one formula, the same bits."""
    ss = tl.arange(0, BLOCK_S)
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < HEAD_D
    # two passes over the splits, BLOCK_S at a time (registers stay bounded for any count):
    # the max of their lse, then the weighted sum of their outputs
    mv = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, NSPLIT, BLOCK_S):
        mv = tl.maximum(mv, tl.load(LP + prow + s0 + ss, mask=s0 + ss < NSPLIT, other=float("-inf")))
    m = tl.max(mv, 0)
    if HAS_SINK:
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wv = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, NSPLIT, BLOCK_S):
        s_ok = s0 + ss < NSPLIT
        w = tl.exp(tl.load(LP + prow + s0 + ss, mask=s_ok, other=float("-inf")) - m_safe)  # 0: empty
        o = tl.load(
            OP + (prow + s0 + ss[:, None]) * HEAD_D + dd[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
        )  # (BLOCK_S, BLOCK_D)
        acc += tl.sum(o * w[:, None], 0)
        wv += w
    den = tl.sum(wv, 0)
    if HAS_SINK:
        den += tl.exp(sink - m_safe)
    out = acc / tl.where(den > 0.0, den, 1.0)
    return out, tl.where(den > 0.0, m_safe + tl.log(tl.where(den > 0.0, den, 1.0)), float("-inf"))


def kv_tile(
    target: Target, block_m: int, block_d: int, esize: int, upcast: bool, p_size: int | None = None
) -> tuple[int, int]:
    """``(BLOCK_N, num_stages)`` of the split kernel's K/V tiles on ``target``.

    Tiles are software-pipelined with ``num_stages=3``: two K/V tiles in flight per CTA (the
    next one loads while this one computes). For 16-bit inputs the block is the largest of
    64/32/16 keys whose two K+V buffers leave room for the residency the registers allow
    anyway: 3 CTAs per SM on CUDA (a 4-warp decode tile needs ~140 registers; sm_90: 64 keys;
    sm_80, 164 KB per SM: 32) and 2 workgroups per CU on ROCm (gfx942: 32 KiB of LDS each,
    counting the 16 x 64 probability tile a 64-key block stages through LDS; d = 128: 32 keys).
    On ROCm, tiles taller than 16 rows (more than 16 query heads a KV head: :func:`tile_rows`) keep
    ``num_stages=2``: the stream
    pipeliner already loads the next tile into registers while this one computes, and a third
    stage doubles their compile time for little. fp32's ieee-precision dot keeps its operands
    in registers: 32 keys, and on gfx942 (64 KiB of LDS) not multi-buffered.

    fp8 K/V: ``esize`` 1 (their scales are prefetched into registers, not buffered), at most
    32 keys on CUDA (registers). On ROCm the stream pipeliner keeps tiles dequantized before
    their dot in registers, not LDS: three in flight for tiles of 16 rows (half-size tiles:
    gfx942's 304 CUs at tp 8 over 32K keys hold one workgroup each, whose two tiles alone fall
    short of Little's law), two of 32 keys for taller tiles (as many workgroups per CU as the
    16-bit kernel's one tile of 32 keys: at half the bytes a tile, as many bytes in flight).
    Every call of a model takes the decode step's tile (issue 49: :func:`tile_rows`). The probability tile is staged in the compute dtype (``p_size`` bytes, default
    ``esize``)."""
    if target.backend == "interpreter":
        return 64, 2
    if upcast:  # (d = 256 on sm_80's 164 KB: 16 keys on 4 warps, or ptxas spills)
        return (16 if _cramped(target, block_d, upcast) else 32), (1 if target.is_hip else 3)
    budget = target.sm_shared // 2 if target.is_hip else target.sm_shared // 3 - 8192
    stages = 2 if target.is_hip and block_m > 16 else 3
    if esize == 1 and target.is_hip:
        stages = 4 if block_m <= 16 else 3  # fp8 on ROCm (above)
    p_size = p_size or esize
    # fp8 on CUDA: a 64-key tile's dequantized MMA operands take ~190 registers (2 CTAs per SM);
    # 32 keys take ~165 (3 CTAs per SM, the 16-bit kernel's)
    for bn in (32, 16) if esize == 1 and not target.is_hip else (64, 32, 16):
        staged_p = block_m * bn * p_size if target.is_hip and bn >= 64 else 0
        if (stages - 1) * (2 * bn * block_d * esize) + staged_p <= budget:
            return bn, stages
    return 16, 2


def _cramped(target: Target, block_d: int, gpu_fp32: bool) -> bool:
    """fp32 at d = 256 on a CUDA target under 200 KB of shared memory per SM (sm_80): 16-key
    tiles on 4 warps (measured: 32 keys on 8 warps spill the position variant at 128 registers,
    16 keys on 8 warps the other)."""
    return gpu_fp32 and block_d >= 256 and not target.is_hip and target.sm_shared < 200 * 1024


def tile_rows(G: int) -> int:
    """Query rows of every program tile of a model with ``G`` query heads a KV head: a decode
    step's G rows, padded to the MMA's 16 (issue 49). A verify's ``G·(K + 1)`` rows and a
    question's slice run in slices of ``tile_rows(G) // G`` positions in this same tile, so a
    row meets its keys in the same instructions alone, in a batch, as a draft or beside a
    joined request's prefill: a tile's height decides the MMA's layout and each row's sum over
    keys (warps along rows or along keys), so it is never chosen by the call. It is the tile the
    decode step was tuned for (the offline compile checks its registers, spills, residency and
    tiles in flight); taller calls re-read their keys once a slice (at G = 4: four positions a
    slice, a verify of 4 drafts in two)."""
    return max(16, triton.next_power_of_2(G))


@dataclass(frozen=True)
class SplitPlan:
    """Launch parameters of the split kernel for one call (and of its reduce)."""

    splits: int  # programs per (batch, KV head): the grid, enough for any row's splits
    split_len: int  # keys per split: fixed, or 0: each row's own (its length over split_cap, at least split_min)
    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    upcast: bool
    block_g: int = 0  # fp8 K/V: scale groups per row, padded to a power of two (0: no scales)
    split_min: int = 0  # keys of a split at the least (a fixed split's length)
    split_cap: int = 0  # the most splits of one row's keys
    levels: int = 1  # loads a K/V tile's address depends on in the loop, it included (paged on CUDA: 2)

    @property
    def depth(self) -> int:
        """K/V tiles in flight per CTA (the software pipeline's buffers): ``num_stages - 1``, shared
        among the loop's indirection ``levels`` (:func:`plan_split`)."""
        return max(1, (self.num_stages - 1) // self.levels)


def plan_split(
    B: int,
    H_kv: int,
    G: int,
    Q: int,
    N: int,
    d: int,
    dtype,
    target: Target,
    *,
    num_splits=None,
    block_n=None,
    num_warps=None,
    num_stages=None,
    kv_dtype=None,
    scale_groups: int = 0,
    fixed_splits: bool = False,
    paged: bool = False,
) -> SplitPlan:
    """The launch parameters the runtime uses for ``q [B, H_kv·G, Q, d]`` against ``N`` keys on
    ``target`` (``Q`` at most one slice of :func:`tile_rows`). ``kv_dtype``: K/V's dtype when it
    is not q's (fp8), with ``scale_groups`` scales per row. The offline compile checks exactly
    these.

    Nothing here depends on ``B`` or ``Q`` (issue 49): one tile for every call (:func:`tile_rows`:
    a decode step's, verifies and slices in slices of it), and splits fixed by key index, of at
    least the kernel's tiles in flight (``depth`` tiles: a split shorter leaves its pipeline part
    empty): ``fixed_splits`` (a tail that grows: a verify's later drafts must not move a row's
    splits) cuts every row's keys in runs of that length; else each row's own length in at most
    two waves' worth of runs (``2 × n_sms``: a shard of one KV head still fills the machine, as
    the batch-sized plan did; a document's keys, read by rows of any batch). ``num_splits``
    (tests, tuning) cuts each row's length in that many runs of at least one tile. The grid covers
    the longest row ``N`` allows.

    ``paged`` (a block table, issue 51): each K/V tile's address comes from a table entry loaded
    in the same loop, and Triton's CUDA pipeliner gives every indirection level ``(num_stages -
    1) / levels`` iterations of lead (its ``AssignLatencies``): at the dense kernel's 3 stages the
    table and the tile get one each, one tile in flight. So a paged launch on CUDA (the caller
    passing ``paged`` only where no positions are read: a decode step's rows over their
    documents and the tail's step) takes ``2 · (stages - 1) + 1`` stages (5): the dense kernel's
    tiles in flight and buffers (the offline compile checks), and the same splits (``depth``).
    Calls that read positions through the table too (a window, a verify's causal rows) keep 3:
    at 5 their loop spills on sm_90. Stages move loads ahead and change no arithmetic: a row's
    numbers stay the same whatever the call (issue 49). ROCm's stream pipeliner and the
    interpreter keep their stages."""
    upcast = target.backend == "interpreter" or dtype == torch.float32
    block_g = triton.next_power_of_2(scale_groups) if scale_groups else 0
    # every call the decode step's tile: a verify's G·(K + 1) rows, a batch's rows of one document
    # and a question's slice meet their keys in slices of it, so a row's dots are the same
    # instructions whatever the call (tile_rows)
    block_m = tile_rows(G)
    block_d = max(16, triton.next_power_of_2(d))
    gpu_fp32 = upcast and target.backend != "interpreter"
    # Tile rules checked by the offline compile (no spills, shared memory / LDS within the
    # target's limit, tiles in flight and residency): see kv_tile; heavy tiles spread over 8
    # warps on CUDA; on ROCm a wavefront is 64 lanes, so 4 of them already hold the tile.
    bn, stages = kv_tile(target, block_m, block_d, (kv_dtype or dtype).itemsize, upcast, p_size=dtype.itemsize)
    block_n = block_n or bn
    levels = 2 if paged and not upcast and not target.is_hip else 1
    num_stages = num_stages or levels * (stages - 1) + 1
    # (fp8: a decode tile at d = 256 stays on 4 warps, 2 CTAs per SM, where 8 warps fit one)
    heavy = block_m * block_d * (2 if gpu_fp32 else 1) >= (8192 if block_g else 4096)
    num_warps = num_warps or (8 if heavy and not target.is_hip and not _cramped(target, block_d, gpu_fp32) else 4)
    n = max(N, 1)
    least = block_n * (1 if num_splits else max(1, (num_stages - 1) // levels))
    if fixed_splits and not num_splits:
        return SplitPlan(
            triton.cdiv(n, least),
            least,
            block_m,
            block_n,
            block_d,
            num_warps,
            num_stages,
            upcast,
            block_g,
            split_min=least,
            split_cap=triton.cdiv(n, least),
            levels=levels,
        )
    cap = num_splits or 2 * target.n_sms
    return SplitPlan(
        min(cap, triton.cdiv(n, least)),
        0,
        block_m,
        block_n,
        block_d,
        num_warps,
        num_stages,
        upcast,
        block_g,
        split_min=least,
        split_cap=cap,
        levels=levels,
    )


def partial_attention_triton(
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
    num_splits=None,
    block_n=None,
    num_warps=None,
    num_stages=None,
    k_pos_sorted=False,
    block_lse=None,
    lse_block: int = 1,
    lse_rows=None,
    fixed_splits: bool = False,
    partials: bool = False,
):
    """Triton version of :func:`partial_attention_ref` (same arguments and outputs).

    The kernel is built for decode (a group's ``G·Q`` query rows in one tile); more rows than
    :func:`tile_rows` are processed in query slices. ``num_splits``, ``block_n``, ``num_warps``
    and ``num_stages`` override the automatic choice of :func:`plan_split` (tests, tuning).
    ``fixed_splits``: every row's keys in runs of one length whatever its length (keys that grow
    at the end, a tail: :func:`plan_split`).

    ``k_scale, v_scale [B, H_kv, N, S]``: ``k`` and ``v`` are an fp8 cache (e4m3fn, or e4m3fnuz
    on ROCm), channel ``c`` of a row scaled by ``scale[..., c // (d / S)]``
    (:func:`partial_ref.dequantize`). The kernel reads the fp8 tiles and their scales and
    dequantizes them in registers (``d + 2S`` bytes a key and head read, against ``2d`` in
    bf16); q is used as given (already in the cache's rotated basis).

    ``k_pos_sorted``: the caller promises that ``k_pos`` ascends over each sequence's valid
    keys (``[0, kv_len)``), as a rank's cache stores them. Each program then finds the first key
    inside the sliding window of its earliest query, and the first key after its latest
    query, by a search over the positions on the device (a few dependent loads), and splits only
    the keys between them: a window layer reads the window, not the shard. Without it (the
    default: any key order) every block's positions are read and blocks no query sees are
    skipped (their K/V never loaded).

    ``block_lse [B, H, Q, ceil(N / lse_block)]`` fp32, ``lse_rows [B, Q]`` bool: as the
    reference's; the split kernel writes them from its score tiles as they pass (no second
    read of the keys), and without ``block_lse`` it is compiled as before.
    """
    B, H, Q, d, H_kv, N = check_inputs(q, k, v, q_pos, k_pos, kv_len)
    if window is not None and q_pos is None:
        raise ValueError("a sliding window needs q_pos and k_pos")
    if block_lse is not None:
        check_block_lse(block_lse, lse_block, lse_rows, B, H, Q, N)
    if N >= 1 << 31:
        raise ValueError(f"a shard of {N} keys is beyond the kernel's 32-bit key index")
    groups = 0
    if k_scale is not None or v_scale is not None:
        groups = _check_scales(k, v, k_scale, v_scale)
        # Dequantized up front instead: groups that are no power-of-two run of channels, and
        # fp32 queries on a GPU (measured: their ieee-precision dots over the dequantized fp32
        # tiles spill on sm_90 at d = 64 with a window)
        if not _tileable(d, groups) or (q.dtype == torch.float32 and target_of(q.device).backend != "interpreter"):
            k, v, groups = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype), 0
            k_scale = v_scale = None
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    o, lse, done = _outputs(q, N, out, lse_out, sink)
    if done:  # no rows, or no keys: block_lse has no entry
        return _none_split(o, lse, sink) if partials else (o, lse)
    tuning = dict(
        num_splits=num_splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages, fixed_splits=fixed_splits
    )
    return _attend(
        q,
        k,
        v,
        o,
        lse,
        N,
        H_kv,
        groups,
        scale=scale,
        q_pos=q_pos,
        k_pos=k_pos,
        kv_len=kv_len,
        window=window,
        softcap=softcap,
        sink=sink,
        k_scale=k_scale,
        v_scale=v_scale,
        k_pos_sorted=k_pos_sorted,
        tuning=tuning,
        blocks=_blocks(block_lse, lse_block, lse_rows),
        partials=_partials(partials, sink),
    )


def _partials(partials: bool, sink):
    """``_attend``'s ``partials`` for a call asking for its splits unreduced (none with a sink:
    its term joins a reduce)."""
    if partials and sink is not None:
        raise ValueError("partials=True takes no sink (the sink joins the merge of the partials)")
    return True if partials else None


def _none_split(o, lse, sink):
    """The unreduced partials of a call with no rows or no keys: one split, empty (o = 0, lse =
    -inf: what its reduce answers)."""
    _partials(True, sink)
    B, H, Q, d = o.shape
    return Partials(
        torch.zeros(B * H * Q * d, dtype=torch.float32, device=o.device),
        torch.full((B * H * Q,), -math.inf, dtype=torch.float32, device=o.device),
        (B, H, Q, 1, d),
        max(Q, 1),
    )


def _blocks(block_lse, lse_block, lse_rows):
    """The per-block log-sum-exp output of a call, as ``_attend`` takes it (None: none)."""
    if block_lse is None:
        return None
    if block_lse.stride(-1) >= 1 << 24:  # a tile's runs are offset in 32 bits: 64 x stride < 2^31
        raise ValueError(f"block_lse's last stride ({block_lse.stride(-1)}) is beyond the kernel's 32-bit tile offsets")
    return block_lse, lse_block, lse_rows


def _outputs(q, N, out, lse_out, sink):
    """``(o, lse, done)``: the outputs (given or new, checked), and whether the call is already
    answered (no rows; or no keys: o = 0 and lse = -inf, or the sink's logit)."""
    B, H, Q, d = q.shape
    dev = q.device
    o = torch.empty(B, H, Q, d, dtype=q.dtype, device=dev) if out is None else out
    lse = torch.empty(B, H, Q, dtype=torch.float32, device=dev) if lse_out is None else lse_out
    if o.shape != (B, H, Q, d) or lse.shape != (B, H, Q) or lse.dtype != torch.float32:
        raise ValueError(f"out must be [{B}, {H}, {Q}, {d}] and lse_out [{B}, {H}, {Q}] fp32")
    if sink is not None and sink.numel() != H:
        raise ValueError(f"sink has {sink.numel()} logits for {H} query heads")
    if B * H * Q == 0:
        return o, lse, True
    if N == 0:
        o.zero_()
        lse.fill_(-math.inf)
        if sink is not None:
            lse.copy_(sink.to(device=dev, dtype=torch.float32).view(1, H, 1).expand(B, H, Q))
        return o, lse, True
    return o, lse, False


def _attend(
    q,
    k,
    v,
    o,
    lse,
    N,
    H_kv,
    groups,
    *,
    scale,
    q_pos,
    k_pos,
    kv_len,
    window,
    softcap,
    sink,
    k_scale,
    v_scale,
    k_pos_sorted,
    tuning,
    table=None,
    page=0,
    blocks=None,
    partials=None,
):
    """The launches of a validated call (``table``, ``page``: a paged shard; ``blocks``:
    ``(block_lse, lse_block, lse_rows)`` or None), query rows in slices the tile holds.
    ``partials``: True (or, within, a slice's ``(op [B, H, q, S, d], lp [B, H, q, S])`` of its
    buffers, :meth:`Partials.slice`): the split launches only, their splits returned unreduced
    (:class:`Partials`; ``merge_triton.reduce_pair`` merges two calls')."""
    B, H, Q, d = q.shape
    G = H // H_kv
    dev = q.device
    step = max(1, tile_rows(G) // G)  # query positions the decode step's tile holds
    if partials is True:  # one buffer for every slice's splits (each slice's plan has as many)
        S = _plan(B, H_kv, G, min(Q, step), N, d, q.dtype, dev, k.dtype, groups, tuning, page, q_pos is not None)
        S = S[1].splits
        n = B * H * Q * S  # (every slice but the last holds step rows: slice i starts at i·B·H·step·S)
        if n * d * 4 > PARTIALS_CAP:  # (a big batch over a long document: reduced a slice at a time)
            partials = None
    if partials is True:
        partials = Partials(
            torch.empty(n * d, dtype=torch.float32, device=dev),
            torch.empty(n, dtype=torch.float32, device=dev),
            (B, H, Q, S, d),
            step,
        )
    if Q > step:  # longer query blocks (a verify, a batch's rows of one document): slices of them
        for a in range(0, Q, step):
            b = min(Q, a + step)
            part = (
                None
                if blocks is None
                else (blocks[0][:, :, a:b], blocks[1], None if blocks[2] is None else blocks[2][:, a:b])
            )
            _attend(
                q[:, :, a:b],
                k,
                v,
                o[:, :, a:b],
                lse[:, :, a:b],
                N,
                H_kv,
                groups,
                scale=scale,
                q_pos=None if q_pos is None else q_pos[..., a:b],
                k_pos=k_pos,
                kv_len=kv_len,
                window=window,
                softcap=softcap,
                sink=sink,
                k_scale=k_scale,
                v_scale=v_scale,
                k_pos_sorted=k_pos_sorted,
                tuning=tuning,
                table=table,
                page=page,
                blocks=part,
                partials=None if partials is None else partials.slice(a // step),
            )
        return partials if partials is not None else (o, lse)

    tuning, plan = _plan(B, H_kv, G, Q, N, d, q.dtype, dev, k.dtype, groups, tuning, page, q_pos is not None)
    has_pos = q_pos is not None
    if partials is not None:  # this slice's region of the call's buffers (Partials.slice)
        op, lp = partials.slice(0) if isinstance(partials, Partials) else partials
        assert op.shape == (B, H, Q, plan.splits, d), (op.shape, plan.splits)
    else:
        op = torch.empty(B, H, Q, plan.splits, d, dtype=torch.float32, device=dev)
        lp = torch.empty(B, H, Q, plan.splits, dtype=torch.float32, device=dev)
    if has_pos:
        qp = q_pos.to(device=dev, dtype=torch.int64)
        kp = k_pos.to(device=dev, dtype=torch.int64)
        sqpb, sqpq = (qp.stride(0), qp.stride(1)) if qp.dim() == 2 else (0, qp.stride(0))
        skpb, skpn = (kp.stride(0), kp.stride(1)) if kp.dim() == 2 else (0, kp.stride(0))
    else:  # unused placeholders, of the same type (a pointer's type is part of the kernel)
        qp = kp = torch.empty(1, dtype=torch.int64, device=dev)
        sqpb = sqpq = skpb = skpn = 0
    kvl = (
        kv_len.to(device=dev, dtype=torch.int64)
        if kv_len is not None
        else qp
        if not has_pos
        else torch.empty(1, dtype=torch.int64, device=dev)
    )
    if groups:
        ks, vs = k_scale.to(device=dev), v_scale.to(device=dev)
        s_strides = (*ks.stride(), *vs.stride())
    else:  # unused placeholders (SCALE_G = 0 compiles the scale loads out)
        ks, vs, s_strides = k, v, (0,) * 8
    lse_block, has_rows = 0, False
    bl, lr, b_strides = lp, kvl, (0,) * 6  # unused placeholders (LSE_BLOCK = 0 compiles block_lse out)
    if blocks is not None:
        bl, lse_block, rows = blocks
        has_rows = rows is not None
        # lse_rows as bytes (one pointer type with or without it: one compiled kernel)
        lr = rows.to(dev).view(torch.uint8) if has_rows else torch.empty(1, dtype=torch.uint8, device=dev)
        b_strides = (*bl.stride(), *(lr.stride() if has_rows else (0, 0)))

    LAST_LAUNCH["split"] = launch(
        _split_kernel,
        (B * H_kv, plan.splits),
        q,
        k,
        v,
        qp,
        kp,
        kvl,
        op,
        lp,
        ks,
        vs,
        table if table is not None else kvl,
        table.stride(0) if table is not None else 0,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        sqpb,
        sqpq,
        skpb,
        skpn,
        *s_strides,
        N,
        H_kv,
        G,
        Q,
        plan.splits,
        scale * LOG2E,
        int(window) if window is not None else 0,
        float(softcap) if softcap is not None else 0.0,
        int(kv_len is not None),
        int(bool(k_pos_sorted)),
        bl,
        lr,
        *b_strides,
        int(has_rows),
        plan.split_len,
        plan.split_min,
        plan.split_cap,
        HEAD_D=d,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_D=plan.block_d,
        HAS_POS=has_pos,
        UPCAST=plan.upcast,
        FANOUT=SEARCH_FANOUT,
        SCALE_G=groups,
        BLOCK_G=max(1, plan.block_g),
        PAGE=page,
        LSE_BLOCK=lse_block,
        SOFTCAP=softcap_mode(softcap),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if partials is not None:  # (the call's Partials; a slice's views: its caller returns them)
        return partials if isinstance(partials, Partials) else None
    if (
        plan.splits == 1
        and sink is None
        and o.dtype == torch.float32
        and ONE_SPLIT_COPY["on"]
        and target_of(dev).backend == "interpreter"
    ):
        # one split: the reduce is the identity (a weight of exp(0) = 1, a sum of one term, + 0.0
        # as its sum starts; fp32 out: the interpreter rounds to 16 bits its own way). Triton's
        # interpreter (the tests' CPU) runs a Python program per row for it, most of an
        # interpreted step's time: there, the same numbers by a copy
        o.copy_(op[:, :, :, 0] + 0.0)
        lse.copy_(lp[:, :, :, 0])
        return o, lse
    sk = sink.to(device=dev, dtype=torch.float32).contiguous() if sink is not None else lp  # placeholder: unused
    launch(
        _reduce_kernel,
        (B * H * Q,),
        op,
        lp,
        o,
        lse,
        sk,
        *o.stride(),
        *lse.stride(),
        H,
        Q,
        plan.splits,
        HEAD_D=d,
        BLOCK_S=REDUCE_BLOCK_S,
        BLOCK_D=plan.block_d,
        HAS_SINK=sink is not None,
        num_warps=4,
    )
    return o, lse


def partial_attention_triton_paged(
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
    num_splits=None,
    block_n=None,
    num_warps=None,
    num_stages=None,
    block_lse=None,
    lse_block: int = 1,
    lse_rows=None,
    fixed_splits: bool = False,
    partials: bool = False,
):
    """Triton version of :func:`paged_ref.partial_attention_paged_ref` (same arguments and
    outputs; tuning as :func:`partial_attention_triton`): the split kernel reads each row's keys
    through its block table, one block id per tile (the page a multiple of the tile), so rows of
    different sequences and documents share one launch, and rows whose tables name the same
    blocks read the same storage. ``k_pool, v_pool [blocks, H_kv, page, d]``, ``block_tables
    [B, nb]`` int32/int64, ``kv_len [B]`` (required), ``pos_pool [blocks, page]``, ``k_scale,
    v_scale [blocks, H_kv, page, S]``. The sorted-position window search is not used here yet:
    a window layer walks the table's tiles, skipping those no query sees. ``block_lse [B, H, Q,
    ceil(nb·page / lse_block)]``, ``lse_rows``: as :func:`partial_attention_triton`'s, over each
    row's keys in table order."""
    if k_pool.dim() != 4 or v_pool.shape != k_pool.shape:
        raise ValueError(
            f"k_pool and v_pool must be [blocks, H_kv, page, d]; got {tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        )
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != q.shape[0]
        or kv_len is None
        or kv_len.shape != (q.shape[0],)
    ):
        raise ValueError(f"block_tables [B, blocks] and kv_len [B] are needed with B = {q.shape[0]}")
    if (q_pos is None) != (pos_pool is None):
        raise ValueError("causal masking needs both q_pos and pos_pool")
    if window is not None and q_pos is None:
        raise ValueError("a sliding window needs q_pos and pos_pool")
    _, H_kv, page, d = k_pool.shape
    B, H, Q = q.shape[:3]
    if q.shape[3] != d or H % H_kv:
        raise ValueError(f"q {tuple(q.shape)} and the pool {tuple(k_pool.shape)} disagree on head dim or heads")
    if page & (page - 1) or page < 16:
        raise ValueError(f"the page must be a power of two of at least 16 keys, got {page}")
    N = block_tables.shape[1] * page
    if block_lse is not None:
        check_block_lse(block_lse, lse_block, lse_rows, B, H, Q, N)
    lse_kw = dict(block_lse=block_lse, lse_block=lse_block, lse_rows=lse_rows) if block_lse is not None else {}
    groups = 0
    if k_scale is not None or v_scale is not None:
        groups = _check_scales(k_pool, v_pool, k_scale, v_scale)
        if not _tileable(d, groups) or (q.dtype == torch.float32 and target_of(q.device).backend != "interpreter"):
            from .paged_ref import gather_pages  # groups the kernel cannot tile: the rows dequantized

            k = dequantize(gather_pages(k_pool, block_tables), gather_pages(k_scale, block_tables), q.dtype)
            v = dequantize(gather_pages(v_pool, block_tables), gather_pages(v_scale, block_tables), q.dtype)
            return partial_attention_triton(
                q,
                k,
                v,
                scale=scale,
                q_pos=q_pos,
                kv_len=kv_len,
                window=window,
                softcap=softcap,
                sink=sink,
                out=out,
                lse_out=lse_out,
                k_pos=None if pos_pool is None else gather_pages(pos_pool, block_tables),
                fixed_splits=fixed_splits,
                partials=partials,
                **lse_kw,
            )
    dev = q.device
    o, lse, done = _outputs(q, N, out, lse_out, sink)
    if done:  # no rows, or no blocks: block_lse has no entry
        return _none_split(o, lse, sink) if partials else (o, lse)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    tuning = dict(
        num_splits=num_splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages, fixed_splits=fixed_splits
    )
    return _attend(
        q,
        k_pool,
        v_pool,
        o,
        lse,
        N,
        H_kv,
        groups,
        scale=scale,
        q_pos=q_pos,
        k_pos=pos_pool,
        kv_len=kv_len,
        window=window,
        softcap=softcap,
        sink=sink,
        k_scale=k_scale,
        v_scale=v_scale,
        k_pos_sorted=False,
        tuning=tuning,
        table=block_tables.to(device=dev).contiguous(),
        page=page,
        blocks=_blocks(block_lse, lse_block, lse_rows),
        partials=_partials(partials, sink),
    )


def _plan(B, H_kv, G, Q, N, d, dtype, dev, kv_dtype, groups, tuning, page, has_pos):
    """``(tuning, plan)`` of one launch of :func:`_attend`: a paged shard's tile never straddles
    two blocks (``block_n`` at most the page)."""
    if page:
        bn = (
            tuning.get("block_n")
            or plan_split(B, H_kv, G, Q, N, d, dtype, target_of(dev), kv_dtype=kv_dtype, scale_groups=groups).block_n
        )
        if page % min(bn, page):
            raise ValueError(f"a page of {page} keys is no multiple of the kernel's {bn}-key tile")
        tuning = {**tuning, "block_n": min(bn, page)}
    paged = bool(page) and not has_pos  # (rows through a table, no positions: two levels, plan_split)
    plan = plan_split(
        B, H_kv, G, Q, N, d, dtype, target_of(dev), kv_dtype=kv_dtype, scale_groups=groups, paged=paged, **tuning
    )
    return tuning, plan


def _check_scales(k, v, k_scale, v_scale) -> int:
    """Scales per row of an fp8 ``k``/``v`` pair (``[B, H_kv, N, S]`` each); raises on a
    mismatch."""
    if k_scale is None or v_scale is None:
        raise ValueError("an fp8 cache needs both k_scale and v_scale")
    if k.dtype.itemsize != 1 or v.dtype != k.dtype or not k.dtype.is_floating_point:
        raise ValueError(f"k_scale/v_scale go with fp8 k and v; got {k.dtype} and {v.dtype}")
    S = k_scale.shape[-1]
    want = (*k.shape[:3], S)
    if k_scale.shape != want or v_scale.shape != want or S < 1 or k.shape[-1] % S:
        raise ValueError(
            f"k_scale and v_scale must be {list(want)} with {k.shape[-1]} channels a multiple "
            f"of their groups; got {tuple(k_scale.shape)}, {tuple(v_scale.shape)}"
        )
    return S


def _tileable(d: int, groups: int) -> bool:
    """Whether the kernel's ``(BLOCK_N, BLOCK_G, BLOCK_D / BLOCK_G)`` view of a K/V tile puts
    each scale group's channels in one row of it: one group, or a power-of-two group width
    (the cache's: 32 channels)."""
    dg = d // groups
    block_d = max(16, triton.next_power_of_2(d))
    return groups == 1 or (dg & (dg - 1) == 0 and dg * triton.next_power_of_2(groups) == block_d)
