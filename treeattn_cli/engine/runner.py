"""The forwards of the batch loop (``batch.BatchDecoder.run``): a round's question chunks into the
tail (:meth:`StepRunner._fill`), a step of one token for every busy slot (:meth:`StepRunner._step`),
a verify of every slot's last token and drafts (:meth:`StepRunner._extend`, or its fixed shape
replayed from a CUDA graph: :meth:`StepRunner._extend_captured`), each one forward of the model over
the rows of the tail (``paged_tail.PagedTail``) and the documents they continue (``attention._cascade``).
What the device needs from the host goes in one copy a forward (``transfers.Staging``); the graphs are
keyed by everything the host decided.
"""

from __future__ import annotations

import torch
from treeattn_kernels import gpu_path

from .graphs import StepGraphs
from .transfers import Staging
from .paged_tail import PagedTail


class StepRunner:
    """The model's forwards over a tail of ``slots`` slots in the rank's pool."""

    def __init__(self, dec, slots: int, capacity: int, pool):
        self.dec = dec
        self.slots = slots
        # the step's CUDA graphs (graphs.StepGraphs), by the documents its rows read and how
        # (the tail then has fixed-shape views)
        self.graphs = StepGraphs(dec.device, dec.world, what="batched decode step") if dec.use_graph else None
        # its verifies' (every slot's last token and drafts, padded to a power of two of rows)
        self.verify_graphs = StepGraphs(dec.device, dec.world, what="batched verify step") if dec.use_graph else None
        self.tail: PagedTail | None = None
        self.staging = Staging(dec.device)  # a forward's inputs, in one copy
        self.runs = 0  # batches run (the engine keeps one decoder: later batches reuse tail and graphs)
        self.last_shards = None  # [world]: the latest answer's tokens on every rank, document and tail (host)
        self.prepare(capacity, pool)

    def prepare(self, capacity: int, pool) -> None:
        """Ready for a batch whose questions and answers take up to ``capacity`` tokens each: the
        tail lives in the rank's block pool (``paged_tail.PagedTail``: each question's blocks
        taken as it is admitted to a slot); its views grow when they must (a static tail's graphs
        are then captured again: they are keyed by its serial and capacity), the per-batch counts
        start from zero. The tail's rows are emptied as questions take slots, so what an earlier
        batch left there is never read."""
        cp = self.dec.comm.world
        width = -(-capacity // cp) + 2
        if self.tail is not None:
            self.tail.release_all()  # (a batch that failed may have left some)
            if self.tail.pool is not pool:
                self.tail = None
        if self.tail is None:
            self.tail = PagedTail(
                pool,
                self.slots,
                rank=self.dec.comm.rank,
                world=cp,
                capacity=width,
                static=self.dec.static or self.graphs is not None,
            )
        self.tail.reserve(width)
        self.documents_per_step = 0  # the most documents one forward read (rows of several: a mixed step)
        self.tail_waits = 0  # rounds a question waited for its tail's blocks (answers under way held the pool)
        self.segments_while_decoding = 0  # document prefill segments run while answers were under way
        self.question_chunks = 0  # chunks of questions prefilled (a question over ``budget`` tokens: several)
        self.chunks_while_decoding = 0  # rounds of question chunks run while answers were under way
        self.counts_at_start = {
            g: (sg.captures, sg.replays)
            for g, sg in (("plain", self.graphs), ("verify", self.verify_graphs))
            if sg is not None
        }

    def graph_counts(self) -> dict:
        """This batch's graph captures and replays (the decoder's graphs outlive a batch)."""
        out = {"graph_captures": 0, "graph_replays": 0, "verify_graph_replays": 0, "graph_note": None}
        if self.graphs is None:
            return out
        c0, r0 = self.counts_at_start["plain"]
        out.update(
            graph_captures=self.graphs.captures - c0,
            graph_replays=self.graphs.replays - r0,
            verify_graph_replays=self.verify_graphs.replays - self.counts_at_start["verify"][1],
            graph_note=self.graphs.note or self.verify_graphs.note,
        )
        return out

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
            chunks.append((b, s, ids[s.fed : s.fed + n]))
            left = None if left is None else left - n
        self.question_chunks += len(chunks)
        rows = [b for b, _, _ in chunks]
        T = max(len(c) for _, _, c in chunks)
        ids = torch.zeros(len(rows), T, dtype=torch.int64)
        pos = torch.full((len(rows), T), -1, dtype=torch.int64)
        for i, (_, s, c) in enumerate(chunks):
            ids[i, T - len(c) :] = torch.tensor(c)
            pos[i, T - len(c) :] = torch.arange(s.doc_tokens + s.fed, s.doc_tokens + s.fed + len(c))
        new = [(b, s) for b, s, _ in chunks if s.fed == 0]
        self.tail.reset_rows([b for b, _ in new], [s.doc.cache.counts[0] for _, s in new])
        self.tail.begin_extend(rows, pos)
        lg = self._forward(ids, pos, rows, [s for _, s, _ in chunks], step=False, finish=self.tail.end_extend)
        done = []
        for i, (b, s, c) in enumerate(chunks):
            s.fed += len(c)
            if s.fed == s.prompt:
                done.append((b, lg[i : i + 1] if lg is not None else None))  # (logits: rank 0 only)
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
            ids[i, : len(f)] = torch.tensor(f)
            pos[i, : len(f)] = torch.arange(p, p + len(f))
        self.tail.begin_extend(rows, pos)
        return self._forward(
            ids,
            pos,
            rows,
            [s for _, s in slots],
            step=False,
            finish=self.tail.end_extend,
            keep=T,
            cites=[s.citation for _, s in slots],
        )

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
            ids[b, : len(f)] = torch.tensor(f)
            pos[b, : len(f)] = torch.arange(p, p + len(f))
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
        return self._forward(
            torch.tensor(tokens)[:, None],
            pos,
            list(range(self.slots)),
            of,
            step=True,
            finish=self.tail.end_step,
            store=store,
            cites=[s.citation if going[b] else None for b, s in enumerate(of)],
        )

    @torch.inference_mode()
    def _forward(
        self, ids, pos, rows, of: list, *, step: bool, finish, keep: int = 1, cites=None, store=None, ext=None
    ):
        """The model on the tail ``rows`` (``ids, pos [R, T]``, host), row i continuing the
        document of slot ``of[i]``: its rows of each document are one group (``attention._cascade``).
        ``cites``: row i's ``cite.Citation`` where its tokens are an answer's that cites (a step
        or a verify), else None. ``store``: a step's (``PagedTail.plan_step``). What the
        device needs from the host (tokens, positions, the groups' rows, where the step's tokens
        are kept, the documents' block tables) goes in one copy (``transfers.Staging``). ``ext``: a
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
            rest = rest[2 if paged else 0 :]
            actx.ext = (rest[0].reshape(-1), rest[1]) if ext is not None else None  # [R·T], [R]
            idx_d = iter(rest[2 if ext is not None else 0 :])
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
