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

``generate`` is a fixed list of requests (:func:`generate_requests`); ``chat`` reads them from
the launcher one by one (``comm.next_request``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from treeattn_kernels import use_reference

from ..parallel import comm as C
from .attention import AttentionContext
from .decode import Decoder, segments
from .documents import PIECE, Document, Documents
from .kvquant import storage
from .pool import KVFormat
from ..parallel.mesh import Mesh, check_tp_within_nodes
from ..topology.layout import cp_layout
from .model import load_model, load_tokenizer, pick_dtype, shapes, weight_bytes


def generate_requests(job) -> list[dict]:
    """``generate`` as requests: the prompt a document in the ranks' block pool, the answer a
    question over it (``Engine._op_generate``); the ring baseline (``decode_method="ring"``,
    ``bench``) as appends and a decode of the engine's own tokens (:func:`single_requests`)."""
    if job.decode_method != "ring":
        return [{"op": "generate"}, {"op": "stop"}]
    return single_requests(job)


def single_requests(job) -> list[dict]:
    """``generate`` as operations on the engine's own tokens (the ring baseline, and tests): load
    a saved cache (``--load-kv``), append the prompt, decode, and with ``--save-kv`` save the
    cache of the prompt."""
    reqs = []
    if job.load_kv:
        reqs.append({"op": "load", "dir": job.load_kv, "manifest": job.load_manifest})
    reqs.append({"op": "append", "ids": list(job.prompt_ids), "piece": job.prefill_chunk})
    if job.save_kv:
        reqs.append({"op": "mark", "name": "prompt"})
    reqs.append({"op": "decode", "seq": 0, "max_new_tokens": job.max_new_tokens, "stop": list(job.stop),
                 "eos_ids": list(job.eos_ids), "sampling": vars(job.sampling), "keep": False,
                 # the ring baseline decodes a token at a time: its blocks rotate for one query row
                 "speculate": job.speculate if job.decode_method != "ring" else "off",
                 "logprobs": job.logprobs, "cite": job.cite})
    if job.save_kv:
        reqs += [{"op": "rollback", "name": "prompt"},
                 {"op": "save", "dir": job.save_kv, **job.save_meta}]
    return reqs + [{"op": "stop"}]


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


class Engine:
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
        self.model = model if model is not None else load_model(
            job.model_dir, dtype, device, trust_remote_code=job.trust_remote_code, allow_pickle=job.allow_pickle,
            tp_mesh=tp_mesh, tp_plan=job.tp_plan)
        self.shapes = sh = shapes(self.model.config)
        plan = (job.scheme, job.groups, job.inner, job.outer)
        if len(set(self.nodes)) > 1 and job.auto_layout:  # planned in the launcher as if on one node
            lay = cp_layout(mesh, self.nodes, job.layout_profile, heads=sh["heads"], head_dim=sh["head_dim"],
                            layers=sh["num_layers"], intra="LOOPBACK" if device.type == "cpu" else "NVSWITCH")
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
        self.kv = KVFormat(sh["num_layers"], self.kv_heads, sh["head_dim"], quant.dtype if quant is not None
                           else kv_dtype, quant, device)
        self.dec = Decoder(self.model, AttentionContext(self.comm, decode_method=job.decode_method),
                           vocab_size=self.model.get_output_embeddings().weight.shape[0], device=device,
                           kv_heads=self.kv_heads, static=static, world=self.world,
                           cuda_graph=job.cuda_graph and ctx.backend == "nccl" and job.decode_method == "tree",
                           sharding=job.prefill_sharding)
        self.lead = ctx.rank == 0
        self.documents = Documents(self)  # the documents in the pool (documents.py)
        self.prefix: Document | None = None  # the engine's own tokens (append, decode, mark, save, load), pooled
        self.ready = False  # tokens appended since the last answer: a decode may follow
        self.marks: dict = {}
        self.summary: dict | None = None
        self._drafters: dict = {}  # rank 0: speculation's n-gram index of each document, by key
        self._tok = None
        self._bd = None  # the batch decoder (batch.py), kept across batches: _batch_decoder
        # the steps' CUDA graphs over every batch so far (batch.BatchDecoder.graph_counts)
        self.graph_totals = {"graph_captures": 0, "graph_replays": 0, "verify_graph_replays": 0, "graph_note": None}

    @property
    def ids(self) -> list:
        """The engine's own tokens, in order (every rank)."""
        return self.prefix.ids if self.prefix is not None else []

    def _prefix(self) -> Document:
        """The engine's own tokens as a document in the pool (made, with the pool, at first use:
        sized for ``job.reserve_tokens`` and at least the default)."""
        if self.prefix is None:
            self.prefix = Document(None, [], self.documents.new_shard({"pool_for": self.job.reserve_tokens,
                                                                       "grow": True}))
        return self.prefix

    # -- requests ----------------------------------------------------------------------
    def serve(self, requests):
        """Serve ``requests`` in order; rank 0 returns the last answer's summary (or None)."""
        for req in requests:
            op = req["op"]
            if op == "stop":
                return self._finish()
            getattr(self, f"_op_{op}")(req)
        return self._finish()

    def _op_append(self, req):
        """Prefill ``ids`` after the engine's own tokens (a document, a question after it), into
        their shard of the pool; the last token's logits wait for a decode."""
        doc = self._prefix()
        ids = list(req["ids"])
        if not ids:
            return
        t0 = time.perf_counter()
        cp = self.mesh.cp
        most = -(-len(ids) // cp) + len(segments(len(ids), cp, req.get("piece"))) + 1  # this rank's share, at most
        if not self.documents.room(doc, most):  # the same answer on every rank: they all refuse together
            pool = self.documents.pool
            raise RuntimeError(f"the KV pool ({pool.num_blocks} blocks of {pool.page} tokens per rank) cannot "
                               f"hold {len(ids)} more tokens after {len(doc.ids)}")
        progress = (lambda done, total: self.ctx.send("prefill", (done, total))) if self.lead else None
        first = len(self.dec.segments)
        logits = self.dec.prefill(doc.cache, torch.tensor([ids], dtype=torch.int64), req.get("piece"), progress)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        doc.ids = list(doc.ids) + ids
        doc.keep_logits(logits, len(ids), seconds, t0, {seg["method"] for seg in self.dec.segments[first:]})
        self.ready = True
        if self.lead:
            self.ctx.send("appended", {"tokens": len(ids), "seconds": seconds, "cached": len(doc.ids)})

    def _op_pool(self, req):
        info = self.documents.make_pool(req)
        if self.lead:
            self.ctx.send("pool", info)

    def _op_decode(self, req):
        """An answer after the engine's own tokens: a question with no tokens of its own over them,
        answered from the last append's logits on the batch loop (a batch of one)."""
        if not self.ready:  # known on every rank: they all refuse together
            raise RuntimeError("decode needs tokens appended first")
        if req.get("keep"):
            raise ValueError("decode keeps no answer: a conversation keeps its turns in a named document "
                             "(a batch question with doc and keep)")
        q = {k: req[k] for k in ("max_new_tokens", "sampling", "stop", "eos_ids", "speculate", "logprobs", "digest",
                                 "cite") if k in req}
        self._op_batch({"questions": [{**q, "ids": []}], "slots": 1, "seq": req.get("seq", 0),
                        "interruptible": req.get("interruptible"), "max_new_tokens": req["max_new_tokens"]},
                       single=True)
        doc = self.prefix
        doc.logits, doc.has_logits, doc.made, self.ready = None, False, None, False

    def citation(self, spec: dict | None):
        """A ``cite.Citation`` for an answer that asks (``spec``: its request's ``cite``), or None."""
        if not spec:
            return None
        from .cite import Citation

        sh = self.shapes
        return Citation(spec["spans"], sh["num_layers"], sh["heads"], layers=spec.get("layers"),
                        detail=spec.get("detail") or "sum", device=self.device, local_heads=self.dec.q_heads,
                        counts=self.heads_split or self.mesh.tp_index == 0)  # tp peers with the same heads: one

    def _drafter(self, own=(), doc: Document | None = None):
        """Rank 0: a drafter over the tokens of ``doc`` (default: the engine's own), then ``own``.
        The index of a long document is built once and shared: later answers and every slot of a
        batch index only what follows it."""
        from .speculate import Drafter

        doc = doc if doc is not None else self._prefix()
        base = self._drafters.get(doc.key)
        if base is None or len(base.tokens) > len(doc.ids) or base.tokens != doc.ids[:len(base.tokens)]:
            for k in [k for k in self._drafters if k is not None and k not in self.documents.resident]:
                del self._drafters[k]  # their documents left memory
            base = self._drafters[doc.key] = Drafter(doc.ids)
        return Drafter(doc.ids[len(base.tokens):] + list(own), base=base)  # (a conversation's kept turns)

    def _op_generate(self, req):
        """``generate`` as one request on the batch loop: the prompt is a document, prefilled into
        the ranks' pools in the segments one prefill of it cuts (``--prefill-chunk``; its progress
        reported, saved once complete with ``--save-kv``), and the answer a question with no
        tokens of its own over it (from its last logits: ``documents.Document.logits``); with
        ``--load-kv`` the loaded cache is the document and the prompt the question (with
        ``--save-kv`` too, the prompt is kept into the document, then saved: the cache of both, as
        a later ``--load-kv`` continues it). Rank 0 streams ``token`` events and ends with
        ``answer``, whose record counts the prompt's prefill, whichever way it went."""
        job = self.job
        prompt = list(job.prompt_ids)
        if job.load_kv:
            from .kvstore import load_ids

            doc_ids, question = load_ids(Path(job.load_kv)), prompt
            doc = {"load_from": job.load_kv, "manifest": job.load_manifest}
        else:
            doc_ids, question = prompt, []
            doc = {"progress": True, "last_logits": True,
                   **({"save_to": job.save_kv, "save_meta": job.save_meta} if job.save_kv else {})}
        doc.update(key="generate", ids=doc_ids, piece=job.prefill_chunk or max(1, -(-len(doc_ids) // self.mesh.cp)))
        keep = {"keep": "question"} if job.load_kv and job.save_kv else {}
        self._op_batch({"op": "batch", "questions": [{"ids": question, "doc": doc, **keep}], "slots": 1,
                        "max_new_tokens": job.max_new_tokens, "stop": list(job.stop), "eos_ids": list(job.eos_ids),
                        "sampling": vars(job.sampling), "speculate": job.speculate, "logprobs": job.logprobs,
                        "digest": job.digest, "cite": job.cite,
                        "pool_for": len(doc_ids) + (len(question) if keep else 0),
                        "tails": len(question) + job.max_new_tokens},  # (the question and its answer: the tail's)
                       single=True)
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
        from .batch import Question
        from .requests import Ask

        defaults = {k: req.get(k) for k in ("max_new_tokens", "sampling", "stop", "eos_ids", "speculate", "logprobs",
                                            "digest", "cite")}
        doc_defaults = {k: req[k] for k in ("budget", "dir", "save_meta", "piece", "save", "pool", "pool_blocks",
                                            "pool_for", "tails", "tail_slots", "grow", "page") if req.get(k) is not None}
        kept_docs: set = set()  # documents a question of this batch keeps into

        def question(q) -> Question:
            ask = Ask.read(q, defaults)
            ids = ask.ids
            stop_check = None
            if self.lead:
                if self._tok is None and ask.stop:
                    self._tok = load_tokenizer(self.job.model_dir, self.job.trust_remote_code)
                stop_check = _stop_check(self._tok, ask.stop, set(ask.eos_ids))
            source, doc_spec = "memory", None
            if ask.doc is not None and ask.doc.action:  # the documents API: evict, drop (now)
                source = self.documents.act({**doc_defaults, **ask.doc.wire()})
                doc = Document(None, [], None)  # nothing to answer over
            elif ask.doc is not None:
                doc_spec = {**doc_defaults, **ask.doc.wire()}
                doc = self.documents.get(doc_spec)
                source = doc.source
            else:  # it continues the engine's own tokens
                doc = self._prefix()
            self.documents.use(doc)
            keep = ask.keep if doc_spec is not None else False  # (into a named document)
            if keep:
                # a kept turn continues the document as the previous turn left it: a second one in
                # the same batch would be answered without the first and fed its pending token too
                if doc.key in kept_docs:
                    raise ValueError(f"a batch keeps at most one question per document; two keep {doc.key!r}")
                kept_docs.add(doc.key)
            if keep is True and doc.pending is not None and not ask.drop_pending:
                ids = [doc.pending] + ids  # the last kept answer's last token: fed now (as an append would)
            return Question(ids, ask.max_new_tokens, ask.sampling, ask.speculate or "off", stop_check, ask.logprobs,
                            doc=doc, source=source, doc_spec=doc_spec, cite=ask.cite, keep=keep, digest=ask.digest)

        qs = [question(q) for q in req["questions"]]
        seq = req.get("seq", 0)
        feed = None
        if req.get("open") and self.lead:
            feed = C.BatchFeed(seq)
        bd = self._batch_decoder(max(1, req["slots"] if req.get("open") else min(req["slots"], len(qs))),
                                 max([len(q.ids) + q.max_new_tokens for q in qs] or [64]))
        t0 = time.perf_counter()

        def on_doc(qi, q):
            ch = self.documents.take_changes()
            if any(ch.values()):
                self.ctx.send("docs", ch)
            self.ctx.send("bdoc", (qi, {"source": q.source, "tokens": q.doc.tokens, "seconds": q.doc.seconds,
                                         "reused": q.doc.reused, "pools": q.pools}))

        last: dict = {}

        def answered(qi, rec):  # (rank 0) a single answer's record is the request's
            last["rec"] = rec
            self.ctx.send("answer", rec) if single else self.ctx.send("banswer", (qi, rec))

        answers = bd.run(qs, drafter=(lambda doc, own: self._drafter(own, doc)) if self.lead else None,
                         citation=self.citation,
                         make_question=question, documents=self.documents, on_doc=on_doc if self.lead else None,
                         interrupted=(lambda: C.interrupted(seq)) if req.get("interruptible") else None,
                         feed=(lambda: (feed.joins(), feed.cancels())) if feed else None,
                         news_flag=C.news if self.lead and (feed or req.get("interruptible")) else None,
                         on_token=(lambda qi, tok: self.ctx.send("token", tok)) if single else
                         (lambda qi, tok: self.ctx.send("btoken", (qi, tok))),
                         on_answer=answered,
                         budget=req.get("piece") or PIECE.get(self.device.type, PIECE["cuda"]))
        done = [a for a in answers if a is not None]
        if done:
            self.summary = done[-1]
        if single and last:  # (rank 0) with its logprobs and digests
            self.summary = {k: v for k, v in last["rec"].items() if k != "token_ids"}
        self.documents.evict(req.get("budget"))  # its questions released their documents
        changes = self.documents.take_changes()
        if self.lead and any(changes.values()):
            self.ctx.send("docs", changes)
        pools = self.documents.pools()  # every rank's (the pool is made on every rank at the same document)
        graphs = bd.graph_counts()
        for k in ("graph_captures", "graph_replays", "verify_graph_replays"):
            self.graph_totals[k] += graphs[k]
        self.graph_totals["graph_note"] = self.graph_totals["graph_note"] or graphs["graph_note"]
        if self.lead:
            self.ctx.send("batch_done", {"pools": pools, "answers": len(done), "new_tokens": sum(a["new_tokens"] for a in done),
                                         "seconds": time.perf_counter() - t0, "slots": bd.slots,
                                         "documents_per_step": bd.documents_per_step,
                                         "segments_while_decoding": bd.segments_while_decoding,
                                         "question_chunks": bd.question_chunks,
                                         "chunks_while_decoding": bd.chunks_while_decoding,
                                         "pool_waits": self.documents.waits,
                                         "tail_waits": bd.tail_waits,  # rounds a question waited for its tail's blocks
                                         "pool": self.documents.pool.stats() if self.documents.pool else None,
                                         "joins": feed.taken if feed else 0, "batch_runs": bd.runs,
                                         # its steps' CUDA graphs (graphs.StepGraphs): captured, replayed
                                         **graphs})

    def _batch_decoder(self, slots: int, capacity: int):
        """The engine's batch decoder, kept from one batch to the next while the slots stay (a
        server's batches end whenever it is idle): its tail and its captured steps are reused,
        not allocated and captured again for every burst of requests."""
        from .batch import BatchDecoder

        if self.documents.pool is None:  # (a batch of no question yet: the default pool)
            self.documents.make_pool({})
        bd, pool = self._bd, self.documents.pool
        if bd is None or bd.slots != slots:
            if bd is not None:
                bd.tail.release_all()
            bd = self._bd = BatchDecoder(self.dec, slots=slots, capacity=capacity, pool=pool)
        else:
            bd.prepare(capacity, pool)
        bd.runs += 1
        return bd

    def _op_mark(self, req):
        """Remember the engine's own tokens as they are now, or with ``doc`` (a key) that resident document."""
        if req.get("doc") is not None:
            self.marks[req["name"]] = self.documents.mark(self._resident_doc(req["doc"], "mark"))
            return
        doc = self._prefix()
        self.marks[req["name"]] = (self.documents.mark(doc), doc.logits, doc.has_logits, doc.made, self.ready)

    def _resident_doc(self, key: str, what: str) -> Document:
        doc = self.documents.resident.get(key)
        if doc is None or not doc.ready:  # the same on every rank: they all refuse together
            raise RuntimeError(f"{what}: the document {key} is not resident")
        return doc

    def _op_rollback(self, req):
        if req.get("doc") is not None:
            self.documents.rollback(self._resident_doc(req["doc"], "rollback"), self.marks[req["name"]])
            return
        mark, logits, has_logits, made, ready = self.marks[req["name"]]
        doc = self._prefix()
        self.documents.rollback(doc, mark)
        doc.logits, doc.has_logits, doc.made, self.ready = logits, has_logits, made, ready

    def _op_save(self, req):
        """Save the engine's cached tokens, or with ``doc`` (a key) that resident document."""
        t0 = time.perf_counter()
        cache, ids = self._prefix().cache, self.ids
        if req.get("doc") is not None:
            doc = self._resident_doc(req["doc"], "save")
            cache, ids = doc.cache, doc.ids
        self.save_cache(cache, ids, Path(req["dir"]), req)
        if self.lead:
            self.ctx.send("saved", {"dir": str(req["dir"]), "tokens": len(ids),
                                    "seconds": time.perf_counter() - t0})

    def save_cache(self, cache, ids, target: Path, meta: dict) -> None:
        """Every rank's shard of ``cache`` (holding ``ids``) to ``target`` (kvstore.py):
        written under a temporary name, renamed once complete; ``meta``: identity, composition,
        nonce."""
        from . import kvstore

        tmp = target.with_name(f"{target.name}.partial-{meta['nonce']}")
        if self.lead:
            tmp.mkdir(parents=True, exist_ok=True)
        self.world.barrier()
        if self.heads_split or self.mesh.tp_index == 0:  # tp peers with the same heads: one writes
            kvstore.save_shard(tmp, cache, cp_index=self.mesh.cp_index, tp_index=self.mesh.tp_index,
                               head0=self.head0)
        self.world.barrier()
        if self.lead:
            sh = self.shapes
            kvstore.finish_save(tmp, target, ids=ids, identity=meta["identity"],
                                dtype=str(self.dtype).replace("torch.", ""),
                                kv={"kv_dtype": self.kv_name,
                                    **({"rotation": cache.quant.rotation, "scale_groups": cache.quant.groups}
                                       if cache.quant is not None else {})},
                                shapes={"layers": sh["num_layers"], "kv_heads": sh["kv_heads"],
                                        "head_dim": sh["head_dim"]},
                                mesh={"nproc": self.ctx.world, "tp": self.mesh.tp, "cp": self.mesh.cp},
                                composition=meta.get("composition", {}))
        self.world.barrier()  # the cache is in place before anyone goes on

    def _op_load(self, req):
        """The engine's own tokens from a saved cache (``kvstore.py``; re-sharded to these ranks)."""
        from . import kvstore

        t0 = time.perf_counter()
        doc = self._prefix()
        doc.cache.free()
        doc.ids, doc.pending, doc.logits, doc.has_logits, doc.made = [], None, None, False, None
        self.ready = False  # a load is followed by an append
        need = kvstore.shard_counts(req["manifest"], self.mesh.cp)[self.mesh.cp_index]
        if not self.documents.room(doc, need):
            raise RuntimeError(f"the KV pool cannot hold the saved cache's {need} tokens on this rank")
        kvstore.load_into(req["dir"], req["manifest"], doc.cache, cp=self.mesh.cp, cp_index=self.mesh.cp_index,
                          head0=self.head0)
        doc.ids = kvstore.load_ids(Path(req["dir"]))
        if self.lead:
            self.ctx.send("loaded", {"dir": req["dir"], "tokens": len(doc.ids),
                                     "seconds": time.perf_counter() - t0})

    def _finish(self):
        mem = [_peak_rss()] + ([torch.cuda.max_memory_allocated(self.device)] if self.device.type == "cuda" else [])
        segs = self.dec.segments
        nm = len(mem)
        every = self.world.all_gather_values(mem + [x for seg in segs for x in (seg["flops"], seg["bytes"])])
        mem = every[:, :nm]  # [ranks, 1 or 2]: every rank's peaks, for the record
        pools = self.documents.pools()  # (a collective: every rank) every rank's [used, total] blocks
        if not self.lead:
            return None
        graphs = self.graph_totals
        shards = self._bd.last_shards if self._bd is not None else None  # the last answer's: document and tail
        if shards is None:
            shards = self.prefix.cache.counts[0] if self.prefix is not None else [0] * self.mesh.cp
        shards = [int(x) for x in shards]
        out = dict(self.summary or {})
        out.update({
            "nproc": self.ctx.world, "tp": self.mesh.tp, "cp": self.mesh.cp, "nodes": len(set(self.nodes)),
            "weight_bytes": weight_bytes(self.model),
            "shard_tokens": shards,
            "scheme": self.scheme, "eager_scheme": self.comm.eager_scheme or self.scheme, "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
            "kv_dtype": self.kv_name,  # bytes of KV one token takes on all ranks together, scales included
            "kv_bytes_per_token": self.kv.bytes_per_token() * self.mesh.tp,
            # the steps replayed from CUDA graphs, over every batch
            "cuda_graph": bool(graphs["graph_captures"]),
            "cuda_graph_replays": graphs["graph_replays"],
            "verify_graph_replays": graphs["verify_graph_replays"],
            "static_step": self.dec.static,
            **({"kv_pool": pools} if pools is not None else {}),
            "kernels": "reference (the fast kernels failed their self-check)" if self.job.reference else "fast",
            "rows": self.model.treeattn_rows.describe(),  # how a row's matmuls stay its own (issue 49)
            "peak_rss_bytes": [int(x) for x in mem[:, 0].tolist()],
            "prefill_segments": [{**{k: seg[k] for k in ("tokens", "cached", "method", "sharding")},
                                  "flops_per_rank": [int(x) for x in every[:, nm + 2 * i].tolist()],
                                  "bytes_per_rank": [int(x) for x in every[:, nm + 2 * i + 1].tolist()]}
                                 for i, seg in enumerate(segs)],
        })
        if self.device.type == "cuda":
            out["peak_device_bytes"] = [int(x) for x in mem[:, 1].tolist()]
        if self.dec.graph_note or graphs["graph_note"]:
            out["note"] = self.dec.graph_note or graphs["graph_note"]
        return out


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_generate(ctx, job, single: bool = False):
    """Entry point of every rank for ``generate`` (``launch.run_local`` / ``run_torchrun``):
    :func:`generate_requests` (``single``: :func:`single_requests`, the engine's own tokens)."""
    summary = Engine(ctx, job).serve(single_requests(job) if single else generate_requests(job))
    if summary is not None:
        ctx.send("done", summary)
    return summary


def rank_engine(ctx, job):
    """Entry point of every rank for ``chat``: requests from the launcher until ``stop``."""
    return Engine(ctx, job).serve(inbox())
