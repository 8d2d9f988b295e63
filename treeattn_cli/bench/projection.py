"""α–β projections of a decode step on clusters we do not have (``treeattn bench --simulate``).

``simulate``: tree vs ring attention on one attention shape (the paper's comparison).
``simulate_mesh``: a whole model on a (cp × tp) mesh: per decode step each rank reads its
``1/tp`` of the weights and its ``1/(tp·cp)`` of the KV cache from memory, runs two
tensor-parallel all-reduces per layer inside its node and one tree merge per layer across its
cp group (the layout's scheme: flat inside a node, hierarchical across nodes). Figures come from
a profile (``profiles/*.yaml``: link α and β, memory bandwidth and size per GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..storage.kvdtypes import token_bytes
from .spec import DTYPES


def simulate(profile_name: str, gpus: list[int], spec, attn_s_per_byte: float | None = None):
    """Predicted tree and ring decode-step times for clusters of ``gpus`` GPUs.

    Local attention time: KV bytes of the shard / memory bandwidth (the profile's, or
    ``attn_s_per_byte`` measured here). Tree: local attention + the layout's merge (NVSwitch /
    XGMI inside a node, the NET link across nodes: hierarchical). Ring: per step the larger of
    one block's attention and one block's transfer (they overlap), p-1 steps, plus the last
    block's attention.
    """
    from ..topology import layout as Lo
    from ..topology.probe import GPU, Topology

    prof = Lo.load_profile(profile_name)
    per_node = prof.gpus_per_node or 8
    intra = next(
        (c for c in ("NVSWITCH", "XGMI", "NVLINK", "PIX", "PXB", "PHB", "NODE", "SYS", "LOOPBACK") if c in prof.links),
        None,
    )
    s_per_byte = attn_s_per_byte or (1.0 / prof.memory_bandwidth if prof.memory_bandwidth else None)
    if s_per_byte is None:
        raise ValueError(f"profile {prof.name} has no memory_bandwidth_gbps: cannot price local attention")
    esize = DTYPES[spec.dtype].itemsize
    H, Hk, d, L = spec.heads, spec.kv_heads, spec.head_dim, spec.layers
    out = []
    for p in gpus:
        links = [
            ["X" if i == j else (intra if i // per_node == j // per_node else "NET") for j in range(p)]
            for i in range(p)
        ]
        topo = Topology(
            [GPU(i) for i in range(p)], links, [[0] * p for _ in range(p)], [[True] * p for _ in range(p)], "simulated"
        )
        ring_link = prof.link("NET" if p > per_node else intra)
        for B in spec.batches or [spec.batch]:
            lay = Lo.choose_layout(topo, prof, batch=B, heads=H, head_dim=d, layers=1)
            caches = 1 if spec.shared else B  # a shared document is read once for all B queries
            for N in spec.seq_lens:
                shard = 2 * caches * Hk * (N / p) * d * esize
                t_attn = shard * s_per_byte
                tree = L * (t_attn + lay.per_layer_s)
                xfer = ring_link.alpha_s + shard * ring_link.beta_s
                ring = L * (t_attn + (p - 1) * max(t_attn, xfer))
                base = {
                    "nproc": p,
                    "seq_len": N,
                    "batch": B,
                    "shared": spec.shared,
                    "heads": H,
                    "kv_heads": Hk,
                    "head_dim": d,
                    "dtype": spec.dtype,
                    "layers": L,
                    "simulated": True,
                    "profile": prof.name,
                    "device": f"simulated {prof.name}",
                    "peak_mem_bytes": int(shard),
                }
                out.append(
                    {
                        **base,
                        "method": "tree",
                        "scheme": lay.scheme,
                        "step_ms_median": tree * 1e3,
                        "bytes_per_step": L * sum(Lo.message_bytes(B, H, d).values()),
                        "collectives_per_step": L * 2,
                        "groups": len(lay.groups),
                    }
                )
                out.append(
                    {
                        **base,
                        "method": "ring",
                        "scheme": "ring",
                        "step_ms_median": ring * 1e3,
                        "bytes_per_step": int(L * (p - 1) * shard),
                        "collectives_per_step": L * (p - 1),
                    }
                )
    return out


@dataclass(frozen=True)
class ModelShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    params: float  # parameters (embeddings and LM head included)


# From the models' config.json and model cards (Meta, 2024-07): 8,030,261,248 / 70,553,706,496 /
# 405,853,388,800 parameters.
MODEL_SHAPES = {
    "llama-3.1-8b": ModelShape(32, 32, 8, 128, 4096, 8.030e9),
    "llama-3.1-70b": ModelShape(80, 64, 8, 128, 8192, 70.554e9),
    "llama-3.1-405b": ModelShape(126, 128, 8, 128, 16384, 405.853e9),
}


def model_shape(name: str) -> ModelShape:
    if name not in MODEL_SHAPES:
        raise ValueError(f"--model-shape must be one of {', '.join(MODEL_SHAPES)}, got {name!r}")
    return MODEL_SHAPES[name]


def speculation_gain(acceptance: float, k: int) -> float:
    """Tokens a verify of ``k`` drafts yields when each draft is kept with probability
    ``acceptance`` (until the first rejected one), plus the model's own token."""
    a = min(max(acceptance, 0.0), 0.999999)
    return (1 - a ** (k + 1)) / (1 - a)


