"""Time the local partial-attention kernel against torch SDPA and flex_attention.

Decode attention is memory-bound: the ceiling is KV bytes / copy bandwidth. Each record holds
the median time, the achieved GB/s (K and V bytes read once), and its fraction of the measured
device-to-device copy bandwidth (read + write bytes / time) on the same device.

With ``--kv-dtype fp8`` the kernel also reads the cache as the engine stores it (e4m3 rows
and a bf16 scale per 32 channels, docs/architecture.md §11): record ``treeattn-fp8``, whose bytes are the
fp8 rows plus their scales (0.53x bf16's at d = 128), beside ``treeattn`` on the 16-bit rows.

Run: ``python -m treeattn_cli.bench.kernel --seq-len 4096,32768,1048576 [--kv-dtype fp8]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from treeattn_kernels import partial_attention

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device, iters=20, warmup=5) -> list[float]:
    """Seconds per call of ``fn()``, one sample per iteration, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    if device.type == "cuda":
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def time_graph(fn, device, iters=20, warmup=5, calls: int = 10) -> list[float]:
    """Seconds per call of ``fn()`` on the device alone: ``calls`` calls captured in one CUDA
    graph, each replay timed with events and divided by ``calls``. An eager call of a small
    kernel is bound by the host (the Python that plans and launches it: ~0.27 ms a call on an
    H100 for treeattn's split + reduce, against 0.013 ms of its device time at 8K keys); the
    engine's decode step replays graphs too, so this is the time a step pays. The engine's own
    capture protocol (``graphs.CudaBackend``: a side-stream warm-up, the capture, the random
    generator healed if it fails); raises when the capture fails (the caller falls back to
    :func:`time_fn`)."""
    from ..engine.graphs import CudaBackend

    def run():
        for _ in range(calls):
            fn()

    for _ in range(warmup):
        fn()
    _sync(device)
    be = CudaBackend()
    be.warm_up(run, device)
    g, _ = be.capture(run, device)
    for _ in range(2):
        g.replay()
    _sync(device)
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / calls)
    return out


