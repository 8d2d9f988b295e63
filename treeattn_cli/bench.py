"""``treeattn bench``: tree (each scheme) vs ring vs single device on the same attention work.

One harness, one loop over methods, run on p ranks. Per case every rank holds its shard of a
random KV cache (contiguous balanced chunks of N tokens) and times decode steps of L layers:
``tree``: local partial attention + the scheme's merge; ``ring``: KV blocks rotate p-1 steps;
``single``: rank 0 alone with the whole cache. The step time of an iteration is the slowest
rank's; we report its median and 10/90 percentiles. A separate untimed step with the counters on
gives collectives and bytes per step. Results are records (dicts); ``report.py`` shows them.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from treeattn_kernels import partial_attention

from .comm import Stats, make_comm
from .ring import chunk_bounds, ring_decode

METHODS = ("tree", "ring", "single")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class BenchSpec:
    """One sweep: every (method[, scheme], N) on the same ranks and shapes."""

    methods: list = field(default_factory=lambda: list(METHODS))
    schemes: list = field(default_factory=lambda: ["allreduce"])
    seq_lens: list = field(default_factory=lambda: [16384])
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float32"
    layers: int = 1
    iters: int = 10
    warmup: int = 3
    groups: list | None = None  # hierarchical scheme's groups
    inner: str = "allreduce"
    outer: str = "tree"

    def cases(self):
        out = []
        for n in self.seq_lens:
            for m in self.methods:
                if m == "tree":
                    out += [("tree", s, n) for s in self.schemes]
                else:
                    out.append((m, None, n))
        return out


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_then_counted(comm, dev, step, spec, stats) -> list[float]:
    """Run ``step`` ``spec.warmup`` times untimed and ``spec.iters`` times timed (each behind a barrier
    and a device sync, so every rank's clock starts together), then once more with ``stats`` counting.
    Returns this rank's seconds per timed step; ``stats`` holds one step's counters afterwards."""
    times = []
    for it in range(spec.warmup + spec.iters):
        comm.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        if it >= spec.warmup:
            times.append(time.perf_counter() - t0)
    stats.reset()
    stats.enabled = True
    comm.barrier()
    step()
    stats.enabled = False
    return times


def bench_rank(ctx, spec: BenchSpec):
    """Rank function (``launch.run_local``): rank 0 returns the records."""
    dev = torch.device(ctx.device)
    dt = DTYPES[spec.dtype]
    stats = Stats()
    base = make_comm("allreduce", stats=stats)
    comms = {}
    for s in {s for m, s, _ in spec.cases() if m == "tree"}:
        comms[s] = make_comm(s, spec.groups, spec.inner, spec.outer, stats=stats) if s != "allreduce" else base
    p, r = base.world, base.rank
    B, H, Hk, d, L = spec.batch, spec.heads, spec.kv_heads, spec.head_dim, spec.layers
    gen = torch.Generator(device=dev).manual_seed(1234)  # the same q on every rank
    q = torch.randn(B, H, 1, d, generator=gen, device=dev, dtype=torch.float32).to(dt)
    records = []
    cases = spec.cases()
    for ci, (method, scheme, N) in enumerate(cases):
        bounds = chunk_bounds(N, p)
        lens = [bounds[i + 1] - bounds[i] for i in range(p)]
        n_local = N if method == "single" else lens[r]
        active = method != "single" or r == 0
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        k = torch.randn(B, Hk, n_local if active else 0, d, device=dev, dtype=torch.float32).to(dt)
        v = torch.randn_like(k)
        comm = comms.get(scheme, base)

        def step():
            for _ in range(L):
                if method == "ring":
                    ring_decode(comm, q, k, v, shard_lens=lens)
                elif method == "tree":
                    o, lse = partial_attention(q, k, v)
                    comm.merge(o, lse)
                elif active:
                    partial_attention(q, k, v)

        times = timed_then_counted(base, dev, step, spec, stats)
        kv_bytes = 2 * k.numel() * k.element_size()
        mem = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else kv_bytes + stats.peak_mem_bytes
        everyone = base.all_gather_values(times + [mem, stats.collectives, stats.bytes_sent,
                                                   stats.peak_mem_bytes])  # [world, iters + 4]
        stats.reset()
        if r == 0:
            per_iter = everyone[:, : len(times)].max(0).values if method != "single" else everyone[0, : len(times)]
            ms = sorted((per_iter * 1e3).tolist())
            col = everyone[:, len(times):]
            records.append({
                "method": method, "scheme": scheme or ("ring" if method == "ring" else "none"),
                "nproc": p if method != "single" else 1, "seq_len": N, "batch": B, "heads": H,
                "kv_heads": Hk, "head_dim": d, "dtype": spec.dtype, "layers": L,
                "step_ms_median": statistics.median(ms), "step_ms_p10": _pct(ms, 10),
                "step_ms_p90": _pct(ms, 90), "bytes_per_step": int(col[:, 2].max()),
                "collectives_per_step": int(col[:, 1].max()), "peak_mem_bytes": int(col[:, 0].max()),
                "device": _device_name(dev), "simulated": False,
            })
            ctx.send("case", (ci + 1, len(cases)))
        del k, v
    return records if r == 0 else None


def _pct(xs, q):
    i = (len(xs) - 1) * q / 100
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def _device_name(dev) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import os
    import platform

    return f"cpu {platform.machine()} ({os.cpu_count()} cores, {torch.get_num_threads()} threads/rank)"


def expected_bytes(method: str, scheme: str, p: int, spec: BenchSpec, seq_len: int, rank: int = 0) -> int:
    """Bytes this rank hands to collectives per step, by formula (tests check the counters)."""
    B, H, Hk, d, L = spec.batch, spec.heads, spec.kv_heads, spec.head_dim, spec.layers
    if p == 1 or method == "single":
        return 0
    if method == "tree" and scheme == "allreduce":
        return L * 4 * B * H * (d + 2)
    if method == "tree" and scheme == "allgather":
        return L * 4 * B * H * (d + 1)
    if method == "ring":
        esize = DTYPES[spec.dtype].itemsize
        cap = -(-seq_len // p)  # the largest shard: blocks are padded to it
        return L * (p - 1) * (2 * B * Hk * cap * d * esize + 8 * B)
    raise ValueError((method, scheme))


# ---------------------------------------------------------------- the command

@dataclass
class BenchOptions:
    methods: str = "tree,ring,single"
    scheme: str = "auto"  # auto | all | comma list
    seq_len: str = "16384"
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "auto"
    nproc: str | None = None  # a comma list: one sweep per rank count
    backend: str = "auto"
    device: str = "auto"
    layers: int = 1
    iters: int = 10
    warmup: int = 3
    timeout: float = 300.0
    simulate: str | None = None
    gpus: str = "8,64,128,1024"
    kernel: bool = False
    model: str | None = None
    new_tokens: int = 16
    layout: str | None = None
    tp: str = "1"  # model mode: ranks per tensor-parallel group; --simulate: a comma list to compare
    model_shape: str | None = None  # --simulate: a known model's shape (projection.MODEL_SHAPES)
    prefill: bool = False  # causal prefill attention per sharding (prefill_bench.py) instead of decode
    mfu: float = 0.5  # --simulate --prefill: the fraction of peak FLOP/s compute runs at


def parse_ints(flag: str, text: str) -> list[int]:
    try:
        vals = [int(float(x)) if "e" in x.lower() else int(x) for x in _expand_k(text)]
    except ValueError:
        raise ValueError(f"{flag} takes a comma list of integers (16K, 1M allowed), got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{flag} values must be >= 1, got {text!r}")
    return vals


def _expand_k(text: str):
    for x in text.split(","):
        x = x.strip()
        mult = {"k": 1024, "m": 1024 * 1024}.get(x[-1:].lower(), 1)
        yield str(int(x[:-1]) * mult) if mult > 1 else x


def make_spec(o: BenchOptions, kind: str, nproc: int) -> BenchSpec:
    from .options import FLAT_SCHEMES, SCHEMES
    from .layout import plan_for_run

    methods = [m.strip() for m in o.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"--methods takes a comma list of {', '.join(METHODS)}, got {o.methods!r}")
    for flag, v in (("--batch", o.batch), ("--heads", o.heads), ("--kv-heads", o.kv_heads),
                    ("--head-dim", o.head_dim), ("--layers", o.layers), ("--iters", o.iters)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if o.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {o.warmup}")
    if o.heads % o.kv_heads:
        raise ValueError(f"--heads ({o.heads}) must be a multiple of --kv-heads ({o.kv_heads})")
    dtype = o.dtype if o.dtype != "auto" else ("bfloat16" if kind == "cuda" else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {o.dtype!r}")
    lay = plan_for_run(kind, nproc, heads=o.heads, head_dim=o.head_dim, layers=o.layers, profile=o.layout)
    if o.scheme == "auto":
        schemes = [lay.scheme]
    elif o.scheme == "all":
        schemes = list(FLAT_SCHEMES) + (["hierarchical"] if lay.scheme == "hierarchical" else [])
    else:
        schemes = [s.strip() for s in o.scheme.split(",")]
        if any(s not in SCHEMES for s in schemes):
            raise ValueError(f"--scheme takes auto, all or a comma list of {', '.join(SCHEMES)}")
    return BenchSpec(methods=methods, schemes=schemes, seq_lens=parse_ints("--seq-len", o.seq_len),
                     batch=o.batch, heads=o.heads, kv_heads=o.kv_heads, head_dim=o.head_dim,
                     dtype=dtype, layers=o.layers, iters=o.iters, warmup=o.warmup,
                     groups=lay.groups if lay.scheme == "hierarchical" else [list(range(nproc))],
                     inner=lay.inner or "allreduce", outer=lay.outer or "tree")


def bench_command(o: BenchOptions, on_progress=None) -> list[dict]:
    """Run the sweep (or the projection, kernel or model mode); returns the records."""
    from .runner import plan_devices

    if o.simulate and o.prefill:
        from .projection import simulate_prefill

        if not 0 < o.mfu <= 1:
            raise ValueError(f"--mfu must be in (0, 1], got {o.mfu}")
        return simulate_prefill(o.simulate, parse_ints("--gpus", o.gpus), parse_ints("--seq-len", o.seq_len),
                                o.model_shape or "llama-3.1-405b", tp=parse_ints("--tp", o.tp)[0], mfu=o.mfu,
                                dtype=o.dtype if o.dtype != "auto" else "bfloat16")
    if o.prefill:
        return prefill_mode(o, on_progress)
    if o.simulate:
        from .projection import simulate, simulate_mesh

        spec = BenchSpec(seq_lens=parse_ints("--seq-len", o.seq_len), batch=o.batch, heads=o.heads,
                         kv_heads=o.kv_heads, head_dim=o.head_dim,
                         dtype=o.dtype if o.dtype != "auto" else "bfloat16", layers=o.layers)
        if o.heads % o.kv_heads:
            raise ValueError(f"--heads ({o.heads}) must be a multiple of --kv-heads ({o.kv_heads})")
        if o.tp != "1" or o.model_shape:
            return simulate_mesh(o.simulate, parse_ints("--gpus", o.gpus), spec.seq_lens,
                                 parse_ints("--tp", o.tp), o.model_shape or "llama-3.1-8b", batch=o.batch,
                                 dtype=spec.dtype)
        return simulate(o.simulate, parse_ints("--gpus", o.gpus), spec)
    counts = parse_ints("--nproc", o.nproc) if o.nproc else [None]
    kind, backend, n, devices = plan_devices(o.device, o.backend, counts[0])
    if o.kernel:
        from .kernel_bench import kernel_bench

        spec = make_spec(o, kind, 1)
        return kernel_bench(spec.seq_lens, batch=spec.batch, heads=spec.heads, kv_heads=spec.kv_heads,
                            head_dim=spec.head_dim, dtype=spec.dtype, device=devices[0],
                            iters=spec.iters, warmup=spec.warmup)
    if o.model is not None:
        return model_mode(o, n, parse_ints("--tp", o.tp)[0])
    from .launch import run_local

    records = []
    for i, count in enumerate(counts):
        kind, backend, n, devices = plan_devices(o.device, o.backend, count)
        spec = make_spec(o, kind, n)
        k = len(spec.cases())

        def ev(rank, what, val, base=i * k, total=len(counts) * k):
            if what == "case" and on_progress is not None:
                on_progress(base + val[0], total)

        records += run_local(bench_rank, n, spec, backend=backend, devices=devices,
                             timeout_s=o.timeout, on_event=ev)[0]
    return records


def prefill_mode(o: BenchOptions, on_progress=None) -> list[dict]:
    """``--prefill``: the attention part of prefill per sharding, on ranks (prefill_bench.py)."""
    from .launch import run_local
    from .prefill_bench import METHODS as PREFILL_METHODS
    from .prefill_bench import prefill_rank
    from .runner import plan_devices

    methods = list(PREFILL_METHODS) if o.methods == BenchOptions.methods else \
        [m.strip() for m in o.methods.split(",") if m.strip()]
    if not methods or any(m not in PREFILL_METHODS for m in methods):
        raise ValueError(f"--prefill --methods takes a comma list of {', '.join(PREFILL_METHODS)}, got {o.methods!r}")
    records = []
    counts = parse_ints("--nproc", o.nproc) if o.nproc else [None]
    for i, count in enumerate(counts):
        kind, backend, n, devices = plan_devices(o.device, o.backend, count)
        spec = make_spec(BenchOptions(**{**vars(o), "methods": "tree", "scheme": "allreduce"}), kind, n)
        spec.methods = methods
        total = len(counts) * len(methods) * len(spec.seq_lens)

        def ev(rank, what, val, base=i * len(methods) * len(spec.seq_lens)):
            if what == "case" and on_progress is not None:
                on_progress(base + val[0], total)

        records += run_local(prefill_rank, n, spec, backend=backend, devices=devices, timeout_s=o.timeout,
                             on_event=ev)[0]
    return records


def model_mode(o: BenchOptions, n: int, tp: int = 1) -> list[dict]:
    """Decode ms/token of ``generate`` for each method on a real model (``tp``: ranks per
    tensor-parallel group of the tree method)."""
    from . import model as M
    from .model_bench import prompt_ids, time_treeattn

    model_dir = M.resolve(o.model)
    tok = M.load_tokenizer(model_dir)
    methods = [m.strip() for m in o.methods.split(",")]
    out = []
    for N in parse_ints("--seq-len", o.seq_len):
        ids = prompt_ids(tok, N)
        for m in methods:
            if m == "single":
                r = time_treeattn(model_dir, ids, o.new_tokens, 1)
            elif m == "ring":
                r = time_treeattn(model_dir, ids, o.new_tokens, n, decode_method="ring")
            else:
                r = time_treeattn(model_dir, ids, o.new_tokens, n, tp=tp,
                                  scheme="allreduce" if o.scheme in ("auto", "all") else o.scheme)
            r.pop("token_ids", None)
            out.append({**r, "method": m, "seq_len": N, "model": str(model_dir), "simulated": False,
                        "step_ms_median": r["decode_ms_per_token"]})
    return out
