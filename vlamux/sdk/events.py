"""A job's Server-Sent Events (`GET /v1/jobs/{id}/events`), followed across reconnects.

Each event has an id (its position in the job's record); after a dropped connection or the server's
`idle` end the stream is opened again with ``Last-Event-ID``, so nothing is missed and nothing comes
twice. The stream is over at the server's `end` event (the job has ended).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Iterator

import httpx

from vlamux.sdk.errors import ServiceUnavailableError
from vlamux.sdk.http import _error


@dataclass(frozen=True)
class JobEvent:
    id: int | None  # None for the stream's own `end` / `idle`
    kind: str  # state | progress | error | end | idle
    data: dict  # the entry (a state transition, a metrics row, {"error"}), or the stream's detail
    line: str = ""  # the entry as a log line


def parse(lines: Iterator[str]) -> Iterator[JobEvent]:
    """SSE lines -> events (comments and `retry:` skipped)."""
    fields: dict[str, str] = {}
    for line in lines:
        if not line:
            if "data" in fields:
                body = json.loads(fields["data"])
                event_id = int(fields["id"]) if fields.get("id", "").isdigit() else None
                if event_id is None:
                    yield JobEvent(None, fields.get("event", "message"), body)
                else:
                    yield JobEvent(event_id, fields.get("event", "message"), body.get("data", {}), body.get("line", ""))
            fields = {}
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        fields[name] = value[1:] if value.startswith(" ") else value


def follow(client: httpx.Client, job_id: str, since: int = 0, deadline: float | None = None,
           max_failures: int = 5) -> Iterator[JobEvent]:
    """Every event of the job after position `since`, until its `end` (which is yielded last).
    Reconnects after `idle` or a broken connection; raises the HTTP error of a refused stream, or
    ServiceUnavailableError after `max_failures` connections in a row that brought nothing."""
    last, failures = since, 0
    while True:
        read_s = 30.0 if deadline is None else max(0.1, min(30.0, deadline - time.monotonic()))
        try:
            with client.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(last)},
                               timeout=httpx.Timeout(read_s, connect=10.0)) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _error(resp)
                for event in parse(resp.iter_lines()):
                    failures = 0
                    if event.id is not None:
                        last = event.id
                    yield event
                    if event.kind == "end":
                        return
                    if deadline is not None and time.monotonic() >= deadline:  # a busy stream ends on time too
                        return
        except (httpx.TransportError, json.JSONDecodeError) as e:
            if deadline is not None and time.monotonic() >= deadline:
                return
            failures += 1
            if failures > max_failures:
                raise ServiceUnavailableError(None, "unavailable", f"job {job_id}: event stream failed "
                                              f"{failures} times in a row ({type(e).__name__}: {e})") from e
            time.sleep(min(5.0, 0.5 * 2 ** failures))
        if deadline is not None and time.monotonic() >= deadline:
            return
