"""The documents this rank holds: one sharded cache each, made resident from memory, disk or a
prefill that runs a segment at a time (docs/architecture.md §12).

A batch's documents live in the rank's block pool (``pool.BlockPool``, sized once, the same on
every rank: ``pool`` bytes or a ``pool_fraction`` of the free memory, else ``room.POOL_BYTES`` for
the device; :meth:`Documents.make_pool`; ``paged_shard.PagedShard``): they take the blocks
their tokens fill, and an evicted document gives its blocks back. Before each prefill segment,
and before a saved copy is loaded, the ranks agree that every one of them has the blocks it
needs (evicting unused documents first); when they have not, the document waits, and the answers
under way go on. Every document is in the pool: one shorter than the number of sequence shards
too (every rank computes its tokens and the fewest-tokens rule places them, as for a short
question; no block of it is offered for reuse). A document grows only by the
turns a conversation keeps (:meth:`Documents.keep`: a kept question and its answer, copied from
the batch's tail onto the rank that holds each of their tokens); :meth:`Documents.rollback`
gives them back.

A document is the cached prefix that questions continue (a server's document, chat's prompt).
:meth:`Documents.get` makes one resident: from memory if held; from a saved cache
(``kvstore``) if one is on disk; else it is *pending* and :meth:`Documents.advance` prefills it
one segment per call, so a batch decodes other documents' questions between the segments (a
new document never stalls running answers for longer than one segment). The segments are
``decode.segments`` of the whole document — the cuts a single prefill call makes — so a
document prefilled a segment at a time holds exactly the numbers it holds prefilled at once.

Documents in use (counted by :meth:`use` / :meth:`release`: questions queued or answering) are
never evicted by the byte budget, and those answered over (:meth:`start`) never at all; the others leave least recently used first when the resident documents exceed
the byte budget, saved to the cache directory first when they are not there yet (a restart, or
a later question, loads them back). Every rank makes the same calls in the same order (the
batch's questions travel to all ranks), so they hold the same documents.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .decode import segments
from .paged_shard import PagedShard
from . import block_reuse
from .pool import BlockPool
from .pool_sizing import make_pool
from ..storage.host_tier import HostTier, default_budget
from ..storage import copies

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
    cache: PagedShard
    todo: list = field(default_factory=list)  # prefill segments (start, end) of ids still to run
    segs: list = field(default_factory=list)  # all of them
    source: str = "memory"  # how it became resident: memory, pool (its blocks were cached), host, disk, prefill
    on_disk: bool = False
    save: dict | None = None  # write-through once complete: {"dir": d, "meta": {...}}
    users: int = 0  # questions queued or answering over it
    running: int = 0  # of them, answering (in a slot)
    evicted: bool = False  # left memory: its cache is gone (a queued question asks for it again)
    hits: int = 0
    keys: list | None = None  # this rank's chained key of each full block of its shard (pool.block_keys)
    counts: list | None = None  # every rank's shard tokens after each segment: [segments + 1][ranks]
    reused: int = (
        0  # tokens (over all ranks) found in the pool's cached blocks (or a saved prefix) instead of prefilled
    )
    loaded: int = 0  # of them, those loaded from a longer document's saved copy (copies.find_prefix)
    pinned: bool = False  # never leaves memory (the documents API's pin)
    progress: bool = False  # rank 0 reports its prefill's progress (``prefill`` events: tokens done, of all)
    load: tuple | None = None  # (dir, manifest): a saved copy to load once every rank has the blocks
    load_upto: int = 0  # of that copy, only the first segments (a longer document's: copies.find_prefix)
    digests: list | None = None  # sha256 of its tokens up to each segment's end (hex; block_reuse.plan)
    salt: str | None = None  # how its prefill was cut and stored (block_reuse.prefill_salt)
    owned: bool = True  # that copy is the cache directory's (a damaged one is removed), not the user's --load-kv
    piece: int | None = None  # tokens per rank of its prefill segments as asked (None: documents.PIECE)
    restore: object = None  # a host_tier.HostCopy of it to copy in once every rank has the blocks
    restored: int = 0  # of its layers, those copied in so far (a restore comes a part per round)
    pending: int | None = None  # a kept answer's last token: sampled, not in the cache (the next kept question's first)
    logits: object = None  # rank 0, when asked (``last_logits``): its last token's ``[1, V]`` from its prefill
    want_logits: bool = False
    has_logits: bool = False  # (every rank) its prefill here kept them
    made: dict | None = None  # with them: that prefill's {tokens, seconds, start, methods} (keep_logits)
    t_start: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0  # to make it resident
    methods: set = field(default_factory=set)  # how its prefill segments met the cache (prefill.plan)

    def keep_logits(self, logits, tokens: int, seconds: float, start: float, methods) -> None:
        """Keep its last token's ``logits`` (rank 0's ``[1, V]``; None elsewhere) from the prefill
        that made them: ``tokens`` prefilled in ``seconds`` from ``start``, by ``methods``
        (``prefill.plan``'s). A question with no tokens of its own answers from them, and its
        record counts that prefill (``batch.BatchDecoder._summary``)."""
        self.logits, self.has_logits = logits, True
        self.made = {"tokens": tokens, "seconds": seconds, "start": start, "methods": sorted(methods)}

    @property
    def ready(self) -> bool:
        """Resident and complete: questions over it can start."""
        return not self.todo and self.load is None and self.restore is None and not self.evicted

    @property
    def waiting(self) -> bool:
        """Resident but not complete: prefill segments or its load to come (:meth:`Documents.advance`)."""
        return bool(self.todo or self.load is not None or self.restore is not None) and not self.evicted

    @property
    def tokens(self) -> int:
        """Tokens held over all ranks (host bookkeeping, the same on every rank)."""
        return int(self.cache.counts[0].sum()) if self.cache is not None else 0


class Documents:
    """This rank's resident documents, least recently used first, within ``budget`` bytes."""

    def __init__(self, engine):
        self.engine = engine
        self.resident: OrderedDict[str, Document] = OrderedDict()
        # since the last take_changes(): keys that left memory, were spilled or saved, whose saved
        # copy was refused as it loaded (corrupt); and each document made resident (made)
        self.changes = {"evicted": [], "spilled": [], "saved": [], "corrupt": [], "made": []}
        self.host = HostTier(0)  # copies of documents that left the pool (sized with the pool: make_pool)
        self._host_seen: list = []  # the host tier's keys as last reported (take_changes)
        self.spill_dir, self.spill_meta = None, None  # where an evicted document not yet saved goes
        self.pool: BlockPool | None = None  # made at start (serve) or at the first paged document
        self.pool_free: int | None = None  # bytes free for KV on this rank when the pool was made
        self.waits = 0  # segments a document waited for blocks (the pool was full of documents in use)
        self.restore_parts = 0  # rounds that copied a part of a document back from the host tier
        self.prefix_loads = 0  # documents whose first segments came from a longer one's saved copy
        self.prefix_index: dict = {}  # rank 0: the cache directory's manifests' prefixes (copies.find_prefix)
        self.writes_off = False  # a write to the cache directory failed (a full disk): no more this run

    def _pool(self, ref: dict) -> BlockPool:
        if self.pool is None:
            self.make_pool(ref)
        return self.pool

    def make_pool(self, ref: dict) -> dict:
        """Allocate this rank's pool now (``serve`` at start, else the first paged document), the
        same number of blocks on every rank (``pool_sizing.make_pool``). Returns ``{blocks, page,
        bytes, free}`` (free: this rank's)."""
        if self.pool is None:
            self.pool, self.pool_free = make_pool(ref, self.engine)
            want = ref.get("host_memory")
            want = default_budget(self.pool.device, self.engine.world.world) if want is None else int(want)
            self.host = HostTier(self.engine.world.all_min(want))  # the same on every rank
        pool = self.pool
        per = BlockPool.bytes_per_block(
            pool.num_layers, pool.kv_heads, pool.head_dim, pool.page, pool.dtype, pool.quant.groups if pool.quant else 0
        )
        return {
            "blocks": self.pool.num_blocks,
            "page": self.pool.page,
            "bytes": self.pool.num_blocks * per,
            "free": self.pool_free,
            "host": self.host.budget,
        }

    def new_shard(self, ref: dict | None = None) -> PagedShard:
        """An empty shard in this rank's pool (made now, from ``ref``, if there is none yet)."""
        eng = self.engine
        return PagedShard(self._pool(ref or {}), rank=eng.comm.rank, world=eng.mesh.cp)

    def _mine(self, doc: Document, s0: int, s1: int) -> int:
        """Tokens of segment ``[s0, s1)`` of ``doc`` this rank will keep: its piece of the
        segment's sharding, or, for a segment shorter than the sequence shards (every rank
        computes all of it: ``decode._prefill_replicated``), those the fewest-tokens rule gives it."""
        from .prefill import shard, size

        eng = self.engine
        if s1 - s0 < eng.mesh.cp:
            return len(doc.cache.placement([True] * (s1 - s0))[0])
        return size(shard(s0, s1 - s0, eng.mesh.cp, balanced=eng.dec.sharding == "balanced")[eng.mesh.cp_index])

    def room(self, doc: Document, add: int, evict: bool = True) -> bool:
        """Whether every rank's pool has the blocks for ``add`` more tokens of ``doc`` on that
        rank (``evict``: making room first by evicting documents no question answers over); the
        same answer on every rank."""
        table = doc.cache.table
        agreed = self.engine.world.all_true(table.blocks_for(add) <= self.pool.available())
        if not agreed and evict:
            self.make_room(keep=doc)  # (counted again: a last block shared with an evicted document
            # is this table's alone now, and needs no copy)
            agreed = self.engine.world.all_true(table.blocks_for(add) <= self.pool.available())
        return agreed

    def make_room(self, keep: Document) -> None:
        """Every resident pooled document no question is answering over leaves memory (saved
        first when it can be; queued questions over it ask for it again when they start)."""
        for key in list(self.resident):
            d = self.resident[key]
            if d is keep or d.running or d.pinned:
                continue
            if d.ready:
                self._evict(key)
            elif d.todo != d.segs or d.reused:  # another pending document's blocks: it starts over
                d.cache.free()  # when its turn comes (its published blocks stay cached while room lasts)
                d.todo, d.reused, d.loaded = list(d.segs), 0, 0

    def nbytes(self) -> int:
        """Bytes of KV the resident documents hold per rank, counted from their token counts
        (the same on every rank, so every rank evicts the same documents)."""
        return sum(self.rank_bytes(d) for d in self.resident.values())

    def rank_bytes(self, doc: Document) -> int:
        """Bytes of KV ``doc`` holds per rank, counted from its tokens (the same on every rank)."""
        return -(-doc.tokens // self.engine.mesh.cp) * doc.cache.bytes_per_token()

    def segment(self, doc: Document, ref: dict, device: torch.device) -> int:
        """Cut ``doc`` into its prefill segments, all still to run (``ref["piece"]`` tokens per
        rank, default :data:`PIECE` of the device); returns the piece."""
        piece = ref.get("piece") or PIECE.get(device.type, PIECE["cuda"])
        doc.segs = list(segments(len(doc.ids), self.engine.mesh.cp, piece)) if doc.ids else []
        doc.todo = list(doc.segs)
        return piece

    def get(self, ref: dict) -> Document:
        """The document of ``ref`` (``key``, ``ids``; optional ``dir`` (the cache directory),
        ``manifest`` (of its saved copy), ``save`` + ``save_meta`` (write-through), ``piece``
        (tokens per rank per prefill segment, default :data:`PIECE`), ``budget`` (bytes per
        rank), ``pool`` / ``pool_fraction`` / ``pool_blocks`` / ``pool_for`` / ``grow`` / ``page`` (the
        pool, when the first document makes it: :meth:`make_pool`), ``load_from`` (a saved cache of
        it, where ``dir`` does not hold it under its key: ``chat --load-kv``), ``save_to`` (where
        its write-through copy goes, instead of ``dir``/key: ``chat --save-kv``; ``save_meta``
        with it), ``progress`` (rank 0 reports its prefill's progress), ``last_logits`` (rank 0 keeps the
        logits of its last token, once prefilled: a question with no tokens of its own answers
        from them, ``generate``)): resident, or pending
        (:meth:`advance` prefills it)."""
        from ..storage import kvstore

        key, ids = ref["key"], list(ref["ids"])
        if ref.get("dir") and ref.get("save_meta"):
            self.spill_dir, self.spill_meta = ref["dir"], ref["save_meta"]
        doc = self.resident.get(key)
        if doc is not None:
            self.resident.move_to_end(key)
            doc.hits += 1
            if doc.ready:  # (a pending one keeps how it becomes resident: prefill, disk)
                doc.source = "memory"
            return doc
        eng = self.engine
        t0 = time.perf_counter()
        cache = self.new_shard(ref)
        saved = Path(ref["load_from"]) if ref.get("load_from") else Path(ref["dir"]) / key if ref.get("dir") else None
        doc = Document(key, ids, cache, t_start=t0, owned=not ref.get("load_from"), piece=ref.get("piece"))
        hosted = self.host.take(key)  # (resident again: the host tier's copy is the document's now)
        if hosted is not None and hosted.ids != ids:  # (a conversation's turns grew it since: not this one)
            hosted = None
        if len(ids) >= eng.mesh.cp:  # (a shorter one fills no block worth sharing: every rank computes it)
            block_reuse.plan(self.engine, self.pool, doc, self.segment(doc, ref, cache.device))
            block_reuse.reuse(self.engine, self.pool, doc)
            if not doc.todo:
                doc.source = "pool"
        # its saved copy, checked (a collective), only when neither the pool nor the host tier holds it
        manifest = copies.saved_manifest(self, saved, ref, ids) if hosted is None and doc.source != "pool" else None
        prefix = None  # else a longer document's saved copy holding its first segments, more than the pool did
        if hosted is None and manifest is None and doc.source != "pool" and doc.digests and ref.get("dir"):
            prefix = copies.find_prefix(self, Path(ref["dir"]), doc, ref)
        if prefix is not None:
            cache.free()
            doc.todo, doc.reused = list(doc.segs), 0
        if doc.source != "pool" and (hosted is not None or manifest is not None) and doc.segs:
            cache.free()  # a copy holds it all: load that instead of the part the pool had
            doc.segs, doc.todo, doc.reused = [], [], 0
        if doc.source == "pool":
            doc.seconds = time.perf_counter() - t0
        elif hosted is not None:
            doc.digests = hosted.digests  # (those of the rows it holds, not of a prefill here)
            doc.restore, doc.source, doc.on_disk = (
                hosted,
                "host",
                saved is not None and (saved / kvstore.MANIFEST).exists(),
            )
            copies.load(self, doc, evict=False)  # (as a saved copy's load, below)
        elif manifest is not None:
            doc.load, doc.source, doc.on_disk = (saved, manifest), "disk", True
            copies.load(self, doc, evict=False)  # now if the blocks are free; else it waits for them like a
            # prefill segment (advance): evicting here could evict the documents of questions queued before it
        elif prefix is not None:  # its first segments loaded, then the rest prefilled
            doc.load, doc.load_upto = prefix[:2], prefix[2]
            doc.source = "disk" if prefix[2] == len(doc.segs) else "prefill"
            copies.load(self, doc, evict=False)
        else:
            doc.source = "prefill"
            if not doc.segs:
                self.segment(doc, ref, cache.device)
        doc.progress = bool(ref.get("progress"))
        doc.want_logits = bool(ref.get("last_logits"))
        if ref.get("save_to"):
            doc.save = {"target": ref["save_to"], "meta": ref["save_meta"]}
        elif ref.get("save") and ref.get("dir") and not doc.on_disk:
            doc.save = {"target": Path(ref["dir"]) / key, "meta": ref["save_meta"], "soft": True}
        self.resident[key] = doc
        if doc.ready:
            self._complete(doc)
        self.evict(ref.get("budget"), keep=doc)
        return doc

    def advance(self, doc: Document) -> int:
        """Prefill the next segment of a pending document (or load its saved copy); returns the
        tokens it took (0: it waits, the pool being full of documents in use)."""
        if doc.load is not None or doc.restore is not None:  # a copy, once every rank has the blocks
            if not copies.load(self, doc):  # (a restore: a part of its layers this round)
                self.waits += 1
                return 0
            self._ready(doc)
            return max(1, len(doc.ids))
        if doc.keys is not None and doc.todo == doc.segs:  # not begun: documents prefilled
            block_reuse.reuse(
                self.engine, self.pool, doc
            )  # since it was asked for (or before a reset) may hold its prefix
            if not doc.todo:
                self._ready(doc)
                return doc.reused
        s0, s1 = doc.todo[0]
        if not self.room(doc, self._mine(doc, s0, s1)):
            self.waits += 1
            return 0
        eng = self.engine
        progress = None
        if doc.progress and eng.lead:  # (chat: the bar while its document is prefilled)
            progress = lambda done, _n, s0=s0, n=len(doc.ids): eng.ctx.send("prefill", (s0 + done, n))  # noqa: E731
        first = len(eng.dec.segments)
        logits = eng.dec.prefill(
            doc.cache, torch.tensor([doc.ids[s0:s1]], dtype=torch.int64), on_progress=progress
        )  # s1 - s0 <= p·piece
        doc.methods |= {seg["method"] for seg in eng.dec.segments[first:]}
        doc.todo.pop(0)
        block_reuse.publish(doc)
        self._ready(doc)
        if doc.want_logits and not doc.todo:  # a question with no tokens of its own starts from them
            doc.keep_logits(
                logits[-1:] if logits is not None else None, len(doc.ids), doc.seconds, doc.t_start, doc.methods
            )
        return s1 - s0

    def _ready(self, doc: Document) -> None:
        if doc.ready:
            if doc.cache.device.type == "cuda":
                torch.cuda.synchronize(doc.cache.device)
            doc.seconds = time.perf_counter() - doc.t_start
            self._complete(doc)

    def _complete(self, doc: Document) -> None:
        if doc.key is not None:  # how it came (pool, host, disk, prefill), its bytes per rank, the seconds
            self.changes["made"].append(
                {
                    "key": doc.key,
                    "source": doc.source,
                    "seconds": doc.seconds,
                    "bytes": self.rank_bytes(doc),
                    "loaded": doc.loaded,
                }
            )
        if doc.save is not None and doc.ids:  # write-through: a restart keeps it
            if copies.write(
                self,
                doc.cache,
                doc.ids,
                doc.save["target"],
                {**doc.save["meta"], "nonce": doc.key[:8], "prefix": copies.prefix_of(doc)},
                soft=doc.save.get("soft", False),
            ):
                doc.on_disk = True
                self.changes["saved"].append(doc.key)
            doc.save = None

    def keep(self, doc: Document, tail, row: int, tokens: list, upto: int | None = None) -> bool:
        """A kept answer (``chat --conversation``) becomes part of its document: the tokens slot
        ``row`` of the batch's ``tail`` holds (its question and answer, ``tokens`` in order, each
        rank's share of them) are copied onto the document's own shard on the same rank, and the
        answer's last token, sampled but not fed, waits as ``doc.pending``. False (nothing
        changes) when the ranks' pools cannot hold them even after evicting documents nobody
        answers over: the conversation goes on from before that question. A collective: every
        rank calls it for the same answer. ``upto``: only the first ``upto`` of ``tokens`` (the
        question: ``generate --load-kv --save-kv`` saves the loaded document and the prompt), the
        first ``upto`` positions after the document on every rank; nothing pending."""
        if not doc.ready:
            return False
        m, counts = int(tail.host_length[row]), tail.counts[row]
        n = int(counts.sum())
        if upto is not None and upto < n:  # each rank holds its tokens in position order
            m = int((tail.pos[row, :m] < doc.tokens + upto).sum())
            counts = self.engine.comm.all_gather_values([m])[:, 0].to(torch.int64)  # [cp]
            n = upto
        if not self.room(doc, m):
            return False
        sh = doc.cache
        layers = ([t[:, :, :m] for t in tail.row_stored(layer, row)] for layer in range(sh.num_layers))
        sh.append_stored(tail.pos[row, :m], counts, layers)
        doc.ids = list(doc.ids) + list(tokens[:n])
        doc.pending = tokens[n] if len(tokens) == n + 1 and upto is None else None
        return True

    def mark(self, doc: Document):
        """A point of ``doc`` to come back to (a conversation's start: ``chat --conversation``'s
        ``/reset``)."""
        return doc.cache.mark(), len(doc.ids), doc.pending

    def rollback(self, doc: Document, mark) -> None:
        """``doc`` as it was at ``mark``: the turns kept since leave (their blocks go back)."""
        cache_mark, n, pending = mark
        doc.cache.rollback(cache_mark)
        doc.ids = list(doc.ids[:n])
        doc.pending = pending

    def use(self, doc: Document) -> None:
        doc.users += 1

    def release(self, doc: Document, running: bool = False) -> None:
        doc.users = max(0, doc.users - 1)
        if running:
            doc.running = max(0, doc.running - 1)

    def start(self, doc: Document) -> None:
        """A question over ``doc`` takes a slot: it stays in memory until that answer ends."""
        doc.running += 1

    def evict(self, budget: int | None, keep: Document | None = None) -> list[str]:
        """Documents out of memory, least recently used first, until the resident ones fit
        ``budget`` bytes; never one in use, a pending one, a pinned one, or ``keep`` (the newest
        is kept too: one document alone may exceed the budget). One not saved yet is saved first when a
        cache directory is known."""
        out = []
        for key in [k for k, d in self.resident.items() if not d.ready and not d.users and d is not keep]:
            self._evict(key)  # a prefill nobody waits for any more (its questions were cancelled)
            out.append(key)
        if budget is None:
            return out
        newest = next(reversed(self.resident), None)
        for key in list(self.resident):
            if self.nbytes() <= budget:
                break
            doc = self.resident[key]
            if doc.users or not doc.ready or doc.pinned or doc is keep or key == newest:
                continue
            self._evict(key)
            out.append(key)
        return out

    def _evict(self, key: str, to_host: bool = True) -> None:
        """``key`` out of the pool: saved first when a cache directory is known and it is not
        there yet, and (``to_host``) a copy kept in the host tier; its blocks given back."""
        doc = self.resident.pop(key)
        restoring, doc.restore = doc.restore, None
        if restoring is not None:  # not (all) copied in: the copy goes back where it was, whole; what
            self.host.add(key, restoring)  # its blocks hold is no copy of anything (not saved, not kept)
        elif (
            not doc.on_disk
            and doc.ids
            and doc.ready
            and self.spill_dir is not None
            and copies.write(
                self,
                doc.cache,
                doc.ids,
                Path(self.spill_dir) / key,
                {**self.spill_meta, "nonce": key[:8], "prefix": copies.prefix_of(doc)},
                soft=True,
            )
        ):
            doc.on_disk = True
            self.changes["spilled"].append(key)
        if to_host and doc.ids and doc.ready and restoring is None:
            self.host.put(key, doc.cache, doc.ids, self.rank_bytes(doc), doc.digests)
        doc.cache.free()
        doc.evicted = True
        self.changes["evicted"].append(key)

    def abandon(self, doc: Document) -> None:
        """A pending document no room can be made for: out of memory, its blocks given back."""
        if self.resident.get(doc.key) is doc:
            del self.resident[doc.key]
            self.changes["evicted"].append(doc.key)
        if doc.restore is not None:  # its copy stays in the host tier
            self.host.add(doc.key, doc.restore)
            doc.restore = None
        doc.cache.free()
        doc.todo, doc.evicted = list(doc.segs), True

    def pools(self) -> list | None:
        """Every rank's pool as ``[[used, total], ...]`` blocks (a collective: every rank calls it
        at the same point), or None before the first pooled document."""
        if self.pool is None:
            return None
        got = self.engine.world.all_gather_values([self.pool.used, self.pool.num_blocks]).tolist()
        return [[int(u), int(t)] for u, t in got]

    # -- the documents API (serve) ---------------------------------------------------------
    def settle(self, doc: Document, ref: dict) -> None:
        """A document's own request found it resident: its ``pin`` (True / False) applies."""
        if ref.get("pin") is not None:
            doc.pinned = bool(ref["pin"])

    def act(self, ref: dict) -> str:
        """``ref["action"]`` on the document ``ref["key"]`` (tokens ``ref["ids"]``), now:
        ``evict`` (out of memory, saved first as any eviction: a TTL ran out) or ``drop`` (out
        of memory, and its cached blocks freed: deleted); returns what happened: evicted,
        dropped, absent (not in memory; a drop still frees its cached blocks), or busy (questions
        over it are queued or answering: nothing done)."""
        key, doc = ref["key"], self.resident.get(ref["key"])
        if doc is not None and (doc.users or doc.running):
            return "busy"
        if ref["action"] == "evict":  # (a TTL: out of memory, the host tier's too)
            hosted = self.host.take(key) is not None
            if doc is None:
                return "evicted" if hosted else "absent"
            self._evict(key, to_host=False)
            return "evicted"
        if ref["action"] != "drop":
            raise ValueError(f"unknown document action {ref['action']!r}")
        keys = doc.keys if doc is not None else None
        self.host.take(key)
        if doc is not None:
            del self.resident[key]
            doc.cache.free()
            doc.evicted = True
            self.changes["evicted"].append(key)
        if keys is None and self.pool is not None and len(ref["ids"]) >= self.engine.mesh.cp:
            tmp = Document(key, list(ref["ids"]), None)
            block_reuse.plan(self.engine, self.pool, tmp, self.segment(tmp, ref, self.pool.device))
            keys = tmp.keys
        if keys and self.pool is not None:
            self.pool.forget(keys)
        return "dropped" if doc is not None else "absent"

    def take_changes(self) -> dict:
        """What left memory, was spilled to disk or saved since the last call (then cleared),
        and (``host``) the keys the host tier holds when they changed."""
        out = {k: list(v) for k, v in self.changes.items()}
        for v in self.changes.values():
            v.clear()
        hosted = list(self.host.copies)
        if hosted != self._host_seen:  # the host tier's documents, when they changed
            out["host"] = self._host_seen = hosted
        return out