def copy_bandwidth(device, nbytes: int = 1 << 30, iters=10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = statistics.median(time_fn(lambda: dst.copy_(src), device, iters=iters, warmup=3))
    return 2 * src.numel() * 4 / t


def decode_inputs(batch, heads, kv_heads, head_dim, N, dtype, device):
    """Random decode inputs ``q [B, H, 1, d]``, ``k, v [B, H_kv, N, d]`` and their KV bytes."""
    q = torch.randn(batch, heads, 1, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, kv_heads, N, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    return q, k, v, 2 * k.numel() * k.element_size()


def fp8_inputs(k, v):
    """``(k8, v8, k_scale, v_scale, bytes)``: ``k``/``v`` as an fp8 cache holds them (the
    engine's own quantizer: rotated rows, bf16 scales per 32 channels) and the bytes one
    decode step reads of them, scales included."""
    from ..storage.kvquant import KVQuant, fp8_dtype

    quant = KVQuant(k.shape[-1], k.device)
    (k8, ks), (v8, vs) = quant.quantize(k), quant.quantize(v)
    assert k8.dtype == fp8_dtype(k.device)
    nbytes = sum(t.numel() * t.element_size() for t in (k8, v8, ks, vs))
    return k8, v8, ks, vs, nbytes


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _flex():
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    fn = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: fn(q, k, v, enable_gqa=True, return_lse=True)


def kernel_bench(
    seq_lens,
    *,
    batch=1,
    heads=32,
    kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    device=None,
    iters=20,
    warmup=5,
    baselines=("sdpa", "flex"),
    copy_bw=None,
    kv_dtype=None,
    on_record=None,
):
    """One record per (N, method): median seconds, GB/s of KV read, fraction of copy bandwidth.
    ``kv_dtype="fp8"`` adds ``treeattn-fp8``: the same kernel over the fp8 cache of the same
    keys (its own byte count, scales included). ``on_record(record)`` gets each record as soon
    as it is measured (a run stopped later keeps what it printed)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = DTYPES[dtype]
    copy_bw = copy_bw or copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else 1 << 27)
    methods = {"treeattn": lambda q, k, v: partial_attention(q, k, v)}
    if "sdpa" in baselines:
        methods["sdpa"] = _sdpa
    if "flex" in baselines and device.type == "cuda":
        flex = _flex()
        if flex is not None:
            methods["flex_attention"] = flex

    class _Records(list):
        def append(self, r):
            super().append(r)
            if on_record is not None:
                on_record(r)

    records = _Records()
    for N in seq_lens:
        q, k, v, kv_bytes = decode_inputs(batch, heads, kv_heads, head_dim, N, dt, device)
        runs = {name: (fn, kv_bytes) for name, fn in methods.items()}
        if kv_dtype == "fp8":
            try:
                k8, v8, ks, vs, f8_bytes = fp8_inputs(k, v)
            except ValueError as e:  # a GPU without fp8 loads (sm_80): said in the record
                records.append({"method": "treeattn-fp8", "seq_len": N, "error": str(e)[:200]})
            else:
                runs["treeattn-fp8"] = (lambda q, k, v: partial_attention(q, k8, v8, k_scale=ks, v_scale=vs), f8_bytes)
        for name, (fn, nbytes) in runs.items():
            try:
                ts = time_fn(lambda: fn(q, k, v), device, iters=iters, warmup=warmup)
            except Exception as e:  # a baseline that cannot run this shape is reported, not fatal
                records.append({"method": name, "seq_len": N, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            eager = statistics.median(ts)
            timing = "eager"
            if device.type == "cuda":  # the device's time (a decode step replays a graph too)
                try:
                    ts = time_graph(lambda: fn(q, k, v), device, iters=iters, warmup=0)
                    timing = "cuda-graph"
                except Exception as e:  # noqa: BLE001 - a method that cannot be captured: eager, said
                    timing = f"eager (capture failed: {type(e).__name__}: {str(e)[:80]})"
            med = statistics.median(ts)
            records.append(
                {
                    "timing": timing,
                    "eager_us_median": eager * 1e6,
                    "method": name,
                    "seq_len": N,
                    "batch": batch,
                    "heads": heads,
                    "kv_heads": kv_heads,
                    "head_dim": head_dim,
                    "dtype": dtype,
                    "kv_dtype": "fp8" if name.endswith("fp8") else dtype,
                    "device": _device_name(device),
                    "time_us_median": med * 1e6,
                    "time_us_min": min(ts) * 1e6,
                    "kv_bytes": nbytes,
                    "gbps": nbytes / med / 1e9,
                    "copy_gbps": copy_bw / 1e9,
                    "frac_copy_bw": nbytes / med / copy_bw,
                }
            )
        q = k = v = k8 = v8 = ks = vs = None  # free this length's tensors before the next
    return records


def tune(
    seq_lens,
    *,
    batch=1,
    heads=32,
    kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    device=None,
    iters=20,
    warmup=5,
    copy_bw=None,
    on_seq_len=None,
):
    """Sweep the Triton kernel's launch parameters per N: block size, warps, stages and split
    count (×½, ×1, ×2 the automatic choice), each timed on CUDA-graph replays (``timing``:
    ``graph``; ``eager`` where no graph can be captured). Each record carries the resource report of the
    configuration's binary (registers, spill bytes, shared memory, K/V tiles in flight and CTAs
    per SM: the same reader as the offline compile of CI, ``offline_compile``); ``best`` marks
    the fastest and ``default`` the configuration the runtime picks itself. ``on_seq_len(recs)``
    gets each length's records as soon as they are done."""
    import itertools

    from treeattn_kernels import partial_triton as pt
    from treeattn_kernels.offline_compile import pipeline_depth, resources
    from treeattn_kernels.targets import occupancy, target_of

    device = torch.device(device or "cuda")
    dt = DTYPES[dtype]
    copy_bw = copy_bw or copy_bandwidth(device)
    target = target_of(device)
    out = []
    for N in seq_lens:
        q, k, v, kv_bytes = decode_inputs(batch, heads, kv_heads, head_dim, N, dt, device)
        auto = pt.plan_split(batch, kv_heads, heads // kv_heads, 1, N, head_dim, dt, target)
        recs = []
        for bn, warps, stages, mult in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3), (0.5, 1, 2)):
            base = pt.plan_split(
                batch, kv_heads, heads // kv_heads, 1, N, head_dim, dt, target, block_n=bn, num_stages=stages
            ).splits  # the runtime's grid for this tile (issue 49)
            splits = max(1, int(base * mult))

            def fn(splits=splits, bn=bn, warps=warps, stages=stages):
                return pt.partial_attention_triton(
                    q, k, v, num_splits=splits, block_n=bn, num_warps=warps, num_stages=stages
                )

            try:
                med, timing = _device_time(fn, device, iters, warmup)
            except Exception as e:  # out of resources: a result of the sweep
                recs.append(
                    {
                        "seq_len": N,
                        "block_n": bn,
                        "num_warps": warps,
                        "num_stages": stages,
                        "splits": splits,
                        "error": f"{type(e).__name__}",
                    }
                )
                continue
            ck = pt.LAST_LAUNCH["split"]
            use = resources(ck, target)
            recs.append(
                {
                    "seq_len": N,
                    "block_n": bn,
                    "num_warps": warps,
                    "num_stages": stages,
                    "splits": splits,
                    "time_us": med * 1e6,
                    "timing": timing,
                    "frac_copy_bw": kv_bytes / med / copy_bw,
                    "regs": use["regs"],
                    "spill_bytes": use["spill_bytes"],
                    "shared_bytes": use["shared_bytes"],
                    "tiles_in_flight": pipeline_depth(ck),
                    "ctas_per_sm": occupancy(target, use["regs"], use["shared_bytes"], warps)["ctas"],
                    "default": (bn, warps, stages, splits)
                    == (auto.block_n, auto.num_warps, auto.num_stages, auto.splits),
                }
            )
        ok = [r for r in recs if "time_us" in r]
        if ok:
            min(ok, key=lambda r: r["time_us"])["best"] = True
        if on_seq_len is not None:
            on_seq_len(recs)
        out += recs
        q = k = v = None  # free this length's tensors before the next
    return out


