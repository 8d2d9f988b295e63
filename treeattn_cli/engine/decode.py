"""Prefill, then the token loop. Yields tokens; knows nothing of the terminal.

Every rank runs the same model on the same tokens: during prefill each on its piece of each
segment (ring attention across pieces, pass-Q attention to earlier segments), during decode
each on the new token (tree-merged attention over the sharded cache). Rank 0 samples and
broadcasts the token with the stop decision, so all ranks stay in lock step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from treeattn_kernels import gpu_route

from . import invariance
from .attention import AttentionContext
from . import host
from .graphs import StepGraphs
from .host import Staging
from .sampling import STOP_CODES, STOP_IDS, Sampling
from .speculate import Drafter, Speculation, emit_all

@dataclass
class Timings:
    start: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0


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
    """One rank's model, cache and communicator, driven through prefill and decode."""

    def __init__(self, model, actx: AttentionContext, *, vocab_size: int, cuda_graph: bool = False,
                 world=None, sharding: str = "balanced"):
        self.model = model
        self.base = getattr(model, model.base_model_prefix)  # the decoder without the LM head
        self.actx = actx
        self.comm = actx.comm  # the sequence shards (a cp group of the mesh)
        self.world = world or actx.comm  # every rank: rank 0's sampled token goes to all
        self.cache = actx.cache
        self.vocab = vocab_size
        self.device = actx.cache.device
        # CUDA graph of the decode step: needs a static cache (fixed shapes) and NCCL
        self.use_graph = cuda_graph and self.device.type == "cuda" and self.cache.static
        # decode steps merge as captured ones do (a step that cites runs eagerly with the same numbers)
        actx.eager = not self.use_graph
        # the step's graphs, by the cache and capacity they replay into (graphs.StepGraphs)
        self.graphs = StepGraphs(self.device, self.world, what="decode step", limit=2)
        # a speculative step's graphs, one per number of rows (the last token and its drafts)
        self.verify_graphs = StepGraphs(self.device, self.world, what="verify step", limit=16)
        self._note = None
        self.staging = Staging(self.device)  # a step's inputs, in one copy
        if self.use_graph and not graph_capture_ok(self.comm):
            self.use_graph, actx.eager = False, True
            self._note = (f"CUDA graphs need torch >= {P2P_CAPTURE_TORCH} to capture the point-to-point "
                          f"sends of the {self.comm.scheme} merge (this is torch {torch.__version__}): "
                          "decoding eagerly")
        self.sharding = sharding  # of prefill segments: "balanced" or "contiguous" (prefill.py)
        self.route = None  # force "pass-q" or "pass-kv" for segments after a cache (tests); None: plan
        self.segments: list[dict] = []  # what each prefill segment did (Decoder.prefill)
        cfg = getattr(model.config, "text_config", None) or model.config
        group = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.q_heads = self.cache.kv_heads * group  # query heads this rank attends with
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

    @property
    def total(self) -> int:
        """Tokens in the cache over all ranks (host bookkeeping, the same on every rank)."""
        return int(self.cache.counts[0].sum())

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, piece: int | None = None, on_progress=None, rows: int = 1):
        """Append ``ids [B, n]`` to the cache (global positions after the tokens it holds: the
        whole prompt, or a question after a cached document); returns the last position's
        logits ``[B, V]`` on rank 0 (None elsewhere); on one rank, ``rows`` > 1 returns the last
        ``rows`` positions' ``[B, rows, V]`` (of the last segment; ``verify/fidelity.py``). ``on_progress(tokens_done, n)`` is called
        per layer on rank 0. Each segment is sharded as ``self.sharding`` says (prefill.py);
        with tokens already cached, its queries or the cache travel, whichever moves fewer
        bytes. ``self.segments`` records, per segment: tokens, cached tokens, the method, and
        this rank's attention FLOPs and bytes sent."""
        from .prefill import plan, positions, shard, size

        B, n = ids.shape
        p, r = self.comm.world, self.comm.rank
        if rows > 1 and p > 1:
            raise ValueError("prefill returns more than the last position's logits on one rank only")
        if n < p:  # too short to give every sequence shard a piece: every rank runs all of it
            return self._prefill_replicated(ids, on_progress)
        start = self.total
        counts = self.cache.counts[0].tolist()
        last_owner = 0
        logits = None
        L = self.cache.num_layers
        stats = self.comm.stats
        for s0, s1 in segments(n, p, piece):
            pieces = shard(start + s0, s1 - s0, p, balanced=self.sharding == "balanced")
            lens = [size(pc) for pc in pieces]
            cache_lens = list(counts)
            method, _ = plan(s1 - s0, sum(cache_lens), p=p, heads=self.q_heads, kv_heads=self.cache.kv_heads,
                             head_dim=self.cache.head_dim, esize=self.cache.k[0].element_size()
                             if self.cache.k else 4, window=self.window, quantized=self.cache.quant is not None)
            if self.route and sum(cache_lens):
                method = self.route
            for i in range(p):
                counts[i] += lens[i]
            self.cache.reserve(max(counts))  # the same on every rank (see cache.py)
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
                mine = torch.cat([ids[:, a - start:b - start] for a, b in pieces[r] if b > a], dim=1)
                out = self._forward(mine.to(self.device), pos[None].expand(B, -1),
                                    want_logits=(s1 == n and r == owner), rows=rows)
                if out is not None:
                    logits = out
            self.segments.append({"tokens": s1 - s0, "cached": sum(cache_lens), "method": method,
                                  "sharding": self.sharding, "flops": stats.flops, "bytes": stats.bytes_sent})
            stats.reset()
            stats.enabled = was
        self.actx.on_layer = None
        self.actx.phase = "decode"
        self.cache.set_counts(counts)
        if p > 1 and last_owner != 0:  # rank 0 samples: it needs the last token's logits
            buf = logits if r == last_owner else torch.empty(B, self.vocab, device=self.device)
            logits = self.comm.broadcast(buf.contiguous(), src=last_owner)
        return logits if r == 0 else None

    def _prefill_replicated(self, ids: torch.Tensor, on_progress=None, rows: int = 1, record: bool = True):
        """Append ``ids [1, n]``, ``n`` shorter than the number of sequence shards (a short
        question after a cached document) or a speculative step's rows: every rank runs the
        model on all ``n`` tokens, as in a decode step with ``n`` query rows, and attends them to
        its own shard; each token is kept by the rank holding the fewest tokens at that point,
        like a decode token (so shards stay within a token of each other), and each rank also
        attends the new tokens it keeps, causally; the partials merge like a decode step's
        (``comm.merge``, one per layer). No rank is left without work in a relay, and every
        shard is attended. Returns the last position's logits ``[1, V]`` (the last ``rows``
        positions', ``[1, rows, V]``) on the cp group's rank 0."""
        B, n = ids.shape
        start = self.total
        positions = torch.arange(start, start + n)
        self.cache.begin_extend([0], positions[None])  # every rank places every token the same way
        pos = positions.to(self.device)
        stats = self.comm.stats
        was, stats.enabled = stats.enabled, True
        stats.reset()
        self.actx.phase, self.actx.positions = "replicated", pos
        if on_progress is not None:
            L = self.cache.num_layers
            self.actx.on_layer = lambda layer: on_progress(n * (layer + 1) // L, n)
        try:
            logits = self._forward(ids.to(self.device), pos[None].expand(B, -1), want_logits=self.comm.rank == 0,
                                   rows=rows)
        finally:
            self.actx.on_layer, self.actx.phase = None, "decode"
        self.cache.end_extend()
        if record:
            self.segments.append({"tokens": n, "cached": start, "method": "replicated", "sharding": "replicated",
                                  "flops": stats.flops, "bytes": stats.bytes_sent})
        stats.reset()
        stats.enabled = was
        return logits

    @torch.inference_mode()
    def verify(self, tokens: list[int]):
        """A speculative step: the last emitted token and its drafts, fed together after what
        the cache holds (``len(tokens)`` query rows, causal among themselves, against every
        shard); their logits ``[len(tokens), V]`` on the cp group's rank 0. The rows not kept
        are dropped with :meth:`keep_verified`."""
        if self.use_graph and self.verify_graphs.on and self.actx.cite is None and \
                gpu_route(self.q_heads // self.cache.kv_heads, len(tokens)) == "triton":  # (ATen's reads lengths)
            return self._verify_captured(tokens)
        logits = self._prefill_replicated(torch.tensor([tokens]), rows=len(tokens), record=False)
        return logits[0] if logits is not None else None

    def _verify_captured(self, tokens: list[int]):
        """:meth:`verify` replayed from a CUDA graph (one per number of rows): the tokens placed
        on the ranks as an extension is (host), then the fixed-shape step (``attention``'s
        ``verify`` phase: every token written, here or to the write-off slot; one call over the
        capacity-long view) from the graph's copies of its inputs (tokens, positions, slots, the
        keys this rank attends), sent in one copy."""
        T, start = len(tokens), self.total
        self.cache.begin_extend([0], torch.arange(start, start + T)[None])  # host: who keeps each token
        slots = self.cache.extension_slots(0, T)
        kept = self.cache.extended_lengths()[0]  # its keys with the ones it keeps
        inputs = self.staging.send([tokens], list(range(start, start + T)), slots, [kept])
        want = self.comm.rank == 0

        def forward(ids, pos, sl, kv_len, eager=False):
            actx = self.actx
            actx.phase, actx.positions, actx.ext = "verify", pos, (sl, kv_len)
            was, actx.eager = actx.eager, eager
            try:
                return self._forward(ids, pos[None], want_logits=want, rows=T)
            finally:
                actx.phase, actx.ext, actx.eager = "decode", None, was

        logits = self.verify_graphs.run((self.cache.serial, self.cache.capacity), inputs, forward,
                                        lambda: forward(*inputs, eager=True))
        self.cache.end_extend()
        return logits[0] if logits is not None else None

    @torch.inference_mode()
    def keep_verified(self, n: int) -> None:
        """Keep only the first ``n`` tokens the latest :meth:`verify` appended (lengths only)."""
        self.cache.truncate_extension(0, keep=n)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, position: int):
        """One decode step for ``tokens [B]`` at global ``position``; logits ``[B, V]`` on rank 0.
        What the device needs from the host (the tokens, where they are kept, the position) goes
        in one copy (``host.Staging``)."""
        B = tokens.shape[0]
        store = self.cache.plan_step()
        tok, st, ps = self.staging.send(tokens, store.to(torch.int64), [position] * B)
        self.cache.start_step(store, st, ps)
        tok, ps = tok[:, None], ps[:, None]  # [B, 1]
        want = self.comm.rank == 0
        if self.use_graph and self.actx.cite is None:  # an answer that cites runs eagerly (its sums are Python's)
            logits = self._graph_step(tok, ps, want)
        else:
            logits = self._forward(tok, ps, want_logits=want)
        self.cache.end_step()
        return logits

    @property
    def graph(self):
        """The step's graphs, when one was captured (else None)."""
        return self.graphs if self.graphs.held else None

    @property
    def captures(self) -> int:  # graphs captured (again after a document switch or growth)
        return self.graphs.captures

    @property
    def replays(self) -> int:
        return self.graphs.replays

    @property
    def graph_note(self) -> str | None:
        return self._note or self.graphs.note or self.verify_graphs.note

    def _graph_step(self, tok, pos, want: bool):
        """The step replayed from its CUDA graph (``graphs.StepGraphs``: captured on first use,
        and again for another cache or a grown one, whose buffers it would otherwise miss).
        Every rank captures on the same step (capacities grow together, see cache.py). If any
        rank's capture fails, every rank decodes eagerly from then on, with a note."""

        def eager():
            self.use_graph, self.actx.eager = False, True
            return self._forward(tok, pos, want_logits=want)

        return self.graphs.run((self.cache.serial, self.cache.capacity), [tok, pos],
                               lambda t, p: self._forward(t, p, want_logits=want), eager)

    def decode(self, logits, *, max_new_tokens: int, sampling: Sampling, stop_check=None,
               interrupted=None, timings=None, speculation=None, context=None, logprobs=None, on_logprobs=None,
               cite=None):
        """Yield ``(token_id, stop_reason)`` pairs (batch 1) from the logits of the last token in
        the cache; the last pair's reason is not None. The last token is sampled but not fed
        to the model (the cache holds everything before it).

        On rank 0 only: ``stop_check(ids_so_far) -> reason | None`` (EOS, stop strings) and
        ``interrupted() -> bool`` (Ctrl-C in chat: reason ``"interrupted"``); rank 0's decision
        travels with the token, so every rank stops on the same step.

        ``speculation`` (``speculate.Speculation``, default off) with ``context`` (the tokens in
        the cache, or a ``speculate.Drafter`` over them; rank 0): each step may feed drafts from
        the context after the last token and
        emit several tokens (``speculate.accept``); rank 0 sends the step's tokens, the stop
        decision and the next drafts in one broadcast, and every rank drops the rejected
        drafts' K/V (lengths only).

        ``logprobs`` (rank 0): each emitted token's logprob and this many alternatives, handed to
        ``on_logprobs(records)`` (``sampling.token_logprobs``'s records) with the step's tokens.
        The step's tokens are read from the device once (``speculate.emit_all``); the other ranks
        read the step's message once.

        ``cite`` (a ``cite.Citation``, on every rank): each forward's rows measure their
        attention over the document's spans, and the rows of the tokens kept count; the decode
        step then runs eagerly (a CUDA graph would replay without the sums).
        """
        t = timings or Timings()
        spec = speculation or Speculation()
        r = self.world.rank
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed) if r == 0 else None
        drafter = None
        if r == 0 and spec.mode != "off":
            drafter = context if isinstance(context, Drafter) else Drafter(context or [])
        n = self.total
        out: list[int] = []
        kmax = max(spec.k, 1)
        msg = torch.zeros(3 + 2 * (kmax + 1), dtype=torch.int64, device=self.device)
        drafts: list[int] = []  # fed after the last token in the latest forward
        t_first = t_step = None  # t_step: when the latest forward began (rank 0 prices drafts with its time)
        while True:
            if r == 0:  # the step's tokens (several when drafts were accepted), the stop, the next drafts
                (emitted, lps), = emit_all([logits.reshape(-1, logits.shape[-1])], [drafts], [sampling], [gen],
                                          [logprobs])  # the step's one read
                spec.observe(len(drafts), len(emitted) - 1,  # the forward's time: ends once its logits are read
                             time.perf_counter() - t_step if t_step is not None else None)
                final, reason = [], None
                for tok in emitted:
                    out.append(tok)
                    final.append(tok)
                    reason = stop_check(out) if stop_check else None
                    if reason is None and interrupted is not None and interrupted():
                        reason = "interrupted"
                    if reason is None and len(out) == max_new_tokens:
                        reason = "length"
                    if reason is not None:
                        break
                if on_logprobs is not None:
                    on_logprobs(lps[:len(final)])
                nxt = []
                if reason is None and drafter is not None:
                    drafter.extend(final)
                    nxt = drafter.draft(min(spec.want(), max_new_tokens - len(out) - 1, kmax))
                row = [0] * msg.shape[0]
                row[0], row[1], row[2] = len(final), STOP_IDS[reason], len(nxt)
                row[3:3 + len(final)] = final
                row[3 + kmax + 1:3 + kmax + 1 + len(nxt)] = nxt
                msg = self.staging.send(row)[0]  # one copy to the device, nothing waits
            self.world.broadcast(msg, src=0)
            if r != 0:
                row = host.read(msg)  # the step's one read on this rank
            head = row[:3]
            final = row[3:3 + head[0]]
            reason = STOP_CODES[head[1]]
            nxt = row[3 + kmax + 1:3 + kmax + 1 + head[2]]
            if drafts:  # the verify fed the last token and its drafts: keep what was emitted, minus the last
                self.keep_verified(len(final))
            if cite is not None:  # the rows of the tokens emitted (none before the first forward)
                cite.keep(len(final))
            if t_first is None:
                t_first = time.perf_counter()
                t.ttft_s = t_first - t.start
            if r != 0:
                out += final
            for i, tok in enumerate(final):
                yield tok, reason if i == len(final) - 1 else None
            if reason is not None:
                break
            pos = n + len(out) - 1  # where the last emitted token goes
            t_step = time.perf_counter()
            if cite is not None:
                cite.begin(1 + len(nxt))
            self.actx.cite = cite
            try:
                logits = self.verify([final[-1]] + nxt) if nxt else self.step(torch.tensor([final[-1]]), pos)
            finally:
                self.actx.cite = None
            drafts = nxt
        t.decode_s = time.perf_counter() - (t_first or time.perf_counter())

    def generate(self, ids: torch.Tensor, *, max_new_tokens: int, sampling: Sampling,
                 stop_check=None, piece: int | None = None, on_progress=None, timings=None):
        """Prefill ``ids`` (after whatever the cache holds), then :meth:`decode`."""
        t = timings or Timings()
        logits = self.prefill(ids, piece, on_progress)
        if self.device.type == "cuda":  # one rank has no broadcast to wait for the prefill
            torch.cuda.synchronize(self.device)
        t.prefill_s = time.perf_counter() - t.start
        yield from self.decode(logits, max_new_tokens=max_new_tokens, sampling=sampling,
                               stop_check=stop_check, timings=t)
