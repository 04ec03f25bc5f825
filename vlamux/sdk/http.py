"""One HTTP connection to the service: auth, JSON or msgpack bodies, errors, retries.

Retries (bounded by `max_retries` attempts after the first, with exponential backoff and jitter,
or the server's ``Retry-After`` when it gives one):

* 429 ``rate_limited`` (the request was refused before it ran, so any method is safe to repeat);
  429 ``quota_exceeded`` is not retried (see `QuotaExceededError`);
* 502, 503, 504 (the server or a proxy in front of it says "try again");
* a connection that could not be made (refused, connect timeout): nothing reached the server;
* a connection that broke or timed out after the request was sent, for idempotent methods only
  (GET, HEAD, PUT, DELETE, OPTIONS): a POST may already have run, so it is not repeated.

Every attempt has a timeout (`timeout_s`, or the call's own), and the time spent sleeping between
attempts is capped by `max_wait_s`, so no call waits forever.
"""

from __future__ import annotations

import email.utils
import logging
import random
import time
from typing import Any

import httpx

from vlamux import wire
from vlamux.sdk.errors import QuotaExceededError, ServiceUnavailableError, VlamuxAPIError, error_from_body

log = logging.getLogger(__name__)

RETRY_STATUS = {429, 502, 503, 504}
IDEMPOTENT = {"GET", "HEAD", "PUT", "DELETE", "OPTIONS"}
USER_AGENT = "vlamux-sdk/0.1"


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when is not None else None


class HTTP:
    """A thin, thread-safe wrapper around one `httpx.Client` for the vlamux API."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float = 60.0, max_retries: int = 5,
                 backoff_s: float = 0.5, max_backoff_s: float = 20.0, max_wait_s: float = 120.0,
                 transport: httpx.BaseTransport | None = None):
        if max_retries < 0:
            raise ValueError("max_retries: must be >= 0")
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.max_retries, self.backoff_s, self.max_backoff_s = int(max_retries), backoff_s, max_backoff_s
        self.max_wait_s = max_wait_s
        self.retries = 0  # retries made so far (all calls): for tests and diagnostics
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json, " + wire.CONTENT_TYPE}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout_s,
                                    transport=transport, follow_redirects=False)

    @property
    def client(self) -> httpx.Client:
        """The underlying connection (its auth headers set): for streams, which `request` does not do."""
        return self._client

    def close(self) -> None:
        self._client.close()

    # ---- one call ---------------------------------------------------------------------------
    def request(self, method: str, path: str, *, json: Any = None, packed: Any = None,
                params: dict | None = None, timeout_s: float | None = None) -> Any:
        """Send one call, retrying what is safe to retry; the decoded answer (None for 204).

        `json` sends a JSON body, `packed` a msgpack body (arrays as `vlamux.wire` encodes
        them); answers are decoded by their content type.
        """
        method = method.upper()
        kwargs: dict[str, Any] = {"params": {k: v for k, v in (params or {}).items() if v is not None}}
        if packed is not None:
            kwargs["content"] = wire.dumps(packed)
            kwargs["headers"] = {"Content-Type": wire.CONTENT_TYPE}
        elif json is not None:
            kwargs["json"] = json
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        kwargs["timeout"] = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        waited, attempt = 0.0, 0
        while True:
            try:
                resp = self._client.request(method, path, **kwargs)
            except httpx.TransportError as e:
                refused = isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))
                retryable = refused or method in IDEMPOTENT
                failure: VlamuxAPIError = ServiceUnavailableError(
                    None, "unavailable", f"{method} {self.url}{path}: {type(e).__name__}: {e}"
                    + ("" if retryable else " (not retried: the request may have run)"))
                cause: Exception | None = e
                delay = self._backoff(attempt, None)
            else:
                if resp.status_code < 400:
                    return _decode(resp)
                failure, cause = _error(resp), None
                retryable = resp.status_code in RETRY_STATUS and not isinstance(failure, QuotaExceededError)
                delay = self._backoff(attempt, parse_retry_after(resp.headers.get("retry-after")))
            if not retryable or attempt >= self.max_retries or waited + delay > self.max_wait_s:
                if retryable and attempt > 0:
                    failure.message += f" (after {attempt + 1} attempts)"
                raise failure from cause
            log.debug("%s %s: %s; retry %d in %.2fs", method, path, failure, attempt + 1, delay)
            time.sleep(delay)
            waited += delay
            attempt += 1
            self.retries += 1

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        """Exponential backoff (0.5-1x jitter), or the server's Retry-After plus a little jitter."""
        base = min(self.max_backoff_s, self.backoff_s * (2 ** attempt))
        delay = base * random.uniform(0.5, 1.0)
        if retry_after is not None:
            delay = retry_after + random.uniform(0.0, min(1.0, 0.1 * retry_after + 0.05))
        return delay

    def send(self, method: str, path: str, content, ctype: str, params: dict | None = None,
             timeout_s: float | None = None) -> Any:
        """One request with a raw body (bytes, or a file streamed from disk); the decoded answer. Not
        retried: a body that was read cannot be sent again, and the call may have run."""
        try:
            resp = self._client.request(method, path, params={k: v for k, v in (params or {}).items() if v is not None},
                                        content=content, headers={"Content-Type": ctype},
                                        timeout=httpx.Timeout(timeout_s or self.timeout_s, connect=10.0))
        except httpx.TransportError as e:
            raise ServiceUnavailableError(None, "unavailable", f"{method} {self.url}{path}: {type(e).__name__}: {e} "
                                          f"(not retried: the request may have run)") from e
        if resp.status_code >= 400:
            raise _error(resp)
        return _decode(resp)

    def download(self, path: str, out: str | None, params: dict | None = None) -> str:
        """GET `path` into the file `out` (default: the server's filename, here), streamed; its path."""
        import os
        import re
        import tempfile

        params = {k: v for k, v in (params or {}).items() if v is not None}
        with self._client.stream("GET", path, params=params, timeout=httpx.Timeout(self.timeout_s, connect=10.0)) as r:
            if r.status_code >= 400:
                r.read()
                raise _error(r)
            m = re.search(r'filename="?([^";]+)"?', r.headers.get("content-disposition", ""))
            out = out or os.path.basename(m.group(1) if m else "policy.safetensors")
            fd, tmp = tempfile.mkstemp(prefix=".download-", dir=os.path.dirname(os.path.abspath(out)))
            try:
                with os.fdopen(fd, "wb") as f:
                    for chunk in r.iter_bytes(1 << 20):
                        f.write(chunk)
                os.replace(tmp, out)  # whole or not at all
            except BaseException:
                os.unlink(tmp)
                raise
        return out

    # ---- conveniences -----------------------------------------------------------------------
    def get(self, path: str, **kw) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw) -> Any:
        return self.request("POST", path, **kw)

    def put(self, path: str, **kw) -> Any:
        return self.request("PUT", path, **kw)

    def delete(self, path: str, **kw) -> Any:
        return self.request("DELETE", path, **kw)


