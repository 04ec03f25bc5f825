"""The HTTP API (vlamux/api/app.py) around a real ServiceHost: tenant isolation, authentication,
bad payloads answered 4xx naming their field, and a schemathesis run that finds no 5xx.

One host serves the whole module (starting one costs seconds). Tenant "A" owns one of every
resource; tenant "B" tries to reach them. The schemathesis tests run last and use tenants of their
own: `pytest -k schemathesis` runs only them.
"""

from __future__ import annotations

import json
import time
import types

import msgpack
import numpy as np
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from vlamux import wire
from vlamux.api.app import create_app
from vlamux.api.host import ServiceConfig, ServiceHost

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}
ENV = {"task": "goal/touch-red-cube", "image_size": 32}
SFT_SPEC = {"name": "t", "kind": "sft", "head": HEAD, "sft": {"dataset": "tiny", "steps": 6, "batch_size": 8},
            "checkpoint_every": 3}
MSGPACK = {"content-type": wire.CONTENT_TYPE}
MISSING_ID = "0123456789ab"  # an id no resource has: "another tenant's" must answer exactly like it


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def observation(batch: int = 2, size: int = 32) -> dict:
    rng = np.random.default_rng(batch)
    return {"images": {"agentview": rng.integers(0, 255, (batch, 3, size, size), dtype=np.uint8)},
            "state": rng.standard_normal((batch, 8)).astype(np.float32),
            "instructions": ["touch the red cube"] * batch}


def actions(batch: int = 2) -> np.ndarray:
    return np.random.default_rng(batch).uniform(-1, 1, (batch, 4, 4)).astype(np.float32)


def packed(obj) -> dict:
    return {"content": wire.dumps(obj)}


def msg(obj) -> dict:
    return {"content": wire.dumps(obj), "headers": MSGPACK}


def ok(r, status: int | tuple = (200, 201, 202, 204)):
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:500]}"
    return r


def wait_future(client, key: str, future_id: str) -> dict:
    f = ok(client.get(f"/v1/futures/{future_id}", params={"wait": 30}, headers=bearer(key))).json()["future"]
    assert f["state"] == "done", f
    return f


# ---- the service -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from demos import demo_dataset

    root = tmp_path_factory.mktemp("api")
    demo_dataset(root / "datasets" / "tiny", 4)
    # The meter ticks only when a test says so (meter.tick()), so usage checks are not racing it.
    host = ServiceHost(ServiceConfig(data_dir=root, env_workers=1, meter_every_s=3600))
    admin_key = host.start()
    assert admin_key and admin_key.startswith("vmx_")
    app = create_app(host)
    client = TestClient(app, raise_server_exceptions=False)
    try:
        yield types.SimpleNamespace(host=host, app=app, client=client, admin=admin_key, root=root)
    finally:
        client.close()
        host.stop()


def new_tenant(svc, name: str, **quotas) -> tuple[str, str]:
    """(tenant id, api key) of a new tenant, not rate limited by the tests' bursts."""
    r = ok(svc.client.post("/v1/tenants", json={"name": name}, headers=bearer(svc.admin)), 201).json()
    ok(svc.client.put(f"/v1/tenants/{r['tenant']['id']}/quotas", json={"requests_per_s": 10000, **quotas},
                      headers=bearer(svc.admin)))
    return r["tenant"]["id"], r["api_key"]


@pytest.fixture(scope="module")
def world(svc):
    """Tenant A with one of every resource, tenant B with a slot of its own, and A's secrets."""
    c = svc.client
    a_id, a_key = new_tenant(svc, "acme-zq7x")
    b_id, b_key = new_tenant(svc, "bolt-k3p9")
    A, B = bearer(a_key), bearer(b_key)

    job = ok(c.post("/v1/jobs", json=SFT_SPEC, headers=A), 202).json()["job"]
    slot = ok(c.post("/v1/training/slots", json={"head": HEAD, "name": "acme-slot-qq"}, headers=A), 201)
    slot = slot.json()["policy"]
    fb = ok(c.post(f"/v1/training/slots/{slot['id']}/forward_backward",
                   **packed({"observation": observation(), "actions": actions()}), headers={**A, **MSGPACK}), 202)
    fb = wait_future(c, a_key, fb.json()["future"]["id"])
    wait_future(c, a_key, ok(c.post(f"/v1/training/slots/{slot['id']}/optim_step", json={}, headers=A))
                       .json()["future"]["id"])
    saved = wait_future(c, a_key, ok(c.post(f"/v1/training/slots/{slot['id']}/save_state", headers=A))
                        .json()["future"]["id"])
    checkpoint = saved["result"]["checkpoint"]
    session = ok(c.post("/v1/sessions", json={"env": ENV, "n_envs": 2}, headers=A), 201).json()["session"]
    ok(c.post(f"/v1/sessions/{session['id']}/reset", json={"seed": 3}, headers=A))
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        t.add(svc.root / "datasets" / "tiny", arcname="tiny")
    ok(c.post("/v1/datasets", params={"name": "acme-data-zz"}, content=buf.getvalue(),
              headers={**A, "Content-Type": "application/x-tar"}), 201)
    upload = ok(c.post("/v1/uploads", json={"bytes": 10}, headers=A), 201).json()["upload"]
    ok(c.put(f"/v1/uploads/{upload['id']}", params={"offset": 0}, content=b"01234",
             headers={**A, "Content-Type": "application/octet-stream"}))
    default_key = ok(c.get("/v1/keys", headers=A)).json()["keys"][0]
    extra = ok(c.post("/v1/keys", json={"name": "acme-extra-key"}, headers=A), 201).json()

    deadline = time.time() + 120
    while (j := ok(c.get(f"/v1/jobs/{job['id']}", headers=A)).json()["job"])["state"] in ("queued", "running"):
        assert time.time() < deadline, f"the SFT job did not finish: {j}"
        time.sleep(0.2)
    assert j["state"] == "succeeded", j
    job_cps = ok(c.get(f"/v1/jobs/{job['id']}/checkpoints", headers=A)).json()["checkpoints"]
    assert len(job_cps) >= 2, job_cps
    metrics = ok(c.get(f"/v1/jobs/{job['id']}/metrics", headers=A)).json()["rows"]
    assert metrics and all(r["loss"] is not None for r in metrics)

    policy = ok(c.get(f"/v1/policies/{job['id']}/download", headers=A)).content
    ok(c.post("/v1/policy-files", params={"name": "acme-pol-zz"}, content=policy,
              headers={**A, "Content-Type": "application/octet-stream"}), 201)
    b_slot = ok(c.post("/v1/training/slots", json={"head": HEAD}, headers=B), 201).json()["policy"]
    b_session = ok(c.post("/v1/sessions", json={"env": ENV, "n_envs": 1}, headers=B), 201).json()["session"]

    ids = {"tenant": a_id, "job": job["id"], "slot": slot["id"], "future": fb["id"], "session": session["id"],
           "key": default_key["id"], "extra_key": extra["key"]["id"], "checkpoint": checkpoint["id"],
           "dataset": "acme-data-zz", "policy_file": "acme-pol-zz", "upload": upload["id"],
           **{f"job_checkpoint_{i}": cp["id"] for i, cp in enumerate(job_cps)}}
    # Everything of A's that B must never see: ids, names, secrets and numbers of A's state.
    secrets = {**ids, "name": "acme-zq7x", "slot_name": "acme-slot-qq", "extra_key_name": "acme-extra-key",
               "api_key": a_key, "extra_api_key": extra["api_key"], "checkpoint_sha": checkpoint["sha256"],
               "checkpoint_bytes": str(checkpoint["bytes"]), "fb_loss": repr(fb["result"]["loss"]),
               "job_final_loss": repr(j["result"]["sft"]["final_loss"]),
               **{f"job_cp_sha_{i}": cp["sha256"] for i, cp in enumerate(job_cps)},
               **{f"metric_loss_{i}": repr(r["loss"]) for i, r in enumerate(metrics)}}
    return types.SimpleNamespace(a_id=a_id, a_key=a_key, b_id=b_id, b_key=b_key, A=A, B=B, ids=ids, secrets=secrets,
                                 b_slot=b_slot["id"], b_session=b_session["id"])


def assert_no_leak(r, secrets: dict, allowed: set = frozenset()) -> None:
    """None of A's `secrets` (but those `allowed`, e.g. the id B itself put in the URL) in the answer."""
    text = r.text + "\n" + "\n".join(f"{k}: {v}" for k, v in r.headers.items())
    for name, value in secrets.items():
        if value in allowed or len(value) < 4:
            continue
        assert value not in text, f"{r.request.method} {r.request.url.path} leaked A's {name} ({value}): {text[:400]}"


# ---- route enumeration ---------------------------------------------------------------------------------------
def api_routes(app) -> list[tuple[str, APIRoute]]:
    return [(m, r) for r in app.routes if isinstance(r, APIRoute) for m in sorted(r.methods - {"HEAD"})]