def _device_time(fn, device, iters, warmup) -> tuple[float, str]:
    """Median seconds per call of ``fn()`` and how they were taken: ``graph`` (replays of a CUDA
    graph: the device's time, what a captured decode step pays), or ``eager`` on a CPU or where
    the capture fails. Eager calls of a small kernel time the host's launch (~0.27 ms on an H100
    against 0.013 ms of device time at 8K keys): a sweep of them ranks noise."""
    if device.type == "cuda":
        try:
            return statistics.median(time_graph(fn, device, iters=iters, warmup=warmup)), "graph"
        except RuntimeError:  # a capture that fails: the eager time, said so
            pass
    return statistics.median(time_fn(fn, device, iters=iters, warmup=warmup)), "eager"


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", default="4096,16384,32768,131072,524288,1048576")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument(
        "--kv-dtype",
        choices=["fp8"],
        default=None,
        help="also time the kernel over an fp8 cache of the same keys (scales included)",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--tune", action="store_true", help="sweep the Triton launch parameters (GPU)")
    a = p.parse_args(argv)
    if a.tune:
        import json

        def show(recs):  # each length as soon as it is swept: a run stopped later keeps it
            for r in recs:
                if r.get("best") or r.get("default") or a.json:
                    print(json.dumps(r), flush=True)

        tune(
            [int(x) for x in a.seq_len.split(",")],
            batch=a.batch,
            heads=a.heads,
            kv_heads=a.kv_heads,
            head_dim=a.head_dim,
            dtype=a.dtype,
            iters=a.iters,
            warmup=a.warmup,
            on_seq_len=show,
        )
        return
    import json

    # --json: one JSON line per record as it is measured (gpu_report keeps them past a timeout)
    recs = kernel_bench(
        [int(x) for x in a.seq_len.split(",")],
        batch=a.batch,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        dtype=a.dtype,
        iters=a.iters,
        warmup=a.warmup,
        kv_dtype=a.kv_dtype,
        on_record=(lambda r: print(json.dumps(r), flush=True)) if a.json else None,
    )
    if not a.json:
        from .. import report

        report.print_kernel_records(recs)


if __name__ == "__main__":
    main()
