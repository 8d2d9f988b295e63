"""The resident engine's front, in the launching process (``serve``): typed requests in
(``requests.Ask``), typed events out (``Began``, ``Token``, ``Done``, ``Failed``), and the
documents the engine knows (``catalog.Catalog``) kept by what the ranks report.

* **One open batch.** The ranks run one engine batch at a time (``engine.Engine._op_batch``
  with ``open``): the first requests start it and every later one joins it whatever its
  document (``comm.post_join``: continuous batching; rows of different documents share each
  decode step), a cancelled one is ended by the engine (``comm.post_cancel``: its slot freed).
  The batch ends when it has answered every request it took; requests that joined after it
  decided to end go first into the next.
* **Documents.** A request's tokens are matched against the catalogue (:meth:`Catalog.match`):
  the document it continues, and how many of its tokens that covers; it asks the engine for
  that document (made resident: found in memory, loaded from the cache directory, or prefilled
  a segment per step while the other answers decode). A document's pin, eviction and deletion
  are requests with nothing to answer (:meth:`EngineFront.document`); a document unused for its
  TTL leaves memory (a sweep, every second).
* What it did is counted (:class:`Stats`, ``GET /health`` shows it): requests, batches,
  latecomers that joined a running batch, batches whose steps mixed documents, prefill segments
  run while answers were under way, answers by how they ended, requests cancelled before they
  began."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..engine.requests import Ask, Began, DocRef, Done, Failed, Token
from ..parallel import comm as C
from ..parallel import launch
from .catalog import Catalog


class Stats:
    """What the front has done since start."""

    def __init__(self):
        self._lock = threading.Lock()
        self._n: dict[str, int] = {
            "requests": 0,
            "batches": 0,
            "joined": 0,
            "dropped": 0,
            "mixed_batches": 0,
            "segments_while_decoding": 0,
            "chunks_while_decoding": 0,
        }
        self._ended: dict[str, int] = {}
        self._now: dict = {}  # the latest values of what is not a count (the KV pool's blocks)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] = self._n.get(name, 0) + n

    def ended(self, reason: str) -> None:
        with self._lock:
            self._ended[reason] = self._ended.get(reason, 0) + 1

    def set(self, name: str, value) -> None:
        with self._lock:
            self._now[name] = value

    def snapshot(self) -> dict:
        with self._lock:
            return {**self._n, **self._now, "answers": dict(self._ended)}


@dataclass
class Ticket:
    """One request in flight: what it asks (``ask.ids``: all its tokens), the document it
    continues (``key``; ``cached``: its tokens that document covers), where its events go
    (``deliver(event)``, called from the front's thread)."""

    ask: Ask
    deliver: object
    key: str = ""
    cached: int = 0
    action: dict | None = None  # a document request (nothing to answer): {"pin": b} or {"action": a}
    cancelled: threading.Event = field(default_factory=threading.Event)
    index: int | None = None  # its question in the running batch
    finished: bool = False

    def acts(self) -> bool:
        """An evict or drop: it reads no document (the engine reports what left)."""
        return bool(self.action and "action" in self.action)


@dataclass
class BatchOptions:
    """How the front's batches run: ``slots`` answering at once, each rank's document pool of
    ``pool_bytes``, prefill segments of ``piece`` tokens, documents saved with ``save_meta``."""

    slots: int
    pool_bytes: int
    piece: int | None = None
    save_meta: dict | None = None


class EngineFront(threading.Thread):
    """Requests into one open engine batch, their events back, the catalogue kept (see the
    module's docstring). ``client``: the ranks (``engine_client.EngineClient``);
    ``read_manifest(dir)``: a saved document's manifest, refused if another model's;
    ``on_pools([(used, total), ...])``: each rank's pool as the ranks report it;
    ``on_made(record)``: a document made resident (``documents.Documents``' ``made`` record)."""

    def __init__(self, client, catalog: Catalog, options: BatchOptions, read_manifest, on_pools=None, on_made=None):
        super().__init__(name="treeattn-front", daemon=True)
        self.client, self.catalog, self.o = client, catalog, options
        self.read_manifest = read_manifest
        self.on_pools = on_pools or (lambda per_rank: None)
        self.on_made = on_made or (lambda record: None)
        self.stats = Stats()
        self.pending: deque[Ticket] = deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.failed: str | None = None
        self.batch_seq: int | None = None
        self._lock = threading.Lock()
        self._using: dict[str, int] = {}  # document key -> requests in flight over it

    def start(self) -> None:
        super().start()
        threading.Thread(target=self._sweep, name="treeattn-ttl", daemon=True).start()

    # -- requests ----------------------------------------------------------------------------
    def submit(self, ask: Ask, doc: int, deliver) -> Ticket:
        """Answer ``ask`` (its ``ids``: every token of the request, its document part the first
        ``doc``); ``deliver(event)`` gets ``Began``, ``Token``... and ``Done`` or ``Failed``."""
        key, cached = self.catalog.match(ask.ids, doc)
        t = Ticket(ask, None, key=key, cached=cached)
        if key:
            with self._lock:
                self._using[key] = self._using.get(key, 0) + 1

        def ended(event) -> None:
            if key and isinstance(event, (Done, Failed)):
                with self._lock:
                    self._using[key] -= 1
            deliver(event)

        t.deliver = ended
        self.stats.add("requests")
        self._queue(t)
        return t

    def document(self, key: str, ids, action: dict, deliver=None) -> str:
        """A request with nothing to answer: document ``key`` (tokens ``ids``) made resident with
        ``{"pin": bool}`` or ``{}``, or ``{"action": "evict" | "drop"}`` run on it. Without
        ``deliver`` it waits and returns the engine's outcome (``Began.source``: document, evicted,
        dropped, absent, busy); a ``Failed`` or an ended request raises ``RuntimeError``."""
        done, got = threading.Event(), {}

        def wait(event):
            if isinstance(event, Began):
                got["source"] = event.source
            elif isinstance(event, (Done, Failed)):
                got["end"] = event
                done.set()

        t = Ticket(Ask(list(ids), 0), deliver or wait, key=key, cached=len(ids), action=action)
        self._queue(t)
        if deliver is not None:
            return ""
        done.wait()
        end = got["end"]
        if isinstance(end, Failed):
            raise RuntimeError(f"the server cannot take documents: {end.reason}")
        if end.stop_reason not in ("document", None):
            raise RuntimeError(f"the document request ended: {end.stop_reason}")
        source = got.get("source", "")
        if "action" not in action:
            e = self.catalog.touch(key, ids, resident=True)
            if action.get("pin") is not None:
                e.pinned = action["pin"]
        elif action["action"] == "drop" and source != "busy":
            self.catalog.forget(key)
        return source

    def in_use(self, key: str) -> bool:
        """Whether a request in flight (answering or waiting) reads document ``key``."""
        with self._lock:
            return self._using.get(key, 0) > 0

    def cancel(self, t: Ticket) -> None:
        t.cancelled.set()
        with self.cv:
            self.cv.notify()

    def shutdown(self) -> None:
        """Stop taking requests; the batch under way ends at its next step (its answers so far kept)."""
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if self.batch_seq is not None:
            try:
                self.client.interrupt(self.batch_seq)
            except Exception:
                pass

    def _queue(self, t: Ticket) -> None:
        """Into the queue; a front that stopped (shut down, or failed) ends it at once (nothing
        would take it: a request must never wait for ever)."""
        with self.cv:
            if self.stopping or self.failed or (self.ident is not None and not self.is_alive()):
                t.finished = True
                t.deliver(Failed(self.failed or "the server is shutting down"))
                return
            self.pending.append(t)
            self.cv.notify()

    def _take(self) -> list[Ticket]:
        """Every waiting request not cancelled (the caller holds ``cv``)."""
        got = list(self.pending)
        self.pending.clear()
        return [t for t in got if not self._drop_cancelled(t)]

    def _drop_cancelled(self, t: Ticket) -> bool:
        if t.cancelled.is_set() and not t.finished:
            t.finished = True
            self.stats.add("dropped")
            t.deliver(Done({"token_ids": [], "stop_reason": "cancelled"}))
            return True
        return False

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while True:
                with self.cv:
                    while not self.pending and not self.stopping:
                        self.cv.wait()
                    if self.stopping:
                        break
                    group = self._take()
                if group:
                    self._batch(group)
        except launch.LaunchError as e:
            self.failed = self.failed or str(e)
        except Exception as e:  # noqa: BLE001 - a broken front must not hang the clients
            self.failed = self.failed or f"{type(e).__name__}: {e}"
        finally:
            reason = self.failed or "the server is shutting down"
            with self.cv:
                for t in self.pending:
                    if not t.finished:
                        t.finished = True
                        t.deliver(Failed(reason))
                self.pending.clear()

    def _wire(self, t: Ticket) -> dict:
        """``t``'s request as the engine reads it: its tokens after its document's, the document."""
        ask = t.ask
        doc = None
        if t.key:
            e = self.catalog.entries.get(t.key)
            manifest = e.manifest if e is not None and e.on_disk and not e.resident else None
            doc = DocRef(t.key, ask.ids[: t.cached], manifest=manifest, **(t.action or {}))
        return Ask(
            ask.ids[t.cached :],
            ask.max_new_tokens,
            ask.sampling,
            ask.stop,
            ask.eos_ids,
            ask.speculate,
            doc=doc,
            cite=ask.cite,
        ).wire()

    def _batch_request(self) -> dict:
        """The open batch's options: slots, the document budget and the cache directory."""
        o = self.o
        req = {
            "op": "batch",
            "seq": self.client.seq,
            "slots": o.slots,
            "open": True,
            "interruptible": True,
            "budget": o.pool_bytes,
            "pool": o.pool_bytes,
            "piece": o.piece,
        }
        if self.catalog.dir is not None:
            req.update(dir=str(self.catalog.dir), save=True, save_meta=o.save_meta)
        return req

    def _took(self, t: Ticket) -> None:
        if t.key and not t.acts():  # a document it asked for is (or is becoming) resident
            self.catalog.touch(t.key, t.ask.ids[: t.cached], resident=True)

    def _batch(self, group: list[Ticket]) -> None:
        """One open batch: ``group`` first, every later request joins it (whatever its document);
        it ends when every request it took is answered."""
        by_index: dict[int, Ticket] = {}
        for i, t in enumerate(group):
            t.index, by_index[i] = i, t
            self._took(t)
        seq = self.client.post(**self._batch_request(), questions=[self._wire(t) for t in group])
        self.batch_seq = seq
        self.stats.add("batches")
        joins: list[list[Ticket]] = []
        cancels = 0
        sent_cancel: set[int] = set()
        try:
            while True:
                with self.cv:  # latecomers join the running batch, whatever their document
                    late = self._take() if not self.stopping else []
                if late:
                    for t in late:
                        self._took(t)
                    C.post_join(self.client.store, seq, len(joins), [self._wire(t) for t in late])
                    joins.append(late)
                    self.stats.add("joined", len(late))
                    for t in late:
                        t.index = len(by_index)
                        by_index[t.index] = t
                gone = [
                    i for i, t in by_index.items() if t.cancelled.is_set() and i not in sent_cancel and not t.finished
                ]
                if gone:
                    C.post_cancel(self.client.store, seq, cancels, gone)
                    cancels += 1
                    sent_cancel.update(gone)
                got = self.client.next_event(0.05)
                if got is not None and self._event(got, by_index, joins):
                    return
        except BaseException as e:  # the ranks are gone (or the front broke): its requests end now
            reason = str(e) or type(e).__name__
            for t in by_index.values():
                if not t.finished:
                    t.finished = True
                    self.stats.ended("error")
                    t.deliver(Failed(reason))
            raise
        finally:
            self.batch_seq = None

    def _event(self, got, by_index: dict, joins: list) -> bool:
        """One event of rank 0 to its request; True when the batch ended."""
        kind, payload = got
        if kind == "btoken":
            by_index[payload[0]].deliver(Token(payload[1]))
        elif kind == "bdoc":
            t, info = by_index[payload[0]], payload[1]
            if info.get("pools"):  # each rank's pool as this request began
                self.on_pools(info["pools"])
            e = self.catalog.entries.get(t.key) if t.key and not t.acts() else None
            if e is not None:
                e.resident = True
                e.hits += t.action is None
            t.deliver(Began(info["source"], t.cached if info["source"] != "prefill" else info.get("reused", 0)))
        elif kind == "docs":
            self.catalog.changed(payload, self.read_manifest)
            for record in payload.get("made", []):
                self.on_made(record)
        elif kind == "banswer":
            t = by_index[payload[0]]
            t.finished = True
            self.stats.ended(str(payload[1].get("stop_reason")))
            t.deliver(Done(payload[1]))
        elif kind == "batch_done":
            self._ended(payload, by_index, joins)
            return True
        return False

    def _ended(self, payload: dict, by_index: dict, joins: list) -> None:
        if payload.get("pools"):
            self.on_pools(payload["pools"])
        if payload.get("documents_per_step", 0) > 1:
            self.stats.add("mixed_batches")  # rows of several documents shared a step
        self.stats.add("segments_while_decoding", payload.get("segments_while_decoding", 0))
        self.stats.add("chunks_while_decoding", payload.get("chunks_while_decoding", 0))
        if payload.get("pool"):  # rank 0's pool after the batch: blocks used, cached, free
            self.stats.set("kv_blocks", payload["pool"])
        late = [t for group in joins[payload.get("joins", 0) :] for t in group]
        if late:  # joined too late for this batch: first into the next one
            self.stats.add("joined", -len(late))
            with self.cv:
                self.pending.extendleft(reversed(late))
        again = {id(t) for t in late}
        for t in by_index.values():  # taken, never begun (the batch was interrupted while
            if not t.finished and id(t) not in again:  # its document was being prefilled)
                t.finished = True
                self.stats.ended("interrupted")
                t.deliver(Done({"token_ids": [], "stop_reason": "interrupted"}))

    def _sweep(self) -> None:
        """Every second: documents whose TTL ran out since their last use leave memory."""
        while not self.stopping and not self.failed:
            for key in self.catalog.expired(time.time(), self.in_use):
                e = self.catalog.entries[key]
                e.evicting = True
                self.document(
                    key,
                    e.ids,
                    {"action": "evict"},
                    lambda ev, e=e: setattr(e, "evicting", False) if isinstance(ev, (Done, Failed)) else None,
                )
            time.sleep(1.0)
