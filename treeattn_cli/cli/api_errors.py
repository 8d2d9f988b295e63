"""The HTTP error body of every ``treeattn serve`` endpoint: an OpenAI error object."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error(status: int, message: str, param=None, code=None, kind="invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def unavailable(srv) -> JSONResponse:
    """503 while ``srv`` cannot answer: its ranks being started again after a lost one (code
    ``recovering``, ``Retry-After``), or gone for good."""
    if srv.recovering:
        r = error(
            503,
            f"the server is starting its ranks again ({srv.recovering}); retry shortly",
            code="recovering",
            kind="server_error",
        )
        r.headers["Retry-After"] = "5"
        return r
    return error(503, f"the server's ranks are gone: {srv.failed}", kind="server_error")
