"""One engine, many requests (docs/architecture.md §10): ranks started once, the model loaded once.

Each rank builds an :class:`Engine` (its share of the model on the (cp × tp) mesh, communicators,
sharded cache, decoder) and serves a sequence of requests, the same on every rank, in order:

* ``{"op": "append", "ids": [...], "piece": n}``: prefill the tokens after what the cache holds
  (the document, a question, the next turn of a conversation);
* ``{"op": "decode", "seq": i, "max_new_tokens": n, "sampling": {...}, "stop": [...],
  "eos_ids": [...], "keep": bool}``: sample an answer, streaming ``token`` events from rank 0
  and ending with an ``answer`` event (its stats); rank 0 also stops when the launcher posts an
  interrupt for request ``i``. ``keep``: the answer stays in the cache (its last token is fed
  with the next append), else the caller rolls back. ``"logprobs": k`` (here and per question
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
* ``{"op": "mark", "name": s}`` / ``{"op": "rollback", "name": s}``: remember the cache's
  lengths / return to them (nothing copied); with ``"doc": key``, those of that resident
  document (a conversation's turns leave, their blocks go back to the pool);
* ``{"op": "save", "dir": d, "nonce": s, ...}`` / ``{"op": "load", "dir": d, "manifest": {...}}``:
  the sharded cache to and from disk (``kvstore.py``);
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

import math
import time
from pathlib import Path

import torch

from treeattn_kernels import use_reference

from ..parallel import comm as C
from .attention import AttentionContext
from .cache import ShardedKVCache
from .decode import Decoder, Timings
from .documents import PIECE, Document, Documents
from .kvquant import storage
from .sampling import Sampling
from .speculate import Speculation
from ..parallel.mesh import Mesh, check_tp_within_nodes
from ..topology.layout import cp_layout
from .model import load_model, load_tokenizer, pick_dtype, shapes, weight_bytes


def generate_requests(job) -> list[dict]:
    """``generate`` as requests: the prompt a document in the ranks' block pool, the answer a
    question over it (``Engine._op_generate``); the ring baseline (``decode_method="ring"``,
    ``bench``) on the engine's own cache (:func:`single_requests`)."""
    if job.decode_method != "ring":
        return [{"op": "generate"}, {"op": "stop"}]
    return single_requests(job)


