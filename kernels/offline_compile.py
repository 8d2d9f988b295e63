"""Compile every Triton kernel of treeattn for a GPU target, without a GPU, and report resources.

Triton's interpreter (the CPU tests) accepts code no GPU compiler does, so device code is not
done until it compiles for real targets. Here a stand-in driver names the target
(``targets.compile_only``) and every configuration the runtime can pick is *launched through
the runtime's own code* on ``meta`` tensors (shapes and strides, no memory), which compiles it
with the wheel's own backends (ptxas for CUDA, LLVM's AMDGPU backend for ROCm) instead of
running it. The configurations: head dim 64/128/256, GQA group 1-8, fp32/bf16/fp16, decode
(Q = 1, a static cache with ragged lengths; sliding window, soft-capping and sinks on and off) and
prefill slices (causal, windowed, pass-Q), KV lengths from 1 to 1M (every split count the
launch code chooses), and the fused merge kernels; and, on the targets that store an fp8 KV
cache (sm_90: e4m3fn, gfx942: e4m3fnuz; the engine refuses fp8 on sm_80), the split kernel
reading fp8 K/V and their scales (decode and speculation's verify blocks). Runtime integers
are not specialised, so the configurations share a few dozen compiled kernels; each is
checked once.

Per compiled kernel: registers, spill bytes, shared memory (LDS) against the target's limit,
K/V tiles in flight (the software pipeline's buffers, read from the TTGIR) and CTAs per SM.
``resources`` is also what ``python -m treeattn_cli.bench.kernel --tune`` reports on a real GPU.

And the decode launches the runtime makes for Llama-3.1-8B and -70B at tp 1 and 8 over 8K, 32K
and 128K keys per rank (:func:`decode_report`): the split kernel's tiles in flight, CTAs per SM
and what limits them, its grid against the SMs (also under a CUDA graph planned on twice the
length), and the bytes it keeps in flight against what the memory system needs (Little's law:
bandwidth x latency); :data:`RULES` are the ones CI asserts. With an fp8 cache (Llama-8B at tp 1
and 8, Llama-70B at tp 1 and 8) the same rules, at least two tiles in flight on every target and
no fewer CTAs resident at once than the bf16 kernel of the same shape, and the bytes read per
key and head (fp8 rows and their scales) against bf16's (or, on a shard that short, the
whole shard in flight at once).

And the split kernel writing ``block_lse`` (issue 37: each row's log-sum-exp per run of 1 or 16
keys, for citations) beside the plain kernel of the same launch (:func:`block_lse_report`):
Llama-3.1-8B's decode (bf16; a window layer; a verify block; an fp8 cache where the target
stores one) and a paged decode step. The variant must not spill, and keeps the plain kernel's
K/V tiles in flight.

And what one step reads from a document's shard (:func:`step_report`, issue 38): Llama-3.1-8B's
and -70B's heads (d = 128, GQA groups of 4 and 8) for one sequence's decode, 8 sequences'
decode rows over one document (cascade) and a verify of 17 rows, bf16 and fp8: the split
kernel's launches (query slices, each reading the shard once) times the bytes its compiled key
loop loads per key (K and V tiles, fp8 scales, positions), against bf16's.

    python -m treeattn_kernels.offline_compile --target sm_90 [--json]

One target per process (Triton keeps compiled kernels per device index; the stand-in is 0).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

from .targets import TARGETS, Target, compile_only, occupancy

HEAD_DIMS = (64, 128, 256)
GROUPS = tuple(range(1, 9))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_LENS = (1, 63, 64, 65, 1000, 4096, 32768, 131072, 1 << 20)  # every split count from 1 to the cap
SPILL_BOUND = 0  # bytes of spilled registers (local memory / scratch) a kernel may use
# Decode shapes of the report: (query heads, KV heads, head dim) per model, tp degrees, keys per rank.
MODELS = {"llama-3.1-8b": (32, 8, 128), "llama-3.1-70b": (64, 8, 128)}
DECODE_TPS = (1, 8)
DECODE_KEYS = (8192, 32768, 131072)
# CTAs per SM of the decode split kernel before issue 23 (num_stages=2, one K/V buffer), at
# the Llama-8B shape: (plain decode, sliding-window decode). Plain: register-bound at 3 on sm_90
# (137 registers) and 4 on sm_80 (128), LDS-bound at 1 on gfx942 (34,816 B); window: 200 and
# 216 registers (2 CTAs), gfx942 4 workgroups (unpipelined, 16 KiB of LDS).
BASELINE_CTAS = {"sm_80": (4, 2), "sm_90": (3, 2), "gfx942": (1, 4)}
RULES = {
    "tiles": "CUDA: >= 2 K/V tiles in flight per CTA, at no fewer CTAs per SM than before",
    "grid": "a full wave (CTAs >= SMs), or every split within its pipeline (the whole shard "
    "requested in the first round trip); under a CUDA graph planned on 2x the length, "
    "every split has work",
    "littles_law": "bytes in flight >= bandwidth x latency (or the whole shard)",
    "lds": "gfx942: <= 32 KiB of LDS, >= 2 workgroups per CU",
    "spills": "no spills",
}
NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8_e4m3fn",
    torch.float8_e4m3fnuz: "fp8_e4m3fnuz",
}
# The fp8 flavour each target's engine stores (kvquant.fp8_dtype); sm_80 has no fp8 loads and
# the engine refuses fp8 there, so its kernels are not built for it.
FP8_KV = {"sm_90": torch.float8_e4m3fn, "gfx942": torch.float8_e4m3fnuz}
FP8_HEAD_DIMS = (64, 96, 128, 256)  # 96: three scale groups, padded to four in the kernel's tile
FP8_MODELS = ("llama-3.1-8b", "llama-3.1-70b")  # the decode report's fp8 shapes (GQA groups of 4 and 8)


def scale_groups(d: int) -> int:
    """Scales per fp8 row of a head dim (``storage/kvdtypes.scale_groups``: one per 32 channels,
    else one): the kernels package imports nothing of the CLI's."""
    return d // 32 if d % 32 == 0 else 1


def kv_row_bytes(d: int, kv_dtype) -> int:
    """Bytes one key's K (or V) row of one head takes: fp8 rows carry their bf16 scales."""
    esize = torch.empty(0, dtype=kv_dtype).element_size()
    return d * esize + (2 * scale_groups(d) if esize == 1 else 0)


