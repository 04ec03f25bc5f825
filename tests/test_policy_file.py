"""A downloaded policy runs with no server (vlamux.policy) and acts as the service does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vlamux.policy
from vlamux.errors import CorruptCheckpointError, IncompatibleError
from vlamux.model import BackboneSpec, HeadSpec, OptimizerSpec
from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig
from vlamux.model.batch import obs_to_observation

HEADS = {
    "gaussian": HeadSpec("gaussian", 4, 4, 8, width=32, depth=1),
    "flow+lora": HeadSpec("flow", 4, 4, 8, width=32, depth=1,
                          adapter={"kind": "lora", "rank": 4, "alpha": 8, "target_modules": ["qkv"]}),
}


def _obs(n=3, seed=0):
    g = np.random.default_rng(seed)
    return {"images": {"agentview": g.integers(0, 255, (n, 3, 32, 32), dtype=np.uint8),
                       "wrist": g.integers(0, 255, (n, 3, 32, 32), dtype=np.uint8)},
            "state": g.standard_normal((n, 8)).astype(np.float32), "instruction": ["touch the red cube"] * n}


@pytest.fixture(scope="module")
def rt():
    runtime = EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny"))).start()
    yield runtime
    runtime.stop()


@pytest.mark.parametrize("kind", list(HEADS))
def test_a_policy_file_acts_as_the_service_does_with_no_server(rt, kind, tmp_path):
    """Trained a few steps through the services, exported, loaded on a backbone built apart: the
    same chunks as the service's replica for the same observations (deterministic), bit for bit."""
    tenant = f"acme-{kind.replace('+', '-')}"
    rt.create_slot(tenant, HEADS[kind], OptimizerSpec(lr=1e-2), seed=3).result(60)
    actions = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(0)) * 2 - 1
    for _ in range(3):
        rt.forward_backward(tenant, obs_to_observation(_obs(seed=1)), actions).result(60)
        rt.optim_step(tenant).result(60)
    assert rt.publisher.flush(10)
    slot = rt.training.runner.slot(tenant)
    path = vlamux.policy.write_policy(slot.export_policy(), rt.training.runner.backbones[slot.backbone_id],
                                      tmp_path / "p.safetensors")
    policy = vlamux.policy.load(path, backbone="tiny")
    obs = _obs()
    served = rt.predict(tenant, obs_to_observation(obs), deterministic=True).result(60)
    np.testing.assert_array_equal(policy.act(obs), served["actions"].numpy())
    assert policy.version == served["policy_version"] == 3
    a, b = policy.act(obs, deterministic=False, seed=5), policy.act(obs, deterministic=False, seed=5)
    np.testing.assert_array_equal(a, b)  # a seeded sampler repeats itself


def test_a_policy_file_refuses_another_backbone_and_damage(rt, tmp_path):
    rt.create_slot("refuser", HEADS["gaussian"], seed=1).result(60)
    slot = rt.training.runner.slot("refuser")
    path = vlamux.policy.write_policy(slot.export_policy(), rt.training.runner.backbones[slot.backbone_id],
                                      tmp_path / "p.safetensors")
    with pytest.raises(IncompatibleError, match=r"builtin-tiny-seed0.*builtin-tiny-seed1"):
        vlamux.policy.load(path, backbone=BackboneSpec(preset="tiny", seed=1))
    raw = bytearray(path.read_bytes())
    raw[-8:] = b"\xff" * 8  # damage the last tensor's bytes
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        vlamux.policy.load(bad, backbone="tiny")


def test_a_policy_downloaded_over_the_api_acts_as_the_service_and_versions_are_kept(tmp_path):
    """Through `vlamux serve` (in-process): a training slot steps, saves (version 2), steps again; the
    live download and the version-2 download each act as the service did at that version; another
    tenant's id answers 404; the CLI writes the same file."""
    from api_server import running_server
    from click.testing import CliRunner

    from vlamux.cli import main
    from vlamux.sdk import Client, NotFoundError

    with running_server(tmp_path / "svc") as (url, admin_key, host):
        admin = Client(url, admin_key)
        _, key = admin.admin.create_tenant("dl", {"requests_per_s": 10000})
        _, other_key = admin.admin.create_tenant("other", {"requests_per_s": 10000})
        c = Client(url, key)
        tc = c.training_client(head={"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}, seed=2)
        wire_obs = {**_obs(), "instructions": _obs()["instruction"]}
        del wire_obs["instruction"]
        acts = (np.random.default_rng(0).uniform(-1, 1, (3, 4, 4))).astype(np.float32)
        for _ in range(2):
            tc.forward_backward(wire_obs, acts)
            tc.optim_step().result(timeout=60)
        tc.save_state().result(timeout=60)
        at_v2 = tc.policy().predict(wire_obs, deterministic=True)
        tc.forward_backward(wire_obs, acts)
        tc.optim_step().result(timeout=60)
        live = tc.policy().predict(wire_obs, deterministic=True)
        assert live["policy_version"] == 3 and not np.array_equal(live["actions"], at_v2["actions"])

        p_live = tc.policy().download(str(tmp_path / "live.safetensors"))
        p_v2 = tc.policy().download(str(tmp_path / "v2.safetensors"), version=2)
        for path, want in ((p_live, live), (p_v2, at_v2)):
            policy = vlamux.policy.load(path, backbone="tiny")
            assert policy.version == want["policy_version"]
            np.testing.assert_array_equal(policy.act(wire_obs), want["actions"])
        with pytest.raises(NotFoundError):
            tc.policy().download(str(tmp_path / "none.safetensors"), version=7)
        with pytest.raises(NotFoundError):
            Client(url, other_key).policy(tc.id).download(str(tmp_path / "theirs.safetensors"))
        assert not (tmp_path / "theirs.safetensors").exists()
        assert not list((tmp_path / "svc").rglob("downloads/*.safetensors"))  # sent, then removed

        env = {"VLAMUX_URL": None, "VLAMUX_API_KEY": None}
        r = CliRunner(env=env).invoke(main, ["--url", url, "--key", key, "policies", "download", tc.id, "--version",
                                             "2", "--out", str(tmp_path / "cli.safetensors")])
        assert r.exit_code == 0 and "wrote" in r.output, r.output
        cli = vlamux.policy.load(tmp_path / "cli.safetensors", backbone="tiny")
        np.testing.assert_array_equal(cli.act(wire_obs), at_v2["actions"])