def depends_on(route: APIRoute, name: str) -> bool:
    """Whether the route (through any chain of dependencies) uses the dependency function `name`."""
    todo = list(route.dependant.dependencies)
    while todo:
        d = todo.pop()
        if getattr(d.call, "__name__", "") == name:
            return True
        todo.extend(d.dependencies)
    return False


def path_params(route: APIRoute) -> list[str]:
    return list(route.param_convertors)


# What each id-taking route is called with: a body that would succeed for the owner, so the only
# reason to refuse is whose id it is. A route missing here fails test_every_id_route_is_covered.
def _valid_request(method: str, path: str, w) -> dict:
    return {
        "POST /v1/policies/{policy_id}/predict": lambda: msg({"observation": observation(), "deterministic": True}),
        "POST /v1/training/slots/{policy_id}/forward_backward":
            lambda: msg({"observation": observation(), "actions": actions()}),
        "POST /v1/training/slots/{policy_id}/optim_step": lambda: {"json": {"lr": 1e-4}},
        "POST /v1/training/slots/{policy_id}/save_state": lambda: {},
        "POST /v1/training/slots/{policy_id}/load_state": lambda: {"json": {"checkpoint_id": w.ids["checkpoint"]}},
        "DELETE /v1/training/slots/{policy_id}": lambda: {},
        "POST /v1/sessions/{session_id}/reset": lambda: {"json": {"seed": 1}},
        "POST /v1/sessions/{session_id}/step": lambda: msg({"actions": np.zeros((2, 4), np.float32)}),
        "DELETE /v1/sessions/{session_id}": lambda: {},
        "GET /v1/jobs/{job_id}": lambda: {},
        "POST /v1/jobs/{job_id}/cancel": lambda: {},
        "GET /v1/jobs/{job_id}/logs": lambda: {},
        "GET /v1/jobs/{job_id}/metrics": lambda: {},
        "GET /v1/jobs/{job_id}/checkpoints": lambda: {},
        "GET /v1/jobs/{job_id}/events": lambda: {},
        "GET /v1/policies/{policy_id}/download": lambda: {},
        "DELETE /v1/datasets/{name}": lambda: {},
        "DELETE /v1/policy-files/{name}": lambda: {},
        "GET /v1/uploads/{upload_id}": lambda: {},
        "PUT /v1/uploads/{upload_id}": lambda: {"params": {"offset": 5}, "content": b"56789",
                                                "headers": {"Content-Type": "application/octet-stream"}},
        "POST /v1/uploads/{upload_id}/finish": lambda: {"json": {"as": "dataset", "name": "acme-up-zz"}},
        "DELETE /v1/uploads/{upload_id}": lambda: {},
        "GET /v1/policies/{policy_id}": lambda: {},
        "GET /v1/policies/{policy_id}/versions": lambda: {},
        "GET /v1/futures/{future_id}": lambda: {},
        "DELETE /v1/keys/{key_id}": lambda: {},
        "POST /v1/tenants/{tenant_id}/disable": lambda: {},
        "POST /v1/tenants/{tenant_id}/enable": lambda: {},
        "PUT /v1/tenants/{tenant_id}/quotas": lambda: {"json": {"requests_per_s": 10000}},
    }[f"{method} {path}"]()


# Which of A's ids fill each path parameter (a job's policy id is its job id: both are policies).
PARAM_IDS = {"policy_id": ["slot", "job"], "job_id": ["job"], "future_id": ["future"], "session_id": ["session"],
             "key_id": ["key", "extra_key"], "tenant_id": ["tenant"], "name": ["dataset", "policy_file"],
             "upload_id": ["upload"]}
# Calls that change A's resources irreversibly: A's own control call for these is made at the end.
DESTRUCTIVE = {"DELETE /v1/sessions/{session_id}", "DELETE /v1/keys/{key_id}", "POST /v1/tenants/{tenant_id}/disable",
               "DELETE /v1/datasets/{name}", "DELETE /v1/policy-files/{name}", "POST /v1/uploads/{upload_id}/finish",
               "DELETE /v1/uploads/{upload_id}", "DELETE /v1/training/slots/{policy_id}"}


def id_calls(app, w):
    """(label, method, url, request kwargs, id in the url, is admin route) for every id-taking route."""
    out = []
    for method, route in api_routes(app):
        params = path_params(route)
        if not params:
            continue
        assert len(params) == 1 and params[0] in PARAM_IDS, f"{method} {route.path}: no ids known for {params}"
        for which in PARAM_IDS[params[0]]:
            value = w.ids[which]
            out.append((f"{method} {route.path}", method, route.path.replace("{" + params[0] + "}", value),
                        _valid_request(method, route.path, w), value, which, depends_on(route, "admin")))
    return out


def test_every_id_route_is_covered(svc, world):
    """A new route with a path parameter must be added to the isolation table (this test fails otherwise)."""
    labels = set()
    for method, route in api_routes(svc.app):
        if path_params(route):
            label = f"{method} {route.path}"
            _valid_request(method, route.path, world)  # KeyError: the route is not covered
            labels.add(label)
    assert len(labels) >= 20, sorted(labels)  # the enumeration itself works
    assert {"POST /v1/policies/{policy_id}/predict", "DELETE /v1/keys/{key_id}", "GET /v1/futures/{future_id}",
            "POST /v1/sessions/{session_id}/step", "PUT /v1/tenants/{tenant_id}/quotas"} <= labels


# ---- isolation ---------------------------------------------------------------------------------------------
def a_state(svc, w) -> dict:
    """What B's refused calls must leave unchanged: A's policies, sessions, keys, tenant record."""
    c = svc.client
    return {"policies": ok(c.get("/v1/policies", headers=w.A)).json(),
            "versions": [ok(c.get(f"/v1/policies/{p}/versions", headers=w.A)).json()
                         for p in (w.ids["slot"], w.ids["job"])],
            "sessions": [{k: v for k, v in s.items() if k != "idle_s"}
                         for s in ok(c.get("/v1/sessions", headers=w.A)).json()["sessions"]],
            "keys": [{k: v for k, v in key.items() if k != "last_used_at"}
                     for key in ok(c.get("/v1/keys", headers=w.A)).json()["keys"]],
            "job": {k: v for k, v in ok(c.get(f"/v1/jobs/{w.ids['job']}", headers=w.A)).json()["job"].items()},
            "upload": ok(c.get(f"/v1/uploads/{w.ids['upload']}", headers=w.A)).json(),
            "files": [ok(c.get(f"/v1/{what}", headers=w.A)).json() for what in ("datasets", "policy-files")],
            "tenant": [t for t in ok(c.get("/v1/tenants", headers=bearer(svc.admin))).json()["tenants"]
                       if t["id"] == w.a_id]}


def test_other_tenants_ids_answer_404_and_leak_nothing(svc, world):
    c, w = svc.client, world
    calls = id_calls(svc.app, w)
    before = a_state(svc, w)
    seen = set()
    for label, method, url, kw, value, which, is_admin in calls:
        seen.add(label)
        r = c.request(method, url, **{**kw, "headers": {**kw.get("headers", {}), **w.B}})
        if is_admin:
            assert r.status_code == 403, f"{label} with B's key: {r.status_code} {r.text[:300]}"
            assert r.json()["error"]["type"] == "forbidden"
        else:
            assert r.status_code == 404, f"{label} on A's {which} with B's key: {r.status_code} {r.text[:300]}"
            assert r.json()["error"]["type"] == "not_found"
            # Exactly as if it did not exist: the answer for an id nobody has, with the id swapped.
            missing = c.request(method, url.replace(value, MISSING_ID),
                                **{**kw, "headers": {**kw.get("headers", {}), **w.B}})
            assert missing.status_code == 404
            assert r.json() == json.loads(missing.text.replace(MISSING_ID, value)), (label, r.text, missing.text)
        assert_no_leak(r, w.secrets, allowed={value})
    assert len(seen) >= 20
    assert a_state(svc, w) == before  # B's attempts changed nothing of A's

    # A's resources are untouched and still work, and the ids were real (A itself gets no 404).
    for label, method, url, kw, value, which, is_admin in calls:
        if label in DESTRUCTIVE:
            continue
        who = bearer(svc.admin) if is_admin else w.A
        r = c.request(method, url, **{**kw, "headers": {**kw.get("headers", {}), **who}})
        if label.startswith("POST /v1/training/slots/") and which == "job":
            assert r.status_code == 404, (label, r.text)  # a job's policy is trained by its job, for A too
        elif label == "POST /v1/jobs/{job_id}/cancel":
            assert r.status_code == 409, (label, r.text)  # A's job exists and is finished
        else:
            ok(r)
        if r.status_code == 202 and "future" in r.json():  # let A's training calls finish in order
            wait_future(c, w.a_key, r.json()["future"]["id"])

    job = ok(c.get(f"/v1/jobs/{w.ids['job']}", headers=w.A)).json()["job"]
    assert job["state"] == "succeeded"
    out = ok(c.post(f"/v1/sessions/{w.ids['session']}/step", **packed({"actions": np.zeros((2, 4), np.float32)}),
                    headers={**w.A, **MSGPACK}))
    assert wire.loads(out.content)["reward"].shape == (2,)
    ok(c.get("/v1/keys", headers=w.A))  # B could not revoke A's default key
    assert not any(k["revoked"] for k in c.get("/v1/keys", headers=w.A).json()["keys"])


