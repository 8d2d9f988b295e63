"""``treeattn serve``: the resident engine behind an OpenAI-compatible HTTP server (the launcher side).

The ranks start once and load the model once (``engine_client.ResidentEngine``); requests come
through FastAPI (``openai_api.py``) and a scheduler thread turns them into engine requests:

* every request is tokenized as ``generate`` would (chat through the template) and split into
  a *document* part — the text before the last paragraph break of its prompt (of its last user
  message) — and the rest, its *question*;
* the document cache (:class:`DocIndex`): a request whose tokens begin with a cached document
  continues that document's sharded KV cache; a new document is made resident by the engine
  (``engine/documents.py``: prefilled a segment per step while other answers decode, or loaded
  from ``--cache-dir``), kept in the ranks' memory least recently used first within
  ``--kv-memory`` per rank, and, with ``--cache-dir``, saved there in the saved-KV format as it
  is made, so a restart finds it;
* every request joins one open engine batch, whatever its document (continuous batching; rows of
  different documents share each decode step, each document's shard read once for its rows, one
  merge across the ranks per layer), each answer exactly the one the request gets alone; the
  batch ends when it has answered every question it took, and the next request starts another;
* a client that disconnects cancels its request; a lost rank turns ``/health`` and every request
  into 503 with the reason; SIGTERM or Ctrl-C stops accepting, ends the answers under way within
  seconds, and stops the ranks;
* at most ``--batch`` requests answer and ``--max-waiting`` wait (:meth:`Server.admit`; past
  that, HTTP 429 with ``Retry-After`` at once); each request is followed from arrival to end by a
  ``metrics.RequestLog`` (Prometheus metrics at ``GET /metrics``, one line on stderr);
* what the scheduler did is counted (:class:`Stats`, shown by ``GET /health``): requests, batches,
  latecomers that joined a running batch, batches whose steps mixed documents, document prefill
  segments run while answers were under way, answers by how they ended (``cancelled``: the engine
  ended the answer and freed its slot), and requests cancelled before they began.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ..parallel import comm as C
from ..parallel import launch
from .options import ServeOptions
from .prompt import MIN_DOCUMENT, document_key



@dataclass
class Job:
    """One request in flight: its tokens, where its document part ends, how to answer it, and
    where its events go (``deliver(kind, payload)``, called from the scheduler thread)."""

    ids: list
    doc: int  # tokens of the document part (0: none)
    max_tokens: int
    sampling: dict
    stop: list
    speculate: str
    deliver: object
    key: str = ""  # the document (cache entry) it continues
    cached: int = 0  # document tokens it found in the cache
    cancelled: threading.Event = field(default_factory=threading.Event)
    index: int | None = None  # its question index in the running batch
    finished: bool = False
    log: object = None  # metrics.RequestLog: its timeline, metrics and log line
    action: dict | None = None  # a documents-API request (nothing to answer): {"pin": b} or {"action": a}
    cite: dict | None = None  # its answer's citation spans (cli/citations.py; "cite": true)


def _acts(j: Job) -> bool:
    """A documents-API evict or drop: it reads no document (the engine reports what left)."""
    return bool(j.action and "action" in j.action)


class Stats:
    """What the scheduler has done since start (``GET /health`` shows it; tests observe it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._n: dict[str, int] = {"requests": 0, "batches": 0, "joined": 0, "dropped": 0, "mixed_batches": 0,
                                   "segments_while_decoding": 0, "chunks_while_decoding": 0}
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


class DocIndex:
    """The document cache as the launching process tracks it: key -> tokens, and whether the
    ranks hold it in memory and whether it is saved in the cache directory."""

    def __init__(self, cache_dir: Path | None):
        self.dir = cache_dir
        self.entries: dict[str, dict] = {}

    key_of = staticmethod(document_key)

    def scan(self, run) -> int:
        """Saved documents of this model in the cache directory (a restart keeps them)."""
        from ..engine.kvstore import KVError, load_ids

        if self.dir is None or not self.dir.is_dir():
            return 0
        for d in sorted(self.dir.iterdir()):
            if not d.is_dir() or ".partial-" in d.name:
                continue
            try:
                manifest = run.load_kv(str(d), note=False)
                ids = load_ids(d)
            except (KVError, ValueError):  # another model's, or damaged: not ours to use
                continue
            if self.key_of(ids) == d.name:
                self.entries[d.name] = {"ids": ids, "resident": False, "disk": True, "manifest": manifest}
        return len(self.entries)

    def conversions(self, kv_name: str) -> list[str]:
        """One line per KV storage among the saved documents that is not ``kv_name`` (they are
        converted as they load: ``kvstore.conversion``)."""
        from ..engine.kvstore import conversion

        by: dict[str, list[str]] = {}
        for key, e in self.entries.items():
            line = conversion(e["manifest"], kv_name) if e.get("manifest") else None
            if line:
                by.setdefault(line, []).append(key)
        return [f"{len(keys)} saved document(s) in {self.dir}: {line}" for line, keys in by.items()]

    def touch(self, key: str, ids, resident: bool | None = None) -> dict:
        """The entry of ``key`` (made if new), used now."""
        now = time.time()
        e = self.entries.setdefault(key, {"ids": list(ids), "resident": False, "disk": False})
        e.setdefault("created", now)
        e.setdefault("hits", 0)
        e["last_used"] = now
        if resident is not None:
            e["resident"] = resident
        return e

    def match(self, ids, doc: int) -> tuple[str, int]:
        """The document a request of tokens ``ids`` (document part: the first ``doc``) continues:
        the longest cached one its tokens begin with (a conversation's later turn), unless its own
        document part is longer (a document that extends a cached one: a new entry, whose
        prefill finds the common beginning in the ranks' block pool and prefills the rest a
        segment at a time); else none ("", 0)."""
        best, n = "", 0
        for key, e in self.entries.items():
            m = len(e["ids"])
            if n < m <= len(ids) - 1 and ids[:m] == e["ids"]:
                best, n = key, m
        if doc >= MIN_DOCUMENT and doc > n:
            return self.key_of(ids[:doc]), doc
        return best, n


class Scheduler(threading.Thread):
    """Turns jobs into one open engine batch over every document (see the module's docstring)."""

    def __init__(self, server):
        super().__init__(name="treeattn-scheduler", daemon=True)
        self.server = server
        self.pending: deque[Job] = deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.batch_seq: int | None = None

    def submit(self, job: Job) -> None:
        with self.cv:
            self.pending.append(job)
            self.cv.notify()

    def cancel(self, job: Job) -> None:
        job.cancelled.set()
        with self.cv:
            self.cv.notify()

    def shutdown(self) -> None:
        """Stop taking jobs; the batch under way ends at its next step (its answers so far kept)."""
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if self.batch_seq is not None:
            try:
                self.server.client.interrupt(self.batch_seq)
            except Exception:
                pass

    def _take(self) -> list[Job]:
        """Every waiting job not cancelled (the caller holds ``cv``)."""
        jobs = list(self.pending)
        self.pending.clear()
        return [j for j in jobs if not self._drop_cancelled(j)]

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
                    self._serve(group)
        except launch.LaunchError as e:
            self.server.fail(str(e))
        except Exception as e:  # noqa: BLE001 - a broken scheduler must not hang the clients
            self.server.fail(f"{type(e).__name__}: {e}")
        finally:
            reason = self.server.failed or "the server is shutting down"
            with self.cv:
                for j in self.pending:
                    if not j.finished:
                        j.finished = True
                        j.deliver("error", reason)
                self.pending.clear()

    def _drop_cancelled(self, j: Job) -> bool:
        if j.cancelled.is_set() and not j.finished:
            j.finished = True
            self.server.stats.add("dropped")
            j.deliver("done", {"token_ids": [], "stop_reason": "cancelled"})
            return True
        return False

    def _question(self, j: Job) -> dict:
        q = {"ids": j.ids[j.cached:], "max_new_tokens": j.max_tokens, "sampling": j.sampling, "stop": j.stop,
             "eos_ids": self.server.eos_ids, "speculate": j.speculate, "cite": j.cite}
        if j.key:
            q["doc"] = {"key": j.key, "ids": j.ids[:j.cached], **(j.action or {})}
            e = self.server.docs.entries.get(j.key)
            if e is not None and e.get("disk") and not e.get("resident") and e.get("manifest"):
                q["doc"]["manifest"] = e["manifest"]
        return q

    def _batch_request(self) -> dict:
        """The open batch's options: slots, the document budget and the cache directory."""
        srv = self.server
        req = {"op": "batch", "seq": srv.client.seq, "slots": srv.o.batch, "open": True, "interruptible": True,
               "budget": srv.o.cache_bytes, "pool": srv.o.cache_bytes, "piece": srv.o.prefill_chunk}
        if srv.docs.dir is not None:
            req.update(dir=str(srv.docs.dir), save=True, save_meta=srv.save_meta)
        return req

    def _documents_changed(self, ch: dict) -> None:
        """The engine's report of documents that left memory, were spilled or saved."""
        srv = self.server
        index = srv.docs.entries
        for key in ch.get("saved", []) + ch.get("spilled", []):
            if key in index:
                index[key]["disk"] = True
                index[key]["manifest"] = srv.run.load_kv(str(srv.docs.dir / key), note=False)
        for key in ch.get("evicted", []):
            if key in index:
                index[key]["resident"] = False
                if not index[key].get("disk"):
                    del index[key]

    def _serve(self, group: list[Job]) -> None:
        """One open batch: ``group`` first, every later job joins it (whatever its document);
        it ends when every question it took is answered."""
        srv = self.server
        by_index: dict[int, Job] = {}
        for i, j in enumerate(group):
            j.index, by_index[i] = i, j
            if j.key and not _acts(j):  # the server's view: a document it asked for is (or is becoming) resident
                srv.docs.touch(j.key, j.ids[:j.cached], resident=True)
        seq = srv.client.post(**self._batch_request(), questions=[self._question(j) for j in group])
        self.batch_seq = seq
        srv.stats.add("batches")
        joins: list[list[Job]] = []
        cancels = 0
        sent_cancel: set[int] = set()
        n = len(group)
        try:
            while True:
                with self.cv:  # latecomers join the running batch, whatever their document
                    late = self._take() if not self.stopping else []
                if late:
                    for j in late:
                        if j.key and not _acts(j):
                            srv.docs.touch(j.key, j.ids[:j.cached], resident=True)
                    C.post_join(srv.client.store, seq, len(joins), [self._question(j) for j in late])
                    joins.append(late)
                    srv.stats.add("joined", len(late))
                    for j in late:
                        j.index, by_index[n] = n, j
                        n += 1
                gone = [i for i, j in by_index.items() if j.cancelled.is_set() and i not in sent_cancel
                        and not j.finished]
                if gone:
                    C.post_cancel(srv.client.store, seq, cancels, gone)
                    cancels += 1
                    sent_cancel.update(gone)
                got = srv.client.next_event(0.05)
                if got is None:
                    continue
                kind, payload = got
                if kind == "btoken":
                    by_index[payload[0]].deliver("token", payload[1])
                elif kind == "bdoc":
                    j, info = by_index[payload[0]], payload[1]
                    if info.get("pools"):  # each rank's pool as this request began
                        srv.pools_seen(info["pools"])
                    if j.key and j.key in srv.docs.entries and not _acts(j):
                        srv.docs.entries[j.key]["resident"] = True
                        e = srv.docs.entries[j.key]
                        e["hits"] = e.get("hits", 0) + (j.action is None)
                    j.deliver("document", {"source": info["source"],
                                           "cached": j.cached if info["source"] != "prefill"
                                           else info.get("reused", 0)})
                elif kind == "docs":
                    self._documents_changed(payload)
                elif kind == "banswer":
                    j = by_index[payload[0]]
                    j.finished = True
                    srv.stats.ended(str(payload[1].get("stop_reason")))
                    j.deliver("done", payload[1])
                elif kind == "batch_done":
                    if payload.get("pools"):
                        srv.pools_seen(payload["pools"])
                    if payload.get("documents_per_step", 0) > 1:
                        srv.stats.add("mixed_batches")  # rows of several documents shared a step
                    srv.stats.add("segments_while_decoding", payload.get("segments_while_decoding", 0))
                    srv.stats.add("chunks_while_decoding", payload.get("chunks_while_decoding", 0))
                    if payload.get("pool"):  # rank 0's pool after the batch: blocks used, cached, free
                        srv.stats.set("kv_blocks", payload["pool"])
                    again = {id(j) for late in joins[payload.get("joins", 0):] for j in late}
                    for late in joins[payload.get("joins", 0):]:  # joined too late for this batch: next one
                        srv.stats.add("joined", -len(late))
                        with self.cv:
                            self.pending.extendleft(reversed(late))
                    for j in by_index.values():  # taken, never begun (the batch was interrupted while
                        if not j.finished and id(j) not in again:  # its document was being prefilled)
                            j.finished = True
                            srv.stats.ended("interrupted")
                            j.deliver("done", {"token_ids": [], "stop_reason": "interrupted"})
                    return
        finally:
            self.batch_seq = None


class Server:
    """The ranks, the document cache, the scheduler and the HTTP app of one ``treeattn serve``."""

    def __init__(self, o: ServeOptions, run, job):
        from .engine_client import ResidentEngine
        from .metrics import Metrics

        self.o, self.run = o, run
        self.tokenizer = run.tokenizer
        self.tokenizing = threading.Lock()  # requests are tokenized off the event loop, one at a time
        self.eos_ids = list(job.eos_ids)
        self.context = run.context
        self.engine = ResidentEngine(run, job, o.timeout)
        self.client = None
        self.docs = DocIndex(Path(o.cache_dir) if o.cache_dir else None)
        self.save_meta = None
        self._failed: str | None = None
        self.stats = Stats()
        self.metrics = Metrics(live=self.live)
        self._lock = threading.Lock()
        self._in_flight = 0  # requests taken and not ended (answering or waiting for a slot)
        self._running: set[int] = set()  # of them, answering (their document event came)
        self._recent: deque[float] = deque(maxlen=32)  # seconds of the latest requests, end to end
        self._using: dict[str, int] = {}  # document key -> requests in flight over it
        self._pool_total = 0  # blocks per rank, as the ranks reported (0: not yet)
        self.scheduler = Scheduler(self)
        self.name = o.served_model_name or (Path(str(o.model)).name if o.model else "SmolLM2-135M-Instruct")
        self.created = int(time.time())

    def start(self) -> None:
        if self.docs.dir is not None:
            self.docs.dir.mkdir(parents=True, exist_ok=True)
            self.save_meta = {"identity": self.run.identity(), "composition": {"kind": "raw"}}
            found = self.docs.scan(self.run)
            if found and not self.o.quiet:
                print(f"[document cache: {found} saved document(s) in {self.docs.dir}]", file=sys.stderr)
            for line in self.docs.conversions(self.run.kv_dtype):  # said even with --quiet: answers differ
                print(f"treeattn: note: {line}", file=sys.stderr)
        self.client = self.engine.start()
        self._make_pool()
        self.scheduler.start()
        threading.Thread(target=self._sweep, name="treeattn-ttl", daemon=True).start()

    def _make_pool(self) -> None:
        """The ranks allocate the documents' pool now (``--kv-memory``: a size, or a fraction of
        what each rank has free with the model loaded): too little memory shows at start, not at
        the first document. Its real size, the same on every rank, is what admission counts."""
        o = self.o
        self.client.post(op="pool", pool=o.cache_bytes, pool_fraction=o.kv_fraction)
        info = self.client.wait("pool")
        asked = (f"--kv-memory {o.kv_fraction:g} of {info['free'] / 2**20:,.0f} MiB free" if o.kv_fraction
                 else f"--kv-memory {o.kv_memory or o.cache_bytes}" if o.cache_bytes else f"the default on {self.run.kind}")
        o.cache_bytes = info["bytes"]
        self.pools_seen([(0, info["blocks"])] * self.run.nproc)
        if not o.quiet:
            print(f"[KV pool: {info['blocks']:,} blocks of {info['page']} tokens per rank, "
                  f"{info['bytes'] / 2**20:,.1f} MiB ({asked})]", file=sys.stderr)

    def pools_seen(self, per_rank: list) -> None:
        """Each rank's pool as the ranks reported it, ``[(used, total), ...]``: the metrics'
        gauges, and the blocks admission counts (the smallest rank's)."""
        self.metrics.pools(per_rank)
        self._pool_total = min(t for _, t in per_rank)

    def live(self) -> dict:
        """Requests answering and waiting, documents resident: now (the metrics' gauges)."""
        with self._lock:
            running = len(self._running)
            waiting = self._in_flight - running
        return {"running": running, "waiting": waiting,
                "documents": sum(1 for e in list(self.docs.entries.values()) if e.get("resident"))}

    def admit(self) -> float | None:
        """Take one more request (None), or refuse it: every slot busy and ``--max-waiting``
        waiting; returns then the seconds a client should wait (the recent requests' mean
        latency, at least 1)."""
        with self._lock:
            if self._in_flight >= self.o.batch + self.o.max_waiting:
                recent = list(self._recent)
                return max(1.0, sum(recent) / len(recent)) if recent else 1.0
            self._in_flight += 1
            return None

    def release(self) -> None:
        """A request :meth:`admit` took that ends before it queued (a bad request)."""
        with self._lock:
            self._in_flight -= 1

    def refused(self, rid: str, prompt_tokens: int, status: str, why: str) -> None:
        """Count (and log) a request refused before it queued."""
        from .metrics import RequestLog

        RequestLog(self.metrics, rid, prompt_tokens, self.o.log_format).end(status, 0, why)

    def submit(self, ids, doc: int, *, max_tokens: int, sampling: dict, stop: list, deliver, rid: str = "",
               cite: dict | None = None) -> Job:
        """A request of tokens ``ids`` (its document part: the first ``doc``) into the queue, once
        :meth:`admit` took it; ``deliver(kind, payload)`` receives its events. ``cite``: its
        answer measures its attention over these spans of the document part (``citations.py``);
        spans past the document tokens it finds cached are in its own part, and not measured."""
        from .metrics import RequestLog

        key, cached = self.docs.match(ids, doc)
        log = RequestLog(self.metrics, rid, len(ids), self.o.log_format)
        log.document = key
        job = Job(ids=ids, doc=doc, max_tokens=max_tokens, sampling=sampling, stop=stop, speculate=self.o.speculate,
                  deliver=None, key=key, cached=cached, log=log, cite=cite)

        if key:
            with self._lock:
                self._using[key] = self._using.get(key, 0) + 1

        def ended(seconds: float) -> None:
            with self._lock:
                self._in_flight -= 1
                self._running.discard(id(job))
                self._recent.append(seconds)
                if key:
                    self._using[key] -= 1

        def observed(kind, payload):
            if kind == "document":
                with self._lock:
                    self._running.add(id(job))
            log.event(kind, payload)
            deliver(kind, payload)

        log.on_end = ended
        job.deliver = observed
        self.stats.add("requests")
        self.scheduler.submit(job)
        return job

    # -- the documents API (documents_api.py) ------------------------------------------------
    def in_use(self, key: str) -> bool:
        """Whether a request in flight (answering or waiting) reads document ``key``."""
        with self._lock:
            return self._using.get(key, 0) > 0

    def document_job(self, key: str, ids, action: dict, deliver) -> Job:
        """A request with nothing to answer that makes document ``key`` (tokens ``ids``) resident
        and applies ``{"pin": bool}``, or runs ``{"action": "evict" | "drop"}`` on it; ``deliver``
        gets its ``document`` event (the engine's outcome in ``source``) and ``done``."""
        job = Job(ids=list(ids), doc=len(ids), max_tokens=0, sampling={"temperature": 0.0, "top_k": 0, "top_p": 1.0,
                  "seed": 0}, stop=[], speculate="off", deliver=deliver, key=key, cached=len(ids), action=action)
        self.scheduler.submit(job)
        return job

    @property
    def room(self):
        """The ranks' pools as admission counts them (``engine.room.PoolRoom``): tokens in,
        verdicts with their numbers out."""
        from ..engine.room import PoolRoom

        o = self.o
        return PoolRoom(cp=max(1, self.run.nproc // o.tp), tp=o.tp, bytes_per_token=self.run.kv_bytes_per_token(o.tp),
                        pool_bytes=o.cache_bytes, reported=self._pool_total)

    def kv_bytes_per_rank(self, tokens: int) -> int:
        """Bytes of KV a document of ``tokens`` takes on each rank."""
        return self.room.rank_bytes(tokens)

    def _sweep(self) -> None:
        """Every second: documents whose TTL ran out since their last use leave memory."""
        while not self.scheduler.stopping and not self.failed:
            now = time.time()
            for key, e in list(self.docs.entries.items()):
                ttl = e.get("ttl_s")
                if ttl and e.get("resident") and not e.get("pinned") and not e.get("evicting") \
                        and now - e.get("last_used", now) > ttl and not self.in_use(key):
                    e["evicting"] = True
                    self.document_job(key, e["ids"], {"action": "evict"},
                                      lambda kind, p, e=e: e.pop("evicting", None) if kind in ("done", "error") else None)
            time.sleep(1.0)

    def pinned(self, exclude: str | None = None) -> list[int]:
        """The tokens of each pinned document (but ``exclude``)."""
        return [len(e["ids"]) for k, e in list(self.docs.entries.items()) if e.get("pinned") and k != exclude]

    def too_large(self, doc_tokens: int, ids=None, tail_tokens: int = 0) -> str | None:
        """Why a request can never be held (``room.PoolRoom.alone``: its document part alone;
        ``PoolRoom.request``: beside the pinned documents, with its question and answer of
        ``tail_tokens``), or None. A document part under :data:`MIN_DOCUMENT` is no document; a
        request over a resident document needs no room for it."""
        room = self.room
        doc = doc_tokens if doc_tokens >= MIN_DOCUMENT else 0
        why = room.alone(doc) if doc else None
        if why:
            return why
        if doc and ids is not None:
            key, n = self.docs.match(ids, doc)
            if n >= doc and self.docs.entries.get(key, {}).get("resident"):
                doc = 0
        return room.request(doc, tail_tokens, self.pinned())

    def fail(self, reason: str) -> None:
        self._failed = self._failed or reason

    @property
    def failed(self) -> str | None:
        """Why the server cannot answer (a lost rank, a broken scheduler), or None."""
        if self._failed is None and self.engine.thread is not None and not self.engine.thread.is_alive():
            err = self.engine.error
            self._failed = str(err) if err is not None else "the ranks stopped"
        return self._failed

    def stop(self) -> None:
        self.scheduler.shutdown()
        self.scheduler.join(timeout=15)
        self.engine.stop(now=self.scheduler.is_alive() or self.failed is not None)


def bind_warning(host: str, port: int, api_key: str | None) -> str | None:
    """What to warn about before listening: an address beyond this machine with no key."""
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.") or api_key:
        return None
    return f"serving on {host} without --api-key: anyone who can reach port {port} can use the model"


def serve_command(o: ServeOptions) -> int:
    """Run ``treeattn serve`` until SIGTERM or Ctrl-C; returns the exit status."""
    try:
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401

        from .openai_api import build_app
    except ImportError:
        raise ValueError("treeattn serve needs FastAPI, uvicorn and prometheus-client: "
                         "pip install 'treeattn[serve]'") from None
    import uvicorn

    from .prepare import prepare_run

    if launch.under_torchrun():
        raise ValueError("serve starts its own local ranks; it does not run under torchrun")
    run = prepare_run(o)
    o.max_new_tokens = o.max_new_tokens or 256
    # nothing reserved for the model's whole context: each document's cache is sized to it
    # (engine/documents.py); the engine's own holds requests without a document and grows as they need
    job = run.job(o, [], reserve=64)
    srv = Server(o, run, job)
    warning = bind_warning(o.host, o.port, o.api_key)
    if warning:
        print(f"treeattn: warning: {warning}", file=sys.stderr)
    srv.start()
    try:
        for path in o.document:  # cached (pinned) before the server listens
            from .documents_api import post_at_start

            d = post_at_start(srv, path, o.pin)
            if not o.quiet:
                print(f"[document {path}: {d['tokens']:,} tokens, id {d['id']}{', pinned' if d['pinned'] else ''}]",
                      file=sys.stderr)
    except BaseException:
        srv.stop()
        raise

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / Ctrl-C: end the answers under way now
            srv.scheduler.shutdown()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(build_app(srv), host=o.host, port=o.port, log_level="warning",
                            timeout_graceful_shutdown=5, lifespan="off")
    server = _Server(config)
    if not o.quiet:
        print(f"treeattn serve: {srv.name} on http://{o.host}:{o.port}/v1 ({run.nproc} {run.kind} rank(s); "
              f"Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        srv.stop()
    return 0 if not srv.failed else 1
