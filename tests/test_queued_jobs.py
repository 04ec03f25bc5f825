"""Jobs the service has no room for are accepted and queued (issue 28): they report a position, what
they wait for and an estimate of when they start, start when room frees, fairly across tenants;
a tenant's own quota still answers 429, with its numbers. Through the HTTP API on a real host whose
service runs one job at a time (`max_running_jobs=1`)."""

from __future__ import annotations

import re
import time
import types

import pytest
from fastapi.testclient import TestClient

from conftest import wait_until
from test_api import HEAD, bearer, new_tenant, ok
from vlamux.api.app import create_app
from vlamux.api.host import ServiceConfig, ServiceHost


def spec(name: str, steps: int) -> dict:
    return {"name": name, "kind": "sft", "head": HEAD, "sft": {"dataset": "tiny", "steps": steps, "batch_size": 4},
            "checkpoint_every": 10**6}


LONG = 10**6  # steps: a job that runs until it is cancelled


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from demos import demo_dataset

    root = tmp_path_factory.mktemp("queued")
    demo_dataset(root / "datasets" / "tiny", 4)
    host = ServiceHost(ServiceConfig(data_dir=root, env_workers=1, meter_every_s=3600, group_cap=None,
                                     max_running_jobs=1))
    admin = host.start()
    client = TestClient(create_app(host), raise_server_exceptions=False)
    try:
        yield types.SimpleNamespace(host=host, client=client, admin=admin)
    finally:
        client.close()
        host.stop()


def submit(svc, key: str, body: dict) -> dict:
    return ok(svc.client.post("/v1/jobs", json=body, headers=bearer(key)), 202).json()["job"]


def view(svc, key: str, job_id: str) -> dict:
    return ok(svc.client.get(f"/v1/jobs/{job_id}", headers=bearer(key))).json()["job"]


def until(cond, timeout_s: float = 60.0):
    return wait_until(cond, timeout_s)


def cancel(svc, key: str, job_id: str) -> dict:
    return ok(svc.client.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(key))).json()["job"]


def test_a_job_at_the_service_limit_is_queued_with_its_place_and_starts_when_room_frees(svc):
    _, a = new_tenant(svc, "queue-a")
    _, b = new_tenant(svc, "queue-b")
    first = submit(svc, a, spec("long", LONG))
    until(lambda: view(svc, a, first["id"])["progress"].get("step", 0) >= 3)  # its progress is known
    second = submit(svc, b, spec("short", 4))
    assert second["state"] == "queued"
    place = second["queue"]
    assert (place["position"], place["of"]) == (1, 1), place
    assert place["waiting_for"] == "jobs running: 1 of 1", place
    # the running job reports steps of 10**6: its end, and so this start, is estimated (not unknown)
    assert place["eta_s"] is not None and place["eta_s"] > 0, place
    assert place["eta_at"] == pytest.approx(time.time() + place["eta_s"], abs=30), place
    assert any("waiting for jobs running" in e["detail"] for e in second["events"]), second["events"]
    listed = ok(svc.client.get("/v1/jobs", headers=bearer(b))).json()["jobs"]
    assert [j["queue"]["position"] for j in listed if j["id"] == second["id"]] == [1]
    assert view(svc, b, second["id"])["state"] == "queued"  # it does not start while the first runs
    cancel(svc, a, first["id"])
    done = until(lambda: (v := view(svc, b, second["id"]))["state"] in ("succeeded", "failed") and v)
    assert done["state"] == "succeeded", done
    assert done["queue"] is None and [e["state"] for e in done["events"]][-2:] == ["running", "succeeded"]


def test_a_tenant_with_many_queued_jobs_does_not_hold_the_others_back(svc):
    _, a = new_tenant(svc, "fair-a")
    _, b = new_tenant(svc, "fair-b")
    running = submit(svc, a, spec("a-long", LONG))
    until(lambda: view(svc, a, running["id"])["state"] == "running")
    a_jobs = [submit(svc, a, spec(f"a{i}", LONG)) for i in range(2)]
    b_job = submit(svc, b, spec("b0", LONG))
    # A has a job running: B's, submitted last, is next; then A's in the order they came
    places = [view(svc, k, j["id"])["queue"]["position"] for k, j in ((b, b_job), (a, a_jobs[0]), (a, a_jobs[1]))]
    assert places == [1, 2, 3], places
    cancel(svc, a, running["id"])
    until(lambda: view(svc, b, b_job["id"])["state"] == "running")
    assert [view(svc, a, j["id"])["queue"]["position"] for j in a_jobs] == [1, 2]
    # a cancelled waiting job leaves the queue and gives its share back
    assert cancel(svc, a, a_jobs[0]["id"])["state"] == "cancelled"
    assert view(svc, a, a_jobs[1]["id"])["queue"]["position"] == 1
    cancel(svc, b, b_job["id"])
    until(lambda: view(svc, a, a_jobs[1]["id"])["state"] == "running")
    cancel(svc, a, a_jobs[1]["id"])