def test_other_tenants_ids_in_bodies_and_queries(svc, world):
    c, w = svc.client, world
    b_slot_before = ok(c.get(f"/v1/policies/{w.b_slot}/versions", headers=w.B)).json()
    # A's checkpoint loaded into B's own slot: not found, and B's slot is unchanged.
    r = c.post(f"/v1/training/slots/{w.b_slot}/load_state", json={"checkpoint_id": w.ids["checkpoint"]}, headers=w.B)
    assert r.status_code == 404, r.text
    assert_no_leak(r, w.secrets, allowed={w.ids["checkpoint"]})
    # A's job checkpoint too.
    r = c.post(f"/v1/training/slots/{w.b_slot}/load_state", json={"checkpoint_id": w.ids["job_checkpoint_0"]},
               headers=w.B)
    assert r.status_code == 404, r.text
    assert ok(c.get(f"/v1/policies/{w.b_slot}/versions", headers=w.B)).json() == b_slot_before
    # A's usage through the admin's query parameter.
    r = c.get("/v1/usage", params={"tenant": w.a_id}, headers=w.B)
    assert r.status_code == 404, r.text
    assert_no_leak(r, w.secrets, allowed={w.a_id})


def test_list_endpoints_show_only_the_callers_resources(svc, world):
    c, w = svc.client, world
    svc.host.meter.tick()  # usage totals are current
    lists = {path: ok(c.get(path, headers=w.B)) for path in
             ("/v1/jobs", "/v1/policies", "/v1/keys", "/v1/sessions", "/v1/usage", "/v1/datasets", "/v1/policy-files")}
    for r in lists.values():
        assert_no_leak(r, w.secrets)
    # The lists are B's own, not empty ones.
    assert [p["id"] for p in lists["/v1/policies"].json()["policies"]] == [w.b_slot]
    assert [s["id"] for s in lists["/v1/sessions"].json()["sessions"]] == [w.b_session]
    assert lists["/v1/jobs"].json()["jobs"] == []
    assert len(lists["/v1/keys"].json()["keys"]) == 1
    assert list(lists["/v1/usage"].json()["usage"]) == [w.b_id]
    assert lists["/v1/datasets"].json()["datasets"] == [{"name": "tiny", "format": "lerobot", "public": True}]
    assert lists["/v1/policy-files"].json()["policy_files"] == []  # A's own are not there
    # And A sees its own.
    a_policies = {p["id"] for p in ok(c.get("/v1/policies", headers=w.A)).json()["policies"]}
    assert a_policies == {w.ids["slot"], w.ids["job"]}
    assert {k["id"] for k in ok(c.get("/v1/keys", headers=w.A)).json()["keys"]} >= {w.ids["key"]}
    assert "api_key" not in c.get("/v1/keys", headers=w.A).text and w.a_key not in c.get("/v1/keys", headers=w.A).text


def _any_request(method: str, route: APIRoute) -> tuple[str, dict]:
    url = route.path
    for p in path_params(route):
        url = url.replace("{" + p + "}", MISSING_ID)
    return url, ({"json": {}} if method in ("POST", "PUT") else {})


def test_authentication_and_roles(svc, world):
    c, w = svc.client, world
    routes = api_routes(svc.app)
    authed = [(m, r) for m, r in routes if depends_on(r, "principal")]
    admin_routes = [(m, r) for m, r in authed if depends_on(r, "admin")]
    tenant_routes = [(m, r) for m, r in authed if depends_on(r, "tenant")]
    assert {r.path for _, r in admin_routes} >= {"/v1/tenants", "/metrics", "/v1/tenants/{tenant_id}/quotas"}
    assert len(tenant_routes) >= 20
    # Every route but the health check and the docs needs a key.
    public = {r.path for m, r in routes if (m, r) not in authed}
    assert public <= {"/healthz", "/dashboard"}, public

    for method, route in authed:
        url, kw = _any_request(method, route)
        label = f"{method} {route.path}"
        for headers in ({}, bearer("vmx_not_a_key"), {"Authorization": "Basic dXNlcjpwYXNz"},
                        {"Authorization": f"Bearer {w.a_key}x"}, {"Authorization": "Bearer "}):
            r = c.request(method, url, **kw, headers=headers)
            assert r.status_code == 401, f"{label} with {headers}: {r.status_code} {r.text[:200]}"
            assert r.json()["error"]["type"] == "unauthenticated"
            assert r.headers.get("www-authenticate") == "Bearer"
    for method, route in admin_routes:
        url, kw = _any_request(method, route)
        r = c.request(method, url, **kw, headers=w.A)
        assert r.status_code == 403, f"{method} {route.path} with a tenant key: {r.status_code} {r.text[:200]}"
        assert r.json()["error"]["type"] == "forbidden"
    for method, route in tenant_routes:
        url, kw = _any_request(method, route)
        r = c.request(method, url, **kw, headers=bearer(svc.admin))
        assert r.status_code == 403, f"{method} {route.path} with the admin key: {r.status_code} {r.text[:200]}"
        assert r.json()["error"]["type"] == "forbidden"
    # The admin sees every tenant; /v1/usage serves both roles.
    names = {t["name"] for t in ok(c.get("/v1/tenants", headers=bearer(svc.admin))).json()["tenants"]}
    assert {"acme-zq7x", "bolt-k3p9"} <= names
    assert w.a_id in ok(c.get("/v1/usage", headers=bearer(svc.admin))).json()["usage"]
    text = ok(c.get("/metrics", headers=bearer(svc.admin))).text
    assert "vlamux_" in text
    # the world's training slot is counted as a slot, not as a job
    ready = [line for line in text.splitlines() if line.startswith('vlamux_training_slots{state="ready"}')]
    assert ready and float(ready[0].split()[-1]) >= 1


def test_disabled_tenant_and_revoked_key_answer_401(svc, world):
    c = svc.client
    t_id, key = new_tenant(svc, "carbon-dis")
    extra = ok(c.post("/v1/keys", json={"name": "second"}, headers=bearer(key)), 201).json()
    ok(c.get("/v1/jobs", headers=bearer(extra["api_key"])))
    ok(c.delete(f"/v1/keys/{extra['key']['id']}", headers=bearer(key)), 204)
    assert c.get("/v1/jobs", headers=bearer(extra["api_key"])).status_code == 401
    ok(c.get("/v1/jobs", headers=bearer(key)))  # revoking one key leaves the others
    ok(c.post(f"/v1/tenants/{t_id}/disable", headers=bearer(svc.admin)))
    assert c.get("/v1/jobs", headers=bearer(key)).status_code == 401
    ok(c.post(f"/v1/tenants/{t_id}/enable", headers=bearer(svc.admin)))
    ok(c.get("/v1/jobs", headers=bearer(key)))


def test_a_failed_slot_costs_no_other_tenant_its_usage(svc, world):
    c = svc.client
    svc.host.meter.tick()
    before = ok(c.get("/v1/usage", headers=world.B)).json()["usage"][world.b_id]
    ok(c.post(f"/v1/policies/{world.b_slot}/predict", **packed({"observation": observation()}),
              headers={**world.B, **MSGPACK}))
    _, key = new_tenant(svc, "hotel-fail")
    r = c.post("/v1/training/slots", json={"head": {**HEAD, "width": 16, "depth": 8, "feature_layers": 8}},
               headers=bearer(key))
    # Refused only once the training service tried to build it (more layers than the backbone has).
    assert r.status_code == 422 and r.json()["error"]["field"] == "head.feature_layers", r.text
    try:
        svc.host.meter.tick()
    finally:
        after = ok(c.get("/v1/usage", headers=world.B)).json()["usage"][world.b_id]
    assert after["requests"] > before["requests"] and after["backbone_s"] > before["backbone_s"], (before, after)


def test_rate_limit_is_per_tenant_and_answers_429_with_retry_after(svc, world):
    _, key = new_tenant(svc, "golf-rate", requests_per_s=1)  # a burst of 2
    answers = [svc.client.get("/v1/jobs", headers=bearer(key)) for _ in range(5)]
    assert {r.status_code for r in answers} == {200, 429}, [r.status_code for r in answers]
    limited = next(r for r in answers if r.status_code == 429)
    assert limited.json()["error"]["type"] == "rate_limited" and int(limited.headers["retry-after"]) >= 1
    ok(svc.client.get("/v1/jobs", headers=world.B))  # another tenant is not held back


