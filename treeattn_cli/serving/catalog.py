"""The documents a resident engine knows (``serve``), as its front (``serving/front.py``) keeps
them: each by its key, its tokens, whether the ranks hold it now and whether a saved copy is in
the cache directory, its pin and TTL, its uses; and the room rules over them (``room.PoolRoom``:
a document that can never fit, a request that cannot beside the pinned ones, a pin past
:data:`PIN_SHARE` of the pool). What the ranks hold changes only by what they report
(:meth:`Catalog.changed`, :meth:`Catalog.began`); no torch here."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..engine.requests import document_key
from ..engine.room import PoolRoom

MIN_DOCUMENT = 32  # tokens: a shorter document part of a request is question, not worth a cache entry
PIN_SHARE = 0.75  # of each rank's pool pinned documents may hold: the rest stays for the others


@dataclass
class Entry:
    """One document: ``resident`` (in the ranks' pools, or being made so), ``host`` (a copy in
    the ranks' host tier), ``on_disk`` (saved in the cache directory; ``manifest`` its saved-KV
    manifest), ``pinned`` (never leaves memory), ``ttl_s`` (leaves memory after so long unused),
    ``hits`` (requests that found it)."""

    ids: list
    resident: bool = False
    host: bool = False
    on_disk: bool = False
    manifest: dict | None = None
    pinned: bool = False
    ttl_s: float | None = None
    created: float = 0.0
    last_used: float = 0.0
    hits: int = 0
    evicting: bool = False  # a TTL eviction asked, not yet done


class Catalog:
    """Every document by key (see the module's docstring). ``room`` gives the ranks' pools as
    admission counts them (a ``room.PoolRoom``, once the ranks made them)."""

    def __init__(self, cache_dir: Path | None, room=None):
        self.dir = cache_dir
        self.entries: dict[str, Entry] = {}
        self.room = room

    key_of = staticmethod(document_key)

    def scan(self, read_manifest) -> tuple[int, int]:
        """Saved documents of this model in the cache directory (a restart keeps them);
        ``read_manifest(dir)`` refuses another model's (``kvstore.KVError``, ``ValueError``).
        Returns how many were found and how many refused (another model's, or damaged: left
        as they are; a request that names one finds it refused again, and replaces it)."""
        from ..storage.kvstore import KVError, load_ids

        refused = 0
        if self.dir is None or not self.dir.is_dir():
            return 0, 0
        for d in sorted(self.dir.iterdir()):
            if not d.is_dir() or ".partial-" in d.name:
                continue
            try:
                manifest = read_manifest(str(d))
                ids = load_ids(d)
            except (KVError, ValueError):  # another model's, or damaged: not ours to use
                refused += 1
                continue
            if self.key_of(ids) == d.name:
                self.entries[d.name] = Entry(ids, on_disk=True, manifest=manifest)
        return len(self.entries), refused

    def conversions(self, kv_name: str) -> list[str]:
        """One line per KV storage among the saved documents that is not ``kv_name`` (they are
        converted as they load: ``kvstore.conversion``)."""
        from ..storage.kvstore import conversion

        by: dict[str, list[str]] = {}
        for key, e in self.entries.items():
            line = conversion(e.manifest, kv_name) if e.manifest else None
            if line:
                by.setdefault(line, []).append(key)
        return [f"{len(keys)} saved document(s) in {self.dir}: {line}" for line, keys in by.items()]

    def touch(self, key: str, ids, resident: bool | None = None) -> Entry:
        """The entry of ``key`` (made if new), used now."""
        now = time.time()
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = Entry(list(ids))
        e.created = e.created or now
        e.last_used = now
        if resident is not None:
            e.resident = resident
        return e

    def match(self, ids, doc: int) -> tuple[str, int]:
        """The document a request of tokens ``ids`` (document part: the first ``doc``) continues:
        the longest known one its tokens begin with (a conversation's later turn), unless its own
        document part is longer (a document that extends a known one: a new entry, whose prefill
        finds the common beginning in the ranks' block pool and prefills the rest a segment at a
        time); else none ("", 0)."""
        best, n = "", 0
        for key, e in self.entries.items():
            m = len(e.ids)
            if n < m <= len(ids) - 1 and ids[:m] == e.ids:
                best, n = key, m
        if doc >= MIN_DOCUMENT and doc > n:
            return self.key_of(ids[:doc]), doc
        return best, n

    def forget(self, key: str) -> None:
        """``key`` deleted: its entry and its saved copy (the ranks dropped it)."""
        import shutil

        self.entries.pop(key, None)
        if self.dir is not None:
            shutil.rmtree(self.dir / key, ignore_errors=True)

    # -- what the ranks report ---------------------------------------------------------------
    def changed(self, ch: dict, read_manifest) -> None:
        """The engine's report of documents that left memory (``evicted``), were written to the
        cache directory (``saved``, ``spilled``), whose saved copy was refused as it loaded
        (``corrupt``: removed, the document prefilled instead), and the keys its host tier holds
        (``host``, when they changed). A document nowhere any more is forgotten (pinned ones
        excepted: their tokens make them resident again)."""
        for key in ch.get("saved", []) + ch.get("spilled", []):
            if key in self.entries:
                self.entries[key].on_disk = True
                self.entries[key].manifest = read_manifest(str(self.dir / key))
        for key in ch.get("corrupt", []):
            e = self.entries.get(key)
            if e is not None and not (self.dir is not None and (self.dir / key / "manifest.json").exists()):
                e.on_disk, e.manifest = False, None
        left = set(ch.get("evicted", [])) | set(ch.get("corrupt", []))  # places a document may have left
        if "host" in ch:
            hosted = set(ch["host"])
            for key, e in self.entries.items():
                if e.host and key not in hosted:
                    left.add(key)
                e.host = key in hosted
        for key in ch.get("evicted", []):
            e = self.entries.get(key)
            if e is not None:
                e.resident = False
        for key in left:
            e = self.entries.get(key)
            if e is not None and not (e.resident or e.host or e.on_disk or e.pinned):
                del self.entries[key]

    def restarted(self) -> None:
        """A new set of ranks holds nothing: a document is known by its saved copy from now on;
        one without a copy is gone, unless pinned (its tokens make it resident again)."""
        for key, e in list(self.entries.items()):
            e.resident = e.evicting = e.host = False
            if not e.on_disk and not e.pinned:
                del self.entries[key]

    # -- room --------------------------------------------------------------------------------
    def pinned(self, exclude: str | None = None) -> list[int]:
        """The tokens of each pinned document (but ``exclude``)."""
        return [len(e.ids) for k, e in list(self.entries.items()) if e.pinned and k != exclude]

    def too_large(self, doc_tokens: int, ids=None, tail_tokens: int = 0) -> str | None:
        """Why a request can never be held (``PoolRoom.alone``: its document part alone;
        ``PoolRoom.request``: beside the pinned documents, with its question and answer of
        ``tail_tokens``), or None. A document part under :data:`MIN_DOCUMENT` is no document; a
        request over a resident document needs no room for it."""
        room: PoolRoom = self.room
        doc = doc_tokens if doc_tokens >= MIN_DOCUMENT else 0
        why = room.alone(doc) if doc else None
        if why:
            return why
        if doc and ids is not None:
            key, n = self.match(ids, doc)
            e = self.entries.get(key)
            if n >= doc and e is not None and e.resident:
                doc = 0
        return room.request(doc, tail_tokens, self.pinned())

    def pin_refusal(self, key: str, tokens: int) -> str | None:
        """Why pinning ``key`` (``tokens``) would take the pinned documents past
        :data:`PIN_SHARE` of the pool, or None."""
        return self.room.pin(tokens, self.pinned(exclude=key), PIN_SHARE)

    def view(self, key: str) -> dict:
        """A document as the documents API shows it (``bytes``: its KV on each rank; ``tier``:
        where it is nearest, ``device`` (the ranks' pools), ``host`` (their host memory),
        ``disk`` (the cache directory))."""
        e = self.entries[key]
        n = len(e.ids)
        tier = "device" if e.resident else "host" if e.host else "disk" if e.on_disk else None
        return {
            "id": key,
            "object": "document",
            "tokens": n,
            "pinned": e.pinned,
            "resident": e.resident,
            "tier": tier,
            "host": e.host,
            "on_disk": e.on_disk,
            "ttl_s": e.ttl_s,
            "created": int(e.created),
            "last_used": int(e.last_used),
            "hits": e.hits,
            "bytes": self.room.rank_bytes(n),
        }

    def expired(self, now: float, in_use) -> list[str]:
        """Resident documents whose TTL ran out since their last use, unpinned and unused
        (``in_use(key)``), not already leaving."""
        return [
            k
            for k, e in list(self.entries.items())
            if e.ttl_s
            and e.resident
            and not e.pinned
            and not e.evicting
            and now - (e.last_used or now) > e.ttl_s
            and not in_use(k)
        ]
