"""``treeattn topo --measure``: link figures measured on the ranks themselves.

Per pair (i, j): the one-way time of a small and of a large message (send, then a 1-element
ack back), giving α (latency) and β (1 / bandwidth); per group (the whole set and each
candidate group): the median latency of an all_reduce of one merge's size. Medians after
warm-up; other ranks wait at a barrier while a pair is timed. The result becomes a profile.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..parallel.comm import make_comm, subgroup


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_rank(ctx, groups, msg_bytes: int, big_bytes: int, iters: int, warmup: int):
    """Rank function (``launch.run_local``): returns rank 0's measurements (None elsewhere)."""
    dev = torch.device(ctx.device)
    comm = make_comm("allreduce")
    p, r = comm.world, comm.rank
    small = torch.zeros(max(1, msg_bytes // 4), device=dev)
    big = torch.zeros(max(1, big_bytes // 4), device=dev)
    ack = torch.zeros(1, device=dev)
    pairs = {}
    for i in range(p):
        for j in range(i + 1, p):
            comm.barrier()
            if r not in (i, j):
                continue
            res = {}
            for name, t in (("small", small), ("big", big)):
                times = []
                for k in range(warmup + iters):
                    _sync(dev)
                    t0 = time.perf_counter()
                    if r == i:
                        comm.send(t, j)
                        comm.recv(ack, j)
                    else:
                        comm.recv(t, i)
                        comm.send(ack, i)
                    _sync(dev)
                    if k >= warmup:
                        times.append(time.perf_counter() - t0)
                res[name] = statistics.median(times)
            if r == i:
                pairs[f"{i}-{j}"] = res
    comm.barrier()
    gathered = {}
    for src in range(p):  # every sender's pair timings, on every rank
        gathered.update(comm.broadcast_object(pairs if r == src else None, src=src) or {})
    allreduce = {}
    for g in [list(range(p))] + [list(x) for x in groups if 1 < len(x) < p]:
        sub = comm if len(g) == p else subgroup(g)
        times = []
        for k in range(warmup + iters):
            comm.barrier()
            if sub is not None:
                _sync(dev)
                t0 = time.perf_counter()
                sub.all_reduce(small, "sum")
                _sync(dev)
                if k >= warmup:
                    times.append(time.perf_counter() - t0)
        allreduce[",".join(map(str, g))] = comm.broadcast_object(statistics.median(times) if times else None, src=g[0])
    return {"pairs": gathered, "allreduce_s": allreduce} if r == 0 else None


def pair_links(pairs: dict, msg_bytes: int, big_bytes: int) -> dict:
    """(α seconds, bandwidth bytes/s) per pair from small/large message round trips."""
    out = {}
    for key, t in pairs.items():
        one_small, one_big = t["small"] / 2, t["big"] - t["small"] / 2  # ack is tiny: half a round trip
        bw = (big_bytes - msg_bytes) / max(one_big - one_small, 1e-9)
        out[key] = (max(one_small, 1e-7), bw)
    return out