def simulate_mesh(
    profile_name: str,
    gpus: list[int],
    seq_lens: list[int],
    tps: list[int],
    shape: str,
    *,
    batch: int = 1,
    shared: bool = False,
    dtype: str = "bfloat16",
    acceptance: float | None = None,
    draft_k: int = 8,
    kv_dtype: str = "auto",
) -> list[dict]:
    """Predicted decode step of a whole model for every (GPUs, tokens, tp) with tp | GPUs,
    tp | H_kv and tp <= GPUs per node; ``fits`` says whether weights + KV fit each GPU's memory
    and ``best`` marks the fastest fitting (tp, cp) per (GPUs, tokens). ``batch`` sequences per
    step; ``shared``: they share one document of N tokens (its cache read once per step for all
    of them; their own few tokens are not priced), else each has N tokens of its own.
    ``tokens_per_s``: the step's tokens (``batch``) over its time. ``acceptance``: also price
    speculative decoding with ``draft_k`` drafts per sequence kept with that probability each: a
    verify step reads the same weights and cache as a decode step, moves ``draft_k + 1`` times
    the merge and all-reduce bytes, and computes ``draft_k + 1`` rows (at the profile's peak
    FLOP/s); ``spec_tokens_per_s`` and ``spec_gain`` (over plain decode) come with it.
    ``kv_dtype``: how the cache is stored (``auto``: ``dtype``; fp8 with its scales), which sets
    the bytes each step reads and what fits."""
    from ..topology import layout as Lo
    from ..topology.layout import ring_allreduce_s
    from ..parallel.mesh import Mesh
    from ..topology.layout import cp_layout

    prof = Lo.load_profile(profile_name)
    m = model_shape(shape)
    if not prof.memory_bandwidth:
        raise ValueError(f"profile {prof.name} has no memory_bandwidth_gbps: cannot price memory reads")
    per_node = prof.gpus_per_node or 8
    intra = next(
        (c for c in ("NVSWITCH", "XGMI", "NVLINK", "PIX", "PXB", "PHB", "NODE", "SYS", "LOOPBACK") if c in prof.links),
        "NET",
    )
    esize = DTYPES[dtype].itemsize
    kv_name = dtype if kv_dtype == "auto" else kv_dtype
    kv_token = token_bytes(kv_name, m.layers, m.kv_heads, m.head_dim)  # all layers and heads
    out = []
    for p in gpus:
        for N in seq_lens:
            rows = []
            for tp in tps:
                if p % tp or m.kv_heads % tp or m.heads % tp or tp > per_node:
                    continue
                mesh = Mesh(p, tp)
                cp = mesh.cp
                nodes = [str(r // per_node) for r in range(p)]
                lay = (
                    cp_layout(
                        mesh,
                        nodes,
                        prof.path,
                        heads=m.heads,
                        head_dim=m.head_dim,
                        layers=m.layers,
                        intra=intra,
                        batch=batch,
                    )
                    if cp > 1
                    else None
                )
                w = m.params * esize / tp
                kv = kv_token // tp * math.ceil(N / cp) * (1 if shared else batch)
                t_w, t_kv = w / prof.memory_bandwidth, kv / prof.memory_bandwidth
                t_ar = ring_allreduce_s(tp, batch * m.hidden * esize, prof.link(intra)) if tp > 1 else 0.0
                t_merge = lay.per_layer_s if lay else 0.0
                step = t_w + t_kv + m.layers * (2 * t_ar + t_merge)
                spec = {}
                if acceptance is not None:
                    fed = batch * (draft_k + 1)  # query rows of a verify step
                    lay_v = (
                        cp_layout(
                            mesh,
                            nodes,
                            prof.path,
                            heads=m.heads,
                            head_dim=m.head_dim,
                            layers=m.layers,
                            intra=intra,
                            batch=fed,
                        )
                        if cp > 1
                        else None
                    )
                    t_ar_v = ring_allreduce_s(tp, fed * m.hidden * esize, prof.link(intra)) if tp > 1 else 0.0
                    t_rows = 2 * m.params / tp * fed / prof.flops if prof.flops else 0.0
                    verify = max(t_w + t_kv, t_rows) + m.layers * (2 * t_ar_v + (lay_v.per_layer_s if lay_v else 0.0))
                    tokens = batch * speculation_gain(acceptance, draft_k)
                    spec = {
                        "acceptance": acceptance,
                        "draft_k": draft_k,
                        "verify_ms": verify * 1e3,
                        "spec_tokens_per_s": tokens / verify,
                        "spec_gain": (tokens / verify) / (batch / step),
                    }
                rows.append(
                    {
                        "method": "tree",
                        "simulated": True,
                        "profile": prof.name,
                        "model": shape,
                        "nproc": p,
                        "tp": tp,
                        "cp": cp,
                        "seq_len": N,
                        "batch": batch,
                        "shared": shared,
                        "dtype": dtype,
                        "kv_dtype": kv_name,
                        "scheme": lay.scheme if lay else "none",
                        "step_ms_median": step * 1e3,
                        "tokens_per_s": batch / step,
                        "weights_ms": t_w * 1e3,
                        "kv_ms": t_kv * 1e3,
                        "tp_allreduce_ms": 2 * m.layers * t_ar * 1e3,
                        "merge_ms": m.layers * t_merge * 1e3,
                        "mem_per_gpu_gb": (w + kv) / 1e9,
                        "fits": prof.memory_bytes is None or w + kv <= prof.memory_bytes,
                        "device": f"simulated {prof.name}",
                        **spec,
                    }
                )
            ok = [r for r in rows if r["fits"]]
            if ok:
                min(ok, key=lambda r: r["step_ms_median"])["best"] = True
            out += rows
    return out


RESERVE_BYTES = 4 << 30  # per GPU, besides weights and KV: CUDA context, NCCL buffers, activations, logits


def max_context(
    profile_name: str,
    gpus: list[int],
    shapes: list[str],
    kv_dtypes: list[str],
    tps: list[int] | None = None,
    dtype: str = "bfloat16",
) -> list[dict]:
    """The longest context whose KV cache fits ``gpus`` GPUs of a profile next to the weights
    (``dtype``, split ``tp`` ways) and :data:`RESERVE_BYTES`, per model shape, KV dtype and tp:
    each GPU holds ``1/tp`` of the weights and ``1/GPUs`` of every token's KV (``tp`` splits
    the KV heads, ``cp`` the tokens), so more tp leaves more room. ``best`` marks the tp with
    the longest context per (shape, GPUs, KV dtype)."""
    from ..topology import layout as Lo

    prof = Lo.load_profile(profile_name)
    if not prof.memory_bytes:
        raise ValueError(f"profile {prof.name} has no memory_gb: cannot size the cache")
    per_node = prof.gpus_per_node or 8
    esize = DTYPES[dtype].itemsize
    out = []
    for shape in shapes:
        m = model_shape(shape)
        for p in gpus:
            for kv in kv_dtypes:
                kv_name = dtype if kv == "auto" else kv
                per_token = token_bytes(kv_name, m.layers, m.kv_heads, m.head_dim)
                rows = []
                for tp in tps or [1, 2, 4, 8]:
                    if p % tp or m.kv_heads % tp or m.heads % tp or tp > per_node:
                        continue
                    w = m.params * esize / tp
                    room = prof.memory_bytes - w - RESERVE_BYTES
                    tokens = max(0, int(room * p // per_token)) if room > 0 else 0
                    rows.append(
                        {
                            "simulated": True,
                            "profile": prof.name,
                            "model": shape,
                            "nproc": p,
                            "tp": tp,
                            "cp": p // tp,
                            "dtype": dtype,
                            "kv_dtype": kv_name,
                            "kv_bytes_per_token": per_token,
                            "weights_gb_per_gpu": w / 1e9,
                            "kv_room_gb_per_gpu": max(room, 0) / 1e9,
                            "max_context": tokens,
                            "reserve_gb": RESERVE_BYTES / 1e9,
                            "device": f"simulated {prof.name}",
                        }
                    )
                if rows:
                    max(rows, key=lambda r: r["max_context"])["best"] = True
                out += rows
    return out


def simulate_prefill(
    profile_name: str,
    gpus: list[int],
    seq_lens: list[int],
    shape: str,
    *,
    tp: int = 8,
    mfu: float = 0.5,
    dtype: str = "bfloat16",
) -> list[dict]:
    """Predicted prefill time of a whole model on ``gpus`` GPUs as ``tp``-way tensor parallel
    groups (inside nodes) × ``cp = gpus / tp`` sequence shards, for balanced and contiguous
    sharding. Compute at ``mfu`` of the profile's dense bf16 FLOP/s: linear layers (2 FLOPs per
    parameter per token) and causal attention, the slowest rank's share (contiguous: the last
    shard does (2cp - 1)/cp of the mean); two tensor-parallel all-reduces of the activations per
    layer; pass-KV ring steps whose KV transfers hide behind each step's attention when they
    can (the exposed rest is added). ``efficiency``: perfect scaling's time over the predicted."""
    from ..topology import layout as Lo
    from ..topology.layout import ring_allreduce_s

    prof = Lo.load_profile(profile_name)
    m = model_shape(shape)
    if not prof.flops:
        raise ValueError(f"profile {prof.name} has no compute_tflops: cannot price prefill compute")
    per_node = prof.gpus_per_node or 8
    intra = next(
        (c for c in ("NVSWITCH", "XGMI", "NVLINK", "PIX", "PXB", "PHB", "NODE", "SYS", "LOOPBACK") if c in prof.links),
        "NET",
    )
    esize = DTYPES[dtype].itemsize
    rate = prof.flops * mfu
    out = []
    for p in gpus:
        if p % tp or m.kv_heads % tp or tp > per_node:
            continue
        cp = p // tp
        cross = "NET" if p > per_node else intra  # cp neighbours sit in other nodes once there are several
        for N in seq_lens:
            lin = 2 * m.params * N
            attn = m.layers * 4 * m.heads * m.head_dim * N * N / 2  # causal: the lower triangle
            ideal = (lin + attn) / (p * rate)
            t_ar = 2 * m.layers * ring_allreduce_s(tp, N / cp * m.hidden * esize, prof.link(intra)) if tp > 1 else 0.0
            block = 2 * (m.kv_heads // tp) * m.head_dim * (N / cp) * esize  # one shard's KV, per layer
            t_xfer = prof.link(cross).alpha_s + block * prof.link(cross).beta_s
            for sharding in ("balanced", "contiguous"):
                share = attn / p * (1.0 if sharding == "balanced" or cp == 1 else (2 * cp - 1) / cp)
                t_step = share / m.layers / max(cp, 1) / rate  # one ring step's attention, per layer
                exposed = m.layers * (cp - 1) * max(0.0, t_xfer - t_step)
                total = (lin / p + share) / rate + t_ar + exposed
                out.append(
                    {
                        "method": sharding,
                        "simulated": True,
                        "profile": prof.name,
                        "model": shape,
                        "nproc": p,
                        "tp": tp,
                        "cp": cp,
                        "seq_len": N,
                        "mfu": mfu,
                        "dtype": dtype,
                        "prefill_s": total,
                        "ideal_s": ideal,
                        "efficiency": ideal / total,
                        "attention_s": share / rate,
                        "linear_s": lin / p / rate,
                        "tp_allreduce_s": t_ar,
                        "exposed_kv_s": exposed,
                        "device": f"simulated {prof.name}",
                    }
                )
    return out
