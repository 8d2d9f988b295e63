"""``/v1/documents``: the documents a ``treeattn serve`` holds, for operators (issue 36).

* ``POST /v1/documents`` ``{"text", "pin"?, "ttl_s"?}`` prefills the document now and answers
  ``200`` with it. It is cached exactly as a chat request whose last user message begins with
  ``text`` followed by a blank line finds it (the same template, the same tokens), so such a
  request reports it in ``usage.prompt_tokens_details.cached_tokens``.
* ``GET /v1/documents``: every cached document, posted or made by requests (``id``, ``tokens``,
  ``pinned``, ``resident`` (in the ranks' memory), ``on_disk``, ``last_used``, ``hits``,
  ``bytes`` (its KV on each rank), ``ttl_s``, ``created``); ``GET /v1/documents/{id}``: one.
* ``PATCH /v1/documents/{id}`` ``{"pin"?, "ttl_s"?}``: pin (making it resident) or unpin, or
  change its TTL (``null``: none).
* ``DELETE /v1/documents/{id}``: out of memory, its cached blocks freed and its saved copy
  deleted; ``409`` while a request over it is in flight (it is not waited for: retry).

A pinned document never leaves memory; the pinned documents together may hold at most
``catalog.PIN_SHARE`` of each rank's pool (``--kv-memory``; the rest stays for other documents): a
pin past that is refused with ``409`` and the numbers (a new document is still cached,
unpinned). A request whose document cannot fit next to the pinned ones gets ``400``
(``document_too_large``). A document unused for its TTL leaves memory (a saved copy, or the pool's
cached blocks, can bring it back). Same key as ``/v1/*``; errors are OpenAI error objects.
"""

from __future__ import annotations

import asyncio
import functools
import json

from fastapi import FastAPI, Request

from .api_errors import error as _error, unavailable
from ..serving.catalog import MIN_DOCUMENT
from .prompt import PromptError, split_chat

_DOC = "document"


class _Bad(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _fields(body: dict, allowed: set) -> tuple:
    if not isinstance(body, dict):
        raise _Bad(400, "the request body must be a JSON object")
    extra = sorted(set(body) - allowed)
    if extra:
        raise _Bad(400, f"unknown field(s) {', '.join(extra)} (allowed: {', '.join(sorted(allowed))})", extra[0])
    pin = body.get("pin")
    if pin is not None and not isinstance(pin, bool):
        raise _Bad(400, "'pin' must be true or false", "pin")
    ttl = body.get("ttl_s")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0):
        raise _Bad(400, f"'ttl_s' must be a positive number of seconds or null, got {json.dumps(ttl)[:40]}", "ttl_s")
    return pin, ttl


def document_ids(srv, text: str) -> list[int]:
    """The tokens a chat request whose last user message begins with ``text`` and a blank line
    has as its document part (_Bad when there is none, or it cannot be held)."""
    try:
        with srv.tokenizing:
            ids, d = split_chat(srv.tokenizer, [{"role": "user", "content": text.rstrip("\n") + "\n\n?"}])
    except PromptError as e:
        raise _Bad(400, str(e)) from None
    if d < MIN_DOCUMENT:
        raise _Bad(400, f"a document needs at least {MIN_DOCUMENT} tokens; this one has {d}", "text")
    if srv.context and d >= srv.context:
        raise _Bad(
            400,
            f"this model's maximum context length is {srv.context} tokens; the document has {d}",
            "text",
            "context_length_exceeded",
        )
    too_large = srv.catalog.too_large(d, ids)
    if too_large:
        raise _Bad(400, too_large, "text", "document_too_large")
    return ids[:d]


def post_at_start(srv, path: str, pin: bool) -> dict:
    """``serve --document FILE [--pin]``: the document cached (pinned) before the server listens."""
    from pathlib import Path

    catalog = srv.catalog
    try:
        text = Path(path).read_text(encoding="utf-8")
        ids = document_ids(srv, text)
        key = catalog.key_of(ids)
        refusal = catalog.pin_refusal(key, len(ids)) if pin else None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--document {path}: cannot read it ({e})") from None
    except _Bad as e:
        raise ValueError(f"--document {path}: {e}") from None
    if refusal:
        raise ValueError(f"--document {path} --pin: {refusal}")
    try:
        srv.front.document(key, ids, {"pin": True} if pin else {})
    except RuntimeError as e:
        raise ValueError(f"--document {path}: {e}") from None
    return catalog.view(key)


