"""Citations from the merge (issue 37; docs/architecture.md §12): where in the document an answer read.

Every decode step already has, per query row and head, the merged log-sum-exp ``lse`` of its
scores over every rank's keys. The split kernels can also write each row's log-sum-exp per block
of keys of this rank's shard (``block_lse``, :func:`treeattn_kernels.partial_attention`); then
``exp(block_lse - lse)`` is the share of the row's attention that block received, exactly,
whatever the number of ranks. Blocks here are single keys (``LSE_BLOCK = 1``): a rank's shard
holds runs of positions cut wherever prefill segments and balanced chunks fell, so a block of
several keys can straddle two sentences, and which ones depends on the number of ranks; one key
a block keeps every span's mass exact on 1, 2 or 3 ranks and any ``--tp``. It costs ``H`` floats
per key and row on the layers that cite (``G / d`` of those layers' K/V bytes: 3 % for
Llama-3.1-8B), against ``2·H_kv·d`` bytes of K/V.

An answer that cites carries its document's *spans* (sentences or paragraphs, as ranges of
global token positions, made from the text by ``cli/citations.py``). Per forward, on the layers
:func:`cite_layers` picks, each asking row's per-key shares are summed over the heads and into
the spans its keys fall in (keys outside every span: the chat template, the question, the answer,
attention sinks at the start, fall into a bin that is dropped); a row counts once its token is
kept (drafts that are rejected do not). At the answer's end the ranks add up their rows (one
all-gather over every rank), and rank 0 has ``[rows, spans]``: the share of each answer row's
attention, averaged over the chosen layers and all heads, that each span received.
"""

from __future__ import annotations

import torch

LSE_BLOCK = 1  # keys per block of the kernels' block_lse (see above: exact spans on any mesh)
SINK_POSITIONS = 4  # the first positions of a sequence draw attention whatever they hold (sinks): never cited


