"""``treeattn bench --prefill``: causal prefill attention on random tensors, per way of cutting it.

Methods: ``balanced`` (2p chunks, rank r holding r and 2p-1-r), ``contiguous`` (chunk r of p: a
pipeline) and ``single`` (rank 0 alone, the whole segment, for the same work on one rank). Per
case every rank builds its piece of a random segment of N tokens and times ``layers`` layers of
``prefill.ring_prefill``; an iteration's time is the slowest rank's. A separate untimed run with
the counters on gives each rank's attention FLOPs and bytes sent. Results are records;
``report.print_prefill`` shows them.
"""

from __future__ import annotations

import statistics

import torch

from .spec import DTYPES, BenchSpec, device_name, pct, timed_then_counted
from ..parallel.comm import Comm, Stats, make_comm
from ..engine.prefill import positions, ring_prefill, shard

METHODS = ("balanced", "contiguous", "single")


def prefill_rank(ctx, spec: BenchSpec):
    """Rank function (``launch.run_local``): rank 0 returns the records."""
    dev = torch.device(ctx.device)
    dt = DTYPES[spec.dtype]
    stats = Stats()
    comm = make_comm("allreduce", stats=stats)
    one = Comm.single(stats=stats)
    p, r = comm.world, comm.rank
    B, H, Hk, d, L = spec.batch, spec.heads, spec.kv_heads, spec.head_dim, spec.layers
    cases = [(m, n) for n in spec.seq_lens for m in spec.methods]
    records = []
    for ci, (method, N) in enumerate(cases):
        single = method == "single"
        pieces = shard(0, N, 1 if single else p, balanced=method == "balanced")
        active = not single or r == 0
        n_r = len(positions(pieces[0 if single else r])) if active else 0
        gen = torch.Generator(device=dev).manual_seed(1000 + r)
        q = torch.randn(B, H, n_r, d, generator=gen, device=dev, dtype=torch.float32).to(dt)
        k = torch.randn(B, Hk, n_r, d, generator=gen, device=dev, dtype=torch.float32).to(dt)
        v = torch.randn_like(k)
        c = one if single else comm

        def step():
            if active:
                for _ in range(L):
                    ring_prefill(c, q, k, v, pieces)

        times = timed_then_counted(comm, dev, step, spec, stats)
        every = comm.all_gather_values(times + [stats.flops, stats.bytes_sent])  # [world, iters + 2]
        stats.reset()
        if r == 0:
            rows = every[:1] if single else every
            ms = sorted((rows[:, : len(times)].max(0).values * 1e3).tolist())
            fl = rows[:, len(times)].tolist()
            records.append(
                {
                    "method": method,
                    "nproc": 1 if single else p,
                    "seq_len": N,
                    "batch": B,
                    "heads": H,
                    "kv_heads": Hk,
                    "head_dim": d,
                    "dtype": spec.dtype,
                    "layers": L,
                    "step_ms_median": statistics.median(ms),
                    "step_ms_p10": pct(ms, 10),
                    "step_ms_p90": pct(ms, 90),
                    "flops_per_rank": [int(x) for x in fl],
                    "flops_max_over_mean": max(fl) / (sum(fl) / len(fl)),
                    "bytes_per_rank": [int(x) for x in rows[:, len(times) + 1].tolist()],
                    "device": device_name(dev),
                    "simulated": False,
                }
            )
            ctx.send("case", (ci + 1, len(cases)))
        q = k = v = None  # free this length's tensors before the next
    return records if r == 0 else None
