"""A downloaded policy runs with no server (vlamux.policy) and acts as the service does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vlamux.policy
from vlamux.errors import CorruptCheckpointError, IncompatibleError
from vlamux.model import BackboneSpec, HeadSpec, OptimizerSpec
from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig
from vlamux.services.environment import obs_to_observation

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