def cite_layers(num_layers: int) -> list[int]:
    """The layers whose attention is counted, all heads of each: the upper half. On the embedded
    model's 21 right answers to planted facts, the upper half found the planted sentence first in
    21 (with :func:`span_scores`), the upper third in 20, every layer in 14, the lower half in 5,
    the last four in 3; single heads of the upper half, 9 to 20 (so no head is left out). Lower
    layers attend by position and syntax (neighbouring tokens, sinks), the upper ones to what the
    answer draws on (BENCHMARKS.md, "Citations from the merge")."""
    return list(range(num_layers // 2, num_layers))


def span_scores(masses, lengths):
    """Each span's score from ``masses [rows, S]`` (each row's share of attention per span) and
    ``lengths [S]`` (its tokens), numpy: the mean share over the rows over the square root of the
    span's tokens. The raw share favours long sentences (more keys, more mass whatever they say),
    the share per token short ones; on 21 planted facts, half of them as long as the document's
    own sentences, the square root put the planted sentence first in 21, the share per token in
    20, the raw share in 18 (BENCHMARKS.md, "Citations from the merge"). The record's ``score``
    is the raw mean share (what a reader can interpret); this only orders them."""
    import numpy as np

    return masses.mean(0) / np.sqrt(np.maximum(lengths, 1))


class Citation:
    """One answer's attention masses over its document's spans, on this rank.

    ``spans [S, 2]``: global positions ``[start, end)`` of the document's spans (sorted, disjoint).
    ``layers``: the layers that count (default :func:`cite_layers`). ``detail``: ``"sum"`` (the
    answer's record), or ``"layers"`` / ``"heads"``: each layer's (and each head's) masses kept
    apart, for the measurement that chose the layers and heads (``bench/cite.py``; ``"heads"``
    with ``--tp 1`` only). ``heads``: the query heads of the whole model (the average's
    denominator), ``local_heads`` this rank's; ``counts``: whether this rank's heads count (a tp
    peer holding the same heads as another does not).
    """

    def __init__(
        self,
        spans,
        num_layers: int,
        heads: int,
        *,
        layers=None,
        detail: str = "sum",
        counts: bool = True,
        local_heads: int | None = None,
        device="cpu",
    ):
        spans = torch.as_tensor(spans, dtype=torch.int64).reshape(-1, 2)
        self.device = torch.device(device)
        self.starts = spans[:, 0].contiguous().to(self.device)
        self.ends = spans[:, 1].contiguous().to(self.device)
        self.S = spans.shape[0]
        chosen = cite_layers(num_layers) if layers is None else sorted(set(int(x) for x in layers))
        if not chosen or any(not 0 <= x < num_layers for x in chosen):
            raise ValueError(f"citation layers {chosen} outside the model's {num_layers}")
        if detail not in ("sum", "layers", "heads"):
            raise ValueError(f"citation detail must be sum, layers or heads, got {detail!r}")
        self.layer_index = {x: i for i, x in enumerate(chosen)}
        self.layers, self.detail, self.heads, self.counts = chosen, detail, heads, counts
        self.local_heads = local_heads or heads
        self.rows: list[torch.Tensor] = []  # kept rows: [layers or 1, (heads,) S] each
        self.pending: torch.Tensor | None = None  # the latest forward's rows: [layers or 1, (heads,) T, S + 1]
        self._bins: dict = {}  # id of a shard -> (keys, their bins): computed once per shard and length

    def wants(self, layer: int) -> bool:
        return layer in self.layer_index

    def bins(self, pos: torch.Tensor) -> torch.Tensor:
        """The span of each key at global positions ``pos [N]`` (``S``: none)."""
        pos = pos.to(self.device)
        i = torch.bucketize(pos, self.starts, right=True) - 1  # the last span starting at or before
        ok = (i >= 0) & (pos < self.ends[i.clamp(min=0)]) & (pos >= 0)
        return torch.where(ok, i, torch.full_like(i, self.S))

    def bins_of(self, shard, n: int, positions) -> torch.Tensor:
        """:meth:`bins` of the first ``n`` keys of ``shard`` (``positions()`` gives their positions
        ``[>= n]`` when they are not known yet). The keys an answer reads keep their positions while
        it lasts (its own tokens only add keys, outside every span), and keys it cannot see have
        no share: once per shard and length is enough."""
        got = self._bins.get(id(shard))
        if got is None or got[0] != n:
            got = self._bins[id(shard)] = (n, self.bins(positions()[:n]))
        return got[1]

    def begin(self, T: int) -> None:
        """A forward with ``T`` rows of this answer begins."""
        lead = (len(self.layers),) if self.detail != "sum" else (1,)
        mid = (self.local_heads,) if self.detail == "heads" else ()
        self.pending = torch.zeros(*lead, *mid, T, self.S + 1, dtype=torch.float32, device=self.device)

    def add(self, layer: int, block_lse: torch.Tensor, lse: torch.Tensor, bins: torch.Tensor) -> None:
        """One layer's shares: ``block_lse [H, T, N]`` (one key a block, this rank's keys),
        ``lse [H, T]`` merged over every rank, ``bins [N]`` (:meth:`bins`)."""
        if self.pending is None or not self.counts:
            return
        # [H, T, N]; keys a row cannot see (-inf) give 0; every row sees a key (its own token): lse is finite
        share = torch.exp(block_lse - lse[..., None].to(block_lse.device)).to(self.device)
        at = self.layer_index[layer] if self.detail != "sum" else 0
        H, T, N = share.shape
        if self.detail == "heads":
            self.pending[at, :, :T].scatter_add_(-1, bins[None, None, :N].expand(H, T, N), share)
        else:
            self.pending[at, :T].scatter_add_(-1, bins[None, :N].expand(T, N), share.sum(0))

    def keep(self, n: int) -> None:
        """The first ``n`` rows of the latest forward were kept (emitted tokens' rows)."""
        if self.pending is None:
            return
        for t in range(min(n, self.pending.shape[-2])):
            self.rows.append(self.pending[..., t, : self.S].clone())
        self.pending = None

    def gather(self, comm):
        """Every rank's rows added up (a collective over ``comm``: every rank calls it at the same
        point): a numpy fp32 ``[rows, S]`` (``[layers, rows, S]``, ``[layers, heads, rows, S]`` with
        ``detail``; numpy, not a tensor, so it travels to the launcher by value), each row the average
        over the counted layers and all heads of the model (per layer, per head: their shares)."""
        lead = (len(self.layers),) if self.detail != "sum" else (1,)
        if self.rows:
            mine = torch.stack(self.rows, -2)
        else:
            mine = torch.zeros(
                *lead, *((self.local_heads,) if self.detail == "heads" else ()), 0, self.S, device=self.device
            )
        total = comm.all_reduce(mine.contiguous(), "sum") if comm.world > 1 else mine
        div = {"sum": self.heads * len(self.layers), "layers": self.heads, "heads": 1}[self.detail]
        total = total.float().cpu() / div
        return (total[0] if self.detail == "sum" else total).numpy()