def test_a_tenants_own_quota_still_answers_429_with_the_numbers(svc):
    _, a = new_tenant(svc, "quota-a", max_concurrent_jobs=2)
    _, b = new_tenant(svc, "quota-b")
    blocker = submit(svc, b, spec("blocker", LONG))
    until(lambda: view(svc, b, blocker["id"])["state"] == "running")
    queued = [submit(svc, a, spec(f"q{i}", 4)) for i in range(2)]
    assert [j["state"] for j in queued] == ["queued", "queued"]
    # queued jobs count against the tenant's own quota: a third is refused, not queued
    r = svc.client.post("/v1/jobs", json=spec("q2", 4), headers=bearer(a))
    assert r.status_code == 429 and r.headers.get("retry-after"), r.text
    err = r.json()["error"]
    assert err["type"] == "quota_exceeded" and "max_concurrent_jobs is 2" in err["message"], err
    assert err["quota"] == {"resource": "jobs", "held": 2, "asked": 1, "limit": 2, "scope": "tenant",
                            "quota": "max_concurrent_jobs"}, err
    cancel(svc, b, blocker["id"])
    for j in queued:
        assert until(lambda: (v := view(svc, a, j["id"]))["state"] in ("succeeded", "failed") and v)["state"] \
            == "succeeded"
    # both ended: the tenant's share is free again
    assert submit(svc, a, spec("q3", 2))["state"] in ("queued", "running", "succeeded")


def test_a_tenants_job_history_keeps_its_newest_finished_jobs(svc, monkeypatch):
    """Past the finished jobs a tenant keeps (--job-history), the oldest leave the store and the disk
    as jobs end; another tenant's are untouched. /metrics has counted every answer, none a 5xx."""
    monkeypatch.setattr(svc.host.jobs, "history", 2)
    a_id, a = new_tenant(svc, "history-a")
    _, b = new_tenant(svc, "history-b")
    finished = ("succeeded", "failed", "cancelled")
    kept = submit(svc, b, spec("b", 2))
    until(lambda: view(svc, b, kept["id"])["state"] in finished)
    jobs = []
    for i in range(4):
        j = submit(svc, a, spec(f"h{i}", 2))
        until(lambda: view(svc, a, j["id"])["state"] in finished)
        jobs.append(j["id"])
    listed = [j["id"] for j in ok(svc.client.get("/v1/jobs", headers=bearer(a))).json()["jobs"]]
    assert listed == [jobs[3], jobs[2]], listed
    workdirs = svc.host.data_dir / "tenants" / a_id / "jobs"
    assert not (workdirs / jobs[0]).exists() and (workdirs / jobs[3]).exists()
    assert svc.client.get(f"/v1/jobs/{jobs[0]}", headers=bearer(a)).status_code == 404
    assert view(svc, b, kept["id"])["state"] == "succeeded"
    text = ok(svc.client.get("/metrics", headers=bearer(svc.admin))).text
    assert 'vlamux_http_responses_total{code="5xx"} 0.0' in text, text[-2000:]
    twos = float(re.search(r'vlamux_http_responses_total\{code="2xx"\} (\S+)', text).group(1))
    assert twos >= 12, twos


def test_after_a_restart_started_jobs_run_again_and_waiting_ones_queue_in_order(tmp_path):
    from demos import demo_dataset

    demo_dataset(tmp_path / "datasets" / "tiny", 4)
    config = ServiceConfig(data_dir=tmp_path, env_workers=1, meter_every_s=3600, group_cap=None, max_running_jobs=1)
    host = ServiceHost(config)
    first = types.SimpleNamespace(host=host, admin=host.start())
    first.client = TestClient(create_app(host), raise_server_exceptions=False)
    _, a = new_tenant(first, "restart-a")
    _, b = new_tenant(first, "restart-b")
    running = submit(first, a, spec("running", LONG))
    until(lambda: view(first, a, running["id"])["state"] == "running")
    waiting = [submit(first, b, spec(f"w{i}", 4)) for i in range(2)]
    first.client.close()
    host.stop()  # as a kill would leave them: one running, two queued, in the store

    host = ServiceHost(config)
    again = types.SimpleNamespace(host=host, admin=host.start())
    again.client = TestClient(create_app(host), raise_server_exceptions=False)
    try:
        until(lambda: view(again, a, running["id"])["state"] == "running")
        assert [view(again, b, j["id"])["queue"]["position"] for j in waiting] == [1, 2]
        cancel(again, a, running["id"])
        for j in waiting:
            assert until(lambda: (v := view(again, b, j["id"]))["state"] in ("succeeded", "failed") and v)["state"] \
                == "succeeded"
    finally:
        again.client.close()
        host.stop()
