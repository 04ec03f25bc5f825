"""End to end, against `vlamux serve --backbone lerobot:CKPT --vlm DIR` as a subprocess: a tenant
uploads a LeRobot SmolVLA checkpoint (a directory, sent as a tar) and a LeRobot dataset, runs an SFT job
that starts from the checkpoint (`init_from`), downloads the result with `format=lerobot`, and
`vlamux.policy.load(DIR, vlm=...)` of it acts as the service's predict does; a π0 checkpoint is
refused at upload, naming its VLM's hash (tests/fixtures/lerobot_vla: tiny random-weight checkpoints
written by lerobot)."""

from __future__ import annotations

import os
import tarfile

import httpx
import numpy as np
import pytest

from api_server import free_port
from test_vla_import import FIX, VLM_DIR

pytestmark = pytest.mark.timeout(600)


def _dataset(root, episodes=2, frames=60, seed=0):
    """A LeRobot v3.0 dataset with the checkpoint's features: cameras front 64x64 and wrist 48x48, an
    8-dim state and 7-dim actions (random: this checks plumbing, not learning)."""
    from vlamux.data.lerobot_writer import LeRobotWriter

    g = np.random.default_rng(seed)
    feats = {"observation.images.front": {"dtype": "image", "shape": [64, 64, 3]},
             "observation.images.wrist": {"dtype": "image", "shape": [48, 48, 3]},
             "observation.state": {"dtype": "float32", "shape": [8]}, "action": {"dtype": "float32", "shape": [7]}}
    with LeRobotWriter(root, 10, feats) as w:
        for _ in range(episodes):
            w.add_episode({"observation.images.front": g.integers(0, 255, (frames, 64, 64, 3), dtype=np.uint8),
                           "observation.images.wrist": g.integers(0, 255, (frames, 48, 48, 3), dtype=np.uint8),
                           "observation.state": g.standard_normal((frames, 8)).astype(np.float32),
                           "action": g.standard_normal((frames, 7)).astype(np.float32)}, "pick up the red cube")
    return root


def _obs(n=2, seed=1):
    g = np.random.default_rng(seed)
    return {"images": {"front": g.integers(0, 255, (n, 3, 64, 64), dtype=np.uint8),
                       "wrist": g.integers(0, 255, (n, 3, 48, 48), dtype=np.uint8)},
            "state": g.standard_normal((n, 8)).astype(np.float32), "instructions": ["pick up the red cube"] * n}


def test_lerobot_checkpoint_in_sft_out_through_a_served_subprocess(tmp_path):
    import vlamux.policy
    from api_server import spawn
    from vlamux.sdk.process import stop
    from vlamux.sdk import Client
    from vlamux.sdk.errors import VlamuxAPIError

    data = _dataset(tmp_path / "acme-demos")
    port, log = free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = spawn(tmp_path / "service", port, log=log.open("a"), env={**os.environ, "OMP_NUM_THREADS": "1"},
                 extra_args=["--backbone", f"lerobot:{FIX / 'smolvla'}", "--vlm", str(VLM_DIR["smolvla"])])
    try:
        admin = Client(url, (tmp_path / "service" / "admin.key").read_text().strip())
        _, key = admin.admin.create_tenant("acme", {"requests_per_s": 10000})
        A = Client(url, key)
        up = A.upload_policy_file(str(FIX / "smolvla"), "smolvla-base")
        assert up["format"] == "lerobot" and up["family"] == "smolvla" and up["cameras"] == ["front", "wrist"]
        assert [f["format"] for f in A.policy_files()] == ["lerobot"]
        with pytest.raises(VlamuxAPIError) as e:  # a checkpoint of a VLM the service does not hold
            A.upload_policy_file(str(FIX / "pi0"), "pi0")
        assert e.value.status == 422 and "sha256" in str(e.value)
        A.upload_dataset(str(data), "acme-demos")
        job = A.submit({"name": "smol-sft", "kind": "sft", "init_from": "smolvla-base", "eval": None,
                        "sft": {"dataset": "acme-demos", "steps": 4, "batch_size": 4}})
        done = job.wait(timeout_s=300, progress=False)
        assert done.state == "succeeded", (done.error, log.read_text()[-3000:])
        losses = [float(r["loss"]) for r in job.metrics() if r.get("loss") not in (None, "")]
        assert len(losses) == 4 and all(np.isfinite(losses))

        tar = A.policy(job.id).download(str(tmp_path / "smol.lerobot.tar"), format="lerobot")
        with tarfile.open(tar) as t:
            t.extractall(tmp_path / "out", filter="data")
        out = tmp_path / "out" / "policy"
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (FIX / "smolvla").iterdir())
        theirs = vlamux.policy.load(out, vlm=VLM_DIR["smolvla"])
        flat = A.policy(job.id).download(str(tmp_path / "smol.policy.safetensors"))
        mine = vlamux.policy.load(flat, backbone=theirs.backbone)
        obs = _obs()
        want = theirs.act(obs)  # deterministic: the flow from zero noise
        assert np.abs(want - mine.act(obs)).max() <= 1e-5
        served = A.policy(job.id).predict(obs, deterministic=True)["actions"]
        assert np.abs(want - served).max() <= 1e-4
        base = vlamux.policy.load(FIX / "smolvla", vlm=VLM_DIR["smolvla"]).act(obs)
        assert np.abs(want - base).max() > 1e-4  # the SFT steps changed the expert
    finally:
        stop(proc)
    with httpx.Client() as c:
        with pytest.raises(httpx.ConnectError):
            c.get(url + "/healthz", timeout=2)
