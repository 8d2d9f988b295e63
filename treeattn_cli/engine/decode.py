"""The model's forwards on one rank: a prefill into a shard of the block pool, and the forward a
step of the batch loop runs (``batch.py``). Knows nothing of sampling or the terminal.

Every rank runs the same model on the same tokens: during prefill each on its piece of each
segment (ring attention across pieces, pass-Q attention to earlier segments); in a step each on
every slot's new tokens (tree-merged cascade attention over the documents' shards and the tail,
``attention._cascade``). The step loop, sampling and streaming live in ``batch.py``.
"""

from __future__ import annotations

import torch

from ..model import invariance
from .attention import AttentionContext

P2P_CAPTURE_TORCH = "2.7"  # blocking send/recv inside a CUDA graph capture (pytorch#148462)


def graph_capture_ok(comm, version: str | None = None) -> bool:
    """Whether this torch can capture the decode step's merge in a CUDA graph: all_reduce and
    broadcast always could; the point-to-point sends of ``tree`` (and of hierarchical levels
    that use it) only from torch 2.7 on."""
    v = tuple(int(x) for x in (version or torch.__version__).split("+")[0].split(".")[:2])
    return v >= tuple(int(x) for x in P2P_CAPTURE_TORCH.split(".")) or comm.world == 1 or not comm.uses_p2p()


def segments(n: int, p: int, piece: int | None) -> list[tuple[int, int]]:
    """Prefill segments of ``p * piece`` tokens (one piece per rank); the tail is merged into
    the previous segment when shorter than p, so only a prompt shorter than p leaves a rank
    without tokens."""
    if not piece or n <= p * piece:
        return [(0, n)]
    cuts = list(range(0, n, p * piece)) + [n]
    if cuts[-1] - cuts[-2] < p:
        del cuts[-2]
    return list(zip(cuts, cuts[1:]))