def test_owner_can_still_use_everything_after_the_attempts(svc, world):
    """Runs after the isolation tests: the destructive calls B was refused, made by their owners."""
    c, w = svc.client, world
    ok(c.post(f"/v1/policies/{w.ids['slot']}/predict", **packed({"observation": observation()}),
              headers={**w.A, **MSGPACK}))
    ok(c.post(f"/v1/policies/{w.ids['job']}/predict", **packed({"observation": observation()}),
              headers={**w.A, **MSGPACK}))
    versions = ok(c.get(f"/v1/policies/{w.ids['slot']}/versions", headers=w.A)).json()
    assert w.ids["checkpoint"] in [cp["id"] for cp in versions["checkpoints"]]
    assert all(cp["policy_id"] == w.ids["slot"] for cp in versions["checkpoints"])
    # A revokes its extra key (B could not): 204, then the extra key is dead and the default one works.
    ok(c.delete(f"/v1/keys/{w.ids['extra_key']}", headers=w.A), 204)
    assert c.get("/v1/jobs", headers=bearer(w.secrets["extra_api_key"])).status_code == 401
    ok(c.get("/v1/jobs", headers=w.A))
    # A closes its session (B could not): 204, then it is gone for A too.
    ok(c.delete(f"/v1/sessions/{w.ids['session']}", headers=w.A), 204)
    assert c.post(f"/v1/sessions/{w.ids['session']}/reset", json={}, headers=w.A).status_code == 404
    # The admin can disable and re-enable A (B's key could not).
    ok(c.post(f"/v1/tenants/{w.a_id}/disable", headers=bearer(svc.admin)))
    assert c.get("/v1/jobs", headers=w.A).status_code == 401
    ok(c.post(f"/v1/tenants/{w.a_id}/enable", headers=bearer(svc.admin)))
    ok(c.get("/v1/jobs", headers=w.A))


# ---- bad payloads --------------------------------------------------------------------------------------------
def _obs(**changes) -> dict:
    obs = observation()
    for k, v in changes.items():
        if k == "image":
            obs["images"]["agentview"] = v
        elif v is None:
            obs.pop(k)
        else:
            obs[k] = v
    return obs


def _nan_state():
    s = observation()["state"]
    s[1, 3] = np.nan
    return s


def _nan_actions():
    a = actions()
    a[0, 1, 2] = np.nan
    return a


def _raw_array(dtype="uint8", shape=(2, 3, 32, 32), nbytes=None):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize if nbytes is None else nbytes
    return {"__nd__": 1, "dtype": dtype, "shape": list(shape), "data": b"\0" * n}


def _raw_obs(image) -> bytes:
    obs = wire._pack(observation())
    obs["images"]["agentview"] = image
    return msgpack.packb({"observation": obs}, use_bin_type=True)


PREDICT, FB = "/v1/policies/{slot}/predict", "/v1/training/slots/{slot}/forward_backward"
STEP, SLOTS, SESSIONS, JOBS = "/v1/sessions/{session}/step", "/v1/training/slots", "/v1/sessions", "/v1/jobs"
BAD_MSGPACK = [
    # (case, path, body (an object to encode, or raw bytes), field)
    ("image float32", PREDICT, {"observation": _obs(image=np.zeros((2, 3, 32, 32), np.float32))},
     "observation.images.agentview"),
    ("image without channel dim", PREDICT, {"observation": _obs(image=np.zeros((2, 32, 32), np.uint8))},
     "observation.images.agentview"),
    ("image 4 channels", PREDICT, {"observation": _obs(image=np.zeros((2, 4, 32, 32), np.uint8))},
     "observation.images.agentview"),
    ("image not an array", PREDICT, {"observation": _obs(image=[1, 2, 3])}, "observation.images.agentview"),
    ("image huge", PREDICT, {"observation": _obs(image=np.zeros((1, 3, 1100, 8), np.uint8),
                                                 instructions=["x"], state=np.zeros((1, 8), np.float32))},
     "observation.images.agentview"),
    ("image 0x0", PREDICT, {"observation": _obs(image=np.zeros((2, 3, 0, 0), np.uint8))},
     "observation.images.agentview"),
    ("batch of 0", PREDICT, {"observation": _obs(image=np.zeros((0, 3, 32, 32), np.uint8), instructions=[],
                                                 state=np.zeros((0, 8), np.float32))}, "observation.instructions"),
    ("deterministic not a bool", PREDICT, {"observation": observation(), "deterministic": "yes"}, "deterministic"),
    ("no images", PREDICT, {"observation": _obs(images={})}, "observation.images"),
    ("3 instructions for batch 2", PREDICT, {"observation": _obs(instructions=["a", "b", "c"])},
     "observation.instructions"),
    ("instructions not strings", PREDICT, {"observation": _obs(instructions=[1, 2])}, "observation.instructions"),
    ("instructions missing", PREDICT, {"observation": _obs(instructions=None)}, "observation.instructions"),
    ("NaN state", PREDICT, {"observation": _obs(state=_nan_state())}, "observation.state"),
    ("state float64 1e300 (inf as float32)", PREDICT,
     {"observation": _obs(state=np.full((2, 8), 1e300, np.float64))}, "observation.state"),
    ("state 1-D", PREDICT, {"observation": _obs(state=np.zeros(8, np.float32))}, "observation.state"),
    ("state int", PREDICT, {"observation": _obs(state=np.zeros((2, 8), np.int32))}, "observation.state"),
    ("state batch 3 for 2 images", PREDICT, {"observation": _obs(state=np.zeros((3, 8), np.float32))},
     "observation.state"),
    ("state width 5, head wants 8", PREDICT, {"observation": _obs(state=np.zeros((2, 5), np.float32))},
     "observation.state"),
    ("missing observation", PREDICT, {"deterministic": True}, "observation"),
    ("observation not a map", PREDICT, {"observation": [1, 2]}, "observation"),
    ("body not a map", PREDICT, [1, 2, 3], "body"),
    ("not msgpack", PREDICT, b"\xc1garbage", "body"),
    ("truncated msgpack", PREDICT, wire.dumps({"observation": observation()})[:100], "body"),
    ("array data short", PREDICT, _raw_obs(_raw_array(nbytes=10)), "observation.images.agentview"),
    ("array dtype object", PREDICT, _raw_obs(_raw_array(dtype="object", nbytes=0)), "observation.images.agentview"),
    ("array negative shape", PREDICT, _raw_obs({**_raw_array(), "shape": [-1, 3, 32, 32]}),
     "observation.images.agentview"),
    ("NaN actions", FB, {"observation": observation(), "actions": _nan_actions()}, "actions"),
    ("inf actions", FB, {"observation": observation(), "actions": actions() * np.inf}, "actions"),
    ("actions float64 1e300", FB, {"observation": observation(), "actions": np.full((2, 4, 4), -1e300)}, "actions"),
    ("actions 2-D", FB, {"observation": observation(), "actions": np.zeros((2, 4), np.float32)}, "actions"),
    ("actions int", FB, {"observation": observation(), "actions": np.zeros((2, 4, 4), np.int64)}, "actions"),
    ("actions missing", FB, {"observation": observation()}, "actions"),
    ("actions batch 3 for 2", FB, {"observation": observation(), "actions": actions(3)}, "actions"),
    ("actions dim 7, head wants 4", FB, {"observation": observation(), "actions": np.zeros((2, 4, 7), np.float32)},
     "actions"),
    ("actions horizon 9, head wants 4", FB,
     {"observation": observation(), "actions": np.zeros((2, 9, 4), np.float32)}, "actions"),
    ("action_mask wrong shape", FB, {"observation": observation(), "actions": actions(),
                                     "action_mask": np.ones((2, 5), bool)}, "action_mask"),
    ("action_mask not bool", FB, {"observation": observation(), "actions": actions(),
                                  "action_mask": np.ones((2, 4), np.float32)}, "action_mask"),
    ("fb missing observation", FB, {"actions": actions()}, "observation"),
    ("step NaN actions", STEP, {"actions": np.full((2, 4), np.nan, np.float32)}, "actions"),
    ("step actions float64 1e300", STEP, {"actions": np.full((2, 4), 1e300)}, "actions"),
    ("step actions 1-D", STEP, {"actions": np.zeros(4, np.float32)}, "actions"),
    ("step actions int", STEP, {"actions": np.zeros((2, 4), np.int32)}, "actions"),
    ("step actions missing", STEP, {}, "actions"),
    ("step 3 actions for 2 envs", STEP, {"actions": np.zeros((3, 4), np.float32)}, "actions"),
    ("step action dim 9", STEP, {"actions": np.zeros((2, 9), np.float32)}, "actions"),
]


