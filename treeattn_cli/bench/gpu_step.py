"""Where a whole decode step's time goes on one GPU (issue 51): one JSON line a record, printed as
it is measured (a run stopped at its time limit keeps what it printed).

    python -m treeattn_cli.bench.gpu_step [--contexts 32768,131072]

A random-weight model of Llama-3.1-8B's shape in bf16 (16 GB of weights; 17 GB of bf16 KV at
128K), one question over a document in the block pool, stepped by the engine's batch loop
(``BatchDecoder._step``: the forward ``generate``, ``chat`` and ``serve`` run). Records (each with
``t_s``, the seconds since the run began):

- ``device``: ``name``, ``copy_gbps`` (measured now), ``weight_bytes`` (what a step reads of them);
- ``gemv``: each weight shape (qkv, o, gate_up, down, lm_head: the step's, fused) as torch's ``linear`` on one row,
  device time from graph replays, ``frac_copy`` against the copy bandwidth;
- ``step`` (``N``, ``kv`` bf16 or fp8): ``synced_ms`` (a sync after each step),
  ``overlapped_ms`` (20 steps back to back, one sync), ``replay_ms`` (the step's graph replayed
  alone: device time), ``floor_ms`` (weights and KV at the copy bandwidth), ``replayed`` and
  ``note`` (whether the steps ran from a CUDA graph, and why not);
- ``census`` (``N``, ``kv``): three eager steps under ``torch.profiler``: kernels a step and
  their device ms by class (``gemm``, ``attention``: the split and reduce kernels, ``other``),
  and the 12 costliest kernels.

Order, most owed first: the bf16 step at the first context and its census, the fp8 step and its
census, then the later contexts. ``--device cpu`` runs the same code on a small model of the same
structure (eager, no graphs, a CPU's profiler): a check that the run works before a GPU's
minutes are spent on it, not a measurement.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch

from .gpu_kernels import Emit

GEMM = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|splitK|addmm|\bmm\b|linear", re.I)
ATTN = re.compile(r"_split_kernel|_reduce_kernel|partial_attention")
TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
)


def gemv(model, device, emit, bw) -> None:
    from .kernel import time_fn, time_graph

    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = getattr(attn, "treeattn_qkv", None), getattr(mlp, "treeattn_gate_up", None)  # (fused_weights)
    shapes = {
        **({"qkv": qkv.weight} if qkv is not None else {"q": attn.q_proj.weight, "k": attn.k_proj.weight}),
        "o": attn.o_proj.weight,
        **({"gate_up": gate_up.weight} if gate_up is not None else {"gate": mlp.gate_proj.weight}),
        "down": mlp.down_proj.weight,
        "lm_head": model.lm_head.weight,
    }
    timer = time_graph if device.type == "cuda" else time_fn
    with torch.inference_mode():
        for name, w in shapes.items():
            x = torch.randn(1, 1, w.shape[1], dtype=w.dtype, device=device)
            t = statistics.median(timer(lambda: torch.nn.functional.linear(x, w), device, iters=20, warmup=3))
            nb = w.numel() * w.element_size()
            emit(kind="gemv", name=name, shape=list(w.shape), us=round(t * 1e6, 2), frac_copy=round(nb / t / bw, 3))


def census(model, N: int, device, emit, quant=None) -> None:
    """Three eager steps under the profiler: the kernels of a step by class."""
    from torch.profiler import ProfilerActivity, profile

    from .gpu_decode import pooled_step

    one, _ = pooled_step(model, N, 8, device, quant=quant, graphs=False)
    cuda = device.type == "cuda"
    for _ in range(2):
        one()
    if cuda:
        torch.cuda.synchronize()
    steps = 3
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            one()
        if cuda:
            torch.cuda.synchronize()
    cls = {"gemm": [0, 0.0], "attention": [0, 0.0], "other": [0, 0.0]}
    top = []
    for e in prof.key_averages():
        t = (getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)) if cuda else e.self_cpu_time_total
        if e.count == 0 or (cuda and not t) or (not cuda and not e.key.startswith("aten::")):
            continue
        c = "gemm" if GEMM.search(e.key) else "attention" if ATTN.search(e.key) else "other"
        cls[c][0] += e.count
        cls[c][1] += t
        top.append((t, e.count, e.key[:60]))
    top.sort(reverse=True)
    emit(
        kind="census",
        N=N,
        kv="fp8" if quant is not None else "bf16",
        counted="device kernels" if cuda else "CPU operations (nested ones too)",
        per_step={c: {"kernels": n / steps, "device_ms": round(t / steps / 1e3, 3)} for c, (n, t) in cls.items()},
        top=[(round(t / steps / 1e3, 3), n // steps, k) for t, n, k in top[:12]],
    )


def step_times(model, N: int, device, emit, bw, quant=None) -> None:
    from .gpu_decode import floor_ms, pooled_step

    cuda = device.type == "cuda"
    n = 20 if cuda else 3
    one, bd = pooled_step(model, N, 3 + 3 * n, device, quant=quant, graphs=cuda)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):  # the capture, and two replays
        one()
    sync()
    synced = []
    for _ in range(n):
        t = time.perf_counter()
        one()
        sync()
        synced.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(n):
        one()
    sync()
    overlapped = (time.perf_counter() - t) / n
    graphs = bd.graphs
    held = list(graphs._graphs.values()) if graphs is not None else []
    reps = []
    for _ in range(n if held else 0):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        held[-1][0].replay()
        b.record()
        b.synchronize()
        reps.append(a.elapsed_time(b) / 1e3)
    emit(
        kind="step",
        N=N,
        kv="fp8" if quant is not None else "bf16",
        replayed=graphs is not None and graphs.replays > 0,
        note=(graphs.note if graphs is not None else bd.dec.graph_note),
        synced_ms=round(statistics.median(synced) * 1e3, 3),
        overlapped_ms=round(overlapped * 1e3, 3),
        replay_ms=round(statistics.median(reps) * 1e3, 3) if reps else None,
        floor_ms=round(floor_ms(model, N, bw, quant), 3),
    )


def run(contexts: list[int], device, emit) -> None:
    from ..storage.kvquant import KVQuant
    from .gpu_decode import _guarded, _model, cache_bytes, step_weight_bytes
    from .kernel import copy_bandwidth

    cuda = device.type == "cuda"
    bw = copy_bandwidth(device, nbytes=(1 << 30) if cuda else (1 << 20), iters=10 if cuda else 2)
    model = _model("treeattn", device.type, ready=True, **({} if cuda else TINY))
    cfg = model.config
    emit(
        kind="device",
        name=torch.cuda.get_device_name(device) if cuda else "cpu (a small model of the same structure)",
        copy_gbps=round(bw / 1e9, 1),
        weight_bytes=step_weight_bytes(model),
    )
    gemv(model, device, emit, bw)
    q8 = KVQuant(cfg.hidden_size // cfg.num_attention_heads, device)
    for i, N in enumerate(contexts):
        need = cache_bytes(cfg, N + 128)
        for quant in (None, q8):
            for what in (step_times, census) if i == 0 else (step_times,):

                def go(what=what, quant=quant):
                    with torch.inference_mode():
                        return what(model, N, device, emit, **({"bw": bw} if what is step_times else {}), quant=quant)

                res = _guarded(go, need) if cuda else go()
                if isinstance(res, str):  # skipped or failed: its own record, and the run goes on
                    emit(kind=what.__name__, N=N, kv="fp8" if quant is not None else "bf16", error=res)
    emit(kind="done")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32768,131072", help="cached tokens, most owed first")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_step: no CUDA device here (--device cpu checks the run on a small model)")
        return 1
    run([int(x) for x in a.contexts.split(",")], device, Emit())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