def _meta(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _cache_kv(B, H_kv, N, d, dtype):
    """K or V as the static cache holds them: ``[B, H_kv, capacity + 1, d]`` viewed to N."""
    return _meta(B, H_kv, N + 1, d, dtype=dtype)[:, :, :N]


def _cache_scales(B, H_kv, N, d):
    """``dict(k_scale, v_scale)`` of an fp8 cache as it holds them: ``[B, H_kv, capacity + 1,
    G]`` bf16 viewed to N."""
    G = scale_groups(d)
    return {n: _meta(B, H_kv, N + 1, G, dtype=torch.bfloat16)[:, :, :N] for n in ("k_scale", "v_scale")}


def fp8_calls(target: Target):
    """The split kernel over an fp8 cache on ``target`` (none where the engine stores no fp8):
    decode (plain, and windowed with soft-capping: every flag a compiled kernel depends on),
    speculation's verify blocks (Q = 8 causal rows) and a query block long enough to be sliced,
    per head dim (96: three scale groups, padded to four) and group size, with bf16 queries (and
    fp16 ones at d = 128: the same code, another operand type; each distinct kernel costs
    seconds of CI). fp32 queries read the cache dequantized up front (one configuration shows
    it)."""
    f8 = FP8_KV.get(target.name)
    if f8 is None:
        return
    for d, dt, G in itertools.product(FP8_HEAD_DIMS, (torch.bfloat16, torch.float16), (1, 4, 8)):
        if dt == torch.float16 and d != 128:
            continue
        H_kv = 8 // G
        for N in (1, 131072):
            for window, softcap in ((None, None), (1024, 30.0)):
                q = _meta(1, H_kv * G, 1, d, dtype=dt)
                kw = dict(
                    kv_len=_meta(1, dtype=torch.int64), window=window, softcap=softcap, **_cache_scales(1, H_kv, N, d)
                )
                if window is not None:
                    kw.update(
                        q_pos=_meta(1, 1, dtype=torch.int64),
                        k_pos=_meta(1, N + 1, dtype=torch.int64)[:, :N],
                        k_pos_sorted=True,
                    )
                yield (
                    f"decode-fp8 d={d} G={G} {NAMES[dt]} {NAMES[f8]} N={N} window={window} softcap={softcap}",
                    dict(q=q, k=_cache_kv(1, H_kv, N, d, f8), v=_cache_kv(1, H_kv, N, d, f8), **kw),
                )
        for Q in (8, 301):  # a verify block, and a block sliced into the tile's rows
            N = 4096
            q = _meta(1, H_kv * G, Q, d, dtype=dt)
            yield (
                f"verify-fp8 d={d} G={G} {NAMES[dt]} {NAMES[f8]} Q={Q}",
                dict(
                    q=q,
                    k=_cache_kv(1, H_kv, N, d, f8),
                    v=_cache_kv(1, H_kv, N, d, f8),
                    kv_len=_meta(1, dtype=torch.int64),
                    q_pos=_meta(1, Q, dtype=torch.int64),
                    k_pos=_meta(1, N + 1, dtype=torch.int64)[:, :N],
                    k_pos_sorted=True,
                    **_cache_scales(1, H_kv, N, d),
                ),
            )
    q = _meta(1, 8, 1, 128, dtype=torch.float32)
    yield (
        f"decode-fp8 d=128 G=4 fp32 {NAMES[f8]} N=4096 (dequantized up front)",
        dict(
            q=q,
            k=_cache_kv(1, 2, 4096, 128, f8),
            v=_cache_kv(1, 2, 4096, 128, f8),
            kv_len=_meta(1, dtype=torch.int64),
            **_cache_scales(1, 2, 4096, 128),
        ),
    )


def decode_calls():
    """Every decode launch: ``(label, kwargs of partial_attention_triton)``."""
    for d, G, dt, N in itertools.product(HEAD_DIMS, GROUPS, DTYPES, KV_LENS):
        for window, softcap in ((None, None), (1024, None), (None, 30.0), (4096, 50.0)):
            B, H_kv = 1, 8 // G if G <= 8 else 1
            q = _meta(B, H_kv * G, 1, d, dtype=dt)
            k, v = _cache_kv(B, H_kv, N, d, dt), _cache_kv(B, H_kv, N, d, dt)
            kw = dict(kv_len=_meta(B, dtype=torch.int64), window=window, softcap=softcap)
            if window is not None:
                kw.update(q_pos=_meta(B, 1, dtype=torch.int64), k_pos=_meta(B, N + 1, dtype=torch.int64)[:, :N])
            yield (f"decode d={d} G={G} {NAMES[dt]} N={N} window={window} softcap={softcap}", dict(q=q, k=k, v=v, **kw))
    for d, dt in itertools.product(HEAD_DIMS, DTYPES):  # learned attention sinks (gpt-oss): the reduce folds them
        q = _meta(1, 8, 1, d, dtype=dt)
        k, v = _cache_kv(1, 2, 4096, d, dt), _cache_kv(1, 2, 4096, d, dt)
        yield (
            f"decode d={d} G=4 {NAMES[dt]} N=4096 sink",
            dict(q=q, k=k, v=v, kv_len=_meta(1, dtype=torch.int64), sink=_meta(8, dtype=torch.float32)),
        )


def prefill_calls():
    """Long query blocks the Triton path runs in slices (fp32 on CUDA, windows, soft-capping;
    ATen's flash kernel takes the rest): the diagonal block, earlier blocks, pass-Q."""
    for d, G, dt in itertools.product(HEAD_DIMS, GROUPS, DTYPES):
        H_kv, Q = max(1, 8 // G), 301  # 301: full slices and a ragged tail slice
        q = _meta(1, H_kv * G, Q, d, dtype=dt)
        for N, kind in ((Q, "causal"), (4096, "past"), (8192, "pass-q")):
            k, v = _meta(1, H_kv, N, d, dtype=dt), _meta(1, H_kv, N, d, dtype=dt)
            pos = dict(q_pos=_meta(Q, dtype=torch.int64), k_pos=_meta(N, dtype=torch.int64))
            for window, softcap in ((None, None), (512, 30.0)):
                kw = dict(window=window, softcap=softcap)
                if kind == "causal" or window is not None:
                    kw.update(pos)
                if kind == "pass-q":
                    kw["kv_len"] = _meta(1, dtype=torch.int64)
                yield (
                    f"prefill-{kind} d={d} G={G} {NAMES[dt]} window={window} softcap={softcap}",
                    dict(q=q, k=k, v=v, **kw),
                )


PAGE = 64  # the paged launches' block of keys: a multiple of every target's tile (32 or 64 keys)


def paged_calls(target: Target):
    """The split kernel reading through block tables (issue 35): a decode step of 8 rows of
    different sequences over pools of 64-key blocks, 128K keys a table, per head dim and group
    size, plain and windowed with soft-capping; a batch's tail under a fixed-shape verify (8
    slots, 8 tokens each, causal by the pool's positions, 4K keys a slot's table); an fp8 pool
    where the target stores fp8."""
    B, nb = 8, 131072 // PAGE
    yield (
        f"paged-verify d=128 G=4 Q=8 causal bf16 page={PAGE}",
        dict(
            q=_meta(B, 8, 8, 128, dtype=torch.bfloat16),
            k_pool=_meta(4096, 2, PAGE, 128, dtype=torch.bfloat16),
            v_pool=_meta(4096, 2, PAGE, 128, dtype=torch.bfloat16),
            block_tables=_meta(B, 4096 // PAGE, dtype=torch.int32),
            kv_len=_meta(B, dtype=torch.int64),
            q_pos=_meta(B, 8, dtype=torch.int64),
            pos_pool=_meta(4096, PAGE, dtype=torch.int64),
        ),
    )
    for d, G in itertools.product(HEAD_DIMS, (1, 4, 8)):
        H_kv = 8 // G
        for window, softcap in ((None, None), (1024, 30.0)):
            kw = dict(
                q=_meta(B, H_kv * G, 1, d, dtype=torch.bfloat16),
                k_pool=_meta(4096, H_kv, PAGE, d, dtype=torch.bfloat16),
                v_pool=_meta(4096, H_kv, PAGE, d, dtype=torch.bfloat16),
                block_tables=_meta(B, nb, dtype=torch.int32),
                kv_len=_meta(B, dtype=torch.int64),
                window=window,
                softcap=softcap,
            )
            if window is not None:
                kw.update(q_pos=_meta(B, 1, dtype=torch.int64), pos_pool=_meta(4096, PAGE, dtype=torch.int64))
            yield f"paged d={d} G={G} bf16 page={PAGE} window={window} softcap={softcap}", kw
    f8 = FP8_KV.get(target.name)
    if f8 is not None:
        G = scale_groups(128)
        yield (
            f"paged-fp8 d=128 G=4 bf16 {NAMES[f8]} page={PAGE}",
            dict(
                q=_meta(B, 8, 1, 128, dtype=torch.bfloat16),
                k_pool=_meta(4096, 2, PAGE, 128, dtype=f8),
                v_pool=_meta(4096, 2, PAGE, 128, dtype=f8),
                block_tables=_meta(B, nb, dtype=torch.int32),
                kv_len=_meta(B, dtype=torch.int64),
                k_scale=_meta(4096, 2, PAGE, G, dtype=torch.bfloat16),
                v_scale=_meta(4096, 2, PAGE, G, dtype=torch.bfloat16),
            ),
        )


LSE_BLOCKS_COMPILED = (1, 16)  # block_lse's runs of keys compiled: one key, and the widest run


def _block_lse_launches(target: Target):
    """``(kind, function, kwargs)`` of the launches :func:`block_lse_report` compares, without
    block_lse: Llama-3.1-8B's decode at tp 1 (32 heads, 8 KV heads, d = 128: G = 4) over a
    static cache of 32K keys (bf16, a sliding-window layer, speculation's verify block of 8
    causal rows; fp8, plain and windowed, where the target stores it), and a paged decode step
    of 8 rows (d = 128, G = 4) over pools of 64-key blocks."""
    from .partial_triton import partial_attention_triton, partial_attention_triton_paged

    H, H_kv, d, N = 32, 8, 128, 32768

    def dense(kv_dtype, window=None, Q=1):
        q = (
            _meta(1, 1, H, d, dtype=torch.bfloat16).transpose(1, 2)
            if Q == 1
            else _meta(1, H, Q, d, dtype=torch.bfloat16)
        )
        kw = dict(
            q=q,
            k=_cache_kv(1, H_kv, N, d, kv_dtype),
            v=_cache_kv(1, H_kv, N, d, kv_dtype),
            kv_len=_meta(1, dtype=torch.int64),
        )
        if kv_dtype.itemsize == 1:
            kw.update(_cache_scales(1, H_kv, N, d))
        if window or Q > 1:
            kw.update(
                window=window,
                k_pos_sorted=True,
                q_pos=_meta(1, Q, dtype=torch.int64),
                k_pos=_meta(1, N + 1, dtype=torch.int64)[:, :N],
            )
        return kw

    yield f"dense d={d} G=4 bf16 N={N}", partial_attention_triton, dense(torch.bfloat16)
    yield f"dense d={d} G=4 bf16 N={N} window=4096", partial_attention_triton, dense(torch.bfloat16, 4096)
    yield f"verify d={d} G=4 bf16 N={N} Q=8", partial_attention_triton, dense(torch.bfloat16, Q=8)
    f8 = FP8_KV.get(target.name)
    if f8 is not None:
        yield f"fp8 d={d} G=4 bf16 {NAMES[f8]} N={N}", partial_attention_triton, dense(f8)
        yield f"fp8 d={d} G=4 bf16 {NAMES[f8]} N={N} window=4096", partial_attention_triton, dense(f8, 4096)
    B, nb = 8, 131072 // PAGE
    yield (
        f"paged d={d} G=4 bf16 page={PAGE}",
        partial_attention_triton_paged,
        dict(
            q=_meta(B, 8, 1, d, dtype=torch.bfloat16),
            k_pool=_meta(4096, 2, PAGE, d, dtype=torch.bfloat16),
            v_pool=_meta(4096, 2, PAGE, d, dtype=torch.bfloat16),
            block_tables=_meta(B, nb, dtype=torch.int32),
            kv_len=_meta(B, dtype=torch.int64),
        ),
    )


def _with_block_lse(kw: dict, lse_block: int, rows: bool) -> dict:
    """``kw`` with a block_lse output ``[B, H, Q, ceil(N / lse_block)]`` (and lse_rows)."""
    B, H, Q = kw["q"].shape[:3]
    N = kw["block_tables"].shape[1] * PAGE if "block_tables" in kw else kw["k"].shape[2]
    out = dict(kw, block_lse=_meta(B, H, Q, -(-N // lse_block), dtype=torch.float32), lse_block=lse_block)
    if rows:
        out["lse_rows"] = _meta(B, Q, dtype=torch.bool)
    return out


def block_lse_calls(target: Target):
    """The block_lse variants of :func:`_block_lse_launches` (``(label, function, kwargs)``), one
    per run length, with lse_rows (the same kernel as without: :func:`block_lse_report`)."""
    for kind, fn, kw in _block_lse_launches(target):
        for lb in LSE_BLOCKS_COMPILED:
            yield f"block_lse {kind} lse_block={lb}", fn, _with_block_lse(kw, lb, rows=True)


def block_lse_report(target: Target) -> list[dict]:
    """The split kernel writing block_lse against the plain kernel of the same launch, per
    launch of :func:`_block_lse_launches` and run length: ``{"kind", "lse_block", "plain",
    "lse", "same_kernel_with_lse_rows"}``, each kernel's registers, spill bytes, shared memory,
    K/V tiles in flight and CTAs per SM. ``checks``: no spills, the plain kernel's tiles in
    flight, shared memory within the target's limit, and lse_rows compiling no other kernel."""
    out = []
    with compile_only(target) as compiled:

        def split_of(fn, kw):
            before = len(compiled)
            fn(**kw)
            ck = next(ck for name, ck, _ in compiled[before:] if name == "_split_kernel")
            res = resources(ck, target)
            res["tiles_in_flight"] = pipeline_depth(ck)
            res["ctas_per_sm"] = occupancy(target, res["regs"], res["shared_bytes"], res["num_warps"])["ctas"]
            res["lse_block"] = _constexprs(ck).get("LSE_BLOCK")
            return ck, res

        for kind, fn, kw in _block_lse_launches(target):
            _, plain = split_of(fn, kw)
            for lb in LSE_BLOCKS_COMPILED:
                ck, lse = split_of(fn, _with_block_lse(kw, lb, rows=False))
                ck_rows, _ = split_of(fn, _with_block_lse(kw, lb, rows=True))
                rec = {
                    "kind": kind,
                    "lse_block": lb,
                    "plain": plain,
                    "lse": lse,
                    "same_kernel_with_lse_rows": ck_rows is ck,
                }
                rec["checks"] = {
                    "spills": plain["spill_bytes"] <= SPILL_BOUND and lse["spill_bytes"] <= SPILL_BOUND,
                    "tiles": lse["tiles_in_flight"] == plain["tiles_in_flight"],
                    "shared": lse["shared_bytes"] <= target.max_shared,
                    "lse_rows": ck_rows is ck and plain["lse_block"] == 0 and lse["lse_block"] == lb,
                }
                out.append(rec)
    return out


# The step report's launches: (kind, query rows per sequence and document, causal positions).
STEP_KINDS = (("batch 1", 1, False), ("batch 8", 8, False), ("verify 17", 17, True))
STEP_KEYS = 32768  # keys of the document's shard (the bytes scale with it; the ratios do not)
STEP_BYTES_BOUND = 0.55  # fp8: the most of bf16's bytes a step may read (scales and positions included)


def _step_launch(H, H_kv, d, Q, causal, kv_dtype, N=STEP_KEYS):
    """The runtime's call for ``Q`` query rows of each head over one document's shard of ``N``
    keys: decode (HF's transposed query), B sequences' rows of a cascade (``[1, H, B, d]``,
    without positions) or a verify block (causal: the step's and the cache's sorted positions)."""
    q = _meta(1, 1, H, d, dtype=torch.bfloat16).transpose(1, 2) if Q == 1 else _meta(1, H, Q, d, dtype=torch.bfloat16)
    kw = dict(
        q=q,
        k=_cache_kv(1, H_kv, N, d, kv_dtype),
        v=_cache_kv(1, H_kv, N, d, kv_dtype),
        kv_len=_meta(1, dtype=torch.int64),
        out=_meta(1, H, Q, d, dtype=torch.float32),
    )
    if kv_dtype.itemsize == 1:
        kw.update(_cache_scales(1, H_kv, N, d))
    if causal:
        kw.update(
            k_pos_sorted=True, q_pos=_meta(1, Q, dtype=torch.int64), k_pos=_meta(1, N + 1, dtype=torch.int64)[:, :N]
        )
    return kw


def loop_bytes_per_key(ck) -> float:
    """Bytes the split kernel's key loop loads per key of one KV head, read off its Triton IR:
    the loads of one iteration of the loop that holds the dots (the K and V tiles, an fp8
    cache's scales, positions), over the keys an iteration walks (its step: BLOCK_N)."""
    lines = ck.asm["ttir"].splitlines()

    def indent(line):
        return len(line) - len(line.lstrip())

    dot = next(i for i, line in enumerate(lines) if "tt.dot" in line)
    head = next(i for i in range(dot, -1, -1) if "scf.for" in lines[i] and indent(lines[i]) < indent(lines[dot]))
    end = next(
        i
        for i in range(head + 1, len(lines))
        if indent(lines[i]) == indent(lines[head]) and lines[i].lstrip().startswith("}")
    )
    total = 0
    for line in lines[head + 1 : end]:
        m = re.search(r"tt\.load .*: (?:tensor<([\dx]+)x)?!tt\.ptr<(\w+)>", line)
        if m:
            elems = math.prod(map(int, (m.group(1) or "1").split("x")))
            t = m.group(2)
            total += elems * (1 if t.startswith("f8") else max(1, int(re.search(r"\d+", t).group()) // 8))
    step = re.search(r"step %c(\d+)_i32", lines[head])
    return total / int(step.group(1))


def step_report(target: Target) -> list[dict]:
    """What one step reads from a document's shard of :data:`STEP_KEYS` keys on ``target``,
    per model of :data:`MODELS` (one rank: its query heads, 8 KV heads, d = 128), kind of step
    (:data:`STEP_KINDS`) and KV dtype (bf16; fp8 where the target stores it): the split kernel's
    ``launches`` (query slices; a launch's programs cut the shard into disjoint runs, so each
    reads every K/V tile once), its compiled loop's ``bytes_per_key`` (one KV head), and
    ``bytes_per_step = launches x KV heads x keys x bytes_per_key``, with ``vs_bf16`` (fp8's
    against bf16's of the same step); the kernel's registers, spills, shared memory and K/V
    tiles in flight. ``checks``: no spills, and an fp8 step reads at most
    :data:`STEP_BYTES_BOUND` of bf16's bytes."""
    from .partial_triton import partial_attention_triton

    out, bf16 = [], {}
    kv_dtypes = (torch.bfloat16,) + ((FP8_KV[target.name],) if target.name in FP8_KV else ())
    with compile_only(target) as compiled:
        for (model, (H, H_kv, d)), (kind, Q, causal), kv_dtype in itertools.product(
            MODELS.items(), STEP_KINDS, kv_dtypes
        ):
            before = len(compiled)
            partial_attention_triton(**_step_launch(H, H_kv, d, Q, causal, kv_dtype))
            splits = [ck for name, ck, _ in compiled[before:] if name == "_split_kernel"]
            ck = splits[0]  # every slice of a step is the same kernel (its height: tile_rows)
            res = resources(ck, target)
            per_key = loop_bytes_per_key(ck)
            step = len(splits) * H_kv * STEP_KEYS * per_key
            if kv_dtype == torch.bfloat16:
                bf16[(model, kind)] = step
            c = _constexprs(ck)
            rec = {
                "model": model,
                "kind": kind,
                "rows": H // H_kv * Q,
                "kv_dtype": NAMES[kv_dtype],
                "launches": len(splits),
                "block_m": c["BLOCK_M"],
                "block_n": c["BLOCK_N"],
                "num_warps": res["num_warps"],
                "regs": res["regs"],
                "spill_bytes": res["spill_bytes"],
                "shared_bytes": res["shared_bytes"],
                "tiles_in_flight": pipeline_depth(ck),
                "ctas_per_sm": occupancy(target, res["regs"], res["shared_bytes"], res["num_warps"])["ctas"],
                "bytes_per_key": round(per_key, 2),
                "bytes_per_step": round(step),
                "vs_bf16": round(step / bf16[(model, kind)], 4),
            }
            rec["checks"] = {
                "spills": res["spill_bytes"] <= SPILL_BOUND,
                "bytes": kv_dtype == torch.bfloat16 or rec["vs_bf16"] <= STEP_BYTES_BOUND,
            }
            out.append(rec)
    return out


# hidden sizes of the norms (and MLP widths) the fused layer kernels meet: Qwen2-0.5B's 896, 2048
# to 8192 (Llama 1B to 70B), and a query/key norm of head dim 128 (Qwen3)
NORM_WIDTHS = (128, 896, 2048, 4096, 8192)


def write_calls(target: Target):
    """A step's keys and values into the pool (``write_triton``): each dtype's plain store, and,
    where the target stores fp8 (:data:`FP8_KV`), the fp8 write from bf16 rows; head dims 64-256."""
    for d in (64, 128, 256):
        for dt in DTYPES:
            yield f"write_kv d={d} {NAMES[dt]}", d, dt, None
        if target.name in FP8_KV:
            yield f"write_kv d={d} {NAMES[FP8_KV[target.name]]}", d, torch.bfloat16, FP8_KV[target.name]


def fused_calls():
    """The layer's small kernels (``fused_triton``: the RMS norm per width and dtype, SiLU × up per
    dtype), at a decode step's rows."""
    for n, dt in itertools.product(NORM_WIDTHS, DTYPES):
        yield f"rms_norm n={n} {NAMES[dt]}", n, dt


def merge_calls():
    """The fused pack/finish of the allreduce merge and the one-launch merge of an all-gather
    (8 ranks), per head dim and output dtype."""
    for d, dt in itertools.product(HEAD_DIMS, DTYPES):
        yield f"merge d={d} {NAMES[dt]}", d, dt


def resources(ck, target: Target) -> dict:
    """Registers, spill bytes and shared memory of a compiled kernel, from its binary (CUDA:
    the cubin through the wheel's ``cuobjdump``; ROCm: the AMDGPU assembly's metadata)."""
    meta = ck.metadata
    shared = int(getattr(meta, "shared", 0) or 0)
    out = {"num_warps": meta.num_warps, "num_stages": getattr(meta, "num_stages", None)}
    if target.backend == "cuda":
        from triton import knobs

        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            text = subprocess.run(
                [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
        use = dict((k, int(v)) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
        out.update(
            regs=use.get("REG"),
            spill_bytes=use.get("STACK", 0) + use.get("LOCAL", 0),
            shared_bytes=shared + use.get("SHARED", 0),
        )
    else:
        asm = ck.asm["amdgcn"]

        def field(name):
            m = re.search(rf"\.{name}:\s+(\d+)", asm)
            return int(m.group(1)) if m else 0

        # VGPR spills go to scratch memory (the private segment); SGPR spills go to VGPR lanes,
        # which costs no memory traffic and is reported apart
        out.update(
            regs=field("vgpr_count"),
            sgpr_spills=field("sgpr_spill_count"),
            spill_bytes=max(4 * field("vgpr_spill_count"), field("private_segment_fixed_size")),
            shared_bytes=max(shared, field("group_segment_fixed_size")),
        )
    out["max_shared"] = target.max_shared
    out["ok"] = out["spill_bytes"] <= SPILL_BOUND and out["shared_bytes"] <= target.max_shared
    return out


def narrow_base_offsets(ck) -> list[str]:
    """Pointer arguments that a kernel offsets by a 32-bit scalar (``tt.addptr %K, %x : ...,
    i32`` in its Triton IR): a batch or head offset computed in i32 wraps past 2^31 elements."""
    ttir = ck.asm.get("ttir", "")
    head = next((line for line in ttir.splitlines() if "tt.func public" in line), "")
    args = set(re.findall(r"%(\w+): !tt\.ptr<", head))  # the kernel's pointer arguments
    found = re.findall(r"tt\.addptr %(\w+), %[\w.#]+ : !tt\.ptr<\w+>, i32", ttir)
    return sorted(set(found) & args)


def pipeline_depth(ck) -> int:
    """K/V tiles in flight per CTA: the buffers of the multi-buffered K and V tiles
    (``ttg.local_alloc : () -> !ttg.memdesc<S x BLOCK_N x BLOCK_D x ...>`` in the TTGIR: the
    software pipeline keeps ``S`` tiles requested ahead of the one it consumes); or, where the
    pipeliner keeps the tiles in registers instead (ROCm's stream pipeliner, for fp8 tiles
    dequantized before their dot), the tiles it requests before the loop that consumes them
    (the prologue's loads of the loop's K/V tile type, per such load of an iteration); 1 for a
    loop that loads and then computes each tile."""
    ttgir = ck.asm.get("ttgir", "")
    allocs = r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x\d+x[a-z]"  # S x rows x cols x dtype
    depths = [int(x) for x in re.findall(allocs, ttgir)]
    dot = ttgir.find("tt.dot ")
    loop = ttgir.rfind("scf.for", 0, dot)
    # 2-D tile loads (shape and element type): tt.load's pointer tensor, a buffer load's result
    tiles = r"(?:tt\.load [^\n]*tensor<(\d+x\d+)x!tt\.ptr<(\w+)>|amdg\.buffer_load [^\n]*-> tensor<(\d+x\d+)x(\w+),)"

    def loads(text):
        return [(a or c, b or d) for a, b, c, d in re.findall(tiles, text)]

    in_loop = loads(ttgir[loop:dot]) if dot > 0 and loop > 0 else []
    ahead = 0
    if in_loop:
        kv = max(in_loop, key=lambda t: math.prod(map(int, t[0].split("x"))))  # the largest: K and V
        ahead = loads(ttgir[:loop]).count(kv) // in_loop.count(kv)
    return max(min(depths) if depths else 1, ahead)


def sass_pipeline(ck) -> dict:
    """CUDA evidence of the pipeline in the machine code: asynchronous copies (``LDGSTS``,
    cp.async) and the most copy groups a wait leaves outstanding (``DEPBAR.LE SB0, N``)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    waits = [int(x, 16) for x in re.findall(r"DEPBAR\.LE\s+SB0,\s*0x([0-9a-f]+)", sass)]
    return {"async_copies": sass.count("LDGSTS"), "max_outstanding_groups": max(waits, default=0)}


def _live_splits(splits: int, blocks: int) -> int:
    """Splits with work when ``blocks`` blocks of live keys are cut into ``splits`` balanced
    runs, as the split kernel cuts them on the device."""
    return sum(1 for s in range(splits) if (s + 1) * blocks // splits > s * blocks // splits)


def decode_shapes():
    """``(model, tp, keys per rank, H, H_kv, d)`` per rank of the report's decode launches."""
    for (model, (H, H_kv, d)), tp, N in itertools.product(MODELS.items(), DECODE_TPS, DECODE_KEYS):
        yield model, tp, N, H // tp, max(1, H_kv // tp), d


def _decode_launch(H, H_kv, d, capacity, dtype=torch.bfloat16, window=None, kv_dtype=None):
    """The runtime's decode call on one rank (``attention.py``): HF's transposed query, the
    static cache ``[1, H_kv, capacity + 1, d]`` viewed to ``capacity``, lengths on the device,
    fp32 partials; a sliding-window layer also passes the step's and the cache's positions. An
    fp8 ``kv_dtype``: the cache's fp8 rows and their scales (``[1, H_kv, capacity + 1, G]``)."""
    from .partial_triton import partial_attention_triton

    q = _meta(1, 1, H, d, dtype=dtype).transpose(1, 2)
    kv_dtype = kv_dtype or dtype
    k, v = _cache_kv(1, H_kv, capacity, d, kv_dtype), _cache_kv(1, H_kv, capacity, d, kv_dtype)
    kw = _cache_scales(1, H_kv, capacity, d) if kv_dtype.itemsize == 1 else {}
    if window:
        kw.update(
            window=window,
            k_pos_sorted=True,
            q_pos=_meta(1, 1, dtype=torch.int64),
            k_pos=_meta(1, capacity + 1, dtype=torch.int64)[:, :capacity],
        )
    partial_attention_triton(
        q, k, v, kv_len=_meta(1, dtype=torch.int64), out=_meta(1, H, 1, d, dtype=torch.float32), **kw
    )


def decode_report(target: Target, dtype=torch.bfloat16) -> list[dict]:
    """The split kernel of every decode launch of :func:`decode_shapes` on ``target``, judged by
    :data:`RULES`: one record per shape (and one for a sliding-window layer of Llama-8B); and,
    where the target stores an fp8 cache (:data:`FP8_KV`), one per Llama-8B shape (and window
    layer) over fp8 K/V, whose CTAs per SM are judged against the ``dtype`` kernel's of the
    same shape. ``kv_dtype`` names each record's cache; ``bytes_per_key`` is what one key of one
    KV head costs to read (K and V rows, fp8 with their scales), ``bytes_per_key_vs_bf16``
    that against a bf16 cache."""
    need = target.bytes_in_flight_needed
    out, judged, plain = [], {}, {}
    with compile_only(target) as compiled:

        def split_of(fn):
            before = len(compiled)
            fn()
            return next((ck, grid) for name, ck, grid in compiled[before:] if name == "_split_kernel")

        shapes = [(m, tp, N, H, Hk, d, None) for m, tp, N, H, Hk, d in decode_shapes()]
        shapes.append(("llama-3.1-8b", 1, 131072, 32, 8, 128, 4096))  # a sliding-window layer
        runs = [(s, dtype) for s in shapes]
        if target.name in FP8_KV:
            runs += [(s, FP8_KV[target.name]) for s in shapes if s[0] in FP8_MODELS]
        for (model, tp, N, H, H_kv, d, window), kv_dtype in runs:
            ck, grid = split_of(lambda: _decode_launch(H, H_kv, d, N, dtype, window, kv_dtype))
            _, graph_grid = split_of(lambda: _decode_launch(H, H_kv, d, 2 * N, dtype, window, kv_dtype))
            if id(ck) not in judged:
                res = resources(ck, target)
                res["tiles_in_flight"] = pipeline_depth(ck)
                res["occupancy"] = occupancy(target, res["regs"], res["shared_bytes"], res["num_warps"])
                if target.backend == "cuda":
                    res.update(sass_pipeline(ck))
                judged[id(ck)] = res
            res = judged[id(ck)]
            bn = _constexprs(ck)["BLOCK_N"]
            depth, ctas_sm = res["tiles_in_flight"], res["occupancy"]["ctas"]
            splits, ctas = grid[1], grid[0] * grid[1]
            blocks = -(-N // bn)
            per_split = -(-blocks // splits)
            row = kv_row_bytes(d, kv_dtype)
            tile = 2 * bn * row  # one K and one V tile (fp8: and their scales)
            shard = 2 * H_kv * N * row
            resident = min(ctas, ctas_sm * target.n_sms)
            in_flight = min(shard, resident * min(depth, per_split) * tile)
            live = _live_splits(graph_grid[1], blocks)
            key = (model, tp, N, window)
            if kv_dtype == dtype:
                plain[key] = (ctas_sm, resident)
            floor = (
                plain.get(key, (0, 0))[0] if kv_dtype != dtype else BASELINE_CTAS.get(target.name, (1, 1))[bool(window)]
            )
            # fp8: the CTAs of this launch resident at once, against the bf16 kernel's at the same
            # shape (a grid that fits in one wave at fewer CTAs per SM loses nothing; nor does a
            # shorter grid whose runs put the whole shard in flight at once)
            resident_floor = plain.get(key, (0, 0))[1] if kv_dtype != dtype else min(ctas, floor * target.n_sms)
            rec = {
                "model": model,
                "tp": tp,
                "keys": N,
                "heads": H,
                "kv_heads": H_kv,
                "head_dim": d,
                "window": window,
                "kv_dtype": NAMES[kv_dtype],
                "block_n": bn,
                "num_stages": res["num_stages"],
                "num_warps": res["num_warps"],
                "regs": res["regs"],
                "spill_bytes": res["spill_bytes"],
                "shared_bytes": res["shared_bytes"],
                "tiles_in_flight": depth,
                "ctas_per_sm": ctas_sm,
                "ctas_floor": floor,
                "resident_ctas": resident,
                "resident_floor": resident_floor,
                "occupancy": res["occupancy"],
                "async_copies": res.get("async_copies"),
                "max_outstanding_groups": res.get("max_outstanding_groups"),
                "keys_walked": min(N, window + bn) if window else N,
                "splits": splits,
                "grid_ctas": ctas,
                "n_sms": target.n_sms,
                "blocks_per_split": per_split,
                "waves": round(ctas / (target.n_sms * max(1, ctas_sm)), 3),
                "graph_splits": graph_grid[1],
                "graph_live_splits": live,
                "bytes_per_key": 2 * row,
                "bytes_per_key_vs_bf16": round(row / kv_row_bytes(d, torch.bfloat16), 4),
                "tile_bytes": tile,
                "shard_bytes": shard,
                "bytes_in_flight": in_flight,
                "bytes_in_flight_per_sm": round(in_flight / target.n_sms),
                "bytes_needed": round(need),
                "bytes_needed_per_sm": round(need / target.n_sms),
                "littles_margin": round(in_flight / min(need, shard), 2) if need else None,
            }
            rec["checks"] = {
                "tiles": (target.backend != "cuda" or (depth >= 2 and ctas_sm >= floor))
                if kv_dtype == dtype
                else depth >= 2 and (resident >= resident_floor or in_flight >= shard),
                "grid": (ctas >= target.n_sms or per_split <= depth) and live == min(graph_grid[1], blocks),
                "littles_law": need == 0 or in_flight >= min(need, shard),
                "lds": not target.is_hip or (res["shared_bytes"] <= 32768 and ctas_sm >= 2),
                "spills": res["spill_bytes"] <= SPILL_BOUND,
            }
            out.append(rec)
    return out


def decode_growth(target: Target, tokens: int = 8192, d: int = 128, dtype=torch.bfloat16) -> int:
    """Distinct kernels eager decode compiles while a shard grows from 1 to ``tokens`` keys
    (Llama-3.1-8B's shape on one rank): the split count and the length change every step."""
    from .partial_triton import partial_attention_triton

    with compile_only(target) as compiled:
        q = _meta(1, 32, 1, d, dtype=dtype)
        for n in range(1, tokens + 1):
            kv = _meta(1, 8, tokens, d, dtype=dtype)[:, :, :n]
            partial_attention_triton(q, kv, kv, kv_len=_meta(1, dtype=torch.int64))
        return len({id(ck) for _, ck, _ in compiled})


def launches(target: Target, calls=None):
    """``(label, thunk)`` of every configuration :func:`compile_all` compiles for ``target``, in
    its order (``calls``: these ``(label, kwargs of partial_attention_triton)`` instead)."""
    from . import Partials
    from .merge_triton import merge_gathered_fused, merge_pair_fused, reduce_pair, unweigh_fused, weigh_fused
    from .partial_triton import partial_attention_triton, partial_attention_triton_paged

    for label, kw in itertools.chain(
        calls or (),
        decode_calls() if calls is None else (),
        prefill_calls() if calls is None else (),
        fp8_calls(target) if calls is None else (),
    ):
        yield label, lambda kw=kw: partial_attention_triton(**kw)
    if calls is not None:
        return
    for label, kw in paged_calls(target):
        yield label, lambda kw=kw: partial_attention_triton_paged(**kw)
    for label, fn, kw in block_lse_calls(target):
        yield label, lambda fn=fn, kw=kw: fn(**kw)
    from .fused_triton import add_rms_norm_triton, rms_norm_triton, silu_mul_triton

    for label, n, dt in fused_calls():

        def layer(n=n, dt=dt):
            rms_norm_triton(_meta(4, n, dtype=dt), _meta(n, dtype=dt), 1e-6)
            add_rms_norm_triton(_meta(4, n, dtype=dt), _meta(4, n, dtype=dt), _meta(n, dtype=dt), 1e-6)
            if n == NORM_WIDTHS[-1]:  # (one block size for every width)
                silu_mul_triton(_meta(4, 14336, dtype=dt), _meta(4, 14336, dtype=dt))

        yield label, layer
    from .write_triton import write_kv_triton

    for label, d, dt, fp8 in write_calls(target):

        def write(d=d, dt=dt, fp8=fp8):
            store = _meta(64, 8, 64, d, dtype=fp8 or dt)
            scales = (_meta(64, 8, 64, d // 32, dtype=torch.bfloat16),) * 2 if fp8 else (None, None)
            rows = _meta(4, 8, d, dtype=dt)
            rotation = _meta(d, d, dtype=torch.float32) if fp8 else None
            write_kv_triton(store, store, _meta(4, dtype=torch.int64), rows, rows, *scales, rotation)

        yield label, write
    for label, d, dt in merge_calls():

        def merge(d=d, dt=dt):
            o, lse = _meta(1, 32, 1, d, dtype=torch.float32), _meta(1, 32, 1, dtype=torch.float32)
            packed = weigh_fused(o, lse, lse)
            unweigh_fused(packed, lse, out=_meta(1, 1, 32, d, dtype=dt).transpose(1, 2), dtype=dt)
            merge_pair_fused(o, lse, o, lse)  # a step's documents' and tail's partials, and alone
            merge_pair_fused(o, lse, o, lse, out=_meta(1, 1, 32, d, dtype=dt).transpose(1, 2))  # (into the layer)
            # a step's two calls' splits, reduced and merged in one launch into the layer (8 rows)
            f32 = torch.float32
            docs = Partials(_meta(2 * 32 * 4 * 4 * d, dtype=f32), _meta(2 * 32 * 4 * 4, dtype=f32), (1, 32, 8, 4, d), 4)
            tail = Partials(_meta(8 * 32 * 2 * d, dtype=f32), _meta(8 * 32 * 2, dtype=f32), (8, 32, 1, 2, d), 4)
            reduce_pair(docs.of_rows(1), tail, out=_meta(8, 1, 32, d, dtype=dt).transpose(1, 2))
            rotation = _meta(d, d, dtype=f32)  # (an fp8 pool's output turned back in the same launch)
            reduce_pair(docs.of_rows(1), tail, out=_meta(8, 1, 32, d, dtype=dt).transpose(1, 2), rotation=rotation)
            every = _meta(8, 1, 32, 1, d + 1, dtype=torch.float32)  # an all-gather of 8 ranks' [o, lse]
            merge_gathered_fused(every, out=_meta(1, 1, 32, d, dtype=dt).transpose(1, 2), dtype=dt)

        yield label, merge


def warm_share(target: Target, share: int, shares: int) -> tuple[int, int]:
    """Compile configurations ``share``, ``share + shares``, ... of :func:`launches` into Triton's
    on-disk cache, nothing recorded; returns ``(compiled, failed)``. Several processes, one
    share each, fill the cache in parallel; :func:`compile_all` then finds every kernel there (cold,
    one process: ~95 s for sm_90's 142 kernels here; warm: ~11 s)."""
    done = failed = 0
    with compile_only(target):
        for i, (_, fn) in enumerate(launches(target)):
            if i % shares != share:
                continue
            try:
                fn()
                done += 1
            except Exception:  # noqa: BLE001 - compile_all names it; warming only skips it
                failed += 1
    return done, failed


def start_warming(target: Target, workers: int | None = None) -> list:
    """``workers`` processes (default: the CPUs this process may use, at most 8) compiling a share
    each of ``target``'s configurations into Triton's cache (:func:`warm_share`); returns them
    (``subprocess.Popen``, output discarded), or ``[]`` for a target not in :data:`TARGETS` or one
    worker. Wait for them before :func:`compile_all`, which then compiles little itself."""
    workers = workers or min(
        8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    if workers < 2 or TARGETS.get(target.name) is None:
        return []
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "treeattn_kernels.offline_compile",
                "--target",
                target.name,
                "--warm",
                f"{w}/{workers}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        for w in range(workers)
    ]


def compile_all(target: Target, calls=None) -> dict:
    """Compile every configuration for ``target``; returns ``{"kernels": [...], "errors": [...],
    "configs": n, "seconds": s}``. Each kernel record carries its resources and the first
    configuration that needed it."""
    t0 = time.perf_counter()
    kernels, errors, seen, n = [], [], {}, 0
    with compile_only(target) as compiled:

        def record(label, fn):
            nonlocal n
            n += 1
            before = len(compiled)
            try:
                fn()
            except Exception as e:  # a compile error is a result: name the configuration
                errors.append({"config": label, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
                return
            for name, ck, grid in compiled[before:]:
                if id(ck) in seen:
                    continue
                seen[id(ck)] = ck
                rec = {
                    "kernel": name,
                    "target": target.name,
                    "first_config": label,
                    "grid": list(grid),
                    "constexprs": _constexprs(ck),
                }
                rec.update(resources(ck, target))
                rec["tiles_in_flight"] = pipeline_depth(ck)
                rec["ctas_per_sm"] = occupancy(target, rec["regs"], rec["shared_bytes"], rec["num_warps"])["ctas"]
                rec["narrow_base_offsets"] = narrow_base_offsets(ck)
                kernels.append(rec)

        for label, fn in launches(target, calls):
            record(label, fn)
    growth = decode_growth(target) if calls is None else None
    decode = decode_report(target) if calls is None else None
    lse = block_lse_report(target) if calls is None else None
    steps = step_report(target) if calls is None else None
    return {
        "target": target.name,
        "configs": n,
        "kernels": kernels,
        "errors": errors,
        "decode_growth_kernels": growth,
        "decode": decode,
        "block_lse": lse,
        "steps": steps,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _constexprs(ck) -> dict:
    """The compile-time parameters of a compiled kernel, by name (tile sizes, flags)."""
    src = getattr(ck, "src", None)
    names = getattr(getattr(src, "fn", None), "arg_names", [])
    out = {}
    for k, v in (getattr(src, "constants", None) or {}).items():
        i = k[0] if isinstance(k, tuple) and len(k) == 1 else k
        if isinstance(i, int) and i < len(names) and names[i].isupper() and isinstance(v, (int, bool)):
            out[names[i]] = v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Compile treeattn's Triton kernels for a GPU target "
        "without a GPU; report registers, spills, shared memory."
    )
    ap.add_argument("--target", required=True, choices=sorted(TARGETS))
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument(
        "--warm",
        default=None,
        metavar="I/N",
        help="only compile share I of N of the configurations into Triton's cache (start_warming)",
    )
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("offline_compile: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    if a.warm:
        m = re.fullmatch(r"(\d+)/(\d+)", a.warm)
        if not m or not int(m[1]) < int(m[2]):
            ap.error(f"--warm takes I/N with 0 <= I < N, got {a.warm!r}")
        share, shares = int(m[1]), int(m[2])
        done, failed = warm_share(TARGETS[a.target], share, shares)
        print(json.dumps({"target": a.target, "share": share, "shares": shares, "compiled": done, "failed": failed}))
        return 0
    res = compile_all(TARGETS[a.target])
    if a.json:
        print(json.dumps(res))
    else:
        print(
            f"{res['target']}: {res['configs']} configurations, {len(res['kernels'])} kernels, "
            f"{len(res['errors'])} errors, {res['seconds']} s; eager decode from 1 to 8192 keys "
            f"compiles {res['decode_growth_kernels']} kernel(s)"
        )
        for k in res["kernels"]:
            print(
                f"  {'ok ' if k['ok'] else 'BAD'} {k['kernel']:<16} regs={k['regs']} spill={k['spill_bytes']} "
                f"shared={k['shared_bytes']}/{k['max_shared']} warps={k['num_warps']} "
                f"stages={k['num_stages']} tiles={k['tiles_in_flight']} ctas/sm={k['ctas_per_sm']}  "
                f"{k['first_config']}"
            )
        for e in res["errors"]:
            print(f"  ERROR {e['config']}: {e['error']}")
        print_decode(res)
        print_block_lse(res)
        print_steps(res)
    decode_ok = all(
        all(r["checks"].values()) for r in (res["decode"] or []) + (res["block_lse"] or []) + (res["steps"] or [])
    )
    return 0 if not res["errors"] and all(k["ok"] for k in res["kernels"]) and decode_ok else 1


def print_decode(res) -> None:
    """The decode report as a table: one line per model, tp and keys per rank."""
    t = TARGETS.get(res["target"])
    sm = "CU" if t and t.is_hip else "SM"
    print(
        f"\ndecode split kernel on {res['target']}"
        + (
            f" ({t.n_sms} {sm}s; Little's law: {t.mem_bw / 1e12:.2f} TB/s x {t.mem_latency_s * 1e6:.1f} us = "
            f"{t.bytes_in_flight_needed / 1e6:.2f} MB in flight, {t.bytes_in_flight_needed / t.n_sms / 1024:.1f} "
            f"KiB per {sm})"
            if t and t.mem_bw
            else ""
        )
    )
    print(
        f"  {'model':<14} {'tp':>2} {'keys':>7} {'win':>5} {'KV':>12} {'B/key':>5} {'BN':>3} {'st':>2} "
        f"{'regs':>4} {'shared':>7} {'tiles':>5} {'CTA/SM':>6} {'splits':>6} {'grid':>5} {'graph':>9} "
        f"{'KiB/SM':>7} {'need':>5} {'margin':>6}  checks"
    )
    for r in res["decode"] or ():
        bad = [k for k, ok in r["checks"].items() if not ok]
        print(
            f"  {r['model']:<14} {r['tp']:>2} {r['keys']:>7} {str(r['window'] or '-'):>5} {r['kv_dtype']:>12} "
            f"{r['bytes_per_key']:>5} {r['block_n']:>3} "
            f"{r['num_stages']:>2} {r['regs']:>4} {r['shared_bytes']:>7} {r['tiles_in_flight']:>5} "
            f"{r['ctas_per_sm']:>6} {r['splits']:>6} {r['grid_ctas']:>5} "
            f"{str(r['graph_live_splits']) + '/' + str(r['graph_splits']):>9} "
            f"{r['bytes_in_flight_per_sm'] / 1024:>7.1f} {r['bytes_needed_per_sm'] / 1024:>5.1f} "
            f"{str(r['littles_margin']):>6}  {'ok' if not bad else 'FAIL ' + ','.join(bad)}"
        )


def print_block_lse(res) -> None:
    """The block_lse report as a table: the plain kernel and the variant, per launch and run."""
    print(f"\nblock_lse split kernel on {res['target']} (plain -> with block_lse)")
    print(f"  {'launch':<50} {'run':>3} {'regs':>9} {'spill':>5} {'shared':>14} {'tiles':>6} {'CTA/SM':>6}  checks")
    for r in res["block_lse"] or ():
        p, v = r["plain"], r["lse"]
        bad = [k for k, ok in r["checks"].items() if not ok]
        print(
            f"  {r['kind']:<50} {r['lse_block']:>3} {str(p['regs']) + '->' + str(v['regs']):>9} "
            f"{v['spill_bytes']:>5} {str(p['shared_bytes']) + '->' + str(v['shared_bytes']):>14} "
            f"{str(p['tiles_in_flight']) + '->' + str(v['tiles_in_flight']):>6} "
            f"{str(p['ctas_per_sm']) + '->' + str(v['ctas_per_sm']):>6}  {'ok' if not bad else 'FAIL ' + ','.join(bad)}"
        )


def print_steps(res) -> None:
    """The step report as a table: launches and bytes a step reads, per model, kind and KV dtype."""
    print(f"\nbytes a step reads from a document's shard on {res['target']} ({STEP_KEYS} keys, 8 KV heads)")
    print(
        f"  {'model':<14} {'step':<9} {'rows':>4} {'KV':>12} {'launch':>6} {'BM':>3} {'BN':>3} {'regs':>4} "
        f"{'spill':>5} {'shared':>6} {'tiles':>5} {'B/key':>6} {'MiB/step':>8} {'vs bf16':>7}  checks"
    )
    for r in res["steps"] or ():
        bad = [k for k, ok in r["checks"].items() if not ok]
        print(
            f"  {r['model']:<14} {r['kind']:<9} {r['rows']:>4} {r['kv_dtype']:>12} {r['launches']:>6} "
            f"{r['block_m']:>3} {r['block_n']:>3} {r['regs']:>4} {r['spill_bytes']:>5} {r['shared_bytes']:>6} "
            f"{r['tiles_in_flight']:>5} {r['bytes_per_key']:>6} {r['bytes_per_step'] / 2**20:>8.1f} "
            f"{r['vs_bf16']:>7}  {'ok' if not bad else 'FAIL ' + ','.join(bad)}"
        )


if __name__ == "__main__":
    sys.exit(main())
