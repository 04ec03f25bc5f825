"""End to end: `vlamux serve` as a real subprocess, two tenants, an SFT job and an RL job through
the SDK; the server is killed (SIGKILL, mid-job) and started again on the same data directory; both
jobs finish from their checkpoints, and nothing recorded before the kill is lost: every metrics row
up to a job's checkpoint stays as it was, each step has one row (the steps run again since the
checkpoint replace theirs), and usage metered until half a second before the kill is on record.
Once with the store in SQLite (the default), once on a real PostgreSQL server (tests/postgres.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_until

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}
# Long enough that neither job ends before the kill (measured alone: SFT at step 35, RL at 304 env steps
# when it comes) and short enough that the rest, after the restart, takes seconds
SFT_STEPS, RL_ENV_STEPS = 150, 800


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(data_dir: Path, port: int, log: Path, store_url: str | None = None) -> subprocess.Popen:
    from api_server import spawn

    extra = ("--store-url", store_url) if store_url else ()
    return spawn(data_dir, port, log=log.open("a"), env={**os.environ, "OMP_NUM_THREADS": "1"}, extra_args=extra)


def _wait_for(cond, timeout_s: float, what: str):
    return wait_until(cond, timeout_s, what, every_s=0.5)


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_jobs_survive_a_killed_server(tmp_path, request, store):
    from demos import demo_dataset
    from vlamux.sdk import Client

    store_url = None
    if store == "postgresql":
        from postgres import fresh_database

        store_url = fresh_database(request.getfixturevalue("postgres_url"), "e2e")

    data_dir = tmp_path / "service"
    demo_dataset(data_dir / "datasets" / "tiny", 6)
    port, log = _port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = _serve(data_dir, port, log, store_url)
    try:
        admin = Client(url, (data_dir / "admin.key").read_text().strip())
        _, key_a = admin.admin.create_tenant("alpha")
        _, key_b = admin.admin.create_tenant("beta")
        alpha, beta = Client(url, key_a), Client(url, key_b)
        sft = alpha.submit({"name": "sft", "kind": "sft", "head": HEAD, "checkpoint_every": 25,
                            "sft": {"dataset": "tiny", "steps": SFT_STEPS, "batch_size": 8}})
        rl = beta.submit({"name": "rl", "kind": "rl", "head": HEAD, "checkpoint_every": 2,
                          "rl": {"env": {"task": "goal/touch-red-cube", "image_size": 32, "max_steps": 20,
                                         "n_action_steps": 2},
                                 "env_steps": RL_ENV_STEPS, "n_envs": 2, "sub_batches": 1, "segment_steps": 8}})
        # Mid-job: both have checkpointed, neither has finished.
        _wait_for(lambda: sft.checkpoints() and rl.checkpoints(), 240, "a checkpoint of each job")
        # alpha also steps a simulator by hand: each answered step is usage the service has metered
        acked, stop_stepping = [], threading.Event()

        def step_env() -> None:
            env = alpha.env_session({"task": "goal/touch-red-cube", "image_size": 32}, n_envs=1)
            env.reset(seed=0)
            try:
                while not stop_stepping.is_set():  # one simulator step a call: one env step of usage
                    out = env.step(np.zeros((1, 4), dtype=np.float32))
                    acked.append(time.monotonic())
                    if out["terminated"][0] or out["truncated"][0]:
                        env.reset()
            except Exception:  # noqa: BLE001 - the server was killed under it: what it acked is counted
                pass

        stepper = threading.Thread(target=step_env, daemon=True)
        stepper.start()
        _wait_for(lambda: len(acked) >= 20, 60, "env steps")
        time.sleep(1.0)
        before = {j.id: (j.refresh().state, j.metrics(), j.checkpoints()) for j in (sft, rl)}
        assert all(state == "running" for state, _, _ in before.values()), before
        usage_before = alpha.usage()
        killed_at = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        stop_stepping.set()
        stepper.join(30)
        steps_acked = sum(1 for t in acked if t <= killed_at - 0.5)

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
        assert sft.result["sft"]["steps"] == SFT_STEPS
        assert rl.result["rl"]["env_steps"] >= RL_ENV_STEPS
        for job in (sft, rl):  # every checkpoint recorded before the kill is still there
            assert len(job.checkpoints()) >= len(before[job.id][2])
        # the SFT rows up to its last checkpoint before the kill are as they were; each step has one row
        _, rows, ckpts = before[sft.id]
        kept = [r for r in rows if r["step"] <= max(c["policy_version"] for c in ckpts)]
        assert kept and sft.metrics()[:len(kept)] == kept
        steps = [r["step"] for r in sft.metrics() if r["phase"] == "sft"]
        assert steps == list(range(1, SFT_STEPS + 1)), "a step without its row, or with two"
        updates = [r["step"] for r in rl.metrics() if r["phase"] == "rl"]
        assert updates == list(range(1, len(updates) + 1)), updates  # one row per RL update, across the restart
        # Resumed from its checkpoint, not from scratch.
        checkpointed = max(c["policy_version"] for c in sft.checkpoints() if c["policy_version"] <= SFT_STEPS)
        assert checkpointed >= 25
        # usage: at most the last half second before the kill may be missing
        recorded = alpha.usage()[next(iter(usage_before))]["env_steps"]
        assert recorded >= steps_acked, (recorded, steps_acked, len(acked))
        usage_after = alpha.usage()
        assert all(usage_after[t]["head_s"] >= usage_before[t]["head_s"] for t in usage_before)
        # Tenants stay apart across the restart too.
        assert [j.id for j in alpha.jobs()] == [sft.id] and [j.id for j in beta.jobs()] == [rl.id]
    finally:
        from vlamux.sdk.process import stop

        stop(proc)
