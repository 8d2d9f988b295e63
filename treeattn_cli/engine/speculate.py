"""Speculative decoding from the document (DESIGN.md §11): drafts by n-gram lookup in the prompt
and the output, verified through the tree merge, exact.

Answers about a long document quote it. :class:`Drafter` finds the latest earlier occurrence of
the last few tokens (a 3-gram, else a 2-gram) and proposes the K tokens that followed it. The
decoder feeds the last token and the K drafts in one forward (K + 1 query rows, causal among
themselves, against every rank's shard: the replicated path), and :func:`accept` keeps the
longest prefix of drafts that greedy decoding would have produced, plus the model's own next
token; the rest is rolled back by lengths. Decode at long context is memory-bound (each step
reads the weights and every KV shard), so a verify of K + 1 rows costs about one step.

With temperature > 0, :func:`accept` does speculative sampling for a draft that is a single
token (accept it with the model's probability of it, else sample the model's distribution
without it): the output keeps the model's distribution exactly, though not the same draws as
decoding one token at a time with the same seed.

:class:`Speculation` is the policy: ``off``, ``ngram:K`` (always K drafts when a match exists),
or ``auto`` (K adapts to how many drafts are accepted, and drafting pauses when few are, so
text that does not repeat costs at most a rare probe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import Sampling, process_logits

NGRAMS = (3, 2)  # n-gram sizes tried, longest first (a 1-gram matches too much to be worth a verify)
AUTO_K = (2, 16)  # auto: the fewest and most drafts per step
PAUSE = 16  # auto: plain steps after drafts stop paying, before the next probe


def parse(text: str) -> tuple[str, int]:
    """``off`` | ``auto`` | ``ngram:K`` -> (mode, K); ValueError (one line) otherwise."""
    t = (text or "auto").strip().lower()
    if t in ("off", "auto"):
        return t, 0 if t == "off" else AUTO_K[1]
    if t.startswith("ngram:"):
        try:
            k = int(t.split(":", 1)[1])
        except ValueError:
            k = 0
        if 1 <= k <= 64:
            return "ngram", k
    raise ValueError(f"--speculate takes off, auto or ngram:K with 1 <= K <= 64, got {text!r}")


class Drafter:
    """Drafts from earlier occurrences of the latest n-gram in a growing token sequence. The
    index of n-grams is built incrementally (each token appended costs O(len(NGRAMS))), so
    drafting stays cheap at any context length. ``base``: a drafter over what comes before
    these tokens (a document shared by many answers), searched when they have no match."""

    def __init__(self, tokens=(), base: "Drafter | None" = None):
        self.tokens: list[int] = []
        self.last: dict = {}  # n-gram -> end index (exclusive) of its latest occurrence
        self.base = base
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            n = len(self.tokens)
            for g in NGRAMS:
                if n > g:  # the g-gram ending just before this token: its continuation is known now
                    self.last[tuple(self.tokens[n - 1 - g:n - 1])] = n - 1

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the last n-gram."""
        if k <= 0:
            return []
        n = len(self.tokens)
        for g in NGRAMS:
            if n < g:
                continue
            gram = tuple(self.tokens[n - g:])
            end = self.last.get(gram)
            if end is not None and end < n:
                return self.tokens[end:end + k]
            if self.base is not None:
                end = self.base.last.get(gram)
                if end is not None:
                    return (self.base.tokens[end:end + k] + self.tokens[:k])[:k]
        return []


