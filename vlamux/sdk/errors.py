"""The SDK's exceptions: one class per kind of failure, all carrying the server's error body.

The server answers every error as ``{"error": {"type", "message", "field"?}}`` (docs/API.md);
`error_from_response` turns that into the class for its HTTP status, so callers catch what they
can act on::

    try:
        client.submit(spec)
    except vlamux.sdk.InvalidInputError as e:
        print("fix", e.field, ":", e.message)
"""

from __future__ import annotations


class VlamuxAPIError(Exception):
    """Base class: an error answered by (or on the way to) the vlamux service.

    `status` is the HTTP status (None when no answer came back), `type` the server's error type
    (``invalid_input``, ``not_found``, ...), `message` its message, `field` the request field it
    is about (or None).
    """

    def __init__(self, status: int | None, type: str, message: str, field: str | None = None):  # noqa: A002
        self.status, self.type, self.message, self.field = status, type, message, field
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = f" [{self.status} {self.type}]" if self.status else f" [{self.type}]"
        return self.message + where

    def __reduce__(self):  # picklable despite the custom __init__
        return (self.__class__, (self.status, self.type, self.message, self.field))


class AuthenticationError(VlamuxAPIError):
    """401: no API key, or an unknown, revoked or disabled tenant's key."""


class PermissionDeniedError(VlamuxAPIError):
    """403: the key may not use this route (an admin route with a tenant key, or the reverse)."""


class NotFoundError(VlamuxAPIError):
    """404: no such resource for this tenant (another tenant's resources look missing too)."""


class InvalidInputError(VlamuxAPIError):
    """400/413/415/422: a bad field, shape, dtype, NaN or size; `field` names it."""


class ConflictError(VlamuxAPIError):
    """409: the resource's state forbids the call (e.g. cancelling a finished job, a taken name)."""


class RateLimitedError(VlamuxAPIError):
    """429: too many requests; `retry_after` is the server's hint in seconds (or None)."""

    def __init__(self, status, type, message, field=None, retry_after: float | None = None):  # noqa: A002
        self.retry_after = retry_after
        super().__init__(status, type, message, field)

    def __reduce__(self):
        return (self.__class__, (self.status, self.type, self.message, self.field, self.retry_after))


class QuotaExceededError(RateLimitedError):
    """429 ``quota_exceeded``: a tenant quota (concurrent jobs, env sessions) is used up.

    Not retried automatically: waiting alone does not help until a job ends or a session closes.
    """


class ServerError(VlamuxAPIError):
    """5xx: the service failed (or a proxy in front of it); retried while attempts remain."""


class ServiceUnavailableError(ServerError):
    """The service could not be reached (connection refused, reset, timed out) after all retries."""


class WaitTimeoutError(VlamuxAPIError, TimeoutError):
    """A client-side wait (a job, a future) ran out of time; the work goes on on the server."""


_BY_STATUS = {401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError, 409: ConflictError,
              400: InvalidInputError, 413: InvalidInputError, 415: InvalidInputError, 422: InvalidInputError,
              429: RateLimitedError}

# Failed futures report the server-side exception's class name; map the ones a tenant can fix.
_BY_EXCEPTION = {"InvalidInputError": InvalidInputError, "IncompatibleError": InvalidInputError,
                 "NonFiniteError": InvalidInputError, "WireError": InvalidInputError,
                 "JobSpecError": InvalidInputError, "NotFound": NotFoundError, "UnknownTenantError": NotFoundError,
                 "Conflict": ConflictError}
_NOMINAL_STATUS = {InvalidInputError: 422, NotFoundError: 404, ConflictError: 409, ServerError: 500}


def error_class(status: int, type_: str | None = None) -> type[VlamuxAPIError]:
    if status == 429 and type_ == "quota_exceeded":
        return QuotaExceededError
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if status >= 500:
        return ServerError
    if 400 <= status < 500:
        return InvalidInputError
    return VlamuxAPIError


def error_from_body(status: int, body, text: str = "", retry_after: float | None = None) -> VlamuxAPIError:
    """The exception for an error answer: `body` is the decoded JSON (or None), `text` the raw text."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        type_ = str(err.get("type") or "error")
        message = str(err.get("message") or f"HTTP {status}")
        field = err.get("field") or None
    elif isinstance(body, dict) and "detail" in body:  # a plain FastAPI/Starlette answer
        type_, message, field = "error", str(body["detail"]), None
    else:
        type_, message, field = "error", (text.strip()[:500] or f"HTTP {status}"), None
    cls = error_class(status, type_)
    if issubclass(cls, RateLimitedError):
        return cls(status, type_, message, field, retry_after=retry_after)
    return cls(status, type_, message, field)


def error_from_future(err: dict | None) -> VlamuxAPIError:
    """The exception for a failed future's ``{"type": <server exception class>, "message"}``."""
    err = err if isinstance(err, dict) else {}
    name = str(err.get("type") or "Error")
    message = str(err.get("message") or name)
    cls = _BY_EXCEPTION.get(name, ServerError)
    head = message.split(":", 1)[0]
    field = head if ":" in message and head and " " not in head and len(head) < 80 else None
    return cls(_NOMINAL_STATUS.get(cls), name, message, field)
