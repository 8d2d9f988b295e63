"""The engine's own tokens (``Engine.prefix``: a document of the pool with no key): what
``append`` adds and a ``decode`` answers from, cut back by ``mark`` / ``rollback``, written and
read by ``save`` / ``load`` — the ring baseline (``bench``), ``bench.cite`` and tests ask this
way; the same ``mark`` / ``rollback`` / ``save`` with ``doc`` act on a resident named document
(a conversation's turns). Mixed into ``engine.Engine``: these methods read its documents, its
decoder and its saver."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .decode import segments
from .documents import Document


class OwnTokens:
    """The requests on the engine's own tokens (see the module's docstring)."""

    @property
    def ids(self) -> list:
        """The engine's own tokens, in order (every rank)."""
        return self.prefix.ids if self.prefix is not None else []

    def _prefix(self) -> Document:
        """The engine's own tokens as a document in the pool (made, with the pool, at first use:
        sized for ``job.reserve_tokens`` and at least the default)."""
        if self.prefix is None:
            self.prefix = Document(
                None, [], self.documents.new_shard({"pool_for": self.job.reserve_tokens, "grow": True})
            )
        return self.prefix

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
            raise RuntimeError(
                f"the KV pool ({pool.num_blocks} blocks of {pool.page} tokens per rank) cannot "
                f"hold {len(ids)} more tokens after {len(doc.ids)}"
            )
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

    def _op_decode(self, req):
        """An answer after the engine's own tokens: a question with no tokens of its own over them,
        answered from the last append's logits on the batch loop (a batch of one)."""
        if not self.ready:  # known on every rank: they all refuse together
            raise RuntimeError("decode needs tokens appended first")
        if req.get("keep"):
            raise ValueError(
                "decode keeps no answer: a conversation keeps its turns in a named document "
                "(a batch question with doc and keep)"
            )
        q = {
            k: req[k]
            for k in ("max_new_tokens", "sampling", "stop", "eos_ids", "speculate", "logprobs", "digest", "cite")
            if k in req
        }
        self._op_batch(
            {
                "questions": [{**q, "ids": []}],
                "slots": 1,
                "seq": req.get("seq", 0),
                "interruptible": req.get("interruptible"),
                "max_new_tokens": req["max_new_tokens"],
            },
            single=True,
        )
        doc = self.prefix
        doc.logits, doc.has_logits, doc.made, self.ready = None, False, None, False

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
        self.saver.save(cache, ids, Path(req["dir"]), req)
        if self.lead:
            self.ctx.send("saved", {"dir": str(req["dir"]), "tokens": len(ids), "seconds": time.perf_counter() - t0})

    def _op_load(self, req):
        """The engine's own tokens from a saved cache (``kvstore.py``; re-sharded to these ranks)."""
        from ..storage import kvstore

        t0 = time.perf_counter()
        doc = self._prefix()
        doc.cache.free()
        doc.ids, doc.pending, doc.logits, doc.has_logits, doc.made = [], None, None, False, None
        self.ready = False  # a load is followed by an append
        need = kvstore.shard_counts(req["manifest"], self.mesh.cp)[self.mesh.cp_index]
        if not self.documents.room(doc, need):
            raise RuntimeError(f"the KV pool cannot hold the saved cache's {need} tokens on this rank")
        kvstore.load_into(
            req["dir"], req["manifest"], doc.cache, cp=self.mesh.cp, cp_index=self.mesh.cp_index, head0=self.head0
        )
        doc.ids = kvstore.load_ids(Path(req["dir"]))
        if self.lead:
            self.ctx.send("loaded", {"dir": req["dir"], "tokens": len(doc.ids), "seconds": time.perf_counter() - t0})
