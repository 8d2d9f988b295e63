"""What every bench harness shares: the sweep's spec, the dtype table, and one timing loop
(barrier, device sync, warm-up, timed steps, then one step with the counters on)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

METHODS = ("tree", "ring", "single")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class BenchSpec:
    """One sweep: every (method[, scheme], N) on the same ranks and shapes."""

    methods: list = field(default_factory=lambda: list(METHODS))
    schemes: list = field(default_factory=lambda: ["allreduce"])
    seq_lens: list = field(default_factory=lambda: [16384])
    batch: int = 1  # the first of ``batches``: what the modes without a batch sweep use
    batches: list = field(default_factory=lambda: [1])  # decode harness and projections: one case per B
    shared: bool = False  # the B sequences share one document (cascade attention: B query rows, one cache)
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float32"
    kv_dtype: str = "auto"  # "fp8": the shards stored as the engine stores fp8 KV (storage/kvquant.py)
    layers: int = 1
    iters: int = 10
    warmup: int = 3
    groups: list | None = None  # hierarchical scheme's groups
    inner: str = "allreduce"
    outer: str = "tree"

    def cases(self):
        """``(method, scheme, N, B)`` of every case of the decode sweep."""
        out = []
        for n in self.seq_lens:
            for b in self.batches:
                for m in self.methods:
                    if m == "tree":
                        out += [("tree", s, n, b) for s in self.schemes]
                    else:
                        out.append((m, None, n, b))
        return out


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_then_counted(comm, dev, step, spec, stats) -> list[float]:
    """Run ``step`` ``spec.warmup`` times untimed and ``spec.iters`` times timed (each behind a barrier
    and a device sync, so every rank's clock starts together), then once more with ``stats`` counting.
    Returns this rank's seconds per timed step; ``stats`` holds one step's counters afterwards."""
    times = []
    for it in range(spec.warmup + spec.iters):
        comm.barrier()
        sync(dev)
        t0 = time.perf_counter()
        step()
        sync(dev)
        if it >= spec.warmup:
            times.append(time.perf_counter() - t0)
    stats.reset()
    stats.enabled = True
    comm.barrier()
    step()
    stats.enabled = False
    return times


def pct(xs, q):
    i = (len(xs) - 1) * q / 100
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def device_name(dev) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import os
    import platform

    return f"cpu {platform.machine()} ({os.cpu_count()} cores, {torch.get_num_threads()} threads/rank)"


def demo_document_cut(tokenizer, n_tokens: int) -> str:
    """The shipped demo document cut at the last paragraph that fits ``n_tokens`` tokens of
    ``tokenizer`` (the measurement scripts' document of a chosen length)."""
    from ..paths import demo_document

    out = []
    for para in demo_document().split("\n\n"):
        if len(tokenizer("\n\n".join(out + [para]))["input_ids"]) > n_tokens and out:
            break
        out.append(para)
    return "\n\n".join(out)
