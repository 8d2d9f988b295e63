"""The record a run of the engine ends with (rank 0's ``done`` event: what ``generate --json``
prints, ``chat``'s and ``check``'s numbers): the last answer's summary, the mesh and the merge
scheme, the pools, the CUDA graphs, each rank's peak memory and, per prefill segment, each rank's
attention FLOPs and bytes sent. A collective: every rank calls it; rank 0 gets the record."""

from __future__ import annotations

import torch

from ..model.load import weight_bytes


def run_record(eng) -> dict | None:
    """``eng``'s (``engine.Engine``) record, on rank 0 (None elsewhere)."""
    mem = [_peak_rss()] + ([torch.cuda.max_memory_allocated(eng.device)] if eng.device.type == "cuda" else [])
    segs = eng.dec.segments
    nm = len(mem)
    every = eng.world.all_gather_values(mem + [x for seg in segs for x in (seg["flops"], seg["bytes"])])
    mem = every[:, :nm]  # [ranks, 1 or 2]: every rank's peaks, for the record
    pools = eng.documents.pools()  # (a collective: every rank) every rank's [used, total] blocks
    if not eng.lead:
        return None
    graphs = eng.graph_totals
    shards = eng.bd.last_shards if eng.bd is not None else None  # the last answer's: document and tail
    if shards is None:
        shards = eng.prefix.cache.counts[0] if eng.prefix is not None else [0] * eng.mesh.cp
    shards = [int(x) for x in shards]
    out = dict(eng.summary or {})
    out.update(
        {
            "nproc": eng.ctx.world,
            "tp": eng.mesh.tp,
            "cp": eng.mesh.cp,
            "nodes": len(set(eng.nodes)),
            "weight_bytes": weight_bytes(eng.model),
            "shard_tokens": shards,
            "scheme": eng.scheme,
            "eager_scheme": eng.comm.eager_scheme or eng.scheme,
            "device": str(eng.device),
            "dtype": str(eng.dtype).replace("torch.", ""),
            "kv_dtype": eng.kv_name,  # bytes of KV one token takes on all ranks together, scales included
            "kv_bytes_per_token": eng.kv.bytes_per_token() * eng.mesh.tp,
            # the steps replayed from CUDA graphs, over every batch
            "cuda_graph": bool(graphs["graph_captures"]),
            "cuda_graph_replays": graphs["graph_replays"],
            "verify_graph_replays": graphs["verify_graph_replays"],
            "static_step": eng.dec.static,
            **({"kv_pool": pools} if pools is not None else {}),
            "kernels": "reference (the fast kernels failed their self-check)" if eng.job.reference else "fast",
            "rows": eng.model.treeattn_rows.describe(),  # how a row's matmuls stay its own (issue 49)
            # modules each run as one operation (one launch on a GPU): model/fused.py (issue 51)
            "fused": dict(getattr(eng.model, "treeattn_fused", {})),
            "peak_rss_bytes": [int(x) for x in mem[:, 0].tolist()],
            "prefill_segments": [
                {
                    **{k: seg[k] for k in ("tokens", "cached", "method", "sharding")},
                    "flops_per_rank": [int(x) for x in every[:, nm + 2 * i].tolist()],
                    "bytes_per_rank": [int(x) for x in every[:, nm + 2 * i + 1].tolist()],
                }
                for i, seg in enumerate(segs)
            ],
        }
    )
    if eng.device.type == "cuda":
        out["peak_device_bytes"] = [int(x) for x in mem[:, 1].tolist()]
    if eng.dec.graph_note or graphs["graph_note"]:
        out["note"] = eng.dec.graph_note or graphs["graph_note"]
    return out


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
