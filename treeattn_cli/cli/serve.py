"""``treeattn serve``: the resident engine behind an OpenAI-compatible HTTP server (the launcher side).

The ranks start once and load the model once (``engine_client.ResidentEngine``); requests come
through FastAPI (``openai_api.py``, ``documents_api.py``), are checked, tokenized as ``generate``
would (chat through the template) and split into a *document* part — the text before the last
paragraph break of its prompt (of its last user message) — and the rest, its *question*; each
becomes a typed engine request (``engine.requests.Ask``) that the engine's front
(``serving/front.py``) answers in one open batch over every document, its events (``Began``,
``Token``, ``Done``, ``Failed``) streamed back. The documents (which the ranks hold, saved
copies in ``--cache-dir``, pins, TTLs, the room rules) are the front's catalogue
(``serving/catalog.py``).

What this module keeps is the server's own: admission (at most ``--batch`` requests answer and
``--max-waiting`` wait, :meth:`Server.admit`; past that, HTTP 429 with ``Retry-After`` at once),
each request followed from arrival to end by a ``metrics.RequestLog`` (Prometheus metrics at
``GET /metrics``, one line on stderr), and SIGTERM or Ctrl-C: stop accepting, end the answers
under way within seconds, stop the ranks. A lost rank is the ranks' life
(``serving/supervision.py``: 503 ``recovering`` while a new set starts, ``--restarts`` tries).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from pathlib import Path

from ..serving.catalog import Catalog
from ..serving.front import BatchOptions, EngineFront
from ..serving.supervision import Supervised
from ..engine.requests import Ask, Began
from ..engine.room import PoolRoom
from ..engine.sampling import Sampling
from ..parallel import forkserver
from .options import ServeOptions


class Server(Supervised):
    """The ranks, the engine's front and the HTTP app of one ``treeattn serve`` (the ranks' life:
    ``serving/supervision.py``)."""

    def __init__(self, o: ServeOptions, run, job):
        from .metrics import Metrics

        super().__init__(o.restarts)
        self.o, self.run = o, run
        self.tokenizer = run.tokenizer
        self.tokenizing = threading.Lock()  # requests are tokenized off the event loop, one at a time
        self.eos_ids = list(job.eos_ids)
        self.context = run.context
        self.job = job
        self.engine = self._new_engine()
        self.catalog = Catalog(Path(o.cache_dir) if o.cache_dir else None)
        self.metrics = Metrics(live=self.live)
        self._lock = threading.Lock()
        self._in_flight = 0  # requests taken and not ended (answering or waiting for a slot)
        self._running: set[int] = set()  # of them, answering (their Began came)
        self._recent: deque[float] = deque(maxlen=32)  # seconds of the latest requests, end to end
        self.pools_seen([(0, 0)])
        self.name = o.served_model_name or (Path(str(o.model)).name if o.model else "SmolLM2-135M-Instruct")
        self.created = int(time.time())

    def read_manifest(self, path: str) -> dict:
        """A saved document's manifest, refused (``KVError``, ``ValueError``) if not this model's."""
        return self.run.load_kv(path, note=False)

    def start(self) -> None:
        save_meta = None
        if self.catalog.dir is not None:
            save_meta = self.run.cache_meta(str(self.catalog.dir))  # (made, writable: else one line)
            found, refused = self.catalog.scan(self.read_manifest)
            if (found or refused) and not self.o.quiet:
                other = (
                    f"; {refused} not usable here (another model's, or damaged): left as they are" if refused else ""
                )
                print(f"[document cache: {found} saved document(s) in {self.catalog.dir}{other}]", file=sys.stderr)
            for line in self.catalog.conversions(self.run.kv_dtype):  # said even with --quiet: answers differ
                print(f"treeattn: note: {line}", file=sys.stderr)
        self._save_meta = save_meta
        self._start_ranks()

    def _new_engine(self):
        from ..serving.engine_client import ResidentEngine

        return ResidentEngine(self.run, self.job, self.o.timeout)

    def _restarted(self) -> None:
        self.metrics.restarts.inc()

    def _start_ranks(self) -> None:
        """The ranks, their pool and the engine's front (at start, and again after a lost rank)."""
        client = self.engine.start()
        self._make_pool(client)
        o = self.o
        self.front = EngineFront(
            client,
            self.catalog,
            BatchOptions(o.batch, o.cache_bytes, o.prefill_chunk, self._save_meta),
            self.read_manifest,
            on_pools=self.pools_seen,
            on_made=self.metrics.document_made,
        )
        self.front.start()

    def _make_pool(self, client) -> None:
        """The ranks allocate the documents' pool now (``--kv-memory``: a size, or a fraction of
        what each rank has free with the model loaded): too little memory shows at start, not at
        the first document. Its real size, the same on every rank, is what admission counts."""
        o = self.o
        client.post(op="pool", pool=o.cache_bytes, pool_fraction=o.kv_fraction, host_memory=o.host_bytes)
        info = client.wait("pool")
        asked = (
            f"--kv-memory {o.kv_fraction:g} of {info['free'] / 2**20:,.0f} MiB free"
            if o.kv_fraction
            else f"--kv-memory {o.kv_memory or o.cache_bytes}"
            if o.cache_bytes
            else f"the default on {self.run.kind}"
        )
        o.cache_bytes = info["bytes"]
        self.pools_seen([(0, info["blocks"])] * self.run.nproc)
        if not o.quiet:
            host = f"; host tier {info['host'] / 2**20:,.0f} MiB per rank" if info.get("host") else "; no host tier"
            print(
                f"[KV pool: {info['blocks']:,} blocks of {info['page']} tokens per rank, "
                f"{info['bytes'] / 2**20:,.1f} MiB ({asked}){host}]",
                file=sys.stderr,
            )

    def pools_seen(self, per_rank: list) -> None:
        """Each rank's pool as the ranks reported it, ``[(used, total), ...]``: the metrics'
        gauges, and the blocks admission counts (the smallest rank's: ``room.PoolRoom``)."""
        if any(t for _, t in per_rank):
            self.metrics.pools(per_rank)
        o = self.o
        self.catalog.room = PoolRoom(
            cp=max(1, self.run.nproc // o.tp),
            tp=o.tp,
            pool_bytes=o.cache_bytes,
            bytes_per_token=self.run.kv_bytes_per_token(o.tp),
            reported=min(t for _, t in per_rank),
        )

    def live(self) -> dict:
        """Requests answering and waiting, documents resident: now (the metrics' gauges)."""
        with self._lock:
            running = len(self._running)
            waiting = self._in_flight - running
        return {
            "running": running,
            "waiting": waiting,
            "documents": sum(1 for e in list(self.catalog.entries.values()) if e.resident),
        }

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

    def submit(
        self,
        ids,
        doc: int,
        *,
        max_tokens: int,
        sampling: Sampling,
        stop: list,
        deliver,
        rid: str = "",
        cite: dict | None = None,
    ):
        """A request of tokens ``ids`` (its document part: the first ``doc``), once :meth:`admit`
        took it, to the engine's front; ``deliver(event)`` receives its events. ``cite``: its
        answer measures its attention over these spans of the document part (``citations.py``);
        spans past the document tokens it finds cached are in its own part, and not measured.
        Returns its ``front.Ticket`` (what :meth:`cancel` takes)."""
        from .metrics import RequestLog

        log = RequestLog(self.metrics, rid, len(ids), self.o.log_format)
        box = {}

        def ended(seconds: float) -> None:
            with self._lock:
                self._in_flight -= 1
                self._running.discard(id(box.get("ticket")))
                self._recent.append(seconds)

        def observed(event) -> None:
            if isinstance(event, Began):
                with self._lock:
                    self._running.add(id(box.get("ticket")))
            log.event(event)
            deliver(event)

        log.on_end = ended
        ask = Ask(list(ids), max_tokens, sampling, list(stop), self.eos_ids, self.o.speculate, cite=cite)
        ticket = box["ticket"] = self.front.submit(ask, doc, observed)
        log.document = ticket.key
        return ticket

    def cancel(self, ticket) -> None:
        """A client gone: its request ends (its slot freed)."""
        self.front.cancel(ticket)


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
        raise ValueError(
            "treeattn serve needs FastAPI, uvicorn and prometheus-client: pip install 'treeattn[serve]'"
        ) from None
    import uvicorn

    from .prepare import prepare_run

    if forkserver.under_torchrun():
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
                print(
                    f"[document {path}: {d['tokens']:,} tokens, id {d['id']}{', pinned' if d['pinned'] else ''}]",
                    file=sys.stderr,
                )
    except BaseException:
        srv.stop()
        raise

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / Ctrl-C: end the answers under way now
            if srv.front is not None:
                srv.front.shutdown()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        build_app(srv), host=o.host, port=o.port, log_level="warning", timeout_graceful_shutdown=5, lifespan="off"
    )
    server = _Server(config)
    if not o.quiet:
        print(
            f"treeattn serve: {srv.name} on http://{o.host}:{o.port}/v1 ({run.nproc} {run.kind} rank(s); Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
    srv.watch(give_up=lambda: setattr(server, "should_exit", True))
    try:
        server.run()
    finally:
        srv.stop()
    return 0 if not srv.failed else 1
