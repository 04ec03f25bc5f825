"""End to end: `vlamux serve` as a real subprocess, two tenants, an SFT job and an RL job through
the SDK; the server is killed (SIGKILL, mid-job) and started again on the same data directory; both
jobs finish from their checkpoints, and nothing recorded before the kill is lost. Once with the store
in SQLite (the default), once on a real PostgreSQL server (tests/postgres.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(data_dir: Path, port: int, log: Path, store_url: str | None = None) -> subprocess.Popen:
    from vlamux.api.server import spawn

    extra = ("--store-url", store_url) if store_url else ()
    return spawn(data_dir, port, log=log.open("a"), env={**os.environ, "OMP_NUM_THREADS": "1"}, extra_args=extra)


def _wait_for(cond, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_jobs_survive_a_killed_server(tmp_path, request, store):
    from vlamux.data.demos import generate
    from vlamux.sdk import Client

    store_url = None
    if store == "postgresql":
        from postgres import fresh_database

        store_url = fresh_database(request.getfixturevalue("postgres_url"), "e2e")

    data_dir = tmp_path / "service"
    generate(["goal/touch-red-cube"], 6, data_dir / "datasets" / "tiny", image_size=32, workers=1, progress=None)
    port, log = _port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = _serve(data_dir, port, log, store_url)
    try:
        admin = Client(url, (data_dir / "admin.key").read_text().strip())
        _, key_a = admin.admin.create_tenant("alpha")
        _, key_b = admin.admin.create_tenant("beta")
        alpha, beta = Client(url, key_a), Client(url, key_b)
        sft = alpha.submit({"name": "sft", "kind": "sft", "head": HEAD, "checkpoint_every": 25,
                            "sft": {"dataset": "tiny", "steps": 400, "batch_size": 8}})
        rl = beta.submit({"name": "rl", "kind": "rl", "head": HEAD, "checkpoint_every": 2,
                          "rl": {"env": {"task": "goal/touch-red-cube", "image_size": 32, "max_steps": 20,
                                         "n_action_steps": 2},
                                 "env_steps": 1600, "n_envs": 2, "sub_batches": 1, "segment_steps": 8}})
        # Mid-job: both have checkpointed, neither has finished.
        _wait_for(lambda: sft.checkpoints() and rl.checkpoints(), 240, "a checkpoint of each job")
        before = {j.id: (j.refresh().state, j.metrics(), len(j.checkpoints())) for j in (sft, rl)}
        assert all(state == "running" for state, _, _ in before.values()), before
        usage_before = alpha.usage()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

        proc = _serve(data_dir, port, log, store_url)
        for job, client in ((sft, alpha), (rl, beta)):
            job = client.job(job.id)
            job.wait(timeout_s=300, progress=False)
            assert job.state == "succeeded", (job.state, job.refresh().error, log.read_text()[-3000:])
            states = [e["state"] for e in job.data["events"]]
            assert states.count("running") >= 2, states  # ran, was resumed, ran again
            assert any("restart" in (e["detail"] or "") for e in job.data["events"]), job.data["events"]
        sft, rl = alpha.job(sft.id), beta.job(rl.id)
        # The work finished where the spec said, from the checkpoint rather than from scratch.
        assert sft.result["sft"]["steps"] == 400
        assert rl.result["rl"]["env_steps"] >= 1600
        for job in (sft, rl):  # every metrics row and checkpoint recorded before the kill is still there
            _, rows, n_ckpt = before[job.id]
            after = job.metrics()
            assert len(job.checkpoints()) >= n_ckpt
            assert after[:len(rows)] == rows
        steps = [r["step"] for r in sft.metrics() if r["phase"] == "sft"]
        assert set(range(1, 401)) <= set(steps)  # every step has its row, across the restart
        # Resumed from its checkpoint, not from scratch: the steps it had checkpointed ran once only.
        checkpointed = max(c["policy_version"] for c in sft.checkpoints() if c["policy_version"] <= 400)
        assert checkpointed >= 25
        assert all(steps.count(s) == 1 for s in range(1, 26)), "the SFT job ran its checkpointed steps again"
        usage_after = alpha.usage()
        assert all(usage_after[t]["head_s"] >= usage_before[t]["head_s"] for t in usage_before)
        # Tenants stay apart across the restart too.
        assert [j.id for j in alpha.jobs()] == [sft.id] and [j.id for j in beta.jobs()] == [rl.id]
    finally:
        from vlamux.api.server import stop

        stop(proc)