def single_requests(job) -> list[dict]:
    """``generate`` on the engine's own cache (the ring baseline, and the single answer the
    pooled one is checked against): load a saved cache (``--load-kv``), append the prompt,
    decode, and with ``--save-kv`` save the cache of the prompt (rolled back past the answer)."""
    reqs = []
    if job.load_kv:
        reqs.append({"op": "load", "dir": job.load_kv, "manifest": job.load_manifest})
    reqs.append({"op": "append", "ids": list(job.prompt_ids), "piece": job.prefill_chunk})
    if job.save_kv:
        reqs.append({"op": "mark", "name": "prompt"})
    reqs.append({"op": "decode", "seq": 0, "max_new_tokens": job.max_new_tokens, "stop": list(job.stop),
                 "eos_ids": list(job.eos_ids), "sampling": vars(job.sampling), "keep": False,
                 "speculate": job.speculate, "logprobs": job.logprobs, "cite": job.cite})
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
    """This rank's model, mesh, communicators, cache and decoder, and the requests it serves."""

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
        cp = mesh.cp
        cap = math.ceil(job.reserve_tokens / cp) + 2
        static = job.static if job.static is not None else device.type == "cuda"
        # KV heads this rank attends with: 1/T of them, unless the plan gives every tp rank all
        # of them (Phi-3's fused qkv_proj is gathered again); then tp peers hold the same heads
        self.heads_split = job.tp_heads_split
        self.kv_heads = sh["kv_heads"] // (mesh.tp if self.heads_split else 1)
        self.head0 = mesh.tp_index * self.kv_heads if self.heads_split else 0
        kv_dtype, quant, self.kv_name = storage(job.kv_dtype, dtype, device, sh["head_dim"])
        self.cache = ShardedKVCache(sh["num_layers"], 1, self.kv_heads, sh["head_dim"], dtype=kv_dtype,
                                    device=device, rank=self.comm.rank, world=cp, capacity=cap, static=static,
                                    quant=quant)
        self.dec = Decoder(self.model, AttentionContext(self.comm, self.cache, decode_method=job.decode_method),
                           vocab_size=self.model.get_output_embeddings().weight.shape[0], world=self.world,
                           cuda_graph=job.cuda_graph and ctx.backend == "nccl" and job.decode_method == "tree",
                           sharding=job.prefill_sharding)
        self.lead = ctx.rank == 0
        self.ids: list[int] = []  # the tokens the cache holds, in order (every rank)
        self.pending: int | None = None  # an answer's last token, sampled but not yet in the cache
        self.logits = None  # rank 0: of the last token in the cache
        self.ready = False  # tokens appended since the last answer: a decode may follow
        self.marks: dict = {}
        self.appended = (0, 0.0, 0.0)  # tokens, seconds, start time of the last append
        self.summary: dict | None = None
        self.methods: list[str] = []  # how the last append's segments met the cache (prefill.plan)
        self._doc_drafter = None  # rank 0: speculation's n-gram index of the cached tokens
        self.documents = Documents(self)  # serve, mixed batches: the resident documents (documents.py)
        self._drafters: dict = {}  # rank 0: speculation's n-gram index of each document, by key
        self._tok = None
        self._bd = None  # the batch decoder (batch.py), kept across batches: _batch_decoder
        self.batch_graphs: dict = {}  # the last batch's CUDA graph counts (batch.BatchDecoder.graph_counts)
        self.generated: dict | None = None  # generate over the pool: its shards and step (_op_generate)

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
        if req.get("drop_pending"):  # the answer ended with EOS: the chat template closes the turn
            self.pending = None
        ids = ([self.pending] if self.pending is not None else []) + list(req["ids"])
        self.pending = None
        if not ids:
            return
        t0 = time.perf_counter()
        progress = (lambda done, total: self.ctx.send("prefill", (done, total))) if self.lead else None
        first = len(self.dec.segments)
        logits = self.dec.prefill(torch.tensor([ids], dtype=torch.int64), req.get("piece"), progress)
        self.methods = sorted({seg["method"] for seg in self.dec.segments[first:]})  # as prefill_segments say
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.logits, self.ready = logits, True
        self.ids += ids
        self.appended = (len(ids), time.perf_counter() - t0, t0)
        if self.lead:
            self.ctx.send("appended", {"tokens": len(ids), "seconds": self.appended[1], "cached": len(self.ids)})

    def _op_pool(self, req):
        info = self.documents.make_pool(req)
        if self.lead:
            self.ctx.send("pool", info)

    def _op_decode(self, req):
        if not self.ready:  # known on every rank: they all refuse together
            raise RuntimeError("decode needs tokens appended first")
        stop_check = None
        if self.lead:
            if self._tok is None and req.get("stop"):
                self._tok = load_tokenizer(self.job.model_dir, self.job.trust_remote_code)
            stop_check = _stop_check(self._tok, req.get("stop") or [], set(req.get("eos_ids") or []))
        seq = req.get("seq", 0)
        n_prompt, prefill_s, t0 = self.appended
        context = len(self.ids)
        timings = Timings(start=t0)
        timings.prefill_s = prefill_s
        toks, reason = [], None
        sampling = Sampling(**req["sampling"])
        spec = Speculation.for_answer(req.get("speculate", "off"), sampling)
        logprobs, want_lp = [], req.get("logprobs")
        on_logprobs = logprobs.extend if self.lead and want_lp is not None else None
        cite = self.citation(req.get("cite"))
        for tok, reason in self.dec.decode(self.logits, max_new_tokens=req["max_new_tokens"],
                                           sampling=sampling, stop_check=stop_check,
                                           interrupted=(lambda: C.interrupted(seq)) if req.get("interruptible") else None,
                                           timings=timings, speculation=spec, logprobs=want_lp,
                                           on_logprobs=on_logprobs, cite=cite,
                                           context=self._drafter() if self.lead and spec.mode != "off" else None):
            toks.append(tok)
            if self.lead:
                self.ctx.send("token", tok)
        cited = cite.gather(self.world) if cite is not None else None  # every rank, at the answer's end
        self.logits, self.ready = None, False
        # the last token was sampled, not fed: it enters the cache with the next append (kept)
        self.ids += toks[:-1]
        self.pending = toks[-1] if req.get("keep") and toks else None
        count = len(toks)
        self.summary = {
            "prompt_tokens": n_prompt, "context_tokens": context, "new_tokens": count, "ttft_s": timings.ttft_s, "prefill_s": prefill_s,
            "prefill_tokens_per_s": n_prompt / prefill_s if prefill_s else None,
            "decode_tokens_per_s": (count - 1) / timings.decode_s if count > 1 and timings.decode_s else None,
            "stop_reason": reason, "prefill_method": "+".join(self.methods) or None,
            "speculation": spec.record(),
            **({"logprobs": logprobs} if want_lp is not None else {}),
            **({"cite": cited} if cited is not None else {}),
        }
        if self.lead:
            self.ctx.send("answer", {**self.summary, "token_ids": toks})

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
        """Rank 0: a drafter over the tokens of ``doc`` (default: those in the engine's cache),
        then ``own``. The index of a long document is built once and shared: later answers and
        every slot of a batch index only what follows it."""
        from .speculate import Drafter

        if doc is not None and doc.key is not None:
            base = self._drafters.get(doc.key)
            if base is None or len(base.tokens) > len(doc.ids) or base.tokens != doc.ids[:len(base.tokens)]:
                for k in [k for k in self._drafters if k not in self.documents.resident]:
                    del self._drafters[k]  # their documents left memory
                base = self._drafters[doc.key] = Drafter(doc.ids)
            return Drafter(doc.ids[len(base.tokens):] + list(own), base=base)  # (a conversation's kept turns)
        base = self._doc_drafter
        if base is None or len(base.tokens) > len(self.ids) or base.tokens != self.ids[:len(base.tokens)]:
            base = self._doc_drafter = Drafter(self.ids)
        return Drafter(self.ids[len(base.tokens):] + list(own), base=base)

    def _op_generate(self, req):
        """``generate`` over the block pool: the prompt is a document, prefilled into the ranks'
        pools in the segments one prefill of it cuts (``--prefill-chunk``; its progress
        reported, saved once complete with ``--save-kv``), and the answer a question with no
        tokens of its own over it (``documents.Document.logits``); with ``--load-kv`` the loaded
        cache is the document and the prompt the question (with ``--save-kv`` too, the prompt is
        kept into the document, then saved: the cache of both, as a later ``--load-kv``
        continues it). Rank 0 streams ``token`` events and ends with ``answer``, as a ``decode``
        does; the summary counts the prompt's prefill, whichever way it went."""
        job = self.job
        first = len(self.dec.segments)
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
        d = self.documents.resident["generate"]
        if keep:
            self._op_save({"dir": job.save_kv, "doc": "generate", **job.save_meta})
        s = dict(self.summary)
        prefill_s = s["prefill_s"] + (0.0 if job.load_kv else d.seconds)
        methods = sorted({seg["method"] for seg in self.dec.segments[first:]} | ({"batched"} if question else set()))
        s.update(prompt_tokens=len(prompt), prefill_s=prefill_s, prefill_method="+".join(methods) or None,
                 prefill_tokens_per_s=len(prompt) / prefill_s if prefill_s else None)
        tail = self._bd.tail
        self.generated = {"shard_tokens": (tail.counts[0] + tail.beside[0]).tolist(),  # the prompt's and the answer's
                          "static_step": bool(tail.static), "kv_pool": self.documents.pools()}  # [[used, total]] per rank
        if self.lead:
            rec = self._single
            s.update({k: rec[k] for k in ("logprobs", "digests") if k in rec})
            self.ctx.send("answer", {**s, "token_ids": rec["token_ids"]})
        self.summary = s

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

        defaults = {k: req.get(k) for k in ("max_new_tokens", "sampling", "stop", "eos_ids", "speculate", "logprobs",
                                            "digest", "cite")}
        doc_defaults = {k: req[k] for k in ("budget", "dir", "save_meta", "piece", "save", "pool", "pool_blocks",
                                            "pool_for", "tails", "tail_slots", "grow", "page") if req.get(k) is not None}
        here = Document(None, self.ids, self.cache)  # the engine's cached tokens: questions without a doc
        kept_docs: set = set()  # documents a question of this batch keeps into

        def question(q) -> Question:
            spec = {**defaults, **({} if isinstance(q, list) else q)}
            ids = list(q if isinstance(q, list) else q["ids"])
            stop_check = None
            if self.lead:
                if self._tok is None and spec.get("stop"):
                    self._tok = load_tokenizer(self.job.model_dir, self.job.trust_remote_code)
                stop_check = _stop_check(self._tok, spec.get("stop") or [], set(spec.get("eos_ids") or []))
            doc, source, doc_spec = here, "memory", None
            if spec.get("doc") and spec["doc"].get("action"):  # the documents API: evict, drop (now)
                source = self.documents.act({**doc_defaults, **spec["doc"]})
                doc = Document(None, [], self.cache)  # nothing to answer over
            elif spec.get("doc"):
                doc_spec = {**doc_defaults, **spec["doc"]}
                doc = self.documents.get(doc_spec)
                source = doc.source
            self.documents.use(doc)
            keep = (spec.get("keep") or False) if doc_spec is not None else False
            if keep:
                # a kept turn continues the document as the previous turn left it: a second one in
                # the same batch would be answered without the first and fed its pending token too
                if doc_spec["key"] in kept_docs:
                    raise ValueError(f"a batch keeps at most one question per document; two keep {doc_spec['key']!r}")
                kept_docs.add(doc_spec["key"])
            if keep is True and doc.pending is not None and not spec.get("drop_pending"):
                ids = [doc.pending] + ids  # the last kept answer's last token: fed now (as an append would)
            return Question(ids, spec["max_new_tokens"], Sampling(**(spec.get("sampling") or {})),
                            spec.get("speculate") or "off", stop_check, spec.get("logprobs"), doc=doc, source=source,
                            doc_spec=doc_spec, cite=spec.get("cite"), keep=keep, digest=bool(spec.get("digest")))

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

        answers = bd.run(qs, drafter=(lambda doc, own: self._drafter(own, doc)) if self.lead else None,
                         citation=self.citation,
                         make_question=question, documents=self.documents, on_doc=on_doc if self.lead else None,
                         interrupted=(lambda: C.interrupted(seq)) if req.get("interruptible") else None,
                         feed=(lambda: (feed.joins(), feed.cancels())) if feed else None,
                         news_flag=C.news if self.lead and (feed or req.get("interruptible")) else None,
                         on_token=(lambda qi, tok: self.ctx.send("token", tok)) if single else
                         (lambda qi, tok: self.ctx.send("btoken", (qi, tok))),
                         on_answer=(lambda qi, rec: setattr(self, "_single", rec)) if single else
                         (lambda qi, rec: self.ctx.send("banswer", (qi, rec))),
                         budget=req.get("piece") or PIECE.get(self.device.type, PIECE["cuda"]))
        done = [a for a in answers if a is not None]
        if done:
            self.summary = done[-1]
        self.documents.evict(req.get("budget"))  # its questions released their documents
        changes = self.documents.take_changes()
        if self.lead and any(changes.values()):
            self.ctx.send("docs", changes)
        pools = self.documents.pools()  # every rank's (the pool is made on every rank at the same document)
        self.batch_graphs = bd.graph_counts()  # (generate's record reads them too)
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
                                         **self.batch_graphs})

    def _batch_decoder(self, slots: int, capacity: int):
        """The engine's batch decoder, kept from one batch to the next while the slots stay (a
        server's batches end whenever it is idle): its tail and its captured steps are reused,
        not allocated and captured again for every burst of requests."""
        from .batch import BatchDecoder
        from .paged_tail import PagedTail

        bd, pool = self._bd, self.documents.pool  # (the tail takes its blocks there, once there is one)
        if bd is None or bd.slots != slots:
            if bd is not None and isinstance(bd.tail, PagedTail):
                bd.tail.release_all()
            bd = self._bd = BatchDecoder(self.dec, slots=slots, capacity=capacity, pool=pool)
        else:
            bd.prepare(capacity, pool)
        bd.runs += 1
        return bd

    def new_cache(self, tokens: int) -> ShardedKVCache:
        """An empty cache for a document of ``tokens`` tokens (stored like the engine's)."""
        c = self.cache
        return ShardedKVCache(c.num_layers, 1, c.kv_heads, c.head_dim, dtype=c.dtype, device=c.device, rank=c.rank,
                              world=c.world, capacity=math.ceil(tokens / self.mesh.cp) + 2, static=c.static,
                              quant=c.quant)

    def _activate(self, cache, ids) -> None:
        """Continue ``cache`` (holding ``ids``) from now on."""
        self.cache = self.dec.cache = self.dec.actx.cache = cache
        self.ids = list(ids)
        self.pending, self.logits, self.ready = None, None, False

    def _op_mark(self, req):
        """Remember the engine's cache as it is now, or with ``doc`` (a key) that resident document."""
        if req.get("doc") is not None:
            self.marks[req["name"]] = self.documents.mark(self._resident_doc(req["doc"], "mark"))
            return
        self.marks[req["name"]] = (self.cache.mark(), len(self.ids), self.logits, self.ready, self.pending)

    def _resident_doc(self, key: str, what: str) -> Document:
        doc = self.documents.resident.get(key)
        if doc is None or not doc.ready:  # the same on every rank: they all refuse together
            raise RuntimeError(f"{what}: the document {key} is not resident")
        return doc

    def _op_rollback(self, req):
        if req.get("doc") is not None:
            self.documents.rollback(self._resident_doc(req["doc"], "rollback"), self.marks[req["name"]])
            return
        mark, n, logits, ready, pending = self.marks[req["name"]]
        self.cache.rollback(mark)
        del self.ids[n:]
        self.logits, self.ready, self.pending = logits, ready, pending

    def _op_save(self, req):
        """Save the engine's cached tokens, or with ``doc`` (a key) that resident document."""
        t0 = time.perf_counter()
        cache, ids = self.cache, self.ids
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
        from . import kvstore

        t0 = time.perf_counter()
        kvstore.load_into(req["dir"], req["manifest"], self.cache, cp=self.mesh.cp, cp_index=self.mesh.cp_index,
                          head0=self.head0)
        self.ids = kvstore.load_ids(Path(req["dir"]))
        self.pending, self.logits, self.ready = None, None, False  # a load is followed by an append
        if self.lead:
            self.ctx.send("loaded", {"dir": req["dir"], "tokens": len(self.ids),
                                     "seconds": time.perf_counter() - t0})

    def _finish(self):
        mem = [_peak_rss()] + ([torch.cuda.max_memory_allocated(self.device)] if self.device.type == "cuda" else [])
        segs = self.dec.segments
        nm = len(mem)
        every = self.world.all_gather_values(mem + [x for seg in segs for x in (seg["flops"], seg["bytes"])])
        mem = every[:, :nm]  # [ranks, 1 or 2]: every rank's peaks, for the record
        if not self.lead:
            return None
        out = dict(self.summary or {})
        out.update({
            "nproc": self.ctx.world, "tp": self.mesh.tp, "cp": self.mesh.cp, "nodes": len(set(self.nodes)),
            "weight_bytes": weight_bytes(self.model),
            "shard_tokens": (self.generated or {}).get("shard_tokens") or self.cache.counts[0].tolist(),
            "scheme": self.scheme, "eager_scheme": self.comm.eager_scheme or self.scheme, "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
            "kv_dtype": self.kv_name,  # bytes of KV one token takes on all ranks together, scales included
            "kv_bytes_per_token": self.cache.bytes_per_token() * self.mesh.tp,
            # steps replayed from CUDA graphs: a single answer's (decode op), or generate's batch of one
            "cuda_graph": self.dec.graph is not None or bool(self.batch_graphs.get("graph_captures")),
            "cuda_graph_replays": self.dec.replays + self.batch_graphs.get("graph_replays", 0),
            "verify_graph_replays": self.dec.verify_graphs.replays + self.batch_graphs.get("verify_graph_replays", 0),
            "static_step": bool(self.generated["static_step"] if self.generated else self.cache.static),
            **({"kv_pool": self.generated["kv_pool"]} if self.generated else {}),  # every rank's [used, total] blocks
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
        if self.dec.graph_note or self.batch_graphs.get("graph_note"):
            out["note"] = self.dec.graph_note or self.batch_graphs["graph_note"]
        return out


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_generate(ctx, job, single: bool = False):
    """Entry point of every rank for ``generate`` (``launch.run_local`` / ``run_torchrun``): its
    KV lives in the ranks' block pools, the engine's own cache reserves nothing (but for the
    ring baseline; ``single``: on the engine's own cache, :func:`single_requests`)."""
    import dataclasses

    if single:
        summary = Engine(ctx, job).serve(single_requests(job))
    else:
        if job.decode_method != "ring":
            job = dataclasses.replace(job, reserve=0)
        summary = Engine(ctx, job).serve(generate_requests(job))
    if summary is not None:
        ctx.send("done", summary)
    return summary


def rank_engine(ctx, job):
    """Entry point of every rank for ``chat``: requests from the launcher until ``stop``."""
    return Engine(ctx, job).serve(inbox())