def accept(logits: torch.Tensor, drafts: list[int], sampling: Sampling, gen) -> list[int]:
    """The tokens one verify step emits: ``logits [k + 1, V]`` of the fed rows (the last emitted
    token, then the ``k`` drafts). Greedy: the drafts greedy agrees with, then greedy's own
    next token. Sampling: each draft kept with the model's probability of it; at the first one
    rejected, a token from the model's distribution without it; if all are kept, one more from
    the last row's distribution."""
    if sampling.temperature == 0:
        best = logits.float().argmax(dim=-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            if best[i] != d:
                break
            out.append(d)
        return out + [best[len(out)]]
    probs = torch.softmax(process_logits(logits.float(), sampling), dim=-1)  # [k + 1, V]
    out = []
    for i, d in enumerate(drafts):
        u = torch.rand((), generator=gen, device=probs.device)
        if u < probs[i, d]:
            out.append(d)
            continue
        rest = probs[i].clone()
        rest[d] = 0
        return out + [int(torch.multinomial(rest / rest.sum(), 1, generator=gen))]
    return out + [int(torch.multinomial(probs[len(drafts)], 1, generator=gen))]


@dataclass
class Speculation:
    """The drafting policy of one answer and what it did (``drafted``, ``accepted`` counts).

    ``auto`` prices drafts with what it measures: ``t0``, the seconds of a plain decode step,
    and ``t1``, what each draft row adds to a verify (on a GPU about nothing: decode is
    memory-bound; on a CPU a little); and ``a``, the share of drafts kept (per draft, until the
    first rejected one). A verify of k drafts yields (1 - a^(k+1)) / (1 - a) tokens for
    t0 + k·t1 seconds: auto drafts the k that maximises tokens per second, and none while no k
    beats a plain step (it probes again after a pause), so text that does not repeat costs
    little more than the rare probe."""

    mode: str = "off"  # off | auto | ngram
    k: int = 0
    drafted: int = 0
    accepted: int = 0
    sampling: str = "greedy"  # or "speculative" (temperature > 0 with ngram:K)
    a: float = 0.6  # auto: running share of drafts kept
    t0: float | None = None  # auto: seconds of a plain step (running)
    t1: float | None = None  # auto: seconds a draft row adds to a verify (running)
    _pause: int = 0

    @classmethod
    def for_answer(cls, text: str, sampling: Sampling) -> "Speculation":
        mode, k = parse(text)
        if mode == "auto" and sampling.temperature > 0:  # keep the seed's exact draws: decode one by one
            return cls("off", 0, sampling="off: sampling")
        return cls(mode, k, sampling="speculative" if sampling.temperature > 0 else "greedy")

    def gain(self, k: int) -> float:
        """Expected tokens per second of a verify of ``k`` drafts over a plain step's (1: even)."""
        if k == 0:
            return 1.0
        a = min(self.a, 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        t0 = self.t0 or 1.0
        t1 = self.t1 if self.t1 is not None else 0.05 * t0
        return tokens * t0 / (t0 + k * max(t1, 0.0))

    def want(self) -> int:
        """How many drafts to ask for this step (0: decode one token)."""
        if self.mode == "off":
            return 0
        if self.mode == "ngram":
            return self.k
        if self._pause:
            self._pause -= 1
            return 0 if self._pause else AUTO_K[0]  # the last paused step probes
        if self.t0 is None:
            return 0  # first measure a plain step
        best = max(range(AUTO_K[0], AUTO_K[1] + 1), key=self.gain)
        if self.gain(best) < 1.05:  # drafts do not pay now: decode plainly for a while
            self._pause = PAUSE
            return 0
        return best

    def observe(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """After a forward: ``accepted`` of ``drafted`` drafts were kept; ``seconds`` it took."""
        self.drafted += drafted
        self.accepted += accepted
        if self.mode != "auto":
            return
        if seconds is not None:
            if drafted == 0:
                self.t0 = seconds if self.t0 is None else 0.8 * self.t0 + 0.2 * seconds
            elif self.t0 is not None:
                per = (seconds - self.t0) / drafted
                self.t1 = per if self.t1 is None else 0.8 * self.t1 + 0.2 * per
        if drafted:
            kept = accepted / (accepted + (accepted < drafted))  # per draft, up to the first rejected
            self.a = 0.7 * self.a + 0.3 * kept

    def record(self) -> dict:
        return {"mode": self.mode, "k": self.k, "drafted": self.drafted, "accepted": self.accepted,
                "sampling": self.sampling}
