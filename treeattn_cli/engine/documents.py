"""The documents this rank holds: one sharded cache each, made resident from memory, disk or a
prefill that runs a segment at a time (DESIGN.md §12).

A document is the cached prefix that questions continue (a server's document, chat's prompt).
:meth:`Documents.get` makes one resident: from memory if held; from a saved cache
(``kvstore``) if one is on disk; else it is *pending* and :meth:`Documents.advance` prefills it
one segment per call, so a batch decodes other documents' questions between the segments (a
new document never stalls running answers for longer than one segment). The segments are
``decode.segments`` of the whole document — the cuts a single prefill call makes — so a
document prefilled a segment at a time holds exactly the numbers it holds prefilled at once.

Documents in use (counted by :meth:`use` / :meth:`release`: questions queued or answering) are
never evicted; the others leave least recently used first when the resident documents exceed
the byte budget, saved to the cache directory first when they are not there yet (a restart, or
a later question, loads them back). Every rank makes the same calls in the same order (the
batch's questions travel to all ranks), so they hold the same documents.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cache import ShardedKVCache
from .decode import segments

# Tokens per rank of a document's prefill segment when the request names none: the longest
# pause a new document puts between the tokens of answers under way is one segment (on the
# project's 2-core CPU box, a segment of 2 x 256 tokens of the embedded model took 1.3-1.6 s;
# 2 x 128 about half that).
PIECE = {"cpu": 128, "cuda": 4096}


@dataclass
class Document:
    """One resident document: its tokens, this rank's cache of them, what remains to prefill."""

    key: str | None  # None: the engine's current prefix (chat's prompt), not a cache entry
    ids: list
    cache: ShardedKVCache
    todo: list = field(default_factory=list)  # prefill segments (start, end) of ids still to run
    source: str = "memory"  # how it became resident: memory, disk, prefill
    on_disk: bool = False
    save: dict | None = None  # write-through once complete: {"dir": d, "meta": {...}}
    users: int = 0  # questions queued or answering over it
    hits: int = 0
    t_start: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0  # to make it resident

    @property
    def ready(self) -> bool:
        return not self.todo

    @property
    def tokens(self) -> int:
        """Tokens held over all ranks (host bookkeeping, the same on every rank)."""
        return int(self.cache.counts[0].sum())


class Documents:
    """This rank's resident documents, least recently used first, within ``budget`` bytes."""

    def __init__(self, engine):
        self.engine = engine
        self.resident: OrderedDict[str, Document] = OrderedDict()
        self.changes = {"evicted": [], "spilled": [], "saved": []}  # since the last take_changes()
        self.spill_dir, self.spill_meta = None, None  # where an evicted document not yet saved goes

    def nbytes(self) -> int:
        return sum(d.cache.nbytes() for d in self.resident.values())

    def get(self, spec: dict) -> Document:
        """The document of ``spec`` (``key``, ``ids``; optional ``dir`` (the cache directory),
        ``manifest`` (of its saved copy), ``save`` + ``save_meta`` (write-through), ``piece``
        (tokens per rank per prefill segment, default :data:`PIECE`), ``budget`` (bytes per
        rank)): resident, or
        pending (:meth:`advance` prefills it)."""
        from . import kvstore

        key, ids = spec["key"], list(spec["ids"])
        if spec.get("dir") and spec.get("save_meta"):
            self.spill_dir, self.spill_meta = spec["dir"], spec["save_meta"]
        doc = self.resident.get(key)
        if doc is not None:
            self.resident.move_to_end(key)
            doc.hits += 1
            doc.source = "memory"
            return doc
        eng = self.engine
        t0 = time.perf_counter()
        cache = eng.new_cache(len(ids))
        saved = Path(spec["dir"]) / key if spec.get("dir") else None
        doc = Document(key, ids, cache, t_start=t0)
        if saved is not None and (saved / kvstore.MANIFEST).exists():
            manifest = spec.get("manifest") or json.loads((saved / kvstore.MANIFEST).read_text())  # ours: spilled
            kvstore.load_into(saved, manifest, cache, cp=eng.mesh.cp, cp_index=eng.mesh.cp_index,
                              head0=eng.head0)
            doc.source, doc.on_disk = "disk", True
            doc.seconds = time.perf_counter() - t0
        else:
            doc.source = "prefill"
            piece = spec.get("piece") or PIECE.get(cache.device.type, PIECE["cuda"])
            doc.todo = list(segments(len(ids), eng.mesh.cp, piece)) if ids else []
        if spec.get("save") and spec.get("dir") and not doc.on_disk:
            doc.save = {"dir": spec["dir"], "meta": spec["save_meta"]}
        self.resident[key] = doc
        if doc.ready:
            self._complete(doc)
        self.evict(spec.get("budget"))
        return doc

    def advance(self, doc: Document) -> int:
        """Prefill the next segment of a pending document; returns the tokens it took."""
        s0, s1 = doc.todo[0]
        dec = self.engine.dec
        was = dec.cache
        dec.cache = dec.actx.cache = doc.cache
        try:
            dec.prefill(torch.tensor([doc.ids[s0:s1]], dtype=torch.int64))  # one segment: s1 - s0 <= p·piece
        finally:
            dec.cache = dec.actx.cache = was
        doc.todo.pop(0)
        if doc.ready:
            if doc.cache.device.type == "cuda":
                torch.cuda.synchronize(doc.cache.device)
            doc.seconds = time.perf_counter() - doc.t_start
            self._complete(doc)
        return s1 - s0

    def complete(self, doc: Document) -> None:
        """Every remaining segment of ``doc`` now."""
        while doc.todo:
            self.advance(doc)

    def _complete(self, doc: Document) -> None:
        if doc.save is not None and doc.ids:  # write-through: a restart keeps it
            target = Path(doc.save["dir"]) / doc.key
            self.engine.save_cache(doc.cache, doc.ids, target, {**doc.save["meta"], "nonce": doc.key[:8]})
            doc.on_disk, doc.save = True, None
            self.changes["saved"].append(doc.key)

    def use(self, doc: Document) -> None:
        doc.users += 1

    def release(self, doc: Document) -> None:
        doc.users = max(0, doc.users - 1)

    def evict(self, budget: int | None, keep: Document | None = None) -> list[str]:
        """Documents out of memory, least recently used first, until the resident ones fit
        ``budget`` bytes; never one in use, a pending one, or ``keep`` (the newest is kept too:
        one document alone may exceed the budget). One not saved yet is saved first when a
        cache directory is known."""
        out = []
        if budget is None:
            return out
        newest = next(reversed(self.resident), None)
        for key in list(self.resident):
            if self.nbytes() <= budget:
                break
            doc = self.resident[key]
            if doc.users or not doc.ready or doc is keep or key == newest:
                continue
            if not doc.on_disk and doc.ids and self.spill_dir is not None:
                self.engine.save_cache(doc.cache, doc.ids, Path(self.spill_dir) / key,
                                       {**self.spill_meta, "nonce": key[:8]})
                doc.on_disk = True
                self.changes["spilled"].append(key)
            del self.resident[key]
            self.changes["evicted"].append(key)
            out.append(key)
        return out

    def take_changes(self) -> dict:
        """What left memory, was spilled to disk or saved since the last call (then cleared)."""
        out = {k: list(v) for k, v in self.changes.items()}
        for v in self.changes.values():
            v.clear()
        return out