@pytest.fixture(scope="module")
def mine(svc):
    """A tenant of its own for the bad-payload tests: a slot and an open session."""
    t_id, key = new_tenant(svc, "delta-bad")
    c, H = svc.client, bearer(key)
    slot = ok(c.post("/v1/training/slots", json={"head": HEAD}, headers=H), 201).json()["policy"]["id"]
    session = ok(c.post("/v1/sessions", json={"env": ENV, "n_envs": 2}, headers=H), 201).json()["session"]["id"]
    ok(c.post(f"/v1/sessions/{session}/reset", json={}, headers=H))
    return types.SimpleNamespace(key=key, H=H, slot=slot, session=session, tenant=t_id)


def assert_invalid(r, field: str | tuple, status=(400, 422)):
    """A 4xx whose error names `field` (or one of a tuple of acceptable names) and starts with it."""
    statuses = (status,) if isinstance(status, int) else status
    fields = (field,) if isinstance(field, str) else field
    assert r.status_code in statuses, f"expected {statuses} naming {field!r}, got {r.status_code}: {r.text[:400]}"
    err = r.json()["error"]
    assert err.get("field") in fields, f"field {err.get('field')!r} is not {field!r}: {err}"
    assert err["message"].startswith(err["field"]), err
    assert err["type"] == "invalid_input", err


@pytest.mark.parametrize("case,path,body,field", BAD_MSGPACK, ids=[c[0] for c in BAD_MSGPACK])
def test_bad_msgpack_payloads_name_the_field(svc, mine, case, path, body, field):
    content = body if isinstance(body, bytes) else wire.dumps(body)
    url = path.format(slot=mine.slot, session=mine.session)
    r = svc.client.post(url, content=content, headers={**mine.H, **MSGPACK})
    assert_invalid(r, field)


def test_good_msgpack_payloads_pass(svc, mine):
    """The control for the table above: the same routes accept the well-formed payloads."""
    c = svc.client
    out = wire.loads(ok(c.post(f"/v1/policies/{mine.slot}/predict", **packed({"observation": observation()}),
                               headers={**mine.H, **MSGPACK})).content)
    assert out["actions"].shape == (2, 4, 4) and out["actions"].dtype == np.float32
    r = ok(c.post(f"/v1/training/slots/{mine.slot}/forward_backward",
                  **packed({"observation": observation(), "actions": actions(),
                            "action_mask": np.ones((2, 4), bool)}), headers={**mine.H, **MSGPACK}), 202)
    wait_future(c, mine.key, r.json()["future"]["id"])
    out = wire.loads(ok(c.post(f"/v1/sessions/{mine.session}/step", **packed({"actions": np.zeros((2, 4), np.float32)}),
                               headers={**mine.H, **MSGPACK})).content)
    assert set(out) == {"observation", "reward", "terminated", "truncated", "success"}
    # The session and slot still work after all the bad payloads: nothing crashed.
    ok(c.get(f"/v1/policies/{mine.slot}", headers=mine.H))


@pytest.mark.parametrize("ctype", ["application/json", "text/plain", "", "application/msgpackx"])
def test_wrong_content_type_is_415(svc, mine, ctype):
    r = svc.client.post(f"/v1/policies/{mine.slot}/predict", content=wire.dumps({"observation": observation()}),
                        headers={**mine.H, "content-type": ctype})
    assert_invalid(r, "content-type", 415)


HEADX = {**HEAD, "horizon": 0}
BAD_JSON = [
    # (case, method, path, json body, field)
    ("slot without head", "POST", SLOTS, {}, "head"),
    ("slot unknown field", "POST", SLOTS, {"head": HEAD, "colour": "red"}, "colour"),
    ("slot head a string", "POST", SLOTS, {"head": "gaussian"}, "head"),
    ("slot head horizon 0", "POST", SLOTS, {"head": HEADX}, "head.horizon"),
    ("slot head horizon a string", "POST", SLOTS, {"head": {**HEAD, "horizon": "4"}}, "head.horizon"),
    ("slot head action_dim -1", "POST", SLOTS, {"head": {**HEAD, "action_dim": -1}}, "head.action_dim"),
    ("slot head unknown kind", "POST", SLOTS, {"head": {**HEAD, "kind": "nope"}}, "head.kind"),
    ("slot head without kind", "POST", SLOTS, {"head": {k: v for k, v in HEAD.items() if k != "kind"}}, "head.kind"),
    ("slot head unknown field", "POST", SLOTS, {"head": {**HEAD, "bogus": 1}}, "head.bogus"),
    ("slot head width 30 / 4 heads", "POST", SLOTS, {"head": {**HEAD, "width": 30}}, "head.width"),
    ("slot optimizer lr a string", "POST", SLOTS, {"head": HEAD, "optimizer": {"lr": "x"}}, "optimizer.lr"),
    ("slot optimizer unknown field", "POST", SLOTS, {"head": HEAD, "optimizer": {"nope": 1}}, "optimizer.nope"),
    ("slot optimizer beta 1.5", "POST", SLOTS, {"head": HEAD, "optimizer": {"betas": [1.5, 0.9]}}, "optimizer.betas"),
    ("slot optimizer one beta", "POST", SLOTS, {"head": HEAD, "optimizer": {"betas": [0.9]}}, "optimizer.betas"),
    ("slot optimizer lr 0", "POST", SLOTS, {"head": HEAD, "optimizer": {"lr": 0}}, "optimizer.lr"),
    ("slot optimizer eps -1", "POST", SLOTS, {"head": HEAD, "optimizer": {"eps": -1}}, "optimizer.eps"),
    ("slot head unknown option", "POST", SLOTS, {"head": {**HEAD, "options": {"pad": 1}}}, "head.options.pad"),
    ("slot head feature_layers 1 of depth 2", "POST", SLOTS, {"head": {**HEAD, "feature_layers": 1}},
     "head.feature_layers"),
    ("slot bins head with 1 bin", "POST", SLOTS, {"head": {**HEAD, "kind": "bins", "options": {"n_bins": 1}}},
     "head.options.n_bins"),
    ("slot head instruction_cond x", "POST", SLOTS, {"head": {**HEAD, "instruction_cond": "x"}},
     "head.instruction_cond"),
    ("slot head width 10**9", "POST", SLOTS, {"head": {**HEAD, "width": 10**9}}, "head.width"),
    ("slot seed a string", "POST", SLOTS, {"head": HEAD, "seed": "x"}, "seed"),
    ("slot seed negative", "POST", SLOTS, {"head": HEAD, "seed": -1}, "seed"),
    ("slot name too long", "POST", SLOTS, {"head": HEAD, "name": "x" * 100}, "name"),
    ("slot body a list", "POST", SLOTS, [HEAD], "body"),
    ("session without env", "POST", SESSIONS, {"n_envs": 1}, "env"),
    ("session negative n_envs", "POST", SESSIONS, {"env": ENV, "n_envs": -1}, "n_envs"),
    ("session zero n_envs", "POST", SESSIONS, {"env": ENV, "n_envs": 0}, "n_envs"),
    ("session n_envs a string", "POST", SESSIONS, {"env": ENV, "n_envs": "two"}, "n_envs"),
    ("session n_envs 10000", "POST", SESSIONS, {"env": ENV, "n_envs": 10000}, "n_envs"),
    ("session unknown field", "POST", SESSIONS, {"env": ENV, "n_env": 2}, "n_env"),
    ("session env unknown field", "POST", SESSIONS, {"env": {**ENV, "colour": 1}}, "env.colour"),
    ("session env unknown task", "POST", SESSIONS, {"env": {**ENV, "task": "goal/fly-to-moon"}},
     ("env.task", "env")),  # the simulator worker finds out; its message names the task
    ("session env unknown backend", "POST", SESSIONS, {"env": {**ENV, "backend": "nope"}}, "env.backend"),
    ("session env image_size -1", "POST", SESSIONS, {"env": {**ENV, "image_size": -1}}, "env.image_size"),
    ("session env image_size a string", "POST", SESSIONS, {"env": {**ENV, "image_size": "big"}}, "env.image_size"),
    ("session env cameras a number", "POST", SESSIONS, {"env": {**ENV, "cameras": 5}}, "env.cameras"),
    ("session env image_size 100000", "POST", SESSIONS, {"env": {**ENV, "image_size": 100000}}, "env.image_size"),
    ("session env options a list", "POST", SESSIONS, {"env": {**ENV, "options": []}}, "env.options"),
    ("session env a string", "POST", SESSIONS, {"env": "tabletop"}, "env"),
    ("job unknown head kind", "POST", JOBS, {**SFT_SPEC, "head": {**HEAD, "kind": "nope"}}, "head.kind"),
    ("job horizon 0", "POST", JOBS, {**SFT_SPEC, "head": HEADX}, "head.horizon"),
    ("job without kind", "POST", JOBS, {k: v for k, v in SFT_SPEC.items() if k != "kind"}, "kind"),
    ("job unknown kind", "POST", JOBS, {**SFT_SPEC, "kind": "dance"}, "kind"),
    ("job without head", "POST", JOBS, {k: v for k, v in SFT_SPEC.items() if k != "head"}, "head"),
    ("job sft without section", "POST", JOBS, {k: v for k, v in SFT_SPEC.items() if k != "sft"}, "sft"),
    ("job dataset ../x", "POST", JOBS, {**SFT_SPEC, "sft": {**SFT_SPEC["sft"], "dataset": "../x"}}, "sft.dataset"),
    ("job dataset /etc", "POST", JOBS, {**SFT_SPEC, "sft": {**SFT_SPEC["sft"], "dataset": "/etc"}}, "sft.dataset"),
    ("job dataset ..", "POST", JOBS, {**SFT_SPEC, "sft": {**SFT_SPEC["sft"], "dataset": ".."}}, "sft.dataset"),
    ("job dataset unknown", "POST", JOBS, {**SFT_SPEC, "sft": {**SFT_SPEC["sft"], "dataset": "nope"}}, "sft.dataset"),
    ("job dataset a number", "POST", JOBS, {**SFT_SPEC, "sft": {**SFT_SPEC["sft"], "dataset": 3}}, "sft.dataset"),
    ("job sft steps a string", "POST", JOBS, {**SFT_SPEC, "sft": {**SFT_SPEC["sft"], "steps": "x"}}, "sft.steps"),
    ("job unknown field", "POST", JOBS, {**SFT_SPEC, "priority": 9}, "priority"),
    ("job checkpoint_every 0", "POST", JOBS, {**SFT_SPEC, "checkpoint_every": 0}, "checkpoint_every"),
    ("job name with spaces", "POST", JOBS, {**SFT_SPEC, "name": "my job"}, "name"),
    ("job init_from", "POST", JOBS, {**SFT_SPEC, "init_from": "/etc/passwd"}, "init_from"),
    ("job optimizer beta 1.5", "POST", JOBS, {**SFT_SPEC, "optimizer": {"betas": [1.5, 0.9]}}, "optimizer.betas"),
    ("job head unknown option", "POST", JOBS, {**SFT_SPEC, "head": {**HEAD, "options": {"pad": 1}}},
     "head.options.pad"),
    ("job wrong backbone", "POST", JOBS, {**SFT_SPEC, "backbone": "huge"}, "backbone"),
    ("job body a list", "POST", JOBS, [SFT_SPEC], "body"),
    ("optim_step lr negative", "POST", "/v1/training/slots/{slot}/optim_step", {"lr": -1}, "lr"),
    ("optim_step lr a string", "POST", "/v1/training/slots/{slot}/optim_step", {"lr": "fast"}, "lr"),
    ("optim_step unknown field", "POST", "/v1/training/slots/{slot}/optim_step", {"steps": 2}, "steps"),
    ("load_state without checkpoint_id", "POST", "/v1/training/slots/{slot}/load_state", {}, "checkpoint_id"),
    ("load_state checkpoint_id a number", "POST", "/v1/training/slots/{slot}/load_state", {"checkpoint_id": 3},
     "checkpoint_id"),
    ("reset seed negative", "POST", "/v1/sessions/{session}/reset", {"seed": -1}, "seed"),
    ("reset seed a string", "POST", "/v1/sessions/{session}/reset", {"seed": "x"}, "seed"),
    ("key name too long", "POST", "/v1/keys", {"name": "k" * 100}, "name"),
    ("key name a number", "POST", "/v1/keys", {"name": 5}, "name"),
]


