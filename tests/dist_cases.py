"""Rank functions for the distributed tests (importable by spawned ranks).

Each function runs on every rank with the same seed, builds the same full inputs, keeps its own
shard, and returns numbers for the parent test to check against the one-rank oracle.
"""

from __future__ import annotations

import os
import signal

import torch

from treeattn_cli.comm import Stats, make_comm
from treeattn_cli.ring import chunk_bounds, ring_decode, ring_prefill
from treeattn_kernels import partial_attention, partial_attention_ref


def shard_sizes(N, world, seed):
    """Uneven sizes summing to N; rank 1 (if any) holds zero tokens."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(world, generator=g) + 0.2
    if world > 1:
        w[1] = 0
    sizes = (w / w.sum() * N).floor().long()
    sizes[0] += N - sizes.sum()
    return sizes.tolist()


def rel_err(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)), "inf pattern differs"
    return ((a - b).abs()[fin].max() / max(1.0, b.abs()[fin].max())).item() if fin.any() else 0.0


def decode_schemes(ctx, seed, groups=None):
    """Every flat scheme, hierarchical (if groups) and ring decode vs the one-rank oracle.

    Returns rows (case, method, o_err, lse_err, o_bits_digest)."""
    comms = {s: make_comm(s) for s in ("allreduce", "allgather", "tree")}
    if groups:
        for inner in ("allreduce", "tree", "allgather"):
            for outer in ("tree", "allreduce"):
                comms[f"hier-{inner}-{outer}"] = make_comm("hierarchical", groups, inner, outer)
    rows = []
    for B in (1, 3):
        for G in (1, 4):
            for dtype in (torch.float32, torch.bfloat16):
                case = f"B{B}-G{G}-{str(dtype)[6:]}"
                gen = torch.Generator().manual_seed(seed + B * 100 + G * 10 + (dtype == torch.bfloat16))
                H_kv, d, N = 2, 64, 67
                q = torch.randn(B, G * H_kv, 1, d, generator=gen).to(dtype)
                k = torch.randn(B, H_kv, N, d, generator=gen).to(dtype)
                v = torch.randn(B, H_kv, N, d, generator=gen).to(dtype)
                o_ref, lse_ref = partial_attention_ref(q, k, v)
                sizes = shard_sizes(N, ctx.world, seed)
                a = sum(sizes[: ctx.rank])
                ks, vs = k[:, :, a:a + sizes[ctx.rank]], v[:, :, a:a + sizes[ctx.rank]]
                o_i, lse_i = partial_attention(q, ks, vs)
                outs = {name: c.merge(o_i, lse_i) for name, c in comms.items()}
                outs["ring"] = ring_decode(comms["allreduce"], q, ks, vs)
                for name, (o, lse) in outs.items():
                    every = comms["allgather"].all_gather(torch.cat([o, lse[..., None]], -1))
                    same = all(torch.equal(every[0], e) for e in every)
                    rows.append((case, name, rel_err(o.to(dtype), o_ref), rel_err(lse, lse_ref), same))
    return rows


def allreduce_accounting(ctx, B, H, d):
    stats = Stats(enabled=True)
    c = make_comm("allreduce", stats=stats)
    o, lse = torch.randn(B, H, 1, d), torch.randn(B, H, 1)
    stats.reset()
    c.merge(o, lse)
    return stats.snapshot()


def ring_accounting(ctx, B, H_kv, N, d):
    stats = Stats(enabled=True)
    c = make_comm("allreduce", stats=stats)
    q, k, v = torch.randn(B, 4 * H_kv, 1, d), torch.randn(B, H_kv, N, d), torch.randn(B, H_kv, N, d)
    stats.reset()
    ring_decode(c, q, k, v, shard_lens=[N] * ctx.world)
    return stats.snapshot()


def prefill_cases(ctx, seed, lengths):
    """Ring prefill of prompts of each length vs single-device causal attention."""
    c = make_comm("allreduce")
    rows = []
    for n in lengths:
        for window in (None, 5):
            gen = torch.Generator().manual_seed(seed + n)
            B, H_kv, G, d = 2, 2, 3, 64
            q = torch.randn(B, G * H_kv, n, d, generator=gen)
            k = torch.randn(B, H_kv, n, d, generator=gen)
            v = torch.randn(B, H_kv, n, d, generator=gen)
            pos = torch.arange(n)
            o_ref, lse_ref = partial_attention_ref(q, k, v, q_pos=pos, k_pos=pos, window=window)
            b = chunk_bounds(n, ctx.world)
            sl = slice(b[ctx.rank], b[ctx.rank + 1])
            o, lse = ring_prefill(c, q[:, :, sl], k[:, :, sl], v[:, :, sl], b, window=window)
            err = (rel_err(o, o_ref[:, :, sl]), rel_err(lse, lse_ref[:, :, sl])) if o.shape[2] else (0.0, 0.0)
            rows.append((n, window, *err))
    return rows


def fail_mid_step(ctx, bad_rank, how):
    """Merge once fine, then ``bad_rank`` raises (or is SIGKILLed) while the others merge."""
    c = make_comm("allreduce")
    o, lse = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1)
    c.merge(o, lse)
    if ctx.rank == bad_rank:
        if how == "raise":
            raise ValueError("boom in layer 3")
        os.kill(os.getpid(), signal.SIGKILL)
    c.merge(o, lse)
    c.merge(o, lse)
    return "survived"



def ring_leaves_inputs_alone(ctx, seed):
    """Ring decode must not write into the caller's K/V/lengths (they may be the cache)."""
    from treeattn_cli.comm import make_comm

    c = make_comm("allreduce")
    g = torch.Generator().manual_seed(seed + ctx.rank)
    k, v = torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    kv_len = torch.tensor([9 - ctx.rank])
    before = (k.clone(), v.clone(), kv_len.clone())
    ring_decode(c, torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(seed)), k, v, kv_len,
                shard_lens=[9] * ctx.world)
    return all(torch.equal(a, b) for a, b in zip(before, (k, v, kv_len)))
