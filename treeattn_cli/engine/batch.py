"""Many questions about one document at once: continuous batching over the shared, sharded
document (docs/architecture.md §11; cascade attention).

This is the engine's one step loop: every answer, a single one included (a batch of one), is
decoded here. Each round it schedules (documents made resident a segment at a time, queued
questions admitted to free slots, question chunks into the tail), runs one forward
(``runner.StepRunner``: a step or a verify of every busy slot), and post-processes (rank 0
samples, accepts drafts and decides stops; every rank applies the same decisions, streams and
frees blocks).

The document stays in its shard of the rank's block pool, one shard per rank, and is never
copied per question. Each question lives in a slot of the *tail* (``paged_tail.PagedTail``, in
the same pool): its own tokens, spread over the ranks like decode tokens. A question takes a
slot only when every rank has the blocks its question and answer can take (documents nobody
answers over leave to make room; else it waits for the answers under way, and a question that
can never fit ends ``no_room``), and gives them back when its answer ends. Per step every rank runs the model on one
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

from . import transfers
from .paged_tail import most_here
from .runner import StepRunner
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
    doc_ref: dict | None = None  # what documents.Documents.get takes to make its document resident again
    pools: list | None = None  # every rank's pool [(used, total) blocks] when it began (serve's metrics)
    cite: dict | None = None  # the request's citation request (engine.Engine.citation): the answer carries ``cite``
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
    speculation: object = None  # rank 0: the answer's speculation policy and counts (speculate.Speculation)
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


class BatchDecoder(StepRunner):
    """Continuous batching of questions after their documents, ``slots`` at a time: the step loop
    (the forwards are :class:`runner.StepRunner`'s)."""

    @torch.inference_mode()
    def run(
        self,
        questions: list[Question],
        *,
        drafter=None,
        interrupted=None,
        feed=None,
        make_question=None,
        on_token=None,
        on_answer=None,
        documents=None,
        on_doc=None,
        budget: int | None = None,
        citation=None,
        news_flag=None,
    ) -> list[dict]:
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
        (:meth:`_fill`), as a document goes a segment per round. ``citation(cite) ->
        cite.Citation`` (every rank): for questions with a ``cite``, the rows of their answer's
        tokens measure their attention over their document's spans (the summary's ``cite``).

        Each question continues its own document (``Question.doc``); rows of different
        documents share the step (``attention._cascade`` reads each document once for its rows,
        and one merge across the ranks serves them all). A question waits in the queue until its
        document is resident: each round prefills one segment of the first pending document a
        queued question needs (``documents.Documents.advance``), and questions whose documents
        are ready take free slots in their order, so a new document neither stalls the answers
        under way for longer than a segment nor holds back questions behind it."""
        return _Run(
            self,
            questions,
            drafter=drafter,
            interrupted=interrupted,
            feed=feed,
            make_question=make_question,
            on_token=on_token,
            on_answer=on_answer,
            documents=documents,
            on_doc=on_doc,
            budget=budget,
            citation=citation,
            news_flag=news_flag,
        ).loop()

    def _admit(self, b: int, q: Question, documents, busy: bool) -> bool | None:
        """Slot ``b``'s blocks for question ``q`` (a pooled tail: the most tokens its question and
        answer can place on this rank, ``paged_tail.most_here``), evicting documents nobody answers
        over when the pool has not got them; the same answer on every rank: True (admitted), False
        (it waits: the answers under way, ``busy``, will give blocks back), None (nothing runs: it never
        fits)."""
        tail = self.tail
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
        """An answer's record. A question with no tokens of its own answers from its document's
        last logits (``generate``: the prompt is the document; a single answer after an append):
        its prompt, prefill and first token count from that prefill (``documents.Document.made``)."""
        n = len(s.tokens)
        decode_s = (s.t_last - s.t_first) if n > 1 else 0.0
        made = s.doc.made if s.prompt == 0 and s.doc is not None and s.doc.made else None
        prompt, prefill_s = (made["tokens"], made["seconds"]) if made else (s.prompt, s.prefill_s)
        since = min(s.t_batch, made["start"]) if made else s.t_batch
        return {
            "prompt_tokens": prompt,
            "context_tokens": s.doc_tokens + s.prompt,
            "new_tokens": n,
            "ttft_s": (s.t_first or s.t_start) - since if n else None,  # (no token: none came first)
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": prompt / prefill_s if prefill_s else None,
            "decode_tokens_per_s": (n - 1) / decode_s if decode_s else None,
            "stop_reason": reason,
            "prefill_method": "+".join(made["methods"]) if made else "batched",
            "speculation": s.speculation.record() if s.speculation is not None else None,
            # how its document became resident: memory, pool, host, disk, prefill (and in how long; loaded:
            # of a prefill, the first tokens from a longer document's saved copy)
            "document": {"source": s.doc.source, "seconds": s.doc.seconds, "loaded": s.doc.loaded}
            if s.doc is not None and s.doc.key
            else None,
        }


class _Run:
    """One batch on the loop: schedule (documents a segment at a time, questions admitted to free
    slots, question chunks into the tail) → one forward (a step or a verify of every busy slot) →
    post-process (rank 0 decides every ready slot's tokens, stop and next drafts; every rank
    applies them). :meth:`BatchDecoder.run` says what each callback is."""

    def __init__(self, bd: BatchDecoder, questions: list, **hooks):
        from .speculate import StepCost

        self.bd, self.dec, self.S = bd, bd.dec, bd.slots
        self.lead = self.dec.world.rank == 0
        for k, v in hooks.items():
            setattr(self, k, v)
        S = self.S
        self.questions = questions
        self.queue = deque(range(len(questions)))
        self.slots: list[_Slot | None] = [None] * S
        self.rows: list = [None] * S  # rank 0: each ready slot's logits of its fed rows [k + 1, V]
        self.drafts: list[list[int]] = [[] for _ in range(S)]  # fed after each slot's last token, latest forward
        self.ready = [False] * S
        self.out: list[dict | None] = [None] * len(questions)
        self.cancelled: set = set()
        self.t0 = time.perf_counter()
        self.t_step = None  # when the latest step's forward began (its time ends once its tokens are read)
        self.clean = False  # nothing else ran on the device between that forward and the read of its tokens
        self.cost = StepCost()  # what the batch's forwards cost, by draft rows: one for every slot
        self.msg = torch.zeros(S + 1, WIDTH, dtype=torch.int64, device=self.dec.device)
        self.seen_news, self.stop_all = -1, False  # rank 0: the launcher's news counter as last read
        self.news = ([], [])  # rank 0: this round's (joined questions, cancelled indices)
        self.filling: list[int] = []  # slots whose question is not all in the tail yet, in the order they began

    def loop(self) -> list:
        while True:
            blocked = self.advance_documents()
            self.fill(self.admit(blocked))
            if not any(self.slots) and not self.queue:
                break
            table = self.decide() if self.lead else None
            table = self.share(table)
            going, nxt = self.apply(table)
            if table[self.S][0] == _ALL_STOPPED:  # Ctrl-C: the answers so far end; the rest are not started
                self.queue.clear()
                for b in range(self.S):
                    if self.slots[b] is not None:  # busy but not ready this round (or prefilling): nothing pending
                        self.finish(self.slots[b], "interrupted")
                        self.slots[b] = None
                self.filling.clear()
                break
            self.forward(going, nxt)
        return self.out

    # -- schedule -------------------------------------------------------------------------
    def advance_documents(self) -> bool:
        """Questions whose document left memory ask for it again; one segment of the first
        document a queued question waits for (or its load). Returns whether that document waits
        for blocks the documents in use hold."""
        questions, documents = self.questions, self.documents
        for qi in self.queue:  # a queued question's document left memory (the pool needed room): ask again
            q = questions[qi]
            if q.doc.evicted and documents is not None:
                documents.release(q.doc)
                q.doc = documents.get(q.doc_ref)
                documents.use(q.doc)
                q.source = q.doc.source
        pending = next((questions[qi].doc for qi in self.queue if questions[qi].doc.waiting), None)
        if pending is None:
            return False
        self.clean = False
        blocked = not documents.advance(pending)
        self.bd.segments_while_decoding += any(self.slots) and not blocked
        if blocked and not any(self.slots):  # nothing will end to make room (pinned documents hold the
            for qi in [qi for qi in self.queue if questions[qi].doc is pending]:  # rest): its questions end
                self.queue.remove(qi)  # here, answered empty ("no_room"); the others go on
                q = questions[qi]
                self.finish(
                    _Slot(qi, len(q.ids), None, time.perf_counter(), self.t0, doc=q.doc, started=False), "no_room"
                )
            documents.abandon(pending)
            blocked = False
        return blocked

    def admit(self, blocked: bool) -> list[int]:
        """Queued questions whose documents are ready take free slots, in their order (a
        document's own request ends here, resident); returns the slots that began."""
        from .speculate import Speculation

        questions, documents, slots = self.questions, self.documents, self.slots
        free = [b for b in range(self.S) if slots[b] is None]
        new, began, doc_only = [], [], []
        for qi in list(self.queue):
            q = questions[qi]
            if q.max_new_tokens == 0 and (q.doc.ready or q.doc_ref is None):  # a document's own request
                self.queue.remove(qi)  # (documents API): nothing to answer, no slot; its document now resident
                if documents is not None and q.doc_ref is not None:
                    documents.settle(q.doc, q.doc_ref)
                began.append(qi)
                doc_only.append(qi)
                continue
            if not free:
                break
            if not q.doc.ready:  # later questions go first, unless this one waits for blocks:
                if blocked:  # then nothing behind it starts (the documents in use finish, it gets room)
                    break
                continue
            room = self.bd._admit(free[0], q, documents, busy=any(slots) or bool(self.filling))
            if room is None:  # its tail can never fit: nothing running holds blocks it could wait for
                self.queue.remove(qi)
                self.finish(
                    _Slot(qi, len(q.ids), None, time.perf_counter(), self.t0, doc=q.doc, started=False), "no_room"
                )
                continue
            if not room:  # it waits for the answers under way to give blocks back; nothing behind it starts
                self.bd.tail_waits += 1
                break
            self.queue.remove(qi)
            b = free.pop(0)
            slots[b] = _Slot(
                qi,
                len(q.ids),
                torch.Generator(device=self.dec.device).manual_seed(q.sampling.seed) if self.lead else None,
                time.perf_counter(),
                self.t0,
                doc=q.doc,
                doc_tokens=q.doc.tokens,
                citation=self.citation(q.cite) if q.cite and self.citation is not None else None,
                row=b,
            )
            if documents is not None:
                documents.start(q.doc)
            if self.lead:
                slots[b].speculation = Speculation.for_answer(q.speculate, q.sampling, self.cost)
                slots[b].drafter = (
                    self.drafter(q.doc, q.ids) if self.drafter and slots[b].speculation.mode != "off" else None
                )
            began.append(qi)
            new.append(b)
        if began:  # each rank's pool as the questions begin (every rank gathers: the same questions)
            pools = documents.pools() if documents is not None else None
            for qi in began:
                questions[qi].pools = pools
                if self.lead and self.on_doc is not None:
                    self.on_doc(qi, questions[qi])
            for qi in doc_only:
                q = questions[qi]
                self.finish(
                    _Slot(qi, 0, None, time.perf_counter(), self.t0, doc=q.doc, doc_tokens=q.doc.tokens, started=False),
                    "document",
                )
        for b in [b for b in new if not questions[slots[b].question].ids]:  # no tokens of its own: it
            new.remove(b)  # answers from its document's last logits (generate: the prompt is the document)
            doc = slots[b].doc
            if not doc.has_logits:
                raise RuntimeError("a question with no tokens needs its document prefilled here with last_logits")
            self.bd.tail.reset_rows([b], [doc.cache.counts[0]])
            self.rows[b] = doc.logits if self.lead else None
            self.ready[b], self.drafts[b] = True, []
        return new

    def fill(self, new: list[int]) -> None:
        """This round's chunks of the questions entering the tail (the new ones after those under way)."""
        slots, S = self.slots, self.S
        self.filling += new
        for b in [b for b in self.filling if slots[b].question in self.cancelled]:  # cancelled in its prefill
            self.filling.remove(b)
            self.finish(slots[b], "cancelled")
            slots[b] = None
        if not self.filling:
            return
        self.clean = False
        self.bd.chunks_while_decoding += any(slots[b] is not None and b not in self.filling for b in range(S))
        for b, lg in self.bd._fill([(b, slots[b]) for b in self.filling], self.questions, self.budget):
            self.filling.remove(b)
            slots[b].prefill_s = time.perf_counter() - slots[b].t_start
            self.rows[b] = lg if self.lead else None
            self.ready[b], self.drafts[b] = True, []

    # -- post-process ---------------------------------------------------------------------
    def decide(self) -> list:
        """Rank 0: every ready slot's tokens (several when drafts were accepted), stop and next
        drafts, from its rows' logits (the step's one read), and what the launcher posted: the
        round's table, ``[S + 1][WIDTH]``."""
        from .speculate import emit_all

        S, slots, questions, drafts = self.S, self.slots, self.questions, self.drafts
        ready_b = [b for b in range(S) if self.ready[b]]
        qs_b = [questions[slots[b].question] for b in ready_b]
        picks = emit_all(
            [self.rows[b] for b in ready_b],
            [drafts[b] for b in ready_b],
            [q.sampling for q in qs_b],
            [slots[b].gen for b in ready_b],
            [q.logprobs for q in qs_b],
        )  # the step's one read
        if self.t_step is not None and self.clean and picks:  # the latest forward, with every slot's drafts in it
            self.cost.observe(sum(len(drafts[b]) for b in ready_b), time.perf_counter() - self.t_step)
        self.news = ([], [])
        if self.news_flag is None or (n := self.news_flag()) != self.seen_news:  # the launcher posted something
            self.seen_news = self.seen_news if self.news_flag is None else n
            self.stop_all = self.interrupted is not None and self.interrupted()
            self.news = self.feed() if self.feed is not None else ([], [])
        table = [[0] * WIDTH for _ in range(S + 1)]
        gone = self.cancelled | set(self.news[1])
        for b, q, (emitted, lps) in zip(ready_b, qs_b, picks):
            s = slots[b]
            s.speculation.observe(len(drafts[b]), len(emitted) - 1)
            final, reason = [], None
            for tok in emitted:
                s.tokens.append(tok)
                final.append(tok)
                reason = q.stop_check(s.tokens) if q.stop_check else None
                if reason is None and self.stop_all:
                    reason = "interrupted"
                if reason is None and s.question in gone:
                    reason = "cancelled"
                if reason is None and len(s.tokens) == q.max_new_tokens:
                    reason = "length"
                if reason is not None:
                    break
            if q.logprobs is not None:
                s.logprobs += lps[: len(final)]
            if q.digest:  # the bits each token was chosen from (the oracle of issue 49)
                s.digests += digests(self.rows[b], len(final))
            nxt = []
            if reason is None and s.drafter is not None:
                s.drafter.extend(final)
                nxt = s.drafter.draft(min(s.speculation.want(len(ready_b)), q.max_new_tokens - len(s.tokens) - 1, KMAX))
            row = table[b]
            row[0], row[1], row[2] = len(final), STOP_IDS[reason], len(nxt)
            row[3 : 3 + len(final)] = final
            row[4 + KMAX : 4 + KMAX + len(nxt)] = nxt
        table[S][0] = _ALL_STOPPED if self.stop_all else 0
        table[S][1] = 1 if self.news[0] or self.news[1] else 0
        self.msg = self.bd.staging.send(table)[0]  # one copy to the device, nothing waits
        return table

    def share(self, table):
        """Rank 0's table to every rank (one broadcast; the other ranks' one read), and the
        questions that joined or were cancelled with it."""
        dec = self.dec
        dec.world.broadcast(self.msg, src=0)
        if not self.lead:
            table = transfers.read(self.msg)  # the step's one read on this rank
        if table[self.S][1]:  # questions joined or were cancelled: every rank learns them
            joined, gone = dec.world.broadcast_object(self.news if self.lead else None, src=0)
            self.questions += [self.make_question(q) for q in joined]
            self.out += [None] * len(joined)
            self.queue.extend(range(len(self.questions) - len(joined), len(self.questions)))
            self.cancelled |= set(gone)
            for qi in [qi for qi in self.queue if qi in self.cancelled]:  # not begun: answered empty
                self.queue.remove(qi)
                q = self.questions[qi]
                self.finish(
                    _Slot(
                        qi,
                        len(q.ids),
                        None,
                        time.perf_counter(),
                        self.t0,
                        doc=q.doc,
                        doc_tokens=q.doc.tokens if q.doc.ready else 0,
                        started=False,
                    ),
                    "cancelled",
                )
        return table

    def apply(self, table) -> tuple[list[bool], list[list[int]]]:
        """Every rank: each ready slot's tokens (rejected drafts cut from the tail), streamed; an
        answer that stops ends. Returns which slots go on and their next drafts."""
        S, slots = self.S, self.slots
        now = time.perf_counter()
        going = [False] * S
        nxt: list[list[int]] = [[] for _ in range(S)]
        for b in range(S):
            if not self.ready[b]:
                continue
            s = slots[b]
            n_out, code, n_next = table[b][:3]
            final = table[b][3 : 3 + n_out]
            reason = STOP_CODES[code]
            if self.drafts[b]:  # the slot's last forward fed its token and drafts: keep what was emitted, less one
                self.bd.tail.truncate_extension(b, keep=n_out)
            if s.citation is not None:  # the rows of the tokens emitted (none after its question's prefill)
                s.citation.keep(n_out)
            if not self.lead:
                s.tokens += final
            s.t_first = s.t_first or now
            s.t_last = now
            if self.lead and self.on_token is not None:
                for tok in final:
                    self.on_token(s.question, tok)
            if reason is None:
                going[b] = True
                nxt[b] = table[b][4 + KMAX : 4 + KMAX + n_next]
                continue
            self.finish(s, reason)
            slots[b] = None
        self.ready = [False] * S
        return going, nxt

    def finish(self, s: _Slot, reason) -> None:
        """An answer ends (every rank): what it keeps joins its document, its blocks go back, its
        record is made (rank 0 hands it on)."""
        q, documents, tail = self.questions[s.question], self.documents, self.bd.tail
        kept = None
        if q.keep and documents is not None:  # what the tail holds of it joins its document
            kept = s.fed > 0 and documents.keep(
                q.doc, tail, s.row, list(q.ids) + list(s.tokens), upto=len(q.ids) if q.keep == "question" else None
            )
        if documents is not None:
            documents.release(q.doc, running=s.started)
        if s.started:  # its blocks back to the pool
            self.bd.last_shards = tail.counts[s.row] + tail.beside[s.row]  # (host counts: read at the end)
            tail.release(s.row)
        rec = self.out[s.question] = self.bd._summary(s, reason)
        if kept is not None:
            rec["kept"] = kept
        if q.cite and self.citation is not None:  # every rank, at the same answer's end
            rec["cite"] = (s.citation or self.citation(q.cite)).gather(self.dec.world)
        if self.lead and self.on_answer is not None:
            lp = {"logprobs": s.logprobs} if q.logprobs is not None else {}
            if q.digest:
                lp["digests"] = s.digests
            self.on_answer(s.question, {**rec, "token_ids": list(s.tokens), **lp})

    # -- the next forward -------------------------------------------------------------------
    def forward(self, going: list[bool], nxt: list[list[int]]) -> None:
        """Every slot that goes on: its last token (and its drafts: then a verify of every busy
        slot) in one forward; its rows' logits wait for the next round's decisions."""
        S, slots, bd = self.S, self.slots, self.bd
        self.t_step = None
        if not any(going):
            return
        busy = [b for b in range(S) if going[b]]
        self.t_step, self.clean = time.perf_counter(), True
        at = {b: slots[b].doc_tokens + slots[b].prompt + len(slots[b].tokens) - 1 for b in busy}  # last token's
        if any(nxt[b] for b in busy):  # drafts to verify: one extension of every busy slot
            feeds = [[slots[b].tokens[-1]] + nxt[b] for b in busy]
            lg = bd._extend([(b, slots[b]) for b in busy], feeds, [at[b] for b in busy])
            for i, b in enumerate(busy):
                self.rows[b] = lg[i, : len(feeds[i])] if self.lead else None
        else:  # an idle slot's row is computed and dropped: with a busy slot's document and
            # position, it widens no window's search and reads no other document
            live = busy[0]
            lg = bd._step(
                [slots[b].tokens[-1] if going[b] else 0 for b in range(S)],
                [at.get(b, at[live]) for b in range(S)],
                going,
                [slots[b if going[b] else live] for b in range(S)],
            )
            for b in busy:
                self.rows[b] = lg[b : b + 1] if self.lead else None
        for b in busy:
            self.ready[b], self.drafts[b] = True, nxt[b]