@pytest.mark.parametrize("case,method,path,body,field", BAD_JSON, ids=[c[0] for c in BAD_JSON])
def test_bad_json_bodies_name_the_field(svc, mine, case, method, path, body, field):
    url = path.format(slot=mine.slot, session=mine.session)
    before = _resources(svc.client, mine.H)
    r = svc.client.request(method, url, json=body, headers=mine.H)
    assert_invalid(r, field)
    assert _resources(svc.client, mine.H) == before  # nothing half-made


def _resources(c, headers) -> tuple:
    return tuple(sorted(x["id"] for x in ok(c.get(path, headers=headers)).json()[name])
                 for path, name in (("/v1/policies", "policies"), ("/v1/jobs", "jobs"), ("/v1/sessions", "sessions")))


def test_bad_json_bodies_leave_no_trace(svc, mine):
    """No slot, job or session was created by the refused bodies (nothing half-made)."""
    c = svc.client
    policies = ok(c.get("/v1/policies", headers=mine.H)).json()["policies"]
    assert [p["id"] for p in policies] == [mine.slot], policies
    assert ok(c.get("/v1/jobs", headers=mine.H)).json()["jobs"] == []
    assert [s["id"] for s in ok(c.get("/v1/sessions", headers=mine.H)).json()["sessions"]] == [mine.session]


BAD_OTHER = [
    # (case, method, path, request kwargs, admin, field)
    ("json not json", "POST", SLOTS, {"content": b"{head", "headers": {"content-type": "application/json"}}, False,
     "body"),
    ("json body empty", "POST", SLOTS, {"content": b"", "headers": {"content-type": "application/json"}}, False,
     "body"),
    ("optional json body not json", "POST", "/v1/training/slots/{slot}/optim_step",
     {"content": b"\xff", "headers": {"content-type": "application/json"}}, False, "body"),
    ("json body a string", "POST", SLOTS, {"json": "head"}, False, "body"),
    ("jobs unknown state", "GET", "/v1/jobs?state=sleeping", {}, False, "state"),
    ("logs negative since", "GET", "/v1/jobs/{slot}/logs?since=-1", {}, False, "since"),
    ("metrics since a string", "GET", "/v1/jobs/{slot}/metrics?since=x", {}, False, "since"),
    ("future wait 100", "GET", "/v1/futures/abc?wait=100", {}, False, "wait"),
    ("future wait nan", "GET", "/v1/futures/abc?wait=nan", {}, False, "wait"),
    ("tenant name with a space", "POST", "/v1/tenants", {"json": {"name": "a b"}}, True, "name"),
    ("tenant without name", "POST", "/v1/tenants", {"json": {}}, True, "name"),
    ("tenant quotas unknown", "POST", "/v1/tenants", {"json": {"name": "q1", "quotas": {"gpus": 3}}}, True,
     "quotas.gpus"),
    ("tenant quotas negative", "POST", "/v1/tenants", {"json": {"name": "q2", "quotas": {"max_env_sessions": -1}}},
     True, "quotas.max_env_sessions"),
    ("quotas negative", "PUT", "/v1/tenants/{tenant}/quotas", {"json": {"max_concurrent_jobs": -1}}, True,
     "max_concurrent_jobs"),
    ("quotas rate 0", "PUT", "/v1/tenants/{tenant}/quotas", {"json": {"requests_per_s": 0}}, True, "requests_per_s"),
    ("quotas unknown", "PUT", "/v1/tenants/{tenant}/quotas", {"json": {"gpus": 1}}, True, "gpus"),
]


@pytest.mark.parametrize("case,method,path,kw,as_admin,field", BAD_OTHER, ids=[c[0] for c in BAD_OTHER])
def test_bad_queries_and_admin_bodies_name_the_field(svc, mine, case, method, path, kw, as_admin, field):
    url = path.format(slot=mine.slot, session=mine.session, tenant=mine.tenant)
    auth = bearer(svc.admin) if as_admin else mine.H
    r = svc.client.request(method, url, **{**kw, "headers": {**kw.get("headers", {}), **auth}})
    assert_invalid(r, field)


def test_unknown_routes_and_methods_answer_the_error_format(svc, mine):
    r = svc.client.get("/v1/nothing-here", headers=mine.H)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found", r.text
    r = svc.client.put(f"/v1/jobs/{MISSING_ID}", headers=mine.H)
    assert r.status_code == 405 and "error" in r.json(), r.text


# ---- body size ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small(svc, tmp_path_factory):
    """A second host (sharing the first one's services) whose body limit is 0.01 MB."""
    host = ServiceHost(ServiceConfig(data_dir=tmp_path_factory.mktemp("small"), max_body_mb=0.01),
                       runtime=svc.host.runtime)
    admin = host.start()
    client = TestClient(create_app(host), raise_server_exceptions=False)
    r = ok(client.post("/v1/tenants", json={"name": "small"}, headers=bearer(admin)), 201).json()
    H = bearer(r["api_key"])
    slot = ok(client.post("/v1/training/slots", json={"head": HEAD}, headers=H), 201).json()["policy"]["id"]
    try:
        yield types.SimpleNamespace(client=client, H=H, slot=slot, limit=int(0.01 * 1024 * 1024))
    finally:
        client.close()
        host.stop()


def _chunks(data: bytes, n: int = 4096):
    for i in range(0, len(data), n):
        yield data[i:i + n]


