"""The split kernel on one GPU, every lever of issue 51 in one run: one JSON line a record, printed
as it is measured (a run stopped at its time limit keeps what it printed).

    python -m treeattn_cli.bench.gpu_kernels [--keys 32768,131072,8192] [--quick]

Llama-3.1-8B's decode shape (32 query heads, 8 KV heads, d 128, batch 1). Times are device time:
10 calls replayed from one CUDA graph (``kernel.time_graph``), median of 20 replays; the copy
bandwidth and every baseline are measured again in the same run, so any card compares to itself.
Records, most owed first at each length (``kind``; every one has ``N``, ``us``, ``gbps`` and
``frac_copy``, its KV bytes against the copy bandwidth, and ``t_s``):

- ``bf16`` as shipped and ``bf16-stages2`` (one tile in flight: what the second is worth);
- ``fp8`` as shipped (the plan's ``splits``, ``block_n``, ``warps``), ``fp8-splits`` at 1.5, 2
  and 3 times the planned splits, ``fp8-cfg`` at other warps and tiles;
- ``paged-bf16`` / ``paged-fp8``: the same keys through a shuffled block table, the shipped plan
  (5 stages on CUDA) and 3 stages; ``max_abs_diff`` against the dense kernel;
- at the first length only: ``rows-*`` (8 and 32 rows over one document, the runtime's route; ``slices``: reads of the keys)
  and ``verify17-*`` (a causal verify of 17 rows).

``--device cpu`` runs the same code through Triton's interpreter on small shapes, timing eager
calls: a check that the run works before a GPU's minutes are spent on it, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

H, HKV, D, PAGE = 32, 8, 128, 64


class Emit:
    """One JSON line a record, with the seconds since the run began (``t_s``)."""

    def __init__(self):
        self.t0 = time.time()

    def __call__(self, **r):
        r["t_s"] = round(time.time() - self.t0, 1)
        print(json.dumps(r), flush=True)


def _cache_entries() -> int:
    d = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    return len(os.listdir(d)) if os.path.isdir(d) else 0


def pool_of(x: torch.Tensor) -> torch.Tensor:
    """``x [1, H_kv, N, w]`` as a block pool's storage ``[N / PAGE, H_kv, PAGE, w]`` (block b holds
    keys ``b*PAGE ...``)."""
    _, hkv, n, w = x.shape
    return x[0].reshape(hkv, n // PAGE, PAGE, w).permute(1, 0, 2, 3).contiguous()


def shuffled(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The pool of ``x`` with its blocks placed at ``perm`` (fp8 moved as bytes)."""
    raw = x.view(torch.uint8) if x.dtype.is_floating_point and x.element_size() == 1 else x
    p = pool_of(raw)
    out = torch.empty_like(p)
    out[perm] = p
    return out.view(x.dtype)


