"""The Python SDK against a real server (uvicorn on localhost, no mocks)."""

import time

import numpy as np
import pytest
from api_server import running_server

import vlamux
from vlamux.sdk import (APIFuture, AuthenticationError, ConflictError, InvalidInputError, NotFoundError,
                        PermissionDeniedError, QuotaExceededError, RateLimitedError, ServiceUnavailableError)
from vlamux.sdk.http import parse_retry_after

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}
ENV = {"task": "goal/touch-red-cube", "image_size": 32}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from demos import demo_dataset

    root = tmp_path_factory.mktemp("service")
    demo_dataset(root / "datasets" / "tiny", 4)
    with running_server(root) as (url, admin_key, host):
        admin = vlamux.Client(url, api_key=admin_key, timeout_s=30)
        _, key = admin.admin.create_tenant("acme")
        yield {"url": url, "admin": admin, "key": key, "host": host}
        admin.close()


@pytest.fixture
def client(server):
    with vlamux.Client(server["url"], api_key=server["key"], timeout_s=30) as c:
        yield c


def batch(n=2, seed=0):
    rng = np.random.default_rng(seed)
    obs = {"images": {"agentview": rng.integers(0, 255, (n, 3, 32, 32), dtype=np.uint8)},
           "state": rng.standard_normal((n, 8)).astype(np.float32),
           "instructions": ["touch the red cube"] * n}
    return obs, rng.uniform(-1, 1, (n, 4, 4)).astype(np.float32)


def test_top_level_client_is_lazy():
    import subprocess
    import sys

    code = "import sys, vlamux; assert 'httpx' not in sys.modules; vlamux.Client; assert 'httpx' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert parse_retry_after("3") == 3.0 and parse_retry_after(None) is None and parse_retry_after("x") is None