def test_bodies_over_the_limit_are_413(small):
    c = small.client
    big = wire.dumps({"observation": observation(batch=2, size=64)})  # 24 KB of images
    assert len(big) > small.limit
    url = f"/v1/policies/{small.slot}/predict"
    r = c.post(url, content=big, headers={**small.H, **MSGPACK})
    assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large", r.text
    # Streamed (chunked, no content-length): counted as it arrives.
    r = c.post(url, content=_chunks(big), headers={**small.H, **MSGPACK})
    assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large", r.text
    # JSON bodies too, declared and streamed.
    body = json.dumps({"head": {**HEAD, "options": {"pad": "x" * 20000}}}).encode()
    for content in (body, _chunks(body)):
        r = c.post("/v1/training/slots", content=content, headers={**small.H, "content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large", r.text
    # Under the limit: served.
    small_obs = wire.dumps({"observation": observation(batch=1, size=32)})
    assert len(small_obs) < small.limit
    ok(c.post(url, content=small_obs, headers={**small.H, **MSGPACK}))
    ok(c.post(url, content=_chunks(small_obs, 1000), headers={**small.H, **MSGPACK}))


def test_bad_content_length_is_400(small):
    r = small.client.post(f"/v1/policies/{small.slot}/predict", content=b"x",
                          headers={**small.H, **MSGPACK, "content-length": "lots"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "content-length", r.text


# ---- schemathesis ----------------------------------------------------------------------------------------------
def _register_msgpack_serializer() -> None:
    """Bodies of application/msgpack operations: raw bytes as generated, anything else packed."""
    import schemathesis

    @schemathesis.serializer(wire.CONTENT_TYPE)
    def _msgpack(ctx, value):
        if value is None or isinstance(value, bytes):
            return value
        return msgpack.packb(value, use_bin_type=True, default=str)


def _wire_documents():
    """Msgpack documents shaped like observations, actions and steps, with arrays of every allowed
    dtype and of random, nearly-right and right shapes (the OpenAPI spec only says "binary")."""
    import math as _math

    from hypothesis import strategies as st

    def array(dtype, shape, fill, short):
        n = _math.prod(shape) * np.dtype(dtype).itemsize
        return {"__nd__": 1, "dtype": dtype, "shape": shape, "data": bytes([fill]) * max(0, n - short)}

    shapes = st.one_of(st.lists(st.integers(0, 5), max_size=5),
                       st.builds(lambda b, h, w: [b, 3, h, w], st.integers(0, 3), st.integers(1, 24),
                                 st.integers(1, 24)),
                       st.builds(lambda b, d: [b, d], st.integers(0, 3), st.sampled_from([0, 4, 8, 9])),
                       st.builds(lambda b, h, a: [b, h, a], st.integers(1, 3), st.sampled_from([1, 4, 5]),
                                 st.sampled_from([4, 7])))
    arrays = st.builds(array, st.sampled_from(sorted(wire.DTYPES)), shapes,
                       st.sampled_from([0, 1, 0x3F, 0x7F, 0xFF]), st.sampled_from([0, 0, 0, 1]))
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=8),
                        st.binary(max_size=8))
    anything = st.recursive(scalars | arrays, lambda inner: st.lists(inner, max_size=3)
                            | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
    observations = st.fixed_dictionaries({}, optional={
        "images": st.dictionaries(st.sampled_from(["agentview", "wrist", ""]), arrays | scalars, max_size=2) | anything,
        "state": arrays | anything,
        "instructions": st.lists(st.text(max_size=12), max_size=4) | anything})
    return st.fixed_dictionaries({}, optional={
        "observation": observations | anything, "actions": arrays | anything, "action_mask": arrays | anything,
        "deterministic": scalars}) | anything


def _near_valid_bodies() -> dict:
    """Bodies close to valid for the fixture's gaussian head (action_dim 4, horizon 4, state_dim 8),
    per operation: odd sizes, dtypes, values (NaN, 3e38, 0) and texts that get past the checks
    into the services, where random bytes never reach."""
    from hypothesis import strategies as st

    from vlamux.model.heads import HEADS

    def array(dtype, shape, fill):
        return {"__nd__": 1, "dtype": dtype, "shape": list(shape),
                "data": bytes([fill]) * (int(np.prod(shape)) * np.dtype(dtype).itemsize)}

    fills = st.sampled_from([0x00, 0x3F, 0x3F, 0xBF, 0x7F, 0xFF])  # 0, ~0.75, ~-0.75, ~3e38, NaN
    floats = st.sampled_from(["float32", "float32", "float16", "float64"])
    texts = st.text(max_size=60) | st.sampled_from(["", " ", "touch the red cube " * 40, "\x00", "\u202e\U0001f916"])

    @st.composite
    def observation(draw, b=None):
        b = b or draw(st.integers(1, 3))
        cams = draw(st.lists(st.sampled_from(["agentview", "wrist", "x" * 70, "a.b"]), min_size=1, max_size=2,
                             unique=True))
        images = {c: array("uint8", (b, 3, draw(st.integers(1, 48)), draw(st.integers(1, 48))), draw(fills))
                  for c in cams}
        out = {"images": images, "instructions": draw(st.lists(texts, min_size=b, max_size=b))}
        if draw(st.integers(0, 4)):
            out["state"] = array(draw(floats), (b, draw(st.sampled_from([8, 8, 8, 0, 3]))), draw(fills))
        return out

    @st.composite
    def forward_backward(draw):
        b = draw(st.integers(1, 3))
        h, a = draw(st.sampled_from([(4, 4), (4, 4), (4, 4), (1, 4), (4, 1)]))
        body = {"observation": draw(observation(b)), "actions": array(draw(floats), (b, h, a), draw(fills))}
        if draw(st.booleans()):
            body["action_mask"] = array("bool", (b, h), draw(st.sampled_from([0, 1])))
        return body

    step = st.builds(lambda n, shape, dtype, fill: {"actions": array(dtype, (n, *shape), fill)},
                     st.sampled_from([2, 2, 1, 3]), st.sampled_from([(4,), (4,), (2,), (4, 4), (1, 4), (0,)]),
                     floats, fills)
    def mostly(valid: list, bad: list):  # three valid values in four
        return st.sampled_from(valid * (3 * max(1, len(bad)))) | st.sampled_from(bad)

    dims = mostly([1, 2, 4], [0, -1])
    head = st.fixed_dictionaries(
        {"kind": mostly(sorted(HEADS), ["nope"]), "action_dim": dims, "horizon": dims},
        optional={"state_dim": mostly([0, 8], [-1]), "width": mostly([8, 16], [30, 0]),
                  "n_heads": mostly([1, 2], [0, 3]), "depth": mostly([1, 2], [0]),
                  "feature_layers": mostly([0], [1, 2]), "instruction_cond": mostly(["none", "add", "adaln"], ["x"]),
                  "options": st.dictionaries(st.sampled_from(["n_bins", "steps", "init_log_std", "x"]),
                                             st.integers(-1, 4) | st.floats(-3, 3) | st.booleans(), max_size=1)})
    optimizer = st.fixed_dictionaries({}, optional={
        "lr": mostly([1e-3], [0.0, -1.0, 1e300]), "weight_decay": mostly([0.0, 0.1], [-1.0]),
        "betas": mostly([[0.9, 0.999]], [[1.5, 0.9], [-0.1, 0.5], [0.9], [0.9, 0.9, 0.9]]),
        "eps": mostly([1e-8], [0.0, -1.0]), "grad_clip": mostly([None, 1.0], [0.0, -1.0])})
    slot = st.fixed_dictionaries({"head": head}, optional={"optimizer": optimizer, "seed": st.integers(0, 3)})
    job = st.fixed_dictionaries({"kind": st.just("sft"), "head": head, "sft": st.fixed_dictionaries(
        {"dataset": mostly(["tiny"], [".", "nope"])},
        optional={"steps": mostly([1, 2], [0]), "batch_size": mostly([1, 4], [0]), "grad_accum": mostly([1, 2], [0]),
                  "schedule": mostly(["constant", "cosine"], ["x"]), "warmup_steps": mostly([0, 2], [-1]),
                  "lr": mostly([None, 1e-3], [0.0, -1.0]), "timeout_s": mostly([10.0], [0.0, -1.0]),
                  "camera_map": mostly([{"observation.images.agentview": "agentview"}], [{}, {"x": "y"}])})},
        optional={"optimizer": optimizer, "checkpoint_every": mostly([1, 2], [0]), "seed": mostly([0, 2], [-1])})
    # A valid spec with exactly one thing wrong, so one fault is never hidden behind another.
    head_faults = {"kind": ["nope", 3, None], "action_dim": [0, -1, 2.5, "4", True, 10**9], "horizon": [0, 10**9],
                   "state_dim": [-1, 10**9], "width": [30, 0, 10**9], "n_heads": [0, 3], "depth": [0, 10**6],
                   "feature_layers": [1, 5], "instruction_cond": ["x", None],
                   "options": [{"x": 1}, [], {"init_log_std": "a"}, {"init_log_std": 1e308}]}
    optim_faults = {"lr": [0.0, -1.0, "x", 1e300], "weight_decay": [-1.0], "betas": [[1.5, 0.9], [-0.1, 0.5], [0.9],
                    [0.9, 0.9, 0.9], "ab", [None, None]], "eps": [0.0, -1.0], "grad_clip": [0.0, -1.0, "x"], "x": [1]}
    sft_faults = {"steps": [0, -1, 10**12], "batch_size": [0, -1, 10**9], "grad_accum": [0], "schedule": ["x"],
                  "warmup_steps": [-1], "lr": [0.0, -1.0], "timeout_s": [0.0, -1.0, 1e300], "seed": [-1, "x"],
                  "camera_map": [{}, {"x": "y"}, [], {"observation.images.agentview": 3}], "dataset": ["", ".", "nope"]}
    faults = [("head", k, v) for k, vs in head_faults.items() for v in vs] + [
        ("optimizer", k, v) for k, vs in optim_faults.items() for v in vs]

    def with_fault(base: dict, where: str, key: str, value) -> dict:
        body = json.loads(json.dumps(base))
        body.setdefault(where, {})[key] = value
        return body

    slot_base = {"head": {**HEAD, "width": 16, "n_heads": 2, "depth": 1}, "optimizer": {"lr": 1e-3}}
    one_fault_slot = st.sampled_from(faults).map(lambda f: with_fault(slot_base, *f))
    job_base = {**SFT_SPEC, "head": slot_base["head"], "sft": {"dataset": "tiny", "steps": 1, "batch_size": 2}}
    one_fault_job = st.sampled_from(faults + [("sft", k, v) for k, vs in sft_faults.items() for v in vs]).map(
        lambda f: with_fault(job_base, *f))
    return {"POST /v1/policies/{policy_id}/predict": st.fixed_dictionaries(
                {"observation": observation()}, optional={"deterministic": st.booleans()}),
            "POST /v1/training/slots/{policy_id}/forward_backward": forward_backward(),
            "POST /v1/sessions/{session_id}/step": step,
            "POST /v1/training/slots": one_fault_slot | slot,
            "POST /v1/jobs": one_fault_job | job}


def _fuzz(label, cases, docs, headers, max_examples, failures, statuses, after_call) -> None:
    """One hypothesis run of one operation: `cases` from schemathesis, their bodies replaced by a
    draw from `docs` (a strategy of documents) when given; a 5xx is added to `failures` and raised."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.checks import not_a_server_error

    @given(case=cases, doc=st.none() if docs is None else docs)
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case, doc):
        if doc is not None and case.media_type in (wire.CONTENT_TYPE, "application/json"):
            case.body = doc  # a structured document instead of random bytes or a random dict
        try:
            response = case.call(headers=headers)
        except Exception as e:  # the test client re-raises what the app did not answer
            failures.append(f"{label}: {type(e).__name__}: {e}\n    body={str(case.body)[:300]} "
                            f"path={case.path_parameters} query={case.query}")
            raise
        statuses.setdefault(label, set()).add(response.status_code)
        if after_call is not None:
            after_call()
        try:
            case.validate_response(response, checks=[not_a_server_error])
        except Exception:
            failures.append(f"{label}: {response.status_code} {response.text[:300]}\n    "
                            f"body={str(case.body)[:300]} path={case.path_parameters} query={case.query}")
            raise

    run()


def _schemathesis_run(app, headers: dict, path_ids: dict, max_examples: int, after_call=None, min_ops: int = 25):
    """Run every operation of the served OpenAPI spec: positive and negative examples with random
    path ids and with `path_ids` (real resources of the caller); msgpack bodies as random bytes or
    random documents; then, for the operations that take a spec or arrays, near-valid bodies aimed
    at the caller's resources. Returns the 5xx found and the statuses seen per operation."""
    import schemathesis
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode

    _register_msgpack_serializer()
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    documents, near_valid = _wire_documents(), _near_valid_bodies()
    failures, statuses, n_ops = [], {}, 0
    for result in schema.get_all_operations():
        op = result.ok()
        n_ops += 1
        params = {p.name for p in op.path_parameters}
        mine = {p: path_ids[p] for p in params if p in path_ids}
        strategies = []
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategies.append(op.as_strategy(generation_mode=mode))
            if params and len(mine) == len(params):
                strategies.append(op.as_strategy(generation_mode=mode, path_parameters=mine))
        is_msgpack = any(b.media_type == wire.CONTENT_TYPE for b in op.body)
        runs = [(st.one_of(strategies), st.none() | documents if is_msgpack else None)]
        if op.label in near_valid and len(mine) == len(params):
            runs.append((op.as_strategy(path_parameters=mine), near_valid[op.label]))
        for i, (cases, docs) in enumerate(runs):
            try:
                _fuzz(op.label, cases, docs, headers, max_examples * (1 + i), failures, statuses, after_call)
            except Exception as e:  # noqa: BLE001 - collect every operation's failure, then report them all
                if not failures or not failures[-1].startswith(op.label):
                    failures.append(f"{op.label}: {type(e).__name__}: {str(e)[:500]}")
    assert n_ops >= min_ops, n_ops
    assert len(statuses) == n_ops, set(statuses)  # every operation was called
    return failures, statuses


@pytest.fixture(scope="module")
def fuzz_tenant(svc):
    """A tenant for schemathesis with a real slot, session, future, job and spare key to aim at."""
    t_id, key = new_tenant(svc, "echo-fuzz", max_env_sessions=3)
    c, H = svc.client, bearer(key)
    slot = ok(c.post("/v1/training/slots", json={"head": HEAD}, headers=H), 201).json()["policy"]["id"]
    fut = ok(c.post(f"/v1/training/slots/{slot}/save_state", headers=H)).json()["future"]["id"]
    wait_future(c, key, fut)
    session = ok(c.post("/v1/sessions", json={"env": ENV, "n_envs": 2}, headers=H), 201).json()["session"]["id"]
    spare = ok(c.post("/v1/keys", json={"name": "spare"}, headers=H), 201).json()["key"]["id"]
    job = ok(c.post("/v1/jobs", json={**SFT_SPEC, "sft": {**SFT_SPEC["sft"], "steps": 2}}, headers=H), 202).json()
    return types.SimpleNamespace(tenant=t_id, key=key, H=H, ids={
        "policy_id": slot, "session_id": session, "future_id": fut, "key_id": spare, "job_id": job["job"]["id"]})


def test_schemathesis_tenant_finds_no_server_error(svc, fuzz_tenant):
    env = svc.host.runtime.environment

    def close_new_sessions():  # a valid POST /v1/sessions starts simulators: keep only the one we aim at
        for s in env.list_sessions(fuzz_tenant.tenant):
            if s["session_id"] != fuzz_tenant.ids["session_id"]:
                env.close_session(fuzz_tenant.tenant, s["session_id"])

    failures, statuses = _schemathesis_run(svc.app, fuzz_tenant.H, fuzz_tenant.ids, max_examples=25,
                                           after_call=close_new_sessions)
    assert not failures, "\n".join(failures)
    svc.host.meter.tick()  # metering still works for everyone after all that (one failed write loses all rows)
    # The run got past validation into the services, not only to 4xx answers.
    for label, status in [("POST /v1/policies/{policy_id}/predict", 200), ("POST /v1/sessions/{session_id}/step", 200),
                          ("POST /v1/training/slots/{policy_id}/forward_backward", 202),
                          ("POST /v1/training/slots", 201), ("GET /v1/jobs/{job_id}", 200)]:
        assert status in statuses[label], (label, statuses[label])
    ok(svc.client.get(f"/v1/policies/{fuzz_tenant.ids['policy_id']}", headers=fuzz_tenant.H))  # still served


def test_schemathesis_admin_finds_no_server_error(svc):
    target, _ = new_tenant(svc, "foxtrot-fuzz")
    failures, statuses = _schemathesis_run(svc.app, bearer(svc.admin), {"tenant_id": target}, max_examples=15)
    assert not failures, "\n".join(failures)
    assert 200 in statuses["PUT /v1/tenants/{tenant_id}/quotas"] and 201 in statuses["POST /v1/tenants"], statuses
    ok(svc.client.get("/healthz"))


def test_schemathesis_harness_reports_a_server_error():
    """The harness above can fail: on an app with a 500 it reports it."""
    from fastapi import FastAPI

    bad = FastAPI()

    @bad.get("/items/{n}")
    def item(n: int):
        if abs(n) > 100:  # most integers hypothesis draws
            raise RuntimeError("boom")
        return {"n": n}

    failures, _ = _schemathesis_run(bad, {}, {}, max_examples=15, min_ops=1)
    assert failures and failures[0].startswith("GET /items/{n}"), failures
