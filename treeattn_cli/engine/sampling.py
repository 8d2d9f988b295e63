"""Sampling a token, the same way on every path (one step, a batch's slots, speculative
verification): greedy, or temperature, then top-k, then top-p; and the stop reasons that travel
with a token between ranks."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

STOP_CODES = {0: None, 1: "eos", 2: "stop", 3: "length", 4: "interrupted", 5: "cancelled"}
STOP_IDS = {v: k for k, v in STOP_CODES.items()}


@dataclass
class Sampling:
    """``temperature`` 0 = greedy. ``top_k`` 0 = off, ``top_p`` 1 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def process_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """``logits [..., V]`` as the sampler sees them: temperature, then top-k, then top-p (fp32)."""
    logits = logits.float() / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        srt, idx = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(srt, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(srt, dim=-1) >= s.top_p  # keep the smallest set reaching top_p
        srt = srt.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, srt)
    return logits


def sample(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """``logits [B, V]`` -> token ids ``[B]`` (greedy, or temperature / top-k / top-p)."""
    if s.temperature == 0:
        return logits.float().argmax(dim=-1)
    probs = torch.softmax(process_logits(logits, s), dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # on the logits' device


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: int) -> list[dict]:
    """What the model thought of each emitted token: ``rows [n, V]`` are the logits each of
    ``tokens`` was chosen from (a verify's rows for its accepted drafts). Per token its
    log-probability under the model's own distribution (raw logits: no temperature, top-k or
    top-p) and the ``k`` most likely tokens, ``{"id", "logprob", "top": [[id, logprob], ...]}``
    (OpenAI's ``logprobs`` / ``top_logprobs``)."""
    lp = torch.log_softmax(rows[: len(tokens)].float(), dim=-1)  # [n, V]
    top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1) if k else None
    return [
        {
            "id": int(t),
            "logprob": float(lp[i, t]),
            "top": [[int(j), float(v)] for v, j in zip(top.values[i].tolist(), top.indices[i].tolist())] if k else [],
        }
        for i, t in enumerate(tokens)
    ]


def digests(rows: torch.Tensor, n: int) -> list[str]:
    """A digest of each of the first ``n`` rows of logits ``rows [..., V]`` (what each emitted
    token was chosen from, a verify's rows in order): 16 hex digits of BLAKE2b over its fp32
    bytes. Equal digests: the same bits (issue 49's oracle: an answer in any batch, with any
    drafts, against the same request alone)."""
    flat = rows.reshape(-1, rows.shape[-1])[:n].float().cpu().contiguous().numpy()
    return [hashlib.blake2b(r.tobytes(), digest_size=8).hexdigest() for r in flat]
