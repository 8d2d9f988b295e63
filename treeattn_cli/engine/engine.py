"""One engine, many requests (docs/architecture.md §10): ranks started once, the model loaded once.

Each rank builds an :class:`Engine` (its share of the model on the (cp × tp) mesh, communicators,
its block pool, decoder) and serves a sequence of requests, the same on every rank, in order.
Every token's KV lives in the rank's block pool, and every answer is decoded by one loop
(``batch.BatchDecoder.run``): a single answer is a batch of one. The engine's own tokens (what
``append`` adds) are a document of the pool like any other (``Engine.prefix``, key None):

* ``{"op": "append", "ids": [...], "piece": n}``: prefill the tokens after the engine's own
  (a document, a question after it);
* ``{"op": "decode", "seq": i, "max_new_tokens": n, "sampling": {...}, "stop": [...],
  "eos_ids": [...], "keep": bool}``: sample an answer from the last append's logits, streaming
  ``token`` events from rank 0 and ending with an ``answer`` event (its stats); rank 0 also stops
  when the launcher posts an interrupt for request ``i``. The answer does not join the engine's
  tokens (a conversation keeps its turns in a named document: ``batch`` with ``keep``); ``"keep":
  True`` is refused. ``"logprobs": k`` (here and per question
  of a batch): the answer carries each token's logprob and its ``k`` most likely alternatives;
  ``"cite": {"spans": [[start, end], ...], "layers": [...], "detail": "sum"}`` (here and per
  question): the answer carries ``cite``, its rows' attention over those spans of global
  positions (``cite.py``: ``[rows, spans]`` fp32, on rank 0);
* ``{"op": "batch", "questions": [[...], ...], "slots": n, "max_new_tokens": n, "sampling": {...},
  "stop": [...], "eos_ids": [...]}``: answer many questions after the document, ``slots`` at a
  time (continuous batching over the shared document, ``batch.py``), streaming ``btoken`` and
  ``banswer`` events (``"digest": True``, for all or per question: each answer carries
  ``digests``, one per token of the logits it was chosen from, ``sampling.digests``); the
  document's cache is unchanged, but for a question with ``"keep":
  True`` (``chat --conversation``): its tokens and its answer's join its document's blocks, and
  the answer's last token is fed with the next kept question over it (``"drop_pending": True``:
  not, the turn having ended with EOS); its answer says ``kept`` (False: the pool could not hold
  them, the document is as it was);
* ``{"op": "mark", "name": s}`` / ``{"op": "rollback", "name": s}``: remember the engine's
  tokens / return to them (the blocks past the mark go back to the pool); with ``"doc": key``,
  those of that resident document (a conversation's turns leave);
* ``{"op": "save", "dir": d, "nonce": s, ...}`` / ``{"op": "load", "dir": d, "manifest": {...}}``:
  the engine's tokens (or with ``doc``, a resident document's) to and from disk (``kvstore.py``);
* ``{"op": "generate"}``: the job's prompt over the block pool, as a batch of one whose
  document is the prompt (``_op_generate``; ``token`` events, then ``answer``);
* ``{"op": "pool", "pool": bytes | "pool_fraction": f, "page": n}``: allocate the documents' block
  pool now (``serve`` at start: an out-of-memory shows then, not at the first document); rank 0
  reports ``pool {blocks, page, bytes, free}``;
* ``{"op": "stop"}``: leave; rank 0 returns the last answer's summary.

``generate`` is a fixed list of requests (``requests.generate_requests``); ``chat`` reads them from
the launcher one by one (``comm.next_request``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from treeattn_kernels import use_reference

from ..parallel import comm as C
from .attention import AttentionContext, register
from .decode import Decoder
from .documents import PIECE, Document, Documents
from ..storage.kvquant import storage
from .pool import KVFormat
from ..parallel.mesh import Mesh, check_tp_within_nodes
from ..topology.layout import cp_layout
from ..model.load import load_model, load_tokenizer, pick_dtype, shapes
from .own_tokens import OwnTokens
from .record import run_record
from .requests import document_key, generate_requests, single_requests
from ..storage.saving import Saver


# what a batch request sets for its questions (``requests.Ask.read``), and for their documents
# (``documents.Documents.get``), where a question does not set its own
ANSWER_DEFAULTS = ("max_new_tokens", "sampling", "stop", "eos_ids", "speculate", "logprobs", "digest", "cite")
DOCUMENT_DEFAULTS = (
    "budget", "dir", "save_meta", "piece", "save", "pool", "pool_blocks", "pool_for", "tails", "tail_slots",
    "grow", "page", "host_memory",
)  # fmt: skip


def inbox():
    """Requests posted by the launcher (``chat``), in order, until ``stop``."""
    seq = 0
    while True:
        req = C.next_request(seq)
        seq += 1
        yield req
        if req["op"] == "stop":
            return


def _stop_check(tokenizer, stop: list, eos: set):
    def check(ids: list[int]):
        if ids[-1] in eos:
            return "eos"
        if stop:
            tail = tokenizer.decode(ids[-32:], skip_special_tokens=True)
            if any(s in tail for s in stop):
                return "stop"
        return None

    return check


class Engine(OwnTokens):
    """This rank's model, mesh, communicators, documents (in its block pool) and decoder, and the
    requests it serves."""

    def __init__(self, ctx, job, model=None):
        """``model``: already built (the first-use probe's, ``verify/family.py``), else loaded
        from ``job.model_dir``."""
        self.ctx, self.job = ctx, job
        self.device = device = torch.device(ctx.device)
        self.dtype = dtype = pick_dtype(job.dtype, device)
        use_reference(job.reference)
        self.mesh = mesh = Mesh(ctx.world, job.tp, ctx.rank)
        self.nodes = C.nodes_of_all_ranks()
        tp_mesh = cp_group = None
        if mesh.tp > 1:
            check_tp_within_nodes(mesh, self.nodes)
            tp_mesh, cp_group = C.grid_mesh(device.type, mesh.cp, mesh.tp)
        self.model = (
            model
            if model is not None
            else load_model(
                job.model_dir,
                dtype,
                device,
                attention=register(),
                trust_remote_code=job.trust_remote_code,
                allow_pickle=job.allow_pickle,
                tp_mesh=tp_mesh,
                tp_plan=job.tp_plan,
            )
        )
        self.shapes = sh = shapes(self.model.config)
        plan = (job.scheme, job.groups, job.inner, job.outer)
        if len(set(self.nodes)) > 1 and job.auto_layout:  # planned in the launcher as if on one node
            lay = cp_layout(
                mesh,
                self.nodes,
                job.layout_profile,
                heads=sh["heads"],
                head_dim=sh["head_dim"],
                layers=sh["num_layers"],
                intra="LOOPBACK" if device.type == "cpu" else "NVSWITCH",
            )
            plan = (lay.scheme, lay.groups, lay.inner or "allreduce", lay.outer or "tree")
        self.scheme = plan[0]
        self.comm = C.make_comm(*plan, parts=mesh.cp_parts(), group=cp_group)  # the merge runs over my cp group
        if job.auto_layout and self.scheme in ("allreduce", "tree") and len(set(self.nodes)) == 1:
            # steps no CUDA graph replays (a verify, a step that cites; every step on a CPU) merge with one
            # collective: the layout's scheme is priced for captured steps, where launches are free
            self.comm.eager_scheme = "allgather"
        self.world = C.make_comm("allreduce") if mesh.tp > 1 else self.comm  # tokens go to every rank
        static = job.static if job.static is not None else device.type == "cuda"
        # KV heads this rank attends with: 1/T of them, unless the plan gives every tp rank all
        # of them (Phi-3's fused qkv_proj is gathered again); then tp peers hold the same heads
        self.heads_split = job.tp_heads_split
        self.kv_heads = sh["kv_heads"] // (mesh.tp if self.heads_split else 1)
        self.head0 = mesh.tp_index * self.kv_heads if self.heads_split else 0
        kv_dtype, quant, self.kv_name = storage(job.kv_dtype, dtype, device, sh["head_dim"])
        # how every shard of this rank stores KV (the pool is sized by it: documents.Documents.make_pool)
        self.kv = KVFormat(
            sh["num_layers"],
            self.kv_heads,
            sh["head_dim"],
            quant.dtype if quant is not None else kv_dtype,
            quant,
            device,
        )
        self.dec = Decoder(
            self.model,
            AttentionContext(self.comm, decode_method=job.decode_method),
            vocab_size=self.model.get_output_embeddings().weight.shape[0],
            device=device,
            kv_heads=self.kv_heads,
            static=static,
            world=self.world,
            cuda_graph=job.cuda_graph and ctx.backend == "nccl" and job.decode_method == "tree",
            sharding=job.prefill_sharding,
        )
        self.lead = ctx.rank == 0
        self.saver = Saver(
            self.world,
            self.lead,
            mesh,
            ctx.world,
            self.heads_split,
            self.head0,
            sh,
            str(dtype).replace("torch.", ""),
            self.kv_name,
        )
        self.documents = Documents(self)  # the documents in the pool (documents.py)
        self.prefix: Document | None = None  # the engine's own tokens (append, decode, mark, save, load), pooled
        self.ready = False  # tokens appended since the last answer: a decode may follow
        self.marks: dict = {}
        self.summary: dict | None = None
        self._drafters: dict = {}  # rank 0: speculation's n-gram index of each document, by key
        self._tok = None
        self.bd = None  # the batch decoder (batch.py), kept across batches: _batch_decoder
        # the steps' CUDA graphs over every batch so far (batch.BatchDecoder.graph_counts)
        self.graph_totals = {"graph_captures": 0, "graph_replays": 0, "verify_graph_replays": 0, "graph_note": None}

    # -- requests ----------------------------------------------------------------------
    def serve(self, requests):
        """Serve ``requests`` in order; rank 0 returns the last answer's summary (or None)."""
        for req in requests:
            op = req["op"]
            if op == "stop":
                return run_record(self)
            getattr(self, f"_op_{op}")(req)
        return run_record(self)

    def _op_pool(self, req):
        info = self.documents.make_pool(req)
        if self.lead:
            self.ctx.send("pool", info)

    def citation(self, cite: dict | None):
        """A ``cite.Citation`` for an answer that asks (``cite``: its request's), or None."""
        if not cite:
            return None
        from .cite import Citation

        sh = self.shapes
        return Citation(
            cite["spans"],
            sh["num_layers"],
            sh["heads"],
            layers=cite.get("layers"),
            detail=cite.get("detail") or "sum",
            device=self.device,
            local_heads=self.dec.q_heads,
            counts=self.heads_split or self.mesh.tp_index == 0,
        )  # tp peers with the same heads: one

    def _drafter(self, own=(), doc: Document | None = None):
        """Rank 0: a drafter over the tokens of ``doc`` (default: the engine's own), then ``own``.
        The index of a long document is built once and shared: later answers and every slot of a
        batch index only what follows it."""
        from .speculate import Drafter

        doc = doc if doc is not None else self._prefix()
        base = self._drafters.get(doc.key)
        if base is None or len(base.tokens) > len(doc.ids) or base.tokens != doc.ids[: len(base.tokens)]:
            for k in [k for k in self._drafters if k is not None and k not in self.documents.resident]:
                del self._drafters[k]  # their documents left memory
            base = self._drafters[doc.key] = Drafter(doc.ids)
        return Drafter(doc.ids[len(base.tokens) :] + list(own), base=base)  # (a conversation's kept turns)

    def _op_generate(self, req):
        """``generate`` as one request on the batch loop: the prompt is a document, prefilled into
        the ranks' pools in the segments one prefill of it cuts (``--prefill-chunk``; its progress
        reported, saved once complete with ``--save-kv``), and the answer a question with no
        tokens of its own over it (from its last logits: ``documents.Document.logits``); with
        ``--load-kv`` the loaded cache is the document and the prompt the question (with
        ``--save-kv`` too, the prompt is kept into the document, then saved: the cache of both, as
        a later ``--load-kv`` continues it); with ``--cache-dir`` the document is the prompt but its
        last token, found in (loaded from) or saved to the directory by its tokens, and the last
        token the question (the same in every run). Rank 0 streams ``token`` events and ends with
        ``answer``, whose record counts the prompt's prefill, whichever way it went."""
        job = self.job
        prompt = list(job.prompt_ids)
        kept = {}  # (--cache-dir: the request's cache directory, written through)
        if job.load_kv:
            from ..storage.kvstore import load_ids

            doc_ids, question = load_ids(Path(job.load_kv)), prompt
            doc = {"load_from": job.load_kv, "manifest": job.load_manifest}
        elif job.cache_dir and len(prompt) > 1:  # the prompt but its last token is the document, kept by
            # its tokens (a saved copy holds no logits: the last token is the question, in every run)
            doc_ids, question = prompt[:-1], prompt[-1:]
            doc = {"progress": True, "key": document_key(doc_ids), "save_meta": job.cache_meta}
            kept = {"dir": job.cache_dir, "save": True}
        else:
            doc_ids, question = prompt, []
            doc = {
                "progress": True,
                "last_logits": True,
                **({"save_to": job.save_kv, "save_meta": job.save_meta} if job.save_kv else {}),
            }
        doc.setdefault("key", "generate")
        doc.update(ids=doc_ids, piece=job.prefill_chunk or max(1, -(-len(doc_ids) // self.mesh.cp)))
        keep = {"keep": "question"} if job.load_kv and job.save_kv else {}
        self._op_batch(
            {
                "op": "batch",
                "questions": [{"ids": question, "doc": doc, **keep}],
                "slots": 1,
                "max_new_tokens": job.max_new_tokens,
                "stop": list(job.stop),
                "eos_ids": list(job.eos_ids),
                "sampling": vars(job.sampling),
                "speculate": job.speculate,
                "logprobs": job.logprobs,
                "digest": job.digest,
                "cite": job.cite,
                "pool_for": len(doc_ids) + (len(question) if keep else 0),
                "tails": len(question) + job.max_new_tokens,
                **kept,
            },  # (tails: the question and its answer)
            single=True,
        )
        if keep:
            self._op_save({"dir": job.save_kv, "doc": "generate", **job.save_meta})

    def _op_batch(self, req, single: bool = False):
        """Many questions, ``req["slots"]`` decoding together (``batch.py``); rank 0 streams
        ``btoken (question, token)`` and ``banswer (question, record)`` events and ends with
        ``batch_done``. Documents' caches are read, never changed.

        A question is a list of token ids (it continues the engine's cached tokens), or
        ``{"ids": [...], ...}`` with its own ``max_new_tokens``, ``sampling``, ``stop``,
        ``eos_ids``, ``speculate`` (default: the request's) and ``doc``: the document it
        continues (``{"key", "ids"}`` and the options of ``documents.Documents.get``; ``budget``,
        ``dir``, ``save_meta`` and ``piece`` default to the request's): questions over different
        documents decode in the same steps, and a document not resident is loaded or prefilled
        a segment per step while the others decode (rank 0 reports ``bdoc (question, {source,
        tokens, seconds, reused})`` when a question starts and ``docs`` with what left memory or was
        saved). With ``"open": True`` more questions may join while the batch runs
        (``comm.post_join``) and any may be cancelled (``comm.post_cancel``); the batch ends when
        every question it took is answered, and ``batch_done`` says how many joins it took."""
        defaults = {k: req.get(k) for k in ANSWER_DEFAULTS}
        doc_defaults = {k: req[k] for k in DOCUMENT_DEFAULTS if req.get(k) is not None}
        kept_docs: set = set()  # documents a question of this batch keeps into

        def question(q):
            return self._question(q, defaults, doc_defaults, kept_docs)

        qs = [question(q) for q in req["questions"]]
        seq = req.get("seq", 0)
        feed = None
        if req.get("open") and self.lead:
            feed = C.BatchFeed(seq)
        bd = self._batch_decoder(
            max(1, req["slots"] if req.get("open") else min(req["slots"], len(qs))),
            max([len(q.ids) + q.max_new_tokens for q in qs] or [64]),
        )
        t0 = time.perf_counter()

        last: dict = {}

        def answered(qi, rec):  # (rank 0) a single answer's record is the request's
            last["rec"] = rec
            self.ctx.send("answer", rec) if single else self.ctx.send("banswer", (qi, rec))

        answers = bd.run(
            qs,
            drafter=(lambda doc, own: self._drafter(own, doc)) if self.lead else None,
            citation=self.citation,
            make_question=question,
            documents=self.documents,
            on_doc=self._doc_began if self.lead else None,
            interrupted=(lambda: C.interrupted(seq)) if req.get("interruptible") else None,
            feed=(lambda: (feed.joins(), feed.cancels())) if feed else None,
            news_flag=C.news if self.lead and (feed or req.get("interruptible")) else None,
            on_token=(lambda qi, tok: self.ctx.send("token", tok))
            if single
            else (lambda qi, tok: self.ctx.send("btoken", (qi, tok))),
            on_answer=answered,
            budget=req.get("piece") or PIECE.get(self.device.type, PIECE["cuda"]),
        )
        done = [a for a in answers if a is not None]
        if done:
            self.summary = done[-1]
        if single and last:  # (rank 0) with its logprobs and digests
            self.summary = {k: v for k, v in last["rec"].items() if k != "token_ids"}
        self.documents.evict(req.get("budget"))  # its questions released their documents
        changes = self.documents.take_changes()
        if self.lead and any(changes.values()):
            self.ctx.send("docs", changes)
        self._batch_done(bd, done, feed, time.perf_counter() - t0)

    def _doc_began(self, qi: int, q):
        """(rank 0) Question ``qi`` starts over its document: what left memory or was saved
        meanwhile (``docs``), then where its document came from (``bdoc``)."""
        ch = self.documents.take_changes()
        if any(ch.values()):
            self.ctx.send("docs", ch)
        self.ctx.send(
            "bdoc",
            (
                qi,
                {
                    "source": q.source,
                    "tokens": q.doc.tokens,
                    "seconds": q.doc.seconds,
                    "reused": q.doc.reused,
                    "loaded": q.doc.loaded,
                    "pools": q.pools,
                },
            ),
        )

    def _batch_done(self, bd, done: list, feed, seconds: float):
        """The batch's end: its CUDA graphs added to the engine's totals, and (rank 0) the
        ``batch_done`` record: its pools, answers, steps' counters and joins."""
        pools = self.documents.pools()  # every rank's (the pool is made on every rank at the same document)
        graphs = bd.graph_counts()
        for k in ("graph_captures", "graph_replays", "verify_graph_replays"):
            self.graph_totals[k] += graphs[k]
        self.graph_totals["graph_note"] = self.graph_totals["graph_note"] or graphs["graph_note"]
        if self.lead:
            self.ctx.send(
                "batch_done",
                {
                    "pools": pools,
                    "answers": len(done),
                    "new_tokens": sum(a["new_tokens"] for a in done),
                    "seconds": seconds,
                    "slots": bd.slots,
                    "documents_per_step": bd.documents_per_step,
                    "segments_while_decoding": bd.segments_while_decoding,
                    "question_chunks": bd.question_chunks,
                    "chunks_while_decoding": bd.chunks_while_decoding,
                    "pool_waits": self.documents.waits,
                    "tail_waits": bd.tail_waits,  # rounds a question waited for its tail's blocks
                    "pool": self.documents.pool.stats() if self.documents.pool else None,
                    "joins": feed.taken if feed else 0,
                    "batch_runs": bd.runs,
                    # its steps' CUDA graphs (graphs.StepGraphs): captured, replayed
                    **graphs,
                },
            )

    def _question(self, q, defaults: dict, doc_defaults: dict, kept_docs: set):
        """A ``batch.Question`` from one question of a batch request (``requests.Ask.read`` with
        the request's ``defaults``): its document found, made resident or acted on (with
        ``doc_defaults``), its stop check on rank 0; ``kept_docs``: the documents a question of
        this batch keeps into already (at most one each)."""
        from .batch import Question
        from .requests import Ask

        ask = Ask.read(q, defaults)
        ids = ask.ids
        stop_check = None
        if self.lead:
            if self._tok is None and ask.stop:
                self._tok = load_tokenizer(self.job.model_dir, self.job.trust_remote_code)
            stop_check = _stop_check(self._tok, ask.stop, set(ask.eos_ids))
        source, doc_ref = "memory", None
        if ask.doc is not None and ask.doc.action:  # the documents API: evict, drop (now)
            source = self.documents.act({**doc_defaults, **ask.doc.wire()})
            doc = Document(None, [], None)  # nothing to answer over
        elif ask.doc is not None:
            doc_ref = {**doc_defaults, **ask.doc.wire()}
            doc = self.documents.get(doc_ref)
            source = doc.source
        else:  # it continues the engine's own tokens
            doc = self._prefix()
        self.documents.use(doc)
        keep = ask.keep if doc_ref is not None else False  # (into a named document)
        if keep:
            # a kept turn continues the document as the previous turn left it: a second one in
            # the same batch would be answered without the first and fed its pending token too
            if doc.key in kept_docs:
                raise ValueError(f"a batch keeps at most one question per document; two keep {doc.key!r}")
            kept_docs.add(doc.key)
        if keep is True and doc.pending is not None and not ask.drop_pending:
            ids = [doc.pending] + ids  # the last kept answer's last token: fed now (as an append would)
        return Question(
            ids,
            ask.max_new_tokens,
            ask.sampling,
            ask.speculate or "off",
            stop_check,
            ask.logprobs,
            doc=doc,
            source=source,
            doc_ref=doc_ref,
            cite=ask.cite,
            keep=keep,
            digest=ask.digest,
        )

    def _batch_decoder(self, slots: int, capacity: int):
        """The engine's batch decoder, kept from one batch to the next while the slots stay (a
        server's batches end whenever it is idle): its tail and its captured steps are reused,
        not allocated and captured again for every burst of requests."""
        from .batch import BatchDecoder

        if self.documents.pool is None:  # (a batch of no question yet: the default pool)
            self.documents.make_pool({})
        bd, pool = self.bd, self.documents.pool
        if bd is None or bd.slots != slots:
            if bd is not None:
                bd.tail.release_all()
            bd = self.bd = BatchDecoder(self.dec, slots=slots, capacity=capacity, pool=pool)
        else:
            bd.prepare(capacity, pool)
        bd.runs += 1
        return bd


def rank_generate(ctx, job, single: bool = False):
    """Entry point of every rank for ``generate`` (``launch.run_local`` / ``run_torchrun``):
    ``requests.generate_requests`` (``single``: ``single_requests``, the engine's own tokens)."""
    summary = Engine(ctx, job).serve(single_requests(job) if single else generate_requests(job))
    if summary is not None:
        ctx.send("done", summary)
    return summary


def rank_engine(ctx, job):
    """Entry point of every rank for ``chat``: requests from the launcher until ``stop``."""
    return Engine(ctx, job).serve(inbox())
