"""The API host with the services on Ray (`vlamux serve --ray`): the same routes and jobs work when the
services are Ray actors. A Ray instance local to this process stands in for a cluster."""

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")

from fastapi.testclient import TestClient  # noqa: E402

from vlamux import wire  # noqa: E402
from vlamux.api.app import create_app  # noqa: E402
from vlamux.api.host import ServiceConfig, ServiceHost  # noqa: E402


HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}
MSGPACK = {"content-type": wire.CONTENT_TYPE}


def test_routes_and_a_job_on_ray_services(tmp_path):
    from demos import demo_dataset

    demo_dataset(tmp_path / "datasets" / "tiny", 4)
    if ray.is_initialized():
        ray.shutdown()
    # A cluster that a killed run left named as this machine's latest: "local" must not try to join it
    from ray._private.utils import get_ray_address_file, read_ray_address, write_ray_address

    before = read_ray_address()
    Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)  # a machine Ray never ran on
    write_ray_address("127.0.0.1:9")
    try:
        host = ServiceHost(ServiceConfig(data_dir=tmp_path, ray_address="local"))
        admin = host.start()
    finally:
        if before:
            write_ray_address(before)
        else:
            os.unlink(get_ray_address_file(None))
    try:
        from vlamux.services.contract import Runtime
        from vlamux.services.ray_runtime import RayRuntime

        assert isinstance(host.runtime, RayRuntime) and isinstance(host.runtime, Runtime)
        c = TestClient(create_app(host))
        key = c.post("/v1/tenants", json={"name": "acme"}, headers={"Authorization": f"Bearer {admin}"}).json()["api_key"]
        auth = {"Authorization": f"Bearer {key}"}
        sid = c.post("/v1/sessions", json={"env": {"task": "goal/touch-red-cube", "image_size": 32}, "n_envs": 2},
                     headers=auth).json()["session"]["id"]
        obs = wire.loads(c.post(f"/v1/sessions/{sid}/reset", json={"seed": 0}, headers=auth).content)["observation"]
        assert obs["images"]["agentview"].shape == (2, 3, 32, 32)
        pid = c.post("/v1/training/slots", json={"head": HEAD}, headers=auth).json()["policy"]["id"]
        out = wire.loads(c.post(f"/v1/policies/{pid}/predict", content=wire.dumps({"observation": obs}),
                                headers={**auth, **MSGPACK}).content)
        assert out["actions"].shape == (2, 4, 4) and out["policy_version"] == 0
        step = wire.loads(c.post(f"/v1/sessions/{sid}/step", content=wire.dumps({"actions": out["actions"]}),
                                 headers={**auth, **MSGPACK}).content)
        assert step["reward"].shape == (2,)
        fb = c.post(f"/v1/training/slots/{pid}/forward_backward",
                    content=wire.dumps({"observation": obs, "actions": out["actions"].astype(np.float32)}),
                    headers={**auth, **MSGPACK}).json()["future"]["id"]
        assert c.get(f"/v1/futures/{fb}?wait=30", headers=auth).json()["future"]["state"] == "done"
        st = c.post(f"/v1/training/slots/{pid}/optim_step", json={"lr": 1e-3}, headers=auth).json()["future"]["id"]
        assert c.get(f"/v1/futures/{st}?wait=30", headers=auth).json()["future"]["state"] == "done"
        assert c.get(f"/v1/policies/{pid}", headers=auth).json()["policy"]["policy_version"] == 1

        job = c.post("/v1/jobs", json={"name": "sft", "kind": "sft", "head": HEAD, "checkpoint_every": 3,
                                       "sft": {"dataset": "tiny", "steps": 6, "batch_size": 8}},
                     headers=auth).json()["job"]["id"]
        live = host.master.jobs.get(job)  # gone from it once ended
        if live is not None:
            host.master.wait(live, 240)
        view = c.get(f"/v1/jobs/{job}", headers=auth).json()["job"]
        assert view["state"] == "succeeded", view["error"]
        assert view["result"]["sft"]["steps"] == 6 and c.get(f"/v1/jobs/{job}/checkpoints", headers=auth).json()["checkpoints"]
        # its slot is gone from the training actor and the replica; its policy is served from its checkpoint
        assert not any(t.endswith(job) for t in host.runtime.tenants())
        out = wire.loads(c.post(f"/v1/policies/{job}/predict", content=wire.dumps({"observation": obs}),
                                headers={**auth, **MSGPACK}).content)
        assert out["actions"].shape == (2, 4, 4) and out["policy_version"] == 6
        # a deleted training slot leaves the actors too; its calls answer 404
        assert c.delete(f"/v1/training/slots/{pid}", headers=auth).status_code == 204
        assert not any(t.endswith(pid) for t in host.runtime.tenants())
        assert c.post(f"/v1/training/slots/{pid}/optim_step", json={}, headers=auth).status_code == 404

        host.meter.tick()
        usage = c.get("/v1/usage", headers=auth).json()["usage"]
        mine = next(iter(usage.values()))
        assert mine["backbone_s"] > 0 and mine["head_s"] > 0 and mine["env_steps"] > 0 and mine["requests"] >= 1
        assert c.get("/metrics", headers={"Authorization": f"Bearer {admin}"}).status_code == 200
        assert c.delete(f"/v1/sessions/{sid}", headers=auth).status_code == 204
    finally:
        host.stop()
    assert not ray.is_initialized()  # the host shut down the Ray instance it started
