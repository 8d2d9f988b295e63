"""Speculative decoding from the document (docs/architecture.md §11): drafts by n-gram lookup in the prompt
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

from dataclasses import dataclass, field

import torch

from .sampling import Sampling, process_logits

NGRAMS = (3, 2)  # n-gram sizes tried, longest first (a 1-gram matches too much to be worth a verify)
AUTO_K = (2, 16)  # auto: the fewest and most drafts per step
PAUSE = 16  # auto: plain steps after drafts stop paying, before the next probe
FADE = 0.6  # auto: weight of what earlier verifies kept and missed at each new one


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
    these tokens (a document shared by many answers); the sequence drafted from is then
    ``base.tokens + tokens``, and every index, n-gram and lookup is over that whole sequence:
    n-grams that start in the base and end here count like any other. So drafts depend on the
    sequence only, not on where it is cut into base and own tokens (the document alone for a
    batch's slots, the document and the question for one question at a time): speculative
    sampling then makes the same draws on every path.

    Copying sticks to its source: while the tokens appended since the last draft are the
    ones that followed its source position, the next draft continues from there, rather than
    from the latest occurrence of the last n-gram (a common phrase occurs all over a document;
    the passage being quoted is the one that was being followed)."""

    def __init__(self, tokens=(), base: "Drafter | None" = None):
        self.tokens: list[int] = []
        self.last: dict = {}  # n-gram -> index (in the whole sequence) of what followed its latest occurrence here
        self.base = base
        self._follow: tuple[int, int] | None = None  # (source index of the last draft, the sequence's length then)
        self.extend(tokens)

    def _lb(self) -> int:
        return len(self.base.tokens) if self.base is not None else 0

    def extend(self, tokens) -> None:
        lb = self._lb()
        for t in tokens:
            self.tokens.append(int(t))
            n = lb + len(self.tokens)
            for g in NGRAMS:
                if n > g:  # the g-gram ending just before this token: its continuation is known now
                    self.last[tuple(self._at(n - 1 - g, g))] = n - 1

    def _at(self, i: int, k: int) -> list[int]:
        """``k`` tokens from index ``i`` of ``base.tokens + tokens`` (fewer at its end)."""
        lb = self._lb()
        if i >= lb:
            return self.tokens[i - lb : i - lb + k]
        return (self.base.tokens[i : i + k] + self.tokens[: max(0, i + k - lb)])[:k]

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens: the continuation of the passage being copied, else what followed
        the latest earlier occurrence of the last n-gram."""
        if k <= 0:
            return []
        n = self._lb() + len(self.tokens)  # the whole sequence
        if self._follow is not None:
            src, seen = self._follow
            m = n - seen
            if m > 0 and src + m < n - 1 and self._at(src, m) == self._at(seen, m):
                out = self._at(src + m, k)
                if out:
                    self._follow = (src + m, n)
                    return out
        self._follow = None
        for g in NGRAMS:
            if n < g:
                continue
            gram = tuple(self._at(n - g, g))
            end = self.last.get(gram)  # here first: the latest occurrence
            if end is None and self.base is not None:
                end = self.base.last.get(gram)
            if end is not None:
                self._follow = (end, n)
                return self._at(end, k)
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


def emit_all(rows: list, drafts: list, samplings: list, gens: list, logprobs: list) -> list[tuple[list, list]]:
    """What every sequence of a step emits, reading the device once (``transfers.read``): ``rows[i]
    [k_i + 1, V]`` its fed rows' logits (the last emitted token, then its ``k_i`` drafts),
    ``samplings[i]``/``gens[i]`` how it samples, ``logprobs[i]``: None, or the alternatives its
    tokens' logprobs carry (``sampling.token_logprobs``). Returns ``(tokens, logprobs)`` per
    sequence, each token as :func:`accept` (or a plain draw) emits it: greedy rows (drafts or not)
    and draws without drafts are chosen on the device, with their logprobs, and read together;
    speculative sampling (drafts with temperature > 0) decides draft by draft and reads as it goes
    (``--speculate auto`` does not draft when sampling)."""
    from . import transfers
    from .sampling import sample, token_logprobs

    parts, plan = [], []
    for lg, dr, s, g, k in zip(rows, drafts, samplings, gens, logprobs):
        if s.temperature != 0 and dr:
            plan.append(None)
            continue
        lg = lg.float() if s.temperature == 0 else lg[-1:].float()  # [n, V]: every fed row, or the last
        tok = lg.argmax(dim=-1) if s.temperature == 0 else sample(lg, s, g)  # [n]
        part = [tok.double()]
        if k is not None:
            lp = torch.log_softmax(lg, dim=-1)  # the raw logits' distribution (token_logprobs')
            part.append(lp.gather(1, tok[:, None])[:, 0].double())
            if k:
                top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
                part += [top.values.double().reshape(-1), top.indices.double().reshape(-1)]
        parts.append(torch.cat(part))
        plan.append((lg.shape[0], k))
    flat = transfers.read(torch.cat(parts)) if parts else []
    out, at = [], 0
    for lg, dr, s, g, k, p in zip(rows, drafts, samplings, gens, logprobs, plan):
        if p is None:  # speculative sampling: draft by draft
            toks = accept(lg, dr, s, g)
            out.append((toks, token_logprobs(lg, toks, k) if k is not None else []))
            continue
        n, k = p
        best = [int(x) for x in flat[at : at + n]]
        kept = 0
        while kept < len(dr) and best[kept] == dr[kept]:  # greedy keeps the drafts it agrees with
            kept += 1
        toks = best[: kept + 1]
        lps = []
        if k is not None:
            w = min(k, lg.shape[-1]) if k else 0
            own = flat[at + n : at + 2 * n]
            vals = flat[at + 2 * n : at + 2 * n + n * w]
            ids = flat[at + 2 * n + n * w : at + 2 * n + 2 * n * w]
            lps = [
                {"id": t, "logprob": own[i], "top": [[int(ids[i * w + j]), vals[i * w + j]] for j in range(w)]}
                for i, t in enumerate(toks)
            ]
            at += n * (2 + 2 * w)
        else:
            at += n
        out.append((toks, lps))
    return out


class StepCost:
    """What a forward costs as a function of the draft rows it carries, measured as it runs: a
    plain step ``t0`` (running mean of the steps without drafts) and a verify of ``k`` drafts
    ``fixed + per_row·k``, fitted by least squares over the latest verifies (older ones fade).
    A verify has a fixed cost of its own besides its rows: on a CPU, weight matmuls of a few
    rows run slower than the one-row ones of a plain step (measured: 4 rows ~1.7x a step, each
    further row ~2 %); on a GPU both are about a plain step. Until verifies of two sizes are
    seen the split follows a prior (5 % of a step per row). The first verify is not timed (it
    pays the one-off costs of a new shape). One object prices every sequence of a batch: the
    batch's forward is what costs."""

    FADE = 0.85  # weight of the previous verifies at each new one
    PRIOR_ROW = 0.05  # per draft row, in plain steps, until two sizes are seen

    def __init__(self):
        self.t0: float | None = None
        self.verifies = 0
        self._w = self._k = self._s = self._kk = self._ks = 0.0

    def observe(self, drafts: int, seconds: float) -> None:
        if drafts == 0:
            self.t0 = seconds if self.t0 is None else 0.8 * self.t0 + 0.2 * seconds
            return
        self.verifies += 1
        if self.verifies == 1:
            return
        f = self.FADE
        self._w, self._k, self._s = f * self._w + 1, f * self._k + drafts, f * self._s + seconds
        self._kk, self._ks = f * self._kk + drafts * drafts, f * self._ks + drafts * seconds

    def verify(self, k: int) -> float:
        """Expected seconds of a forward carrying ``k`` draft rows (``k`` = 0: a plain step)."""
        t0 = self.t0 or 1.0
        if k == 0:
            return t0
        row = self.PRIOR_ROW * t0
        if self._w < 1e-9:
            return t0 + k * row
        mk, ms = self._k / self._w, self._s / self._w
        var = self._kk / self._w - mk * mk
        if var > 0.25:  # drafts of at least two sizes: the slope is measured
            row = max(0.0, (self._ks / self._w - mk * ms) / var)
        fixed = max(t0, ms - row * mk)  # a verify costs at least a plain step
        return fixed + k * row