def _decode(resp: httpx.Response) -> Any:
    if resp.status_code == 204 or not resp.content:
        return None
    ctype = resp.headers.get("content-type", "")
    if ctype.startswith(wire.CONTENT_TYPE):
        return wire.loads(resp.content)
    if "json" in ctype:
        return resp.json()
    return resp.text


def _error(resp: httpx.Response) -> VlamuxAPIError:
    try:
        body = resp.json()
    except ValueError:
        body = None
    return error_from_body(resp.status_code, body, resp.text if body is None else "",
                           retry_after=parse_retry_after(resp.headers.get("retry-after")))


def wait_ready(url: str, timeout_s: float = 120.0, proc=None) -> None:
    """Block until the service at `url` answers /healthz; a `proc` (its server process) that exits
    first, or the deadline, raises with what happened."""
    end = time.monotonic() + timeout_s
    # one client for all the polls: each new one builds a TLS context (tens of ms of CPU, 5 times a
    # second for as long as a server takes to start)
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < end:
            if proc is not None and proc.poll() is not None:
                raise ServiceUnavailableError(None, "unavailable", f"the server process exited with code "
                                                                   f"{proc.returncode} before it was ready")
            try:
                if client.get(f"{url.rstrip('/')}/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise ServiceUnavailableError(None, "unavailable", f"{url} not ready after {timeout_s:.0f}s")


def call(url: str, method: str, path: str, api_key: str, body: Any = None, timeout_s: float = 60.0) -> Any:
    """One JSON request on a connection of its own (scripts and tests; clients keep an `HTTP`)."""
    http = HTTP(url, api_key, timeout_s=timeout_s, max_retries=2)
    try:
        return http.request(method, path, json=body) or {}
    finally:
        http.close()