def run(keys: list[int], device: torch.device, emit, quick: bool = False) -> None:
    from treeattn_kernels import partial_attention
    from treeattn_kernels import partial_triton as pt
    from treeattn_kernels.targets import target_of

    from .kernel import copy_bandwidth, decode_inputs, fp8_inputs, time_fn, time_graph

    cuda = device.type == "cuda"
    heads, kv_heads, d = (H, HKV, D) if cuda else (8, 2, 64)

    def us(fn) -> float:
        if cuda:
            return statistics.median(time_graph(fn, device, iters=20, warmup=3)) * 1e6
        return statistics.median(time_fn(fn, device, iters=1, warmup=0)) * 1e6

    bw = copy_bandwidth(device, nbytes=(1 << 30) if cuda else (1 << 20), iters=10 if cuda else 2)
    emit(
        kind="device",
        name=torch.cuda.get_device_name(device) if cuda else "cpu (Triton's interpreter)",
        copy_gbps=round(bw / 1e9, 1),
        triton_cache_entries=_cache_entries(),
    )
    tgt = target_of(device)

    def rec(kind, N, t, nbytes, **extra):
        emit(
            kind=kind,
            N=N,
            us=round(t, 2),
            gbps=round(nbytes / t / 1e3, 1),
            frac_copy=round(nbytes / (t * 1e-6) / bw, 3),
            **extra,
        )

    for i, N in enumerate(keys):
        q, k, v, nb = decode_inputs(1, heads, kv_heads, d, N, torch.bfloat16, device)
        k8, v8, ks, vs, nb8 = fp8_inputs(k, v)
        fp8 = dict(k_scale=ks, v_scale=vs)
        # 1. baselines: bf16 as shipped and single-buffered, fp8 as shipped
        rec("bf16", N, us(lambda: pt.partial_attention_triton(q, k, v)), nb)
        rec("bf16-stages2", N, us(lambda: pt.partial_attention_triton(q, k, v, num_stages=2)), nb)
        plan = pt.plan_split(
            1, kv_heads, heads // kv_heads, 1, N, d, q.dtype, tgt, kv_dtype=k8.dtype, scale_groups=ks.shape[-1]
        )
        rec(
            "fp8",
            N,
            us(lambda: pt.partial_attention_triton(q, k8, v8, **fp8)),
            nb8,
            splits=plan.splits,
            block_n=plan.block_n,
            warps=plan.num_warps,
        )
        if quick and i:
            continue
        # 2. the fp8 levers: more CTAs resident (splits), warps, 64-key tiles
        for mult in (1.5, 2, 3):
            s = int(plan.splits * mult)
            rec("fp8-splits", N, us(lambda: pt.partial_attention_triton(q, k8, v8, **fp8, num_splits=s)), nb8, splits=s)
        for warps, bn in ((2, 32), (8, 32), (4, 64)):
            rec(
                "fp8-cfg",
                N,
                us(lambda: pt.partial_attention_triton(q, k8, v8, **fp8, num_warps=warps, block_n=bn)),
                nb8,
                warps=warps,
                block_n=bn,
            )
        # 3. paged against dense on the same keys: a shuffled table, the shipped plan and 3 stages
        perm = torch.randperm(N // PAGE, device=device)
        table = perm[None].to(torch.int32)
        kv_len = torch.tensor([N], device=device)
        kp, vp = shuffled(k, perm), shuffled(v, perm)
        o_dense, _ = pt.partial_attention_triton(q, k, v)
        for st in (None, 3):
            o_p, _ = pt.partial_attention_triton_paged(q, kp, vp, table, kv_len, num_stages=st)
            rec(
                "paged-bf16",
                N,
                us(lambda: pt.partial_attention_triton_paged(q, kp, vp, table, kv_len, num_stages=st)),
                nb,
                stages=st or "shipped",
                max_abs_diff=float((o_p.float() - o_dense.float()).abs().max()),
            )
        k8p, v8p, ksp, vsp = (shuffled(x, perm) for x in (k8, v8, ks, vs))
        for st in (None, 3):
            rec(
                "paged-fp8",
                N,
                us(
                    lambda: pt.partial_attention_triton_paged(
                        q, k8p, v8p, table, kv_len, k_scale=ksp, v_scale=vsp, num_stages=st
                    )
                ),
                nb8,
                stages=st or "shipped",
            )
        # 4. rows over one document (chat --batch's) and a verify of 17 rows, the runtime's route
        if i == 0:
            for R in (8, 32):
                qr = torch.randn(1, heads, R, d, dtype=torch.bfloat16, device=device)
                G = heads // kv_heads
                slices = -(-R // max(1, pt.tile_rows(G) // G))  # each slice reads the keys once
                rec("rows-bf16", N, us(lambda: partial_attention(qr, k, v)), nb, rows=R, slices=slices)
                rec("rows-fp8", N, us(lambda: partial_attention(qr, k8, v8, **fp8)), nb8, rows=R, slices=slices)
            qv = torch.randn(1, heads, 17, d, dtype=torch.bfloat16, device=device)
            pos = dict(
                q_pos=torch.arange(N - 17, N, device=device)[None],
                k_pos=torch.arange(N, device=device)[None],
                k_pos_sorted=True,
            )
            rec("verify17-bf16", N, us(lambda: partial_attention(qv, k, v, **pos)), nb)
            rec("verify17-fp8", N, us(lambda: partial_attention(qv, k8, v8, **fp8, **pos)), nb8)
        q = k = v = k8 = v8 = ks = vs = kp = vp = None  # this length's tensors freed before the next
        if cuda:
            torch.cuda.empty_cache()
    emit(kind="done", triton_cache_entries=_cache_entries())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="32768,131072,8192", help="key counts, most owed first")
    ap.add_argument("--quick", action="store_true", help="after the first length, only the three baselines")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here (--device cpu checks the run through Triton's interpreter)")
        return 1
    run([int(x) for x in a.keys.split(",")], device, Emit(), quick=a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
