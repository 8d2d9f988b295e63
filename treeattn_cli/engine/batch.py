"""Many questions about one document at once: continuous batching over the shared, sharded
document (docs/architecture.md §11; cascade attention).

The document stays in its cache, one shard per rank, and is never copied per question. Each
question lives in a slot of a second cache, the *tail* (batch = slots): its own tokens, spread
over the ranks like decode tokens. Once the rank has a block pool, the tail's keys and values
live there too (``paged_tail.PagedTail``): a question takes a slot only when every rank has the
blocks its question and answer can take (documents nobody answers over leave to make room;
else it waits for the answers under way, and a question that can never fit ends ``no_room``),
and gives them back when its answer ends. Per step every rank runs the model on one
token of every busy slot; per layer its attention reads its document shard once for all of
them (the slots' queries are rows of one kernel call) and each slot's tail rows, merges the two
partials by LSE, and one merge across the ranks serves the whole batch (``attention._cascade``).

A question enters a free slot with a prefill of all its tokens at once (every new question of
that moment together, left-padded to one length); when its answer ends, the next question
takes the slot. Rank 0 samples every slot with the slot's own generator (each answer starts
from the seed, as one alone would), decides stops per slot, and broadcasts the step's tokens
and decisions, so all ranks follow the same schedule. Answers are exactly those of each
question alone after the document.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from treeattn_kernels import gpu_path

from .cache import ShardedKVCache
from .paged_tail import PagedTail, most_here
from . import host
from .graphs import StepGraphs
from .host import Staging
from .sampling import STOP_CODES, STOP_IDS, Sampling, digests

_IDLE = -1  # a slot with nothing to report this round
_ALL_STOPPED = -2  # the launcher interrupted the batch
KMAX = 64  # the most drafts a step may carry per slot (speculate.parse's bound)
WIDTH = 3 + 2 * (KMAX + 1)  # per slot: tokens out, stop code, drafts, the tokens, the next drafts


@dataclass
class Question:
    """One question of a batch: its tokens and how to answer it (rank 0 holds ``stop_check``)."""

    ids: list
    max_new_tokens: int
    sampling: Sampling
    speculate: str = "off"
    stop_check: object = None
    logprobs: int | None = None  # report each token's logprob and this many top alternatives (rank 0)
    doc: object = None  # documents.Document it continues (resident, or pending a prefill)
    source: str = "memory"  # how its document became resident when it asked: memory, disk, prefill
    doc_spec: dict | None = None  # what documents.Documents.get takes to make its document resident again
    pools: list | None = None  # every rank's pool [(used, total) blocks] when it began (serve's metrics)
    cite: dict | None = None  # the request's citation spec (engine.Engine.citation): the answer carries ``cite``
    keep: bool | str = False  # the question and its answer become part of its document (chat --conversation);
    # "question": the question alone (generate --load-kv --save-kv)
    digest: bool = False  # report a digest of the logits each token was chosen from (rank 0; sampling.digests)


@dataclass
class _Slot:
    question: int  # index into the batch's questions
    prompt: int  # tokens of the question
    gen: object  # rank 0: the slot's sampling generator
    t_start: float  # when the question entered its slot
    t_batch: float  # when the batch began (time to first token counts from there)
    prefill_s: float = 0.0
    tokens: list = field(default_factory=list)
    t_first: float | None = None
    t_last: float | None = None
    spec: object = None  # rank 0: the answer's speculation policy and counts (speculate.Speculation)
    drafter: object = None  # rank 0: its n-gram drafter over the document, the question and the answer
    cancelled: bool = False
    logprobs: list = field(default_factory=list)  # rank 0: sampling.token_logprobs of each token, when asked
    digests: list = field(default_factory=list)  # rank 0: sampling.digests of each token's logits, when asked
    doc: object = None  # the question's documents.Document
    doc_tokens: int = 0  # its tokens: the question's first position
    started: bool = True  # took a slot (False: cancelled before it began)
    fed: int = 0  # of the question's tokens, those in the tail (its prefill goes a chunk per round)
    citation: object = None  # cite.Citation of an answer that cites (every rank)
    row: int = -1  # its slot: its row of the tail


class BatchDecoder:
    """Continuous batching of questions after their documents, ``slots`` at a time."""

    def __init__(self, dec, slots: int, capacity: int, pool=None):
        self.dec = dec
        self.slots = slots
        doc = dec.cache  # the shapes and storage every document's cache shares
        # the step's CUDA graphs (graphs.StepGraphs), by the documents its rows read and how
        # (the tail then has fixed-shape views, as the single step's cache does)
        self.graphs = StepGraphs(doc.device, dec.world, what="batched decode step") if dec.use_graph else None
        # its verifies' (every slot's last token and drafts, padded to a power of two of rows)
        self.verify_graphs = StepGraphs(doc.device, dec.world, what="batched verify step") \
            if dec.use_graph else None
        self.tail: ShardedKVCache | None = None
        self.staging = Staging(doc.device)  # a forward's inputs, in one copy
        self.runs = 0  # batches run (the engine keeps one decoder: later batches reuse tail and graphs)
        self.prepare(capacity, pool)

    def prepare(self, capacity: int, pool=None) -> None:
        """Ready for a batch whose questions and answers take up to ``capacity`` tokens each: the
        tail lives in the rank's block pool when there is one (``paged_tail.PagedTail``: each
        question's blocks taken as it is admitted to a slot), else in a dense cache of its own;
        it grows when it must (a static tail's graphs are then captured again: they are keyed by
        its serial and capacity), the per-batch counts start from zero. The tail's rows are emptied
        as questions take slots, so what an earlier batch left there is never read."""
        doc, cp = self.dec.cache, self.dec.comm.world
        width = -(-capacity // cp) + 2
        static = self.graphs is not None or doc.static  # (the engine's: job.static)
        if isinstance(self.tail, PagedTail):
            self.tail.release_all()  # (a batch that failed may have left some)
            if self.tail.pool is not pool:
                self.tail = None
        if self.tail is None or (pool is not None) != isinstance(self.tail, PagedTail):
            if pool is not None:
                self.tail = PagedTail(pool, self.slots, rank=doc.rank, world=doc.world, capacity=width, static=static)
            else:
                self.tail = ShardedKVCache(doc.num_layers, self.slots, doc.kv_heads, doc.head_dim, dtype=doc.dtype,
                                           device=doc.device, rank=doc.rank, world=doc.world, capacity=width,
                                           quant=doc.quant, static=static)  # stored like the document
        self.tail.reserve(width)
        self.documents_per_step = 0  # the most documents one forward read (rows of several: a mixed step)
        self.tail_waits = 0  # rounds a question waited for its tail's blocks (answers under way held the pool)
        self.segments_while_decoding = 0  # document prefill segments run while answers were under way
        self.question_chunks = 0  # chunks of questions prefilled (a question over ``budget`` tokens: several)
        self.chunks_while_decoding = 0  # rounds of question chunks run while answers were under way
        self.counts_at_start = {g: (sg.captures, sg.replays) for g, sg in
                                (("plain", self.graphs), ("verify", self.verify_graphs)) if sg is not None}

    def graph_counts(self) -> dict:
        """This batch's graph captures and replays (the decoder's graphs outlive a batch)."""
        out = {"graph_captures": 0, "graph_replays": 0, "verify_graph_replays": 0, "graph_note": None}
        if self.graphs is None:
            return out
        c0, r0 = self.counts_at_start["plain"]
        out.update(graph_captures=self.graphs.captures - c0, graph_replays=self.graphs.replays - r0,
                   verify_graph_replays=self.verify_graphs.replays - self.counts_at_start["verify"][1],
                   graph_note=self.graphs.note or self.verify_graphs.note)
        return out

    @torch.inference_mode()
    def run(self, questions: list[Question], *, drafter=None, interrupted=None, feed=None, make_question=None,
            on_token=None, on_answer=None, documents=None, on_doc=None, budget: int | None = None,
            citation=None, news_flag=None) -> list[dict]:
        """Answer every question; returns (on every rank) one summary per question, in order.

        Rank 0 only: each question's ``stop_check(ids) -> reason | None``; ``interrupted() ->
        bool`` (Ctrl-C: every answer ends); ``feed() -> (new questions, cancelled indices)``
        polled when ``news_flag() -> int`` (one look at the launcher's store a step) changes, or
        each step without it (questions that join, as raw requests ``make_question`` turns into
        :class:`Question` on every rank; answers to cancel); ``on_token(question, token)``;
        ``on_answer(question, summary)`` as each answer ends; ``on_doc(question, Question)`` as a
        question takes a slot (its document resident); ``drafter(document, question tokens) ->
        speculate.Drafter`` over the document and the question, for questions that speculate:
        each slot then drafts, and accepts, on its own (a step with drafts feeds every busy
        slot's last token and drafts as one extension of the tail). ``budget``: question tokens
        prefilled per round (None: every new question whole): a long question goes in chunks
        of ``budget`` tokens, one round each, between the steps of the answers under way
        (:meth:`_fill`), as a document goes a segment per round. ``citation(spec) ->
        cite.Citation`` (every rank): for questions with a ``cite`` spec, the rows of their answer's
        tokens measure their attention over their document's spans (the summary's ``cite``).

        Each question continues its own document (``Question.doc``); rows of different
        documents share the step (``attention._cascade`` reads each document once for its rows,
        and one merge across the ranks serves them all). A question waits in the queue until its
        document is resident: each round prefills one segment of the first pending document a
        queued question needs (``documents.Documents.advance``), and questions whose documents
        are ready take free slots in their order, so a new document neither stalls the answers
        under way for longer than a segment nor holds back questions behind it."""
        from .speculate import Speculation, StepCost, emit_all

        dec, S = self.dec, self.slots
        lead = dec.world.rank == 0
        queue = deque(range(len(questions)))
        slots: list[_Slot | None] = [None] * S
        rows: list = [None] * S  # rank 0: each ready slot's logits of its fed rows [k + 1, V]
        drafts: list[list[int]] = [[] for _ in range(S)]  # fed after each slot's last token, latest forward
        ready = [False] * S
        out: list[dict | None] = [None] * len(questions)
        cancelled: set = set()
        t0 = time.perf_counter()
        t_step = None  # when the latest step's forward began (its time ends once its tokens are read)
        clean = False  # nothing else ran on the device between that forward and the read of its tokens
        cost = StepCost()  # what the batch's forwards cost, by draft rows: one for every slot
        msg = torch.zeros(S + 1, WIDTH, dtype=torch.int64, device=dec.device)
        seen_news, stop_all = -1, False  # rank 0: the launcher's news counter as last read
        filling: list[int] = []  # slots whose question is not all in the tail yet, in the order they began

        def finish(s: _Slot, reason):
            q = questions[s.question]
            kept = None
            if q.keep and documents is not None:  # what the tail holds of it joins its document
                kept = s.fed > 0 and documents.keep(q.doc, self.tail, s.row, list(q.ids) + list(s.tokens),
                                                    upto=len(q.ids) if q.keep == "question" else None)
            if documents is not None:
                documents.release(q.doc, running=s.started)
            if s.started and isinstance(self.tail, PagedTail):  # its blocks back to the pool
                self.tail.release(s.row)
            out[s.question] = self._summary(s, reason)
            if kept is not None:
                out[s.question]["kept"] = kept
            if questions[s.question].cite and citation is not None:  # every rank, at the same answer's end
                c = s.citation or citation(questions[s.question].cite)
                out[s.question]["cite"] = c.gather(dec.world)
            if lead and on_answer is not None:
                lp = {"logprobs": s.logprobs} if questions[s.question].logprobs is not None else {}
                if questions[s.question].digest:
                    lp["digests"] = s.digests
                on_answer(s.question, {**out[s.question], "token_ids": list(s.tokens), **lp})

        while True:
            for qi in queue:  # a queued question's document left memory (the pool needed room): ask again
                q = questions[qi]
                if q.doc.evicted and documents is not None:
                    documents.release(q.doc)
                    q.doc = documents.get(q.doc_spec)
                    documents.use(q.doc)
                    q.source = q.doc.source
            pending = next((questions[qi].doc for qi in queue if questions[qi].doc.waiting), None)
            blocked = False  # the pool has no room for it while other documents are in use
            if pending is not None:  # one segment of the first document a queued question waits for
                clean = False
                blocked = not documents.advance(pending)
                self.segments_while_decoding += any(slots) and not blocked
                if blocked and not any(slots):  # nothing will end to make room (pinned documents hold the
                    for qi in [qi for qi in queue if questions[qi].doc is pending]:  # rest): its questions end
                        queue.remove(qi)  # here, answered empty ("no_room"); the others go on
                        q = questions[qi]
                        finish(_Slot(qi, len(q.ids), None, time.perf_counter(), t0, doc=q.doc, started=False),
                               "no_room")
                    documents.abandon(pending)
                    blocked = False
            free = [b for b in range(S) if slots[b] is None]
            new, began, doc_only = [], [], []
            for qi in list(queue):
                q = questions[qi]
                if q.max_new_tokens == 0 and (q.doc.ready or q.doc_spec is None):  # a document's own request
                    queue.remove(qi)  # (documents API): nothing to answer, no slot; its document now resident
                    if documents is not None and q.doc_spec is not None:
                        documents.settle(q.doc, q.doc_spec)
                    began.append(qi)
                    doc_only.append(qi)
                    continue
                if not free:
                    break
                if not q.doc.ready:  # later questions go first, unless this one waits for blocks:
                    if blocked:  # then nothing behind it starts (the documents in use finish, it gets room)
                        break
                    continue
                room = self._admit(free[0], q, documents, busy=any(slots) or bool(filling))
                if room is None:  # its tail can never fit: nothing running holds blocks it could wait for
                    queue.remove(qi)
                    finish(_Slot(qi, len(q.ids), None, time.perf_counter(), t0, doc=q.doc, started=False), "no_room")
                    continue
                if not room:  # it waits for the answers under way to give blocks back; nothing behind it starts
                    self.tail_waits += 1
                    break
                queue.remove(qi)
                b = free.pop(0)
                slots[b] = _Slot(qi, len(q.ids), torch.Generator(device=dec.device).manual_seed(q.sampling.seed)
                                 if lead else None, time.perf_counter(), t0, doc=q.doc, doc_tokens=q.doc.tokens,
                                 citation=citation(q.cite) if q.cite and citation is not None else None, row=b)
                if documents is not None:
                    documents.start(q.doc)
                if lead:
                    slots[b].spec = Speculation.for_answer(q.speculate, q.sampling, cost)
                    slots[b].drafter = drafter(q.doc, q.ids) if drafter and slots[b].spec.mode != "off" else None
                began.append(qi)
                new.append(b)
            if began:  # each rank's pool as the questions begin (every rank gathers: the same questions)
                pools = documents.pools() if documents is not None else None
                for qi in began:
                    questions[qi].pools = pools
                    if lead and on_doc is not None:
                        on_doc(qi, questions[qi])
                for qi in doc_only:
                    q = questions[qi]
                    finish(_Slot(qi, 0, None, time.perf_counter(), t0, doc=q.doc, doc_tokens=q.doc.tokens,
                                 started=False), "document")
            for b in [b for b in new if not questions[slots[b].question].ids]:  # no tokens of its own: it
                new.remove(b)  # answers from its document's last logits (generate: the prompt is the document)
                doc = slots[b].doc
                if not doc.has_logits:
                    raise RuntimeError("a question with no tokens needs its document prefilled here with "
                                       "last_logits")
                self.tail.reset_rows([b], [doc.cache.counts[0]])
                rows[b] = doc.logits if lead else None
                ready[b], drafts[b] = True, []
            filling += new
            for b in [b for b in filling if slots[b].question in cancelled]:  # cancelled in its prefill
                filling.remove(b)
                finish(slots[b], "cancelled")
                slots[b] = None
            if filling:
                clean = False
                self.chunks_while_decoding += any(slots[b] is not None and b not in filling for b in range(S))
                for b, lg in self._fill([(b, slots[b]) for b in filling], questions, budget):
                    filling.remove(b)
                    slots[b].prefill_s = time.perf_counter() - slots[b].t_start
                    rows[b] = lg if lead else None
                    ready[b], drafts[b] = True, []
            if not any(slots) and not queue:
                break
            if lead:  # every ready slot's tokens (several when drafts were accepted), stop, next drafts
                ready_b = [b for b in range(S) if ready[b]]
                qs_b = [questions[slots[b].question] for b in ready_b]
                picks = emit_all([rows[b] for b in ready_b], [drafts[b] for b in ready_b], [q.sampling for q in qs_b],
                                 [slots[b].gen for b in ready_b], [q.logprobs for q in qs_b])  # the step's one read
                if t_step is not None and clean and picks:  # the latest forward, with every slot's drafts in it
                    cost.observe(sum(len(drafts[b]) for b in ready_b), time.perf_counter() - t_step)
                news = ([], [])
                if news_flag is None or (n := news_flag()) != seen_news:  # the launcher posted something
                    seen_news = seen_news if news_flag is None else n
                    stop_all = interrupted is not None and interrupted()
                    news = feed() if feed is not None else ([], [])
                table = [[0] * WIDTH for _ in range(S + 1)]
                n_ready = len(ready_b)
                for b, q, (emitted, lps) in zip(ready_b, qs_b, picks):
                    s = slots[b]
                    s.spec.observe(len(drafts[b]), len(emitted) - 1)
                    final, reason = [], None
                    for tok in emitted:
                        s.tokens.append(tok)
                        final.append(tok)
                        reason = q.stop_check(s.tokens) if q.stop_check else None
                        if reason is None and stop_all:
                            reason = "interrupted"
                        if reason is None and s.question in cancelled | set(news[1]):
                            reason = "cancelled"
                        if reason is None and len(s.tokens) == q.max_new_tokens:
                            reason = "length"
                        if reason is not None:
                            break
                    if q.logprobs is not None:
                        s.logprobs += lps[:len(final)]
                    if q.digest:  # the bits each token was chosen from (the oracle of issue 49)
                        s.digests += digests(rows[b], len(final))
                    nxt = []
                    if reason is None and s.drafter is not None:
                        s.drafter.extend(final)
                        nxt = s.drafter.draft(min(s.spec.want(n_ready), q.max_new_tokens - len(s.tokens) - 1, KMAX))
                    row = table[b]
                    row[0], row[1], row[2] = len(final), STOP_IDS[reason], len(nxt)
                    row[3:3 + len(final)] = final
                    row[4 + KMAX:4 + KMAX + len(nxt)] = nxt
                table[S][0] = _ALL_STOPPED if stop_all else 0
                table[S][1] = 1 if news[0] or news[1] else 0
                msg = self.staging.send(table)[0]  # one copy to the device, nothing waits
            dec.world.broadcast(msg, src=0)
            if not lead:
                table = host.read(msg)  # the step's one read on this rank
            if table[S][1]:  # questions joined or were cancelled: every rank learns them
                joined, gone = dec.world.broadcast_object(news if lead else None, src=0)
                questions += [make_question(q) for q in joined]
                out += [None] * len(joined)
                queue.extend(range(len(questions) - len(joined), len(questions)))
                cancelled |= set(gone)
                for qi in [qi for qi in queue if qi in cancelled]:  # not begun: answered empty
                    queue.remove(qi)
                    q = questions[qi]
                    finish(_Slot(qi, len(q.ids), None, time.perf_counter(), t0, doc=q.doc,
                                 doc_tokens=q.doc.tokens if q.doc.ready else 0, started=False), "cancelled")
            now = time.perf_counter()
            going = [False] * S
            nxt_all: list[list[int]] = [[] for _ in range(S)]
            for b in range(S):
                if not ready[b]:
                    continue
                s = slots[b]
                n_out, code, n_next = table[b][:3]
                final = table[b][3:3 + n_out]
                reason = STOP_CODES[code]
                if drafts[b]:  # the slot's last forward fed its token and drafts: keep what was emitted, less one
                    self.tail.truncate_extension(b, keep=n_out)
                if s.citation is not None:  # the rows of the tokens emitted (none after its question's prefill)
                    s.citation.keep(n_out)
                if not lead:
                    s.tokens += final
                s.t_first = s.t_first or now
                s.t_last = now
                if lead and on_token is not None:
                    for tok in final:
                        on_token(s.question, tok)
                if reason is None:
                    going[b] = True
                    nxt_all[b] = table[b][4 + KMAX:4 + KMAX + n_next]
                    continue
                finish(s, reason)
                slots[b] = None
            ready = [False] * S
            if table[S][0] == _ALL_STOPPED:  # Ctrl-C: the answers so far end; the rest are not started
                queue.clear()
                for b in range(S):
                    if slots[b] is not None:  # busy but not ready this round (or still prefilling): nothing pending
                        finish(slots[b], "interrupted")
                        slots[b] = None
                filling.clear()
                break
            t_step = None
            if any(going):
                busy = [b for b in range(S) if going[b]]
                t_step, clean = time.perf_counter(), True
                at = {b: slots[b].doc_tokens + slots[b].prompt + len(slots[b].tokens) - 1 for b in busy}  # last token's
                if any(nxt_all[b] for b in busy):  # drafts to verify: one extension of every busy slot
                    feeds = [[slots[b].tokens[-1]] + nxt_all[b] for b in busy]
                    lg = self._extend([(b, slots[b]) for b in busy], feeds, [at[b] for b in busy])
                    for i, b in enumerate(busy):
                        rows[b] = lg[i, :len(feeds[i])] if lead else None
                else:  # an idle slot's row is computed and dropped: with a busy slot's document and
                    # position, it widens no window's search and reads no other document
                    live = busy[0]
                    lg = self._step([slots[b].tokens[-1] if going[b] else 0 for b in range(S)],
                                    [at.get(b, at[live]) for b in range(S)], going,
                                    [slots[b if going[b] else live] for b in range(S)])
                    for b in busy:
                        rows[b] = lg[b:b + 1] if lead else None
                for b in busy:
                    ready[b], drafts[b] = True, nxt_all[b]
        return out

    def _admit(self, b: int, q: Question, documents, busy: bool) -> bool | None:
        """Slot ``b``'s blocks for question ``q`` (a pooled tail: the most tokens its question and
        answer can place on this rank, ``paged_tail.most_here``), evicting documents nobody answers
        over when the pool has not got them; the same answer on every rank: True (admitted), False
        (it waits: the answers under way, ``busy``, will give blocks back), None (nothing runs: it never
        fits)."""
        tail = self.tail
        if not isinstance(tail, PagedTail):
            return True
        world = self.dec.world
        need = tail.blocks_for(most_here(q.doc.cache.counts[0], len(q.ids) + q.max_new_tokens, tail.rank))
        ok = world.all_true(need <= tail.pool.available())
        if not ok and documents is not None:
            documents.make_room(keep=q.doc)
            ok = world.all_true(need <= tail.pool.available())
        if ok:
            tail.admit(b, need * tail.pool.page)
            return True
        return False if busy else None

    def _summary(self, s: _Slot, reason) -> dict:
        n = len(s.tokens)
        decode_s = (s.t_last - s.t_first) if n > 1 else 0.0
        return {"prompt_tokens": s.prompt, "context_tokens": s.doc_tokens + s.prompt, "new_tokens": n,
                "ttft_s": (s.t_first or s.t_start) - s.t_batch if n else None,  # (no token: none came first)
                "prefill_s": s.prefill_s,
                "prefill_tokens_per_s": s.prompt / s.prefill_s if s.prefill_s else None,
                "decode_tokens_per_s": (n - 1) / decode_s if decode_s else None,
                "stop_reason": reason, "prefill_method": "batched",
                "speculation": s.spec.record() if s.spec is not None else None}

    def _fill(self, slots: list, questions: list, budget: int | None) -> list:
        """This round's chunks of the questions entering the tail, ``slots`` (``(index, _Slot)``
        pairs in the order they began), in one forward (left-padded to the longest chunk, padding
        kept nowhere); returns ``(index, logits [1, V])`` of each slot whose question is now all
        in the tail. A question is cut in chunks of ``budget`` tokens from its start, whatever
        else the round holds (the same cuts when it is asked alone); the round takes chunks in
        order while they fit in ``budget`` tokens, and at least one."""
        chunks, left = [], budget
        for b, s in slots:
            ids = questions[s.question].ids
            n = len(ids) - s.fed if budget is None else min(len(ids) - s.fed, budget)
            if chunks and left is not None and n > left:
                break
            chunks.append((b, s, ids[s.fed:s.fed + n]))
            left = None if left is None else left - n
        self.question_chunks += len(chunks)
        rows = [b for b, _, _ in chunks]
        T = max(len(c) for _, _, c in chunks)
        ids = torch.zeros(len(rows), T, dtype=torch.int64)
        pos = torch.full((len(rows), T), -1, dtype=torch.int64)
        for i, (_, s, c) in enumerate(chunks):
            ids[i, T - len(c):] = torch.tensor(c)
            pos[i, T - len(c):] = torch.arange(s.doc_tokens + s.fed, s.doc_tokens + s.fed + len(c))
        new = [(b, s) for b, s, _ in chunks if s.fed == 0]
        self.tail.reset_rows([b for b, _ in new], [s.doc.cache.counts[0] for _, s in new])
        self.tail.begin_extend(rows, pos)
        lg = self._forward(ids, pos, rows, [s for _, s, _ in chunks], step=False, finish=self.tail.end_extend)
        done = []
        for i, (b, s, c) in enumerate(chunks):
            s.fed += len(c)
            if s.fed == s.prompt:
                done.append((b, lg[i:i + 1] if lg is not None else None))  # (logits: rank 0 only)
        return done

    def _extend(self, slots: list, feeds: list[list[int]], positions: list[int]):
        """Each of ``slots`` (``(index, _Slot)`` pairs) feeds its last token and its drafts
        (right-padded to the longest, padding kept nowhere): logits of every fed row,
        ``[len(slots), T, V]``."""
        if self.verify_graphs is not None and self.verify_graphs.on and not any(s.citation for _, s in slots):
            return self._extend_captured(slots, feeds, positions)
        rows = [b for b, _ in slots]
        T = max(len(f) for f in feeds)
        ids = torch.zeros(len(rows), T, dtype=torch.int64)
        pos = torch.full((len(rows), T), -1, dtype=torch.int64)
        for i, (f, p) in enumerate(zip(feeds, positions)):
            ids[i, :len(f)] = torch.tensor(f)
            pos[i, :len(f)] = torch.arange(p, p + len(f))
        self.tail.begin_extend(rows, pos)
        return self._forward(ids, pos, rows, [s for _, s in slots], step=False, finish=self.tail.end_extend, keep=T,
                             cites=[s.citation for _, s in slots])

    def _extend_captured(self, slots: list, feeds: list[list[int]], positions: list[int]):
        """:meth:`_extend` in the fixed shape a CUDA graph replays: every slot a row (an idle one
        all padding, written nowhere), the rows padded to a power of two, every token written
        (to its slot on the rank that keeps it, the write-off slot elsewhere), each row's keys
        counted on the device (``attention._cascade`` with ``ext``). Same return."""
        S = self.slots
        T = 1 << (max(len(f) for f in feeds) - 1).bit_length()
        ids = torch.zeros(S, T, dtype=torch.int64)
        pos = torch.full((S, T), -1, dtype=torch.int64)
        of = [slots[0][1]] * S  # an idle row reads a busy slot's document (and is dropped)
        for (b, s), f, p in zip(slots, feeds, positions):
            ids[b, :len(f)] = torch.tensor(f)
            pos[b, :len(f)] = torch.arange(p, p + len(f))
            of[b] = s
        self.tail.begin_extend(list(range(S)), pos)
        ext = ([self.tail.extension_slots(i, T) for i in range(S)], self.tail.extended_lengths())  # host numbers
        lg = self._forward(ids, pos, list(range(S)), of, step=False, finish=self.tail.end_extend, keep=T, ext=ext)
        return lg[[b for b, _ in slots]] if lg is not None else None

    def _step(self, tokens: list[int], positions: list[int], going: list[bool], of: list):
        """One token for every slot that goes on (the others are written off; ``of``: the slot
        whose document each row reads): logits ``[S, V]``."""
        store = self.tail.plan_step(active=going)  # host: where each slot's token is kept
        pos = torch.tensor(positions, dtype=torch.int64)[:, None]
        return self._forward(torch.tensor(tokens)[:, None], pos, list(range(self.slots)), of, step=True,
                             finish=self.tail.end_step, store=store,
                             cites=[s.citation if going[b] else None for b, s in enumerate(of)])

    def _forward(self, ids, pos, rows, of: list, *, step: bool, finish, keep: int = 1, cites=None, store=None,
                 ext=None):
        """The model on the tail ``rows`` (``ids, pos [R, T]``, host), row i continuing the
        document of slot ``of[i]``: its rows of each document are one group (``attention._cascade``).
        ``cites``: row i's ``cite.Citation`` where its tokens are an answer's that cites (a step
        or a verify), else None. ``store``: a step's (``ShardedKVCache.plan_step``). What the
        device needs from the host (tokens, positions, the groups' rows, where the step's tokens
        are kept, the documents' block tables) goes in one copy (``host.Staging``). ``ext``: a
        fixed-shape verify's (every token's slot ``[R][T]``, each row's keys ``[R]``:
        :meth:`_extend_captured`)."""
        from .attention import pooled_documents

        dec = self.dec
        actx = dec.actx
        groups: dict = {}
        for i, s in enumerate(of):
            groups.setdefault(id(s.doc), (s.doc.cache, []))[1].append(i)
        parts = [idx for _, idx in groups.values() if len(idx) != len(of)]
        first = torch.tensor([s.doc_tokens for s in of], dtype=torch.int64)[:, None]
        send = [ids, pos, torch.where(pos < 0, first, pos)]  # padding (-1) runs at its row's first position
        if store is not None:
            send += [store.to(torch.int64), pos[:, 0]]
        shards = [cache for cache, _ in groups.values()]
        paged = pooled_documents(shards)
        if paged:  # the documents' block tables, once for every layer of the forward
            width = 1 << (max([len(d.table.blocks) for d in shards] + [1]) - 1).bit_length()  # a power of two:
            # a captured step's tables keep their shape while documents of other lengths come and go
            send += [[d.table.blocks + [0] * (width - len(d.table.blocks)) for d in shards], [d.n for d in shards]]
        if ext is not None:
            send += [ext[0], ext[1]]
        sent = self.staging.send(*send, *parts)
        ids_d = sent[0]
        at = 3
        if store is not None:
            self.tail.start_step(store, sent[3], sent[4])
            at = 5
        inputs = sent[:3] + sent[at:]  # ids, positions, model positions, [tables, lengths], groups' rows
        specs = [(cache, idx) for cache, idx in groups.values()]  # host: each document and its rows
        self.documents_per_step = max(self.documents_per_step, len(groups))
        cited = bool(cites) and any(c is not None for c in cites)
        want = dec.comm.rank == 0

        def forward(ids_d, pos_d, mpos_d, *rest, eager=True):
            actx.paged = (rest[0], rest[1]) if paged else None
            rest = rest[2 if paged else 0:]
            actx.ext = (rest[0].reshape(-1), rest[1]) if ext is not None else None  # [R·T], [R]
            idx_d = iter(rest[2 if ext is not None else 0:])
            actx.groups = [(cache, None if len(idx) == len(of) else next(idx_d), idx) for cache, idx in specs]
            actx.phase, actx.tail, actx.rows, actx.step, actx.positions = "cascade", self.tail, rows, step, pos_d
            was, actx.eager = actx.eager, eager
            if cited:
                actx.cites = list(cites)
            try:  # padding is kept nowhere
                return dec._forward(ids_d, mpos_d, want_logits=want, rows=keep)
            finally:
                actx.phase, actx.tail, actx.groups, actx.cites, actx.paged = "decode", None, [], [], None
                actx.eager, actx.ext = was, None

        if cited:
            for c in cites:
                if c is not None:
                    c.begin(ids.shape[1])
        graphs = self.graphs if step else self.verify_graphs if ext is not None else None
        if graphs is not None and graphs.on and not cited:  # (the cascade's launches are all the split kernel's:
            # its query slices read lengths on the device, whatever the rows: attention.shared_impl)
            # replayed: everything the host decided is in the key, the rest reads the graph's
            # copies of ``inputs``. Documents read through their block tables (the GPU's path)
            # are data: only how many rows each has counts (a graph serves any documents of the
            # pool); a document read through its own view counts by its buffers, view and rows.
            if paged and gpu_path(ids_d):
                docs = ("tables", tuple(len(i) for _, i in specs))
            else:
                docs = tuple((c.graph_key(), tuple(i)) for c, i in specs)
            key = (self.tail.serial, self.tail.capacity, want, docs)
            logits = graphs.run(key, inputs, lambda *t: forward(*t, eager=False), lambda: forward(*inputs))
        else:  # a step that cites merges as the captured ones do (as a single answer's: the same numbers)
            logits = forward(*inputs, eager=not (step and self.graphs is not None and self.graphs.on))
        finish()
        return logits
