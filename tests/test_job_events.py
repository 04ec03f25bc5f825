"""A job's Server-Sent Events (GET /v1/jobs/{id}/events) and the SDK that follows them."""

from __future__ import annotations

import time

import httpx
import pytest
from api_server import running_server

from vlamux.sdk import Client, NotFoundError
from vlamux.sdk.events import follow

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}
ENV = {"task": "goal/touch-red-cube", "image_size": 32, "max_steps": 20, "n_action_steps": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("events")) as (url, admin_key, host):
        admin = Client(url, admin_key)
        _, key = admin.admin.create_tenant("streamer", {"requests_per_s": 10000})
        _, other = admin.admin.create_tenant("neighbour", {"requests_per_s": 10000})
        yield url, Client(url, key), Client(url, other)


def _rl(name: str, env_steps: int = 48) -> dict:
    return {"name": name, "kind": "rl", "head": HEAD,
            "rl": {"env": ENV, "env_steps": env_steps, "n_envs": 1, "sub_batches": 1, "segment_steps": 4}}


def test_a_jobs_stream_has_every_entry_once_in_order_and_ends_with_the_job(server):
    url, c, _ = server
    job = c.submit(_rl("streamed"))
    events = list(job.events(timeout_s=120))
    assert events[-1].kind == "end" and events[-1].data["state"] == "succeeded"
    ids = [e.id for e in events if e.id is not None]
    assert ids == list(range(1, len(ids) + 1))
    kinds = [e.kind for e in events]
    assert kinds.count("state") >= 3 and kinds.count("progress") >= 3  # queued, running, succeeded; rows
    assert [e.data["state"] for e in events if e.kind == "state"][-1] == "succeeded"
    assert all(e.line for e in events if e.id is not None)
    # the same record as the polled logs, line for line
    assert [e.line for e in events if e.id is not None] == job.logs()

    # reconnecting after event k: the entries after k, once, then the end
    k = len(ids) // 2
    again = list(follow(c._http.client, job.id, since=k, deadline=time.monotonic() + 60))
    assert [e.id for e in again if e.id is not None] == ids[k:] and again[-1].kind == "end"
    with httpx.stream("GET", f"{url}/v1/jobs/{job.id}/events", timeout=30,
                      headers={"Authorization": c._http.client.headers["Authorization"], "Last-Event-ID": str(ids[-1])}) as r:
        body = r.read().decode()
    assert "id:" not in body and "event: end" in body


def test_wait_and_follow_logs_use_the_stream(server):
    _, c, _ = server
    job = c.submit(_rl("waited"))
    assert job.wait(timeout_s=120, progress=False).state == "succeeded"
    lines = list(c.job(job.id).follow_logs())
    assert lines == c.job(job.id).logs()


def test_another_tenants_job_has_no_stream_and_a_bad_last_event_id_is_refused(server):
    url, c, other = server
    job = c.submit(_rl("private", env_steps=8))
    with pytest.raises(NotFoundError):
        next(iter(other.job(job.id).events(timeout_s=10)))
    r = httpx.get(f"{url}/v1/jobs/{job.id}/events", timeout=30,
                  headers={"Authorization": c._http.client.headers["Authorization"], "Last-Event-ID": "x; rm"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "last-event-id"
    job.wait(timeout_s=120, progress=False)


def test_events_timeout_bounds_a_busy_stream(server):
    """A job that keeps sending progress still lets `events(timeout_s=...)` return on time."""
    _, c, _ = server
    job = c.submit(_rl("busy", env_steps=100_000))
    try:
        t0 = time.monotonic()
        seen = [e for e in job.events(timeout_s=4)]
        assert time.monotonic() - t0 < 15 and seen and seen[-1].kind != "end"
    finally:
        job.cancel()
        job.wait(timeout_s=120, progress=False)


def test_a_stream_without_news_ends_after_its_idle_bound(server, monkeypatch):
    """An evaluation writes no metrics rows: with the idle bound at 1 s, the stream says `idle` and
    closes; the SDK reconnects from the last id and still sees the job to its end."""
    import vlamux.api.app as app

    monkeypatch.setattr(app, "STREAM_IDLE_S", 1.0)
    url, c, _ = server
    job = c.submit({"name": "quiet", "kind": "eval", "head": HEAD,
                    "eval": {"episodes": 4, "n_envs": 1, "env": {**ENV, "max_steps": 120}}})
    raw = httpx.get(f"{url}/v1/jobs/{job.id}/events", timeout=60,
                    headers={"Authorization": c._http.client.headers["Authorization"]}).text
    assert "event: idle" in raw and "event: end" not in raw, raw[-400:]
    events = list(job.events(timeout_s=180))
    assert events[-1].kind == "end" and [e.id for e in events if e.id] == sorted({e.id for e in events if e.id})
