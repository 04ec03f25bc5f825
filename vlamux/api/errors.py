"""How the API answers errors: one JSON shape, ``{"error": {"type", "message", "field"}}``, the status
a client can act on, and `Retry-After` where waiting helps. Also the request-body size limit."""

from __future__ import annotations

import asyncio
import logging
import math
import uuid

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlamux import wire
from vlamux.api.faults import Conflict, NotFound, QuotaExceeded, TooLarge
from vlamux.errors import IncompatibleError, InvalidInputError, UnknownTenantError, VlamuxError, public_message

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, type_: str, message: str, field: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.type, self.message, self.field, self.headers = status, type_, message, field, headers


def error_response(status: int, type_: str, message: str, field: str | None = None, headers=None,
                   **extra) -> JSONResponse:
    body = {"error": {"type": type_, "message": public_message(message), **extra}}
    if field:
        body["error"]["field"] = field
    return JSONResponse(body, status_code=status, headers=headers)


def field_of(message: str) -> str | None:
    """Our errors start with the field they are about: "head.horizon: must be ..."."""
    head = message.split(":", 1)[0]
    return head if head and " " not in head and len(head) < 80 else None


def translate(e: Exception) -> JSONResponse:
    if isinstance(e, ApiError):
        return error_response(e.status, e.type, e.message, e.field, e.headers)
    if isinstance(e, QuotaExceeded):
        retry = max(1, math.ceil(e.retry_after_s))
        kind = "rate_limited" if str(e).startswith("rate") else "quota_exceeded"
        extra = {"quota": e.numbers} if e.numbers else {}
        return error_response(429, kind, str(e), headers={"Retry-After": str(retry)}, **extra)
    if isinstance(e, (NotFound, UnknownTenantError)) or type(e).__name__ in ("SessionNotFound", "DatasetNotFound"):
        return error_response(404, "not_found", str(e.args[0]) if e.args else "not found")
    if isinstance(e, Conflict):
        return error_response(409, "conflict", str(e))
    if isinstance(e, TooLarge):
        return error_response(413, "payload_too_large", str(e), field_of(str(e)))
    if isinstance(e, wire.WireError) and not e.field:  # the body as a whole does not decode
        message = str(e) if str(e).startswith("body") else f"body: {e}"
        return error_response(422, "invalid_input", message, "body")
    if isinstance(e, (InvalidInputError, wire.WireError, IncompatibleError)):
        field = getattr(e, "field", None) or field_of(str(e))
        return error_response(422, "invalid_input", str(e), field)
    if type(e).__name__ == "QuotaExceeded":  # the Environment Service's own limits
        return error_response(429, "quota_exceeded", str(e), headers={"Retry-After": "5"})
    if type(e).__name__ == "QueueClosed":  # no replica can take it right now (restarting, not yet staged)
        return error_response(503, "unavailable", str(e), headers={"Retry-After": "1"})
    if isinstance(e, TimeoutError):
        return error_response(503, "unavailable", f"timed out: {e}", headers={"Retry-After": "2"})
    if isinstance(e, VlamuxError):
        return error_response(422, "invalid_input", str(e), field_of(str(e)))
    incident = uuid.uuid4().hex[:12]
    log.error("unexpected error (incident %s)", incident, exc_info=e)
    # its message could say anything about the service's insides: the log has it, the answer an id
    return error_response(500, "server_error", f"internal error ({type(e).__name__}); incident {incident} "
                                               f"in the service's log")


UPLOAD_TYPES = (b"application/x-tar", b"application/gzip", b"application/x-gzip", b"application/x-hdf5",
                b"application/octet-stream")


def _is_upload(path: str) -> bool:
    return path in ("/v1/datasets", "/v1/policy-files") or (path.startswith("/v1/uploads/") and path.count("/") == 3)


class BodyLimit:
    """413 for a body over `limit` bytes (`json_limit` for any body that is not msgpack): at once when
    content-length says so, else as it streams in.

    A pure ASGI middleware, so that a chunked body (no content-length) is counted too, whatever
    reads it (FastAPI's JSON parsing or `msgpack_body`). JSON bodies are specs and small settings, and
    FastAPI parses them on the event loop, so their limit is far below that of array payloads."""

    def __init__(self, app, limit: int, json_limit: int | None = None, read_timeout_s: float = 60.0,
                 upload_limit: int | None = None):
        self.app, self.max_bytes, self.read_timeout_s = app, limit, read_timeout_s
        self.json_limit = limit if json_limit is None else min(limit, json_limit)
        self.upload_limit = limit if upload_limit is None else upload_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, upload = dict(scope.get("headers") or []), False
        ctype = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if ctype in (b"application/msgpack", b"application/x-msgpack"):
            limit = self.max_bytes
        elif ctype in UPLOAD_TYPES and _is_upload(scope.get("path", "")):  # streamed to disk, not parsed
            limit = self.upload_limit
            upload = True
        else:
            limit = self.json_limit
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
                if n < 0:
                    raise ValueError
            except ValueError:
                return await error_response(400, "invalid_input", "content-length: not a non-negative integer",
                                    "content-length")(scope, receive, send)
            if n > limit:
                return await error_response(413, "payload_too_large", f"body of {n} bytes; the limit is {limit}")(
                    scope, receive, send)
        seen, complete = 0, False
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s
        # an upload may take long as a whole: for it the timeout is per chunk (a stalled sender)

        async def counted():
            nonlocal seen, complete, deadline
            if complete:  # after the body: a wait for the client's disconnect, which has no deadline
                return await receive()
            try:  # a client that trickles its body (or stops) must not hold the request for ever
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                raise StarletteHTTPException(408, f"body: not received within {self.read_timeout_s:g} s") from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            if upload:
                deadline = asyncio.get_running_loop().time() + self.read_timeout_s
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # handled by the app's HTTPException handler: 413 in our format
                    raise StarletteHTTPException(413, f"body over the limit of {limit} bytes")
            return message

        await self.app(scope, counted, send)
