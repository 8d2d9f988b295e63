"""The decode-step harness of ``treeattn bench``: tree (each scheme) vs ring vs single device on
the same attention work.

Per case every rank holds its shard of a random KV cache (contiguous balanced chunks of N
tokens) and times decode steps of L layers: ``tree``: local partial attention + the scheme's
merge; ``ring``: KV blocks rotate p-1 steps; ``single``: rank 0 alone with the whole cache. The
step time of an iteration is the slowest rank's; records carry its median and 10/90
percentiles, and one untimed step with the counters on gives collectives and bytes per step.
"""

from __future__ import annotations

import statistics

import torch

from treeattn_kernels import partial_attention

from ..storage.kvquant import KVQuant
from ..parallel.comm import Stats, make_comm
from ..parallel.ring import chunk_bounds, ring_decode
from .spec import DTYPES, BenchSpec, device_name, pct, timed_then_counted


def bench_rank(ctx, spec: BenchSpec):
    """Rank function (``launch.run_local``): rank 0 returns the records. With ``spec.shared``
    the B sequences of a case share one document: their queries are B rows against one cache
    (``q [1, H, B, d]``), as ``chat --batch`` decodes; else each sequence has its own cache."""
    dev = torch.device(ctx.device)
    dt = DTYPES[spec.dtype]
    stats = Stats()
    base = make_comm("allreduce", stats=stats)
    comms = {}
    for s in {s for m, s, _, _ in spec.cases() if m == "tree"}:
        comms[s] = make_comm(s, spec.groups, spec.inner, spec.outer, stats=stats) if s != "allreduce" else base
    p, r = base.world, base.rank
    H, Hk, d, L = spec.heads, spec.kv_heads, spec.head_dim, spec.layers
    records = []
    cases = spec.cases()
    for ci, (method, scheme, N, B) in enumerate(cases):
        gen = torch.Generator(device=dev).manual_seed(1234 + B)  # the same q on every rank
        qshape = (1, H, B, d) if spec.shared else (B, H, 1, d)
        q = torch.randn(*qshape, generator=gen, device=dev, dtype=torch.float32).to(dt)
        caches = 1 if spec.shared else B
        bounds = chunk_bounds(N, p)
        lens = [bounds[i + 1] - bounds[i] for i in range(p)]
        n_local = N if method == "single" else lens[r]
        active = method != "single" or r == 0
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        k = torch.randn(caches, Hk, n_local if active else 0, d, device=dev, dtype=torch.float32).to(dt)
        v = torch.randn_like(k)
        comm = comms.get(scheme, base)
        attend, kv_bytes = partial_attention, 2 * k.numel() * k.element_size()
        if spec.kv_dtype == "fp8":  # stored as the engine stores it; queries and outputs rotated per step
            quant = KVQuant(d, dev)
            (k8, ks), (v8, vs) = quant.quantize(k), quant.quantize(v)
            kv_bytes = 2 * (k8.numel() * k8.element_size() + ks.numel() * ks.element_size())

            def attend(q, k, v):  # noqa: F811 - the fp8 cache's read
                o, lse = partial_attention(quant.rotate(q), k8, v8, k_scale=ks, v_scale=vs)
                return quant.unrotate(o), lse

            k, v = quant.restore(k8, ks).to(dt), quant.restore(v8, vs).to(dt)  # the ring baseline's blocks

        def step():
            for _ in range(L):
                if method == "ring":
                    ring_decode(comm, q, k, v, shard_lens=lens)
                elif method == "tree":
                    o, lse = attend(q, k, v)
                    comm.merge(o, lse)
                elif active:
                    attend(q, k, v)

        times = timed_then_counted(base, dev, step, spec, stats)
        mem = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else kv_bytes + stats.peak_mem_bytes
        everyone = base.all_gather_values(
            times + [mem, stats.collectives, stats.bytes_sent, stats.peak_mem_bytes]
        )  # [world, iters + 4]
        stats.reset()
        if r == 0:
            per_iter = everyone[:, : len(times)].max(0).values if method != "single" else everyone[0, : len(times)]
            ms = sorted((per_iter * 1e3).tolist())
            col = everyone[:, len(times) :]
            records.append(
                {
                    "method": method,
                    "scheme": scheme or ("ring" if method == "ring" else "none"),
                    "nproc": p if method != "single" else 1,
                    "seq_len": N,
                    "batch": B,
                    "shared": spec.shared,
                    "heads": H,
                    "kv_heads": Hk,
                    "head_dim": d,
                    "dtype": spec.dtype,
                    "kv_dtype": spec.kv_dtype,
                    "layers": L,
                    "step_ms_median": statistics.median(ms),
                    "step_ms_p10": pct(ms, 10),
                    "step_ms_p90": pct(ms, 90),
                    "bytes_per_step": int(col[:, 2].max()),
                    "collectives_per_step": int(col[:, 1].max()),
                    "peak_mem_bytes": int(col[:, 0].max()),
                    "device": device_name(dev),
                    "simulated": False,
                }
            )
            ctx.send("case", (ci + 1, len(cases)))
        q = k = v = attend = None  # free this case's cache before the next one
    return records if r == 0 else None


def expected_bytes(
    method: str, scheme: str, p: int, spec: BenchSpec, seq_len: int, rank: int = 0, batch: int | None = None
) -> int:
    """Bytes this rank hands to collectives per step, by formula (tests check the counters)."""
    B = batch if batch is not None else spec.batch
    H, Hk, d, L = spec.heads, spec.kv_heads, spec.head_dim, spec.layers
    caches = 1 if spec.shared else B
    if p == 1 or method == "single":
        return 0
    if method == "tree" and scheme == "allreduce":
        return L * 4 * B * H * (d + 2)
    if method == "tree" and scheme == "allgather":
        return L * 4 * B * H * (d + 1)
    if method == "ring":
        esize = DTYPES[spec.dtype].itemsize
        cap = -(-seq_len // p)  # the largest shard: blocks are padded to it
        return L * (p - 1) * (2 * caches * Hk * cap * d * esize + 8 * caches)
    raise ValueError((method, scheme))