@dataclass
class Speculation:
    """The drafting policy of one answer and what it did (``drafted``, ``accepted`` counts).

    ``auto`` prices drafts with what it measures: the :class:`StepCost` of a plain step and of
    a verify of k drafts (shared by the sequences of a batch), and ``a``, the chance that a draft
    is kept given the ones before it were: drafts kept over drafts kept plus rejections, pooled
    over the latest verifies (older ones fade), which is the maximum-likelihood estimate for
    runs cut short by k. Pooled, not averaged per verify: copying is bursty (a paragraph is
    copied whole, then one miss where the answer leaves it), and one miss after a long run
    barely moves it. A verify of k drafts yields (1 - a^(k+1)) / (1 - a) tokens: auto drafts
    the k that maximises tokens per second, and none while no k beats a plain step (it probes
    again after a pause), so text that does not repeat costs little more than the rare probe."""

    mode: str = "off"  # off | auto | ngram
    k: int = 0
    drafted: int = 0
    accepted: int = 0
    sampling: str = "greedy"  # or "speculative" (temperature > 0 with ngram:K)
    a: float = 0.6  # auto: the chance a draft is kept (the prior until drafts are seen)
    _kept: float = 0.0  # auto: drafts kept, faded
    _missed: float = 0.0  # auto: rejections (verifies cut short), faded
    cost: StepCost = field(default_factory=StepCost)  # auto: what forwards cost (shared in a batch)
    _pause: int = 0

    @classmethod
    def for_answer(cls, text: str, sampling: Sampling, cost: StepCost | None = None) -> "Speculation":
        mode, k = parse(text)
        if mode == "auto" and sampling.temperature > 0:  # keep the seed's exact draws: decode one by one
            return cls("off", 0, sampling="off: sampling")
        return cls(mode, k, sampling="speculative" if sampling.temperature > 0 else "greedy", cost=cost or StepCost())

    def gain(self, k: int, batch: int = 1) -> float:
        """Expected tokens per second of a forward where this sequence carries ``k`` drafts,
        over a plain step's (1: even), in a batch of ``batch`` sequences (the others taken as
        plain: this sequence's drafts pay for the verify's cost alone)."""
        if k == 0:
            return 1.0
        a = min(self.a, 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        return (batch - 1 + tokens) * self.cost.verify(0) / (batch * self.cost.verify(k))

    def want(self, batch: int = 1) -> int:
        """How many drafts to ask for this step (0: decode one token)."""
        if self.mode == "off":
            return 0
        if self.mode == "ngram":
            return self.k
        if self._pause:
            self._pause -= 1
            return 0 if self._pause else AUTO_K[0]  # the last paused step probes
        if self.cost.t0 is None:
            return 0  # first measure a plain step
        best = max(range(AUTO_K[0], AUTO_K[1] + 1), key=lambda k: self.gain(k, batch))
        if self.gain(best, batch) < 1.05:  # drafts do not pay now: decode plainly for a while
            self._pause = PAUSE
            return 0
        return best

    def observe(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """After a forward: ``accepted`` of ``drafted`` drafts were kept; ``seconds`` it took
        (None in a batch, whose forward is timed once for all: ``cost.observe``)."""
        self.drafted += drafted
        self.accepted += accepted
        if self.mode != "auto":
            return
        if seconds is not None:
            self.cost.observe(drafted, seconds)
        if drafted:
            self._kept = FADE * self._kept + accepted
            self._missed = FADE * self._missed + (accepted < drafted)
            if self._missed == 0:  # nothing rejected yet: the prior's share, raised by what was kept
                self.a = max(self.a, self._kept / (self._kept + 1))
            else:
                self.a = self._kept / (self._kept + self._missed)

    def record(self) -> dict:
        return {
            "mode": self.mode,
            "k": self.k,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "sampling": self.sampling,
        }
