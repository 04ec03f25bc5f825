"""End to end, against `vlamux serve` as a subprocess: tenant A uploads a LeRobot v3.0 dataset (in
resumable chunks), trains an SFT job on it, downloads the policy, and `vlamux.policy.load(...).act`
equals the service's predict for the same observations (deterministic); A uploads the file back as a
policy file and starts a job from it. Tenant B sees none of A's datasets, uploads, jobs, policies or
policy files: each id answers 404, each list is B's own."""

from __future__ import annotations

import os
import socket

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(600)
HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _obs(n=3, seed=0):
    g = np.random.default_rng(seed)
    return {"images": {"agentview": g.integers(0, 255, (n, 3, 32, 32), dtype=np.uint8),
                       "wrist": g.integers(0, 255, (n, 3, 32, 32), dtype=np.uint8)},
            "state": g.standard_normal((n, 8)).astype(np.float32), "instructions": ["touch the red cube"] * n}


def test_tenant_data_in_policies_out_through_a_served_subprocess(tmp_path):
    import vlamux.policy
    from api_server import spawn
    from vlamux.sdk.process import stop
    from demos import demo_dataset
    from vlamux.data.lerobot import LeRobotDataset
    from vlamux.sdk import Client
    from vlamux.sdk.uploads import upload

    demos = tmp_path / "acme-demos"
    demo_dataset(demos, 4)
    assert LeRobotDataset(demos).info["codebase_version"] == "v3.0"
    port, log = _port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = spawn(tmp_path / "service", port, log=log.open("a"), env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        admin = Client(url, (tmp_path / "service" / "admin.key").read_text().strip())
        _, a_key = admin.admin.create_tenant("acme", {"requests_per_s": 10000})
        _, b_key = admin.admin.create_tenant("bolt", {"requests_per_s": 10000})
        A, B = Client(url, a_key), Client(url, b_key)

        d = upload(A._http, str(demos), "dataset", "acme-demos", chunk_bytes=32 << 10, whole_bytes=0)
        assert d["episodes"] == 4 and d["format"] == "lerobot" and d["codebase_version"] == "v3.0"
        job = A.submit({"name": "acme-sft", "kind": "sft", "head": HEAD, "eval": None,
                        "sft": {"dataset": "acme-demos", "steps": 6, "batch_size": 8}})
        assert job.wait(timeout_s=300, progress=False).state == "succeeded", job.error
        path = A.policy(job.id).download(str(tmp_path / "acme.policy.safetensors"))
        policy = vlamux.policy.load(path, backbone="tiny")
        for seed in range(3):
            obs = _obs(seed=seed)
            served = A.policy(job.id).predict(obs, deterministic=True)
            np.testing.assert_array_equal(policy.act(obs), served["actions"])
        pf = A.upload_policy_file(path, "acme-start")
        again = A.submit({"name": "acme-again", "kind": "sft", "head": HEAD, "eval": None, "init_from": "acme-start",
                          "sft": {"dataset": "acme-demos", "steps": 2, "batch_size": 8}})
        assert again.wait(timeout_s=300, progress=False).state == "succeeded", again.error
        open_upload = httpx.post(f"{url}/v1/uploads", json={"bytes": 100}, timeout=30,
                                 headers={"Authorization": f"Bearer {a_key}"}).json()["upload"]["id"]

        # B: nothing of A's exists for it
        hb = {"Authorization": f"Bearer {b_key}"}
        for method, route in (("GET", f"/v1/jobs/{job.id}"), ("GET", f"/v1/policies/{job.id}"),
                              ("GET", f"/v1/policies/{job.id}/download"), ("GET", f"/v1/jobs/{job.id}/events"),
                              ("DELETE", "/v1/datasets/acme-demos"), ("DELETE", f"/v1/policy-files/{pf['name']}"),
                              ("GET", f"/v1/uploads/{open_upload}"), ("DELETE", f"/v1/uploads/{open_upload}")):
            r = httpx.request(method, f"{url}{route}", headers=hb, timeout=30)
            assert r.status_code == 404, (method, route, r.status_code, r.text)
        assert [x["name"] for x in B.datasets() if not x["public"]] == [] and B.policy_files() == []
        assert B.jobs() == [] and B.policies() == []
        r = httpx.post(f"{url}/v1/jobs", headers=hb, timeout=30, json={
            "name": "steal", "kind": "sft", "head": HEAD, "init_from": "acme-start", "sft": {"dataset": "acme-demos"}})
        assert r.status_code == 422 and r.json()["error"]["field"] in ("init_from", "sft.dataset"), r.text
        # and A's things are all still there
        assert [x["name"] for x in A.datasets() if not x["public"]] == ["acme-demos"]
        assert [x["name"] for x in A.policy_files()] == ["acme-start"]
    finally:
        stop(proc)
