"""The HTTP error body of every ``treeattn serve`` endpoint: an OpenAI error object."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error(status: int, message: str, param=None, code=None, kind="invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)