def add_routes(app: FastAPI, srv) -> None:
    catalog = srv.catalog

    async def ask(key: str, ids, action: dict) -> str:
        """A document request to the engine (off the event loop); its outcome."""
        try:
            return await asyncio.to_thread(srv.front.document, key, ids, action)
        except RuntimeError as e:
            raise _Bad(503, str(e)) from None

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        if len(raw) > srv.o.max_request_bytes:
            raise _Bad(
                413,
                f"the request body ({len(raw)} bytes) exceeds this server's limit of "
                f"{srv.o.max_request_bytes} bytes (--max-request-bytes)",
                code="request_too_large",
            )
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise _Bad(400, "the request body is not valid JSON") from None

    def guarded(handler):
        @functools.wraps(handler)  # FastAPI reads the handler's parameters through it
        async def wrapped(*args, **kwargs):
            if srv.failed:
                return unavailable(srv)
            try:
                return await handler(*args, **kwargs)
            except _Bad as e:
                if e.status == 503 and srv.failed:  # the ranks were lost under it
                    return unavailable(srv)
                return _error(e.status, str(e), e.param, e.code)

        return wrapped

    @app.post("/v1/documents")
    @guarded
    async def post_document(request: Request):
        body = await body_of(request)
        pin, ttl = _fields(body, {"text", "pin", "ttl_s"})
        text = body.get("text")
        if not isinstance(text, str) or not text.strip():
            raise _Bad(400, "'text' must be a non-empty string", "text")
        ids = await asyncio.to_thread(document_ids, srv, text)
        key = catalog.key_of(ids)
        refusal = catalog.pin_refusal(key, len(ids)) if pin else None
        keep = pin is None or refusal is not None  # no pin asked (or refused): it stays as it was
        await ask(key, ids, {} if keep else {"pin": pin})
        e = catalog.entries.get(key)
        if e is None:  # another request deleted it meanwhile (the same text posted and deleted at once)
            raise _Bad(
                409,
                f"document {key!r} was deleted by another request while this one posted it; post it again",
                code="document_deleted",
            )
        if "ttl_s" in body:
            e.ttl_s = ttl
        if refusal:
            raise _Bad(409, refusal + "; the document is cached, unpinned", "pin", "pin_exceeds_pool")
        return catalog.view(key)

    @app.get("/v1/documents")
    async def list_documents():
        return {"object": "list", "data": [catalog.view(k) for k in list(catalog.entries)]}

    def known(doc_id: str):
        e = catalog.entries.get(doc_id)
        if e is None:
            raise _Bad(404, f"no document {doc_id!r} (GET /v1/documents lists them)", code="document_not_found")
        return e

    @app.get("/v1/documents/{doc_id}")
    @guarded
    async def get_document(doc_id: str):
        known(doc_id)
        return catalog.view(doc_id)

    @app.patch("/v1/documents/{doc_id}")
    @guarded
    async def patch_document(doc_id: str, request: Request):
        e = known(doc_id)
        body = await body_of(request)
        pin, ttl = _fields(body, {"pin", "ttl_s"})
        if pin:
            refusal = catalog.pin_refusal(doc_id, len(e.ids))
            if refusal:
                raise _Bad(409, refusal, "pin", "pin_exceeds_pool")
        if pin or (pin is False and e.resident):
            await ask(doc_id, e.ids, {"pin": pin})  # resident (loaded or prefilled again when pinned)
        e = known(doc_id)
        if pin is not None:
            e.pinned = pin
        if "ttl_s" in body:
            e.ttl_s = ttl
        return catalog.view(doc_id)

    @app.delete("/v1/documents/{doc_id}")
    @guarded
    async def delete_document(doc_id: str):
        e = known(doc_id)
        busy = f"document {doc_id!r} is read by a request in flight; retry when it ends"
        if srv.front.in_use(doc_id):
            raise _Bad(409, busy, code="document_in_use")
        if await ask(doc_id, e.ids, {"action": "drop"}) == "busy":
            raise _Bad(409, busy, code="document_in_use")
        return {"id": doc_id, "object": _DOC, "deleted": True}