class Decoder:
    """One rank's model and communicators: prefill into a shard, and the batch loop's forwards."""

    def __init__(
        self,
        model,
        actx: AttentionContext,
        *,
        vocab_size: int,
        device,
        kv_heads: int,
        static: bool = False,
        cuda_graph: bool = False,
        world=None,
        sharding: str = "balanced",
    ):
        self.model = model
        self.base = getattr(model, model.base_model_prefix)  # the decoder without the LM head
        self.actx = actx
        self.comm = actx.comm  # the sequence shards (a cp group of the mesh)
        self.world = world or actx.comm  # every rank: rank 0's sampled token goes to all
        self.vocab = vocab_size
        self.device = torch.device(device)
        self.static = static  # fixed-shape steps (the tail's views capacity-long): what a CUDA graph replays
        # the batch loop's steps replayed from CUDA graphs: fixed shapes and NCCL
        self.use_graph = cuda_graph and self.device.type == "cuda" and static
        self.graph_note = None
        if self.use_graph and not graph_capture_ok(self.comm):
            self.use_graph = False
            self.graph_note = (
                f"CUDA graphs need torch >= {P2P_CAPTURE_TORCH} to capture the point-to-point "
                f"sends of the {self.comm.scheme} merge (this is torch {torch.__version__}): "
                "decoding eagerly"
            )
        # steps no graph replays merge as captured ones do (a step that cites runs eagerly with the same numbers)
        actx.eager = not self.use_graph
        self.sharding = sharding  # of prefill segments: "balanced" or "contiguous" (prefill.py)
        self.route = None  # force "pass-q" or "pass-kv" for segments after a cache (tests); None: plan
        self.segments: list[dict] = []  # what each prefill segment did (Decoder.prefill)
        cfg = getattr(model.config, "text_config", None) or model.config
        group = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.q_heads = kv_heads * group  # query heads this rank attends with (``kv_heads``: its KV heads)
        self.window = getattr(cfg, "sliding_window", None)

    def _forward(self, ids, positions, want_logits: bool, rows: int = 1):
        """The model on ``ids [B, T]``: the last position's logits ``[B, V]`` (``rows`` > 1: the
        last ``rows`` positions', ``[B, rows, V]``) where ``want_logits``, else None."""
        kw = dict(input_ids=ids, position_ids=positions, use_cache=False, treeattn_ctx=self.actx)
        # every forward but a document's prefill segment may hold rows of several requests, or must
        # give a request's rows the numbers any other forward would: rows in fixed chunks
        with invariance.shared_rows(self.actx.phase != "prefill"):
            if want_logits:
                logits = self.model(**kw, logits_to_keep=rows).logits
                return (logits[:, -1] if rows == 1 else logits[:, -rows:]).float()
            self.base(**kw)
        return None

    @torch.inference_mode()
    def prefill(self, cache, ids: torch.Tensor, piece: int | None = None, on_progress=None, rows: int = 1):
        """Append ``ids [1, n]`` to ``cache`` (this rank's shard of a document,
        ``paged_shard.PagedShard``; global positions after the tokens it holds: a whole document,
        a segment of it, or a question after it); returns the last position's logits ``[1, V]``
        on rank 0 (None elsewhere); on one rank, ``rows`` > 1 returns the last ``rows`` positions'
        ``[1, rows, V]`` (of the last segment; ``verify/fidelity.py``). ``on_progress(tokens_done,
        n)`` is called per layer on rank 0. Each segment is sharded as ``self.sharding`` says
        (prefill.py); with tokens already cached, its queries or the cache travel, whichever moves
        fewer bytes. ``self.segments`` records, per segment: tokens, cached tokens, the method, and
        this rank's attention FLOPs and bytes sent."""
        self.actx.cache = cache
        try:
            return self._prefill(cache, ids, piece, on_progress, rows)
        finally:
            self.actx.cache = None

    def _prefill(self, cache, ids, piece, on_progress, rows):
        from .prefill import plan, positions, shard, size

        B, n = ids.shape
        p, r = self.comm.world, self.comm.rank
        if rows > 1 and p > 1:
            raise ValueError("prefill returns more than the last position's logits on one rank only")
        if n < p:  # too short to give every sequence shard a piece: every rank runs all of it
            return self._prefill_replicated(cache, ids, on_progress)
        start = int(cache.counts[0].sum())
        counts = cache.counts[0].tolist()
        last_owner = 0
        logits = None
        L = cache.num_layers
        stats = self.comm.stats
        for s0, s1 in segments(n, p, piece):
            pieces = shard(start + s0, s1 - s0, p, balanced=self.sharding == "balanced")
            lens = [size(pc) for pc in pieces]
            cache_lens = list(counts)
            method, _ = plan(
                s1 - s0,
                sum(cache_lens),
                p=p,
                heads=self.q_heads,
                kv_heads=cache.kv_heads,
                head_dim=cache.head_dim,
                esize=cache.k[0].element_size(),
                window=self.window,
                quantized=cache.quant is not None,
            )
            if self.route and sum(cache_lens):
                method = self.route
            for i in range(p):
                counts[i] += lens[i]
            last = start + s1 - 1
            owner = next(i for i in range(p) if any(a <= last < b for a, b in pieces[i]))
            last_owner = owner
            self.actx.phase, self.actx.pieces, self.actx.cache_lens = "prefill", pieces, cache_lens
            self.actx.method = method
            if on_progress is not None:
                seg = s1 - s0
                self.actx.on_layer = lambda layer, s0=s0, seg=seg: on_progress(s0 + seg * (layer + 1) // L, n)
            was, stats.enabled = stats.enabled, True
            stats.reset()
            if lens[r]:  # a prompt shorter than p leaves a rank without tokens: nothing to attend
                pos = positions(pieces[r], self.device)
                self.actx.positions = pos
                mine = torch.cat([ids[:, a - start : b - start] for a, b in pieces[r] if b > a], dim=1)
                out = self._forward(
                    mine.to(self.device), pos[None].expand(B, -1), want_logits=(s1 == n and r == owner), rows=rows
                )
                if out is not None:
                    logits = out
            self.segments.append(
                {
                    "tokens": s1 - s0,
                    "cached": sum(cache_lens),
                    "method": method,
                    "sharding": self.sharding,
                    "flops": stats.flops,
                    "bytes": stats.bytes_sent,
                }
            )
            stats.reset()
            stats.enabled = was
        self.actx.on_layer = None
        self.actx.phase = "decode"
        cache.set_counts(counts)
        if p > 1 and last_owner != 0:  # rank 0 samples: it needs the last token's logits
            buf = logits if r == last_owner else torch.empty(B, self.vocab, device=self.device)
            logits = self.comm.broadcast(buf.contiguous(), src=last_owner)
        return logits if r == 0 else None

    def _prefill_replicated(self, cache, ids: torch.Tensor, on_progress=None):
        """Append ``ids [1, n]``, ``n`` shorter than the number of sequence shards (a short
        document, or a short question after one): every rank runs the model on all ``n`` tokens
        and attends them to its own shard; each token is kept by the rank holding the fewest
        tokens at that point, like a decode token (so shards stay within a token of each other),
        and each rank also attends the new tokens it keeps, causally; the partials merge like a
        step's (``comm.merge``, one per layer). No rank is left without work in a relay, and
        every shard is attended. Returns the last position's logits ``[1, V]`` on the cp group's
        rank 0."""
        B, n = ids.shape
        start = int(cache.counts[0].sum())
        positions = torch.arange(start, start + n)
        cache.begin_extend([0], positions[None])  # every rank places every token the same way
        pos = positions.to(self.device)
        stats = self.comm.stats
        was, stats.enabled = stats.enabled, True
        stats.reset()
        self.actx.phase, self.actx.positions = "replicated", pos
        if on_progress is not None:
            L = cache.num_layers
            self.actx.on_layer = lambda layer: on_progress(n * (layer + 1) // L, n)
        try:
            logits = self._forward(ids.to(self.device), pos[None].expand(B, -1), want_logits=self.comm.rank == 0)
        finally:
            self.actx.on_layer, self.actx.phase = None, "decode"
        cache.end_extend()
        self.segments.append(
            {
                "tokens": n,
                "cached": start,
                "method": "replicated",
                "sharding": "replicated",
                "flops": stats.flops,
                "bytes": stats.bytes_sent,
            }
        )
        stats.reset()
        stats.enabled = was
        return logits
