"""OpenAI's wire format over a ``serve.Server`` (``srv``: what it serves, ``admit`` and
``submit`` a request, ``cancel`` one): ``GET /health``, ``GET /metrics`` (Prometheus),
``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/completions``, streamed as server-sent events ending
with ``[DONE]``, with ``usage`` (``prompt_tokens_details.cached_tokens``: the document tokens
found in the cache). Requests are checked here: a malformed one gets HTTP 400 with an OpenAI
error object, an unknown model 404, a missing or wrong key 401, a server whose ranks are lost 503,
a body over ``--max-request-bytes`` 413, and a request past ``--batch`` + ``--max-waiting`` 429
with ``Retry-After`` (at once: the server goes on serving the others).
Parameters treeattn does not honour are refused with 400, never ignored. OpenAI's
``prompt_cache_retention``: ``"in_memory"`` is what every document gets (kept in the ranks'
pools and host tier while they have room), ``"24h"`` needs ``--cache-dir`` (where every document
is saved as it is made, found again by any later request). An extension of the
format: ``"cite": true`` (the official client's ``extra_body``) gives the answer ``citations`` and
``sentence_citations`` (``cli/citations.py``) on its message (chat), its choice (completions), or
the final chunk's delta or choice when streamed."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .api_errors import error as _error, unavailable
from .citations import CiteError, citations, for_request
from ..serving.catalog import MIN_DOCUMENT
from ..engine.requests import Began, Done, Failed, Token
from ..engine.sampling import Sampling
from .prompt import PromptError, split_chat, split_completion

# parameters a client may send at their default (the official client and others often do);
# any other value is refused: treeattn would not honour it
_DEFAULTS = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "response_format": (None,),
    "functions": (None, []),
}
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "interrupted": "stop", "cancelled": "stop"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def _number(body, name, lo, hi, default, integer=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:40]}", name)
    if not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def _stops(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadRequest("'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    return stop


def _content(m, i) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c
    ):
        return "".join(p["text"] for p in c)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def _messages(body) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise BadRequest(
                f"messages[{i}] must be an object with a role of system, user or assistant", f"messages[{i}].role"
            )
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": _content(m, i)})
    return out


def _common(srv, body, chat: bool) -> dict:
    """The sampling and limits of a request, checked; BadRequest otherwise."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != srv.name:
        raise BadRequest(
            f"The model `{model}` does not exist (this server serves `{srv.name}`)", "model", 404, "model_not_found"
        )
    for name, allowed in _DEFAULTS.items():
        if name in body and body[name] not in allowed:
            raise BadRequest(f"'{name}' is not supported by treeattn (exact greedy or sampled decoding only)", name)
    retention = body.get("prompt_cache_retention")
    if retention not in (None, "in_memory", "24h"):
        raise BadRequest(
            f"'prompt_cache_retention' must be \"in_memory\" or \"24h\", got {json.dumps(retention)[:40]}",
            "prompt_cache_retention",
        )
    if retention == "24h" and srv.catalog.dir is None:  # (documents outlive memory only on disk)
        raise BadRequest(
            "'prompt_cache_retention': \"24h\" keeps the document on disk: start the server with --cache-dir",
            "prompt_cache_retention",
        )
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, limit, 1, 1 << 30, None, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return {
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 0.0, 2.0, 0.0),  # greedy unless asked
        "top_p": _number(body, "top_p", 1e-9, 1.0, 1.0),
        "seed": _number(body, "seed", -(1 << 62), 1 << 62, 0, integer=True),
        "stop": _stops(body),
        "stream": stream,
        "usage_in_stream": bool(opts.get("include_usage")),
    }


