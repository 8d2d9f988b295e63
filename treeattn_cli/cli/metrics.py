"""What ``treeattn serve`` tells an operator about each request: Prometheus metrics (``GET
/metrics``, with ``prometheus-client``) and one log line per request on stderr (issue 36).

:class:`RequestLog` follows one request through the events the engine's front delivers to it
(``document``: it took a slot, with the document tokens found cached; ``token``; ``done`` with
its stop reason, or ``error``) and, when it ends, observes it into :class:`Metrics` and writes
its line. Every request is counted, streamed or not, and so are those refused before they
queued (``rejected``: back-pressure). Nothing here computes anything the engine needs.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: a cached document's first token on a CPU is ~0.1-1 s, a cold 1M-token one minutes
_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_E2E = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The server's metrics in their own registry (one per server)."""

    def __init__(self, live=None):
        """``live()``: ``{"running", "waiting", "documents"}`` now (read at each scrape)."""
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "treeattn_time_to_first_token_seconds",
            "From the request's arrival to its first token (its document's prefill included).",
            buckets=_TTFT,
            registry=r,
        )
        self.tpot = Histogram(
            "treeattn_time_per_output_token_seconds",
            "Between two tokens of one answer, as the engine's front delivers them.",
            buckets=_TPOT,
            registry=r,
        )
        self.e2e = Histogram(
            "treeattn_e2e_request_latency_seconds", "From the request's arrival to its end.", buckets=_E2E, registry=r
        )
        self.prompt = Counter("treeattn_prompt_tokens", "Prompt tokens of the requests that ended.", registry=r)
        self.generation = Counter("treeattn_generation_tokens", "Tokens generated.", registry=r)
        self.cached = Counter(
            "treeattn_cached_prompt_tokens",
            "Prompt tokens found in the document cache instead of prefilled.",
            registry=r,
        )
        self.requests = Counter(
            "treeattn_requests",
            "Requests by how they ended: stop (EOS or a stop string), "
            "length, cancelled (the client left), interrupted (the server stopped), error, "
            "rejected (back-pressure: 429), too_large (413).",
            ["outcome"],
            registry=r,
        )
        self.blocks_used = Gauge(
            "treeattn_kv_blocks_used",
            "Blocks of the rank's KV pool holding documents in "
            "use or resident (as the latest request began, or a batch ended).",
            ["rank"],
            registry=r,
        )
        self.restarts = Counter(
            "treeattn_rank_restarts",
            "New sets of ranks the server started after losing one (serve.Server.recover).",
            registry=r,
        )
        tier = (
            "How a document was made resident: pool (its blocks still cached in the ranks' pools), host "
            "(copied back from the host tier), disk (loaded from --cache-dir), prefill (computed)."
        )
        self.made = Counter("treeattn_documents_made", f"Documents made resident. {tier}", ["tier"], registry=r)
        self.made_bytes = Counter(
            "treeattn_documents_made_bytes",
            f"Bytes of KV per rank of the documents made resident. {tier}",
            ["tier"],
            registry=r,
        )
        self.made_seconds = Counter(
            "treeattn_documents_made_seconds",
            f"Seconds from a document's request to its being resident. {tier}",
            ["tier"],
            registry=r,
        )
        self.made_loaded = Counter(
            "treeattn_documents_prefix_tokens_loaded",
            "Tokens of documents loaded from a longer document's saved copy in --cache-dir (their first "
            "prefill segments, the same tokens prefilled the same way) before the rest was prefilled.",
            registry=r,
        )
        self.blocks_total = Gauge("treeattn_kv_blocks_total", "Blocks of the rank's KV pool.", ["rank"], registry=r)
        live = live or (lambda: {})
        for name, doc, field in (
            ("treeattn_requests_running", "Requests answering (in a slot).", "running"),
            ("treeattn_requests_waiting", "Requests queued for a slot.", "waiting"),
            ("treeattn_documents_resident", "Documents in the ranks' memory.", "documents"),
        ):
            Gauge(name, doc, registry=r).set_function(lambda f=field: float(live().get(f, 0)))

    def pools(self, per_rank: list) -> None:
        """Each rank's pool, ``[(used, total), ...]`` by rank."""
        for rank, (used, total) in enumerate(per_rank):
            self.blocks_used.labels(rank=str(rank)).set(used)
            self.blocks_total.labels(rank=str(rank)).set(total)

    def document_made(self, rec: dict) -> None:
        """A document made resident (the engine's ``made`` record: source, bytes, seconds)."""
        tier = rec.get("source", "prefill")
        self.made.labels(tier).inc()
        self.made_bytes.labels(tier).inc(rec.get("bytes", 0))
        self.made_seconds.labels(tier).inc(rec.get("seconds", 0.0))
        self.made_loaded.inc(rec.get("loaded", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def outcome(stop_reason) -> str:
    return {"eos": "stop", "stop": "stop"}.get(stop_reason, str(stop_reason or "stop"))


class RequestLog:
    """One request's timeline, from arrival to its end (see the module)."""

    def __init__(self, metrics: Metrics, rid: str, prompt_tokens: int, fmt: str = "text", on_end=None):
        self.metrics, self.rid, self.prompt_tokens, self.fmt = metrics, rid, prompt_tokens, fmt
        self.on_end = on_end  # on_end(seconds): once, when it ends (the server's in-flight count)
        self.t0 = time.perf_counter()
        self.first = self.last = None
        self.tokens = 0
        self.cached = 0
        self.document = ""
        self._ended = False
        self._lock = threading.Lock()

    def event(self, event) -> None:
        """One event of the request's answer (``engine.requests``)."""
        from ..engine.requests import Began, Done, Failed, Token

        now = time.perf_counter()
        if isinstance(event, Began):
            self.cached = int(event.cached)
        elif isinstance(event, Token):
            if self.first is None:
                self.first = now
                self.metrics.ttft.observe(now - self.t0)
            else:
                self.metrics.tpot.observe(now - self.last)
            self.last = now
            self.tokens += 1
        elif isinstance(event, Done):
            self.end(outcome(event.stop_reason), len(event.record.get("token_ids", [])) or self.tokens)
        elif isinstance(event, Failed):
            self.end("error", self.tokens, event.reason)

    def end(self, status: str, generated: int, error: str | None = None) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        m, now = self.metrics, time.perf_counter()
        m.requests.labels(outcome=status).inc()
        if status in ("rejected", "too_large"):
            self._write(status, 0, None, now, error)
            return
        if self.first is None and generated:  # a non-streamed record carried its tokens at once
            m.ttft.observe(now - self.t0)
        m.e2e.observe(now - self.t0)
        m.prompt.inc(self.prompt_tokens)
        m.generation.inc(generated)
        m.cached.inc(self.cached)
        if self.on_end is not None:
            self.on_end(now - self.t0)
        self._write(status, generated, (self.first or now) - self.t0 if generated else None, now, error)

    def _write(self, status, generated, ttft, now, error) -> None:
        if self.fmt == "none":
            return
        rec = {
            "id": self.rid,
            "document": self.document or None,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached,
            "generated_tokens": generated,
            "ttft_s": round(ttft, 4) if ttft is not None else None,
            "e2e_s": round(now - self.t0, 4),
            "status": status,
            **({"error": error} if error else {}),
        }
        if self.fmt == "json":
            line = json.dumps(rec)
        else:
            line = (
                "treeattn: request "
                + " ".join(
                    f"{k}={'-' if v is None else (f'{v:.3f}' if isinstance(v, float) else v)}"
                    for k, v in rec.items()
                    if k != "error"
                )
                + (f" error={json.dumps(error)}" if error else "")
            )
        try:
            print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr closed: the metrics still count it
            pass
