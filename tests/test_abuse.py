"""The findings of issue 16 (one tenant must not be able to hurt another, or its own work), each
reproduced against `vlamux serve` started as a subprocess on loopback, and shown fixed."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(600)

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(data_dir: Path, port: int, log: Path):
    from vlamux.api.server import spawn

    return spawn(data_dir, port, log=log.open("a"), env={**os.environ, "OMP_NUM_THREADS": "1"})


def _batch(n=2, seed=0):
    rng = np.random.default_rng(seed)
    obs = {"images": {"agentview": rng.integers(0, 255, (n, 3, 32, 32), dtype=np.uint8)},
           "state": rng.standard_normal((n, 8)).astype(np.float32),
           "instructions": ["touch the red cube"] * n}
    return obs, rng.uniform(-1, 1, (n, 4, 4)).astype(np.float32)


def _nan_into_a_weight(path: Path) -> None:
    """Finding 7's damage: NaN bytes written over one float32 tensor of a safetensors file."""
    import json

    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k, v in header.items() if k.startswith("head.") and isinstance(v, dict) and v["dtype"] == "F32")
    start, end = header[name]["data_offsets"]
    raw[8 + n + start:8 + n + end] = struct.pack("<f", float("nan")) * ((end - start) // 4)
    path.write_bytes(bytes(raw))


def test_damaged_checkpoints_are_refused_and_an_unrestorable_slot_fails_visibly(tmp_path):
    """Finding 7: a checkpoint with NaN bytes written into one tensor loaded as "done" and served NaN
    actions; a truncated slot checkpoint at start-up reset the slot to version 0 and kept serving.
    Now: the first load is refused naming the checksum, the policy keeps its live weights; after a
    restart the truncated slot is failed, says why, and serves nothing."""
    from vlamux.api.server import stop
    from vlamux.sdk import Client, ConflictError, InvalidInputError

    data_dir, port, log = tmp_path / "service", _port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = _serve(data_dir, port, log)
    try:
        admin = Client(url, (data_dir / "admin.key").read_text().strip())
        _, key = admin.admin.create_tenant("acme")
        acme = Client(url, key)
        tc = acme.training_client(head=HEAD, optimizer={"lr": 1e-2}, seed=1, name="kept")
        obs, actions = _batch()
        tc.forward_backward(obs, actions)
        tc.optim_step().result(timeout=60)
        cp = tc.save_state().result(timeout=60)["checkpoint"]
        files = list(data_dir.rglob(f"slots/{tc.id}/*.safetensors"))
        assert len(files) == 1, files
        good = files[0].read_bytes()
        live = tc.policy().predict(obs, deterministic=True)

        _nan_into_a_weight(files[0])
        with pytest.raises(InvalidInputError) as e:
            tc.load_state(cp["id"]).result(timeout=60)
        assert "sha256" in str(e.value) and str(data_dir) not in str(e.value), str(e.value)
        after = tc.policy().predict(obs, deterministic=True)  # nothing was loaded: the same policy acts
        assert np.isfinite(after["actions"]).all() and np.array_equal(after["actions"], live["actions"])
        assert after["policy_version"] == live["policy_version"]

        files[0].write_bytes(good[: len(good) // 2])  # truncated, then the service restarts on it
        stop(proc)
        proc = _serve(data_dir, port, log)
        acme = Client(url, key)
        info = acme.policy(tc.id).info()
        assert info["state"] == "failed" and info["policy_version"] is None, info
        assert "sha256" in info["error"] and str(data_dir) not in info["error"], info  # the store's digest caught it
        assert tc.id in [p["id"] for p in acme.policies()]  # listed, failed, not silently gone
        with pytest.raises(ConflictError, match="failed"):
            acme.policy(tc.id).predict(obs)
        with pytest.raises(ConflictError, match="failed"):
            acme.training_client(policy_id=tc.id).forward_backward(obs, actions)
    finally:
        stop(proc)