class _Reply:
    """A request's events from the engine's front (on its thread) into this request's event loop."""

    def __init__(self, loop):
        self.loop, self.queue = loop, asyncio.Queue()

    def __call__(self, event):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class _Text:
    """The answer's text as tokens arrive: what can be sent now (held back: a tail that may turn
    into a stop string, an incomplete UTF-8 sequence), and the final text cut at the stop."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop, self.ids, self.sent = tokenizer, stop, [], 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def _cut(self, text: str) -> tuple[str, bool]:
        at = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        return (text[:at], True) if at >= 0 else (text, False)

    def add(self, token: int) -> str:
        self.ids.append(token)
        text, stopped = self._cut(self.tok.decode(self.ids, skip_special_tokens=True))
        ready = len(text) if stopped else max(self.sent, len(text) - self.hold)
        while ready > self.sent and text[ready - 1] == "\ufffd":
            ready -= 1
        out = text[self.sent : ready]
        self.sent = max(self.sent, ready)
        return out

    def finish(self) -> tuple[str, str, bool]:
        """(the rest to send, the whole text, whether a stop string ended it)."""
        text, stopped = self._cut(self.tok.decode(self.ids, skip_special_tokens=True))
        rest = text[self.sent :]
        self.sent = len(text)
        return rest, text, stopped


def build_app(srv) -> FastAPI:
    app = FastAPI(title="treeattn", docs_url=None, redoc_url=None, openapi_url=None)

    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, exc: HTTPException):  # (an unknown path or method: OpenAI's error body)
        what = "no such endpoint" if exc.status_code == 404 else str(exc.detail)
        return _error(
            exc.status_code,
            f"{request.method} {request.url.path}: {what}",
            code="not_found" if exc.status_code == 404 else None,
        )

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if srv.o.api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {srv.o.api_key}":
                return _error(
                    401,
                    "Incorrect or missing API key (Authorization: Bearer <key>)",
                    code="invalid_api_key",
                    kind="authentication_error",
                )
        return await call_next(request)

    @app.get("/health")
    async def health():
        if srv.failed:
            return JSONResponse(
                {"status": "recovering" if srv.recovering else "error", "reason": srv.failed}, status_code=503
            )
        return {"status": "ok", "model": srv.name, "stats": srv.front.stats.snapshot() if srv.front else {}}

    @app.get("/metrics")
    async def metrics():
        from .metrics import CONTENT_TYPE

        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": srv.name, "object": "model", "created": srv.created, "owned_by": "treeattn"}],
        }

    async def answer(request: Request, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if srv.failed:
            return unavailable(srv)
        limit = srv.o.max_request_bytes
        size = request.headers.get("content-length")
        raw = b"" if size is not None and size.isdigit() and int(size) > limit else await request.body()
        if (size is not None and size.isdigit() and int(size) > limit) or len(raw) > limit:
            why = (
                f"the request body ({int(size) if size and size.isdigit() else len(raw)} bytes) exceeds "
                f"this server's limit of {limit} bytes (--max-request-bytes)"
            )
            srv.refused(rid, 0, "too_large", why)
            return _error(413, why, code="request_too_large")
        retry = srv.admit()  # first: a refusal costs no parsing and no tokenizing
        if retry is not None:
            why = (
                f"this server is answering {srv.o.batch} requests and {srv.o.max_waiting} more are waiting "
                f"(--batch, --max-waiting); retry in {retry:.0f} s"
            )
            srv.refused(rid, 0, "rejected", why)
            resp = _error(429, why, code="rate_limit_exceeded", kind="rate_limit_error")
            resp.headers["Retry-After"] = str(int(retry + 0.999))
            return resp

        def prepare():
            """The request checked and tokenized (off the event loop: a long document takes a while)."""
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
                raise BadRequest("the request body is not valid JSON") from None
            p = _common(srv, body, chat)
            tok = srv.tokenizer
            if chat:
                messages = _messages(body)
                with srv.tokenizing:  # one thread at a time in the (Rust) tokenizer
                    ids, doc = split_chat(tok, messages)
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                if not isinstance(prompt, str) or not prompt:
                    raise BadRequest("'prompt' must be a non-empty string", "prompt")
                with srv.tokenizing:
                    ids, doc = split_completion(tok, prompt)
            default = 16 if not chat else min(512, max(1, (srv.context or 4096) - len(ids)))
            max_tokens = p["max_tokens"] or default
            if srv.context and len(ids) + max_tokens > srv.context:
                raise BadRequest(
                    f"This model's maximum context length is {srv.context} tokens; the request has "
                    f"{len(ids)} prompt tokens and asks for {max_tokens} more",
                    "max_tokens",
                    code="context_length_exceeded",
                )
            question = len(ids) - (doc if doc >= MIN_DOCUMENT else 0)  # (a shorter document part is question)
            too_large = srv.catalog.too_large(doc, ids, tail_tokens=question + max_tokens)
            if too_large:
                raise BadRequest(too_large, "messages" if chat else "prompt", code="document_too_large")
            spans = None
            if not isinstance(body.get("cite", False), bool):
                raise BadRequest("'cite' must be a boolean", "cite")
            if body.get("cite"):
                try:
                    spans = for_request(tok, ids, messages=messages if chat else None, prompt=None if chat else prompt)
                except CiteError as e:
                    raise BadRequest(str(e), "cite") from None
            return p, ids, doc, max_tokens, spans

        try:
            p, ids, doc, max_tokens, spans = await asyncio.to_thread(prepare)
        except (BadRequest, PromptError) as e:
            srv.release()
            srv.metrics.requests.labels(outcome="invalid").inc()
            if isinstance(e, PromptError):
                return _error(400, str(e))
            return _error(e.status, str(e), e.param, e.code)
        except BaseException:
            srv.release()
            raise
        reply = _Reply(asyncio.get_running_loop())
        job = srv.submit(
            ids,
            doc,
            max_tokens=max_tokens,
            stop=p["stop"],
            deliver=reply,
            rid=rid,
            sampling=Sampling(p["temperature"], 0, p["top_p"], p["seed"]),
            cite=spans.spec() if spans else None,
        )
        text = _Text(srv.tokenizer, p["stop"])
        meta = {"cached": 0}

        def usage(n):
            return {
                "prompt_tokens": len(ids),
                "completion_tokens": n,
                "total_tokens": len(ids) + n,
                "prompt_tokens_details": {"cached_tokens": meta["cached"]},
            }

        def chunk(delta: str | None, finish=None, first=False, cited=None):
            created = int(time.time())
            if chat:
                d = ({"role": "assistant", "content": ""} if first else {}) | ({"content": delta} if delta else {})
                return {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": srv.name,
                    "choices": [{"index": 0, "delta": d | (cited or {}), "finish_reason": finish, "logprobs": None}],
                }
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": srv.name,
                "choices": [
                    {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None, **(cited or {})}
                ],
            }

        def cited(record) -> dict | None:
            """The answer's citations (``"cite": true``), from the masses its record carries."""
            if spans is None or record.get("cite") is None:
                return None
            return citations(spans, record["cite"], srv.tokenizer, record.get("token_ids", []))

        async def events():
            """The request's events; a client gone cancels the request."""
            try:
                while True:
                    try:
                        event = await asyncio.wait_for(reply.queue.get(), 0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            srv.cancel(job)
                            return
                        continue
                    if isinstance(event, Began):
                        meta["cached"] = event.cached
                        continue
                    if isinstance(event, Done) and event.stop_reason == "no_room":
                        event = Failed(
                            "the KV pool has no room for this request's document and answer "
                            "next to the pinned ones (unpin or delete some: /v1/documents)"
                        )
                    yield event
                    if isinstance(event, (Done, Failed)):
                        return
            except asyncio.CancelledError:  # the client went away mid-stream
                srv.cancel(job)
                raise

        if p["stream"]:

            async def sse():
                yield f"data: {json.dumps(chunk(None, first=True))}\n\n"
                async for event in events():
                    if isinstance(event, Token):
                        piece = text.add(event.token)
                        if piece:
                            yield f"data: {json.dumps(chunk(piece))}\n\n"
                    elif isinstance(event, Failed):
                        err = {"error": {"message": event.reason, "type": "server_error", "param": None, "code": None}}
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    else:
                        record = event.record
                        rest, _, stopped = text.finish()
                        finish = "stop" if stopped else _FINISH.get(record.get("stop_reason"), "stop")
                        yield f"data: {json.dumps(chunk(rest or None, finish, cited=cited(record)))}\n\n"
                        if p["usage_in_stream"]:
                            last = chunk(None)
                            last["choices"] = []
                            last["usage"] = usage(len(record.get("token_ids", [])))
                            yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(
                sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
        record = None
        async for event in events():
            if isinstance(event, Failed):  # (its ranks lost under it: 503 recovering, retry)
                return unavailable(srv) if srv.failed else _error(503, event.reason, kind="server_error")
            if isinstance(event, Done):
                record = event.record
        if record is None:  # the client went away
            return _error(499, "the client closed the request")
        for t in record.get("token_ids", []):
            text.add(t)
        _, whole, stopped = text.finish()
        finish = "stop" if stopped else _FINISH.get(record.get("stop_reason"), "stop")
        n = len(record.get("token_ids", []))
        extra = cited(record) or {}
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": whole, **extra},
                "finish_reason": finish,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": whole, "finish_reason": finish, "logprobs": None, **extra}
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": srv.name,
            "choices": [choice],
            "usage": usage(n),
        }

    from .documents_api import add_routes

    add_routes(app, srv)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    return app
