"""How far a lossy KV cache (``--kv-dtype fp8``) moves a model's predictions on the user's own
document (issue 27): measured, never assumed.

One device, one rank. The model is loaded once; the document is prefilled chunk by chunk into
two shards side by side, each in a block pool as the engine keeps them, one in the model's own
dtype (the reference) and one stored as the run would store it, through treeattn's own
attention, so what is measured is what ``generate`` computes. At every position of the document the two next-token distributions are compared:

* ``top1_agreement``: the share of positions whose most likely next token agrees;
* ``kl_mean``: the mean over positions of KL(reference ‖ lossy), in nats;

then both continue ``new_tokens`` greedily from the document's end (each token appended and
attended as stored): ``greedy_agreement``
(the share of positions with the same token) and ``greedy_prefix`` (tokens equal before the
first difference, after which the two continuations see different text).

The verdict (``top1_agreement >= 0.95`` and ``kl_mean <= 0.01``) is kept per model and KV dtype
under ``cache_root()/fidelity/``, so ``generate --kv-dtype fp8`` can say when none is recorded.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

THRESHOLDS = {"top1_agreement": 0.95, "kl_mean": 0.01}  # below the first or above the second: drift
CHUNK = 512  # document tokens per prefill chunk: bounds the [chunk, vocab] logits held at once


def _record_path(identity: dict, kv_name: str) -> Path:
    from ..paths import cache_root

    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "fidelity" / f"{key}-{kv_name}.json"


def recorded(identity: dict, kv_name: str) -> dict | None:
    """The latest fidelity check recorded for this model and KV storage, or None."""
    try:
        return json.loads(_record_path(identity, kv_name).read_text())
    except (OSError, ValueError):
        return None


def _compare(ref_logits, test_logits) -> tuple[int, float]:
    """``(positions whose argmax agrees, sum over positions of KL(ref ‖ test))`` of ``[n, V]``."""
    lr = torch.log_softmax(ref_logits.double(), dim=-1)
    lt = torch.log_softmax(test_logits.double(), dim=-1)
    agree = int((lr.argmax(-1) == lt.argmax(-1)).sum())
    kl = float((lr.exp() * (lr - lt)).sum(-1).clamp(min=0).sum())
    return agree, kl


@torch.inference_mode()
def measure(
    model_dir,
    ids: list[int],
    *,
    kv_dtype: str = "fp8",
    dtype: torch.dtype = torch.float32,
    device="cpu",
    new_tokens: int = 32,
    chunk: int = CHUNK,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    on_progress=None,
) -> dict:
    """The fidelity record of storing ``ids``' KV as ``kv_dtype`` against the model's ``dtype``."""
    from ..engine.attention import AttentionContext, register
    from ..engine.decode import Decoder
    from ..storage.kvquant import storage
    from ..model.load import load_model, shapes
    from ..engine.paged_shard import PagedShard
    from ..engine.pool import BlockPool
    from ..parallel.comm import Comm

    t0 = time.perf_counter()
    device = torch.device(device)
    model = load_model(
        model_dir, dtype, device, attention=register(), trust_remote_code=trust_remote_code, allow_pickle=allow_pickle
    )
    sh = shapes(model.config)
    vocab = model.get_output_embeddings().weight.shape[0]
    n = len(ids)
    dec = Decoder(model, AttentionContext(Comm.single()), vocab_size=vocab, device=device, kv_heads=sh["kv_heads"])
    shards = {}
    page = 64
    for which, kv in (("reference", "auto"), ("test", kv_dtype)):
        kv_store, quant, name = storage(kv, dtype, device, sh["head_dim"])
        pool = BlockPool(
            sh["num_layers"],
            sh["kv_heads"],
            sh["head_dim"],
            page=page,
            num_blocks=-(-(n + new_tokens) // page) + 2,
            dtype=kv_store,
            device=device,
            quant=quant,
        )
        shards[which] = (PagedShard(pool, rank=0, world=1), name)
    agree, kl, last = 0, 0.0, {}
    x = torch.tensor([ids], dtype=torch.int64)
    for s0 in range(0, n, chunk):
        s1 = min(n, s0 + chunk)
        got = {w: dec.prefill(shard, x[:, s0:s1], s1 - s0, rows=s1 - s0) for w, (shard, _) in shards.items()}
        rows = {w: (lg if lg.dim() == 3 else lg[:, None])[0] for w, lg in got.items()}  # [c, V]
        a, k = _compare(rows["reference"], rows["test"])
        agree, kl = agree + a, kl + k
        last = {w: r[-1:] for w, r in rows.items()}
        if on_progress is not None:
            on_progress(s1, n)
    answers = {}
    for w, (shard, _) in shards.items():  # greedy: each token appended after the shard, its logits the next's
        logits, out = last[w], []
        for _ in range(new_tokens):
            out.append(int(logits.argmax(-1)))
            if len(out) < new_tokens:
                logits = dec.prefill(shard, torch.tensor([[out[-1]]]))
        answers[w] = out
    same = [a == b for a, b in zip(answers["reference"], answers["test"])]
    prefix = next((i for i, s in enumerate(same) if not s), len(same))
    rec = {
        "check": "kv-fidelity",
        "kv_dtype": shards["test"][1],
        "reference": shards["reference"][1],
        "tokens": n,
        "device": str(device),
        "top1_agreement": agree / n,
        "kl_mean": kl / n,
        "greedy_tokens": len(same),
        "greedy_agreement": sum(same) / max(1, len(same)),
        "greedy_prefix": prefix,
        "kv_bytes_per_token": {w: shard.bytes_per_token() for w, (shard, _) in shards.items()},
        "thresholds": THRESHOLDS,
        "seconds": time.perf_counter() - t0,
    }
    rec["ok"] = rec["top1_agreement"] >= THRESHOLDS["top1_agreement"] and rec["kl_mean"] <= THRESHOLDS["kl_mean"]
    return rec


def save(identity: dict, record: dict, document: str) -> Path:
    """Keep ``record`` (with the document's hash and the time) as this model's latest check."""
    from ..paths import write_atomic

    path = _record_path(identity, record["kv_dtype"])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(
        path,
        json.dumps(
            {
                **record,
                "document_sha256": hashlib.sha256(document.encode()).hexdigest(),
                "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            },
            indent=1,
        ),
    )
    return path