def test_retries_on_unavailable(tmp_path):
    """A stand-in server that answers 503 (Retry-After: 0) twice, then 200; 500 is not retried."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from vlamux.sdk import ServerError

    calls = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _answer(self, status, body, headers=()):
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            calls.append((self.path, self.headers.get("Authorization")))
            if self.path.startswith("/v1/jobs") and len(calls) <= 2:
                self._answer(503, {"error": {"type": "unavailable", "message": "busy"}}, [("Retry-After", "0")])
            elif self.path.startswith("/v1/jobs"):
                self._answer(200, {"jobs": []})
            elif self.path.startswith("/v1/datasets"):
                self._answer(500, {"error": {"type": "server_error", "message": "boom"}})
            else:
                self._answer(504, b"gateway timeout")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with vlamux.Client(f"http://127.0.0.1:{srv.server_port}", api_key="k1", max_retries=3) as c:
            assert c.jobs() == [] and c._http.retries == 2
            assert all(auth == "Bearer k1" for _, auth in calls)
            with pytest.raises(ServerError) as e:
                c.datasets()
            assert e.value.status == 500 and e.value.message == "boom" and c._http.retries == 2
        with vlamux.Client(f"http://127.0.0.1:{srv.server_port}", api_key="k1", max_retries=1,
                           backoff_s=0.01) as c:
            with pytest.raises(ServerError) as e:
                c.policies()
            assert e.value.status == 504 and "gateway timeout" in e.value.message and c._http.retries == 1
    finally:
        srv.shutdown()
        srv.server_close()


def test_errors_map_to_classes(server, client):
    url = server["url"]
    with vlamux.Client(url, api_key="vmx_nope_nope") as bad, pytest.raises(AuthenticationError) as e:
        bad.jobs()
    assert e.value.status == 401 and e.value.type == "unauthenticated"
    with pytest.raises(PermissionDeniedError):
        client.admin.list_tenants()
    with pytest.raises(NotFoundError) as e:
        client.job("nope")
    assert e.value.status == 404 and "nope" in e.value.message
    with pytest.raises(InvalidInputError) as e:
        client.training_client(head={**HEAD, "horizon": 0})
    # docs/API.md promises field "head.horizon"; the spec loader's message names "head" only (reported).
    assert e.value.field in ("head", "head.horizon") and "horizon" in e.value.message and e.value.status == 422
    with pytest.raises(InvalidInputError) as e:
        client.jobs(state="bogus")
    assert e.value.field == "state"
    with pytest.raises(InvalidInputError) as e:
        client.submit({"name": "x", "kind": "sft", "head": HEAD, "sft": {"dataset": "missing", "steps": 2}})
    assert e.value.field == "sft.dataset"
    with pytest.raises(ConflictError) as e:
        server["admin"].admin.create_tenant("acme")
    assert e.value.field == "name"
    # Nothing listens on a closed port: connection errors are retried, then reported.
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with vlamux.Client(f"http://127.0.0.1:{port}", api_key="k", max_retries=2, backoff_s=0.01) as down:
        with pytest.raises(ServiceUnavailableError):
            down.jobs()
        assert down._http.retries == 2


def test_rate_limited_calls_are_retried(server):
    admin = server["admin"].admin
    tenant, key = admin.create_tenant("slowpoke")
    admin.set_quotas(tenant["id"], requests_per_s=5)  # bursts of 10, then 5/s
    with vlamux.Client(server["url"], api_key=key, max_retries=0) as c:
        with pytest.raises(RateLimitedError) as e:
            for _ in range(30):
                c.list_keys()
        assert e.value.retry_after is not None and e.value.retry_after >= 1 and e.value.type == "rate_limited"
    time.sleep(2.1)  # the bucket fills again
    with vlamux.Client(server["url"], api_key=key, max_retries=5) as c:
        t0 = time.monotonic()
        for _ in range(20):
            assert c.list_keys()
        assert c._http.retries >= 1  # at least one 429 was answered, and waited out
        assert time.monotonic() - t0 >= 1.0  # Retry-After (whole seconds) was honoured
    # A used-up quota is not waited out: it raises at once.
    admin.set_quotas(tenant["id"], requests_per_s=100, max_env_sessions=0)
    with vlamux.Client(server["url"], api_key=key) as c, pytest.raises(QuotaExceededError) as e:
        c.env_session(ENV)
    assert c._http.retries == 0 and e.value.status == 429


def test_training_client_round_trip(client):
    tc = client.training_client(head=HEAD, optimizer={"lr": 1e-2}, seed=3, name="tinker")
    obs, actions = batch()
    # Sent back to back without waiting: the server runs them in this order.
    fb1 = tc.forward_backward(obs, actions)
    step = tc.optim_step(lr=5e-2)
    fb2 = tc.forward_backward(obs, actions)
    assert isinstance(fb1, APIFuture) and fb1.op == "forward_backward"
    loss1, loss2 = fb1.result(timeout=60)["loss"], fb2.result(timeout=60)["loss"]
    step.result(timeout=60)
    assert np.isfinite(loss1) and loss2 != pytest.approx(loss1, rel=1e-6)  # fb2 saw the stepped weights
    tc.optim_step()  # applies fb2's gradients
    saved = tc.save_state().result(timeout=60)
    cp = saved["checkpoint"]
    assert cp["policy_id"] == tc.id and cp["policy_version"] == 2
    fb3 = tc.forward_backward(obs, actions)
    tc.optim_step()
    loss3 = fb3.result(timeout=60)["loss"]
    tc.load_state(cp["id"]).result(timeout=60)
    again = tc.forward_backward(obs, actions).result(timeout=60)["loss"]
    assert again == pytest.approx(loss3, rel=1e-5)  # back at the saved weights
    assert [c["id"] for c in tc.policy().versions()["checkpoints"]] == [cp["id"]]
    # Attach a second client to the same slot.
    same = client.training_client(policy_id=tc.id)
    assert same.id == tc.id and same.info["source"] == "training_slot"
    # A bad batch fails fast, naming the field; a bad checkpoint is not found.
    with pytest.raises(InvalidInputError) as e:
        tc.forward_backward(obs, actions[:, :, :2][:1])
    assert e.value.field == "actions"
    with pytest.raises(NotFoundError):
        tc.load_state("nope")


def test_env_session_and_predict(client):
    tc = client.training_client(head=HEAD)
    policy = client.policy(tc.id)
    with client.env_session(ENV, n_envs=1) as env:
        obs = env.reset(seed=1)
        assert obs["images"]["agentview"].shape == (1, 3, 32, 32) and obs["images"]["agentview"].dtype == np.uint8
        assert obs["state"].shape == (1, 8) and len(obs["instructions"]) == 1
        out = policy.predict(obs, deterministic=True)
        assert out["actions"].shape == (1, 4, 4) and out["actions"].dtype == np.float32
        assert out["policy_version"] == 0
        again = policy.predict(obs, deterministic=True, policy_version=0)["actions"]
        np.testing.assert_allclose(again, out["actions"], atol=1e-5)
        with pytest.raises(ConflictError) as e:  # a pinned version that is not the one served
            policy.predict(obs, policy_version=5)
        assert e.value.field == "policy_version"
        res = env.step(out["actions"][:, 0])
        assert set(res) == {"observation", "reward", "terminated", "truncated", "success"}
        assert res["reward"].shape == (1,) and res["observation"]["images"]["agentview"].shape == (1, 3, 32, 32)
        with pytest.raises(InvalidInputError) as e:
            env.step(np.full((1, 4), np.nan, np.float32))
        assert e.value.field == "actions"
    assert env.closed
    env.close()  # twice is fine
    with pytest.raises(NotFoundError):
        env.step(np.zeros((1, 4), np.float32))
    with pytest.raises(InvalidInputError) as e:
        policy.predict({"images": {"agentview": np.zeros((1, 3, 32, 32), np.float32)}, "instructions": ["x"]})
    assert e.value.field == "observation.images.agentview"


def test_submit_sft_job_and_wait(client, capsys):
    assert {"name": "tiny", "format": "lerobot", "public": True} in client.datasets()
    spec = {"name": "t", "kind": "sft", "head": HEAD, "sft": {"dataset": "tiny", "steps": 6, "batch_size": 8},
            "checkpoint_every": 3}
    job = client.submit(spec)
    assert job.state in ("queued", "running") and job.kind == "sft"
    job.wait(timeout_s=120, progress=True, poll_s=0.2)
    assert job.state == "succeeded", job.error
    assert job.result["sft"]["steps"] == 6 and job.progress["step"] == 6
    assert "t sft" in capsys.readouterr().err  # the progress bar
    assert [j.id for j in client.jobs(state="succeeded")] == [job.id]
    rows = job.metrics()
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(np.isfinite(r["loss"]) for r in rows)
    assert any("succeeded" in line for line in job.logs())
    assert job.logs(since=len(job.logs())) == []
    assert sorted(c["policy_version"] for c in job.checkpoints())[-1] == 6
    with pytest.raises(ConflictError):
        job.cancel()
    assert client.job(job.id).state == "succeeded"
    usage = client.usage()
    assert len(usage) == 1 and next(iter(usage.values()))["stored_bytes"] > 0


def test_wait_times_out_and_cancel(client):
    spec = {"name": "long", "kind": "sft", "head": HEAD, "sft": {"dataset": "tiny", "steps": 100000, "batch_size": 8},
            "checkpoint_every": 100000}
    job = client.submit(spec)
    with pytest.raises(TimeoutError):
        job.wait(timeout_s=0.5, progress=False, poll_s=0.1)
    assert job.cancel().state == "cancelled"
