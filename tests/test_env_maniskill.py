"""ManiSkill3: runs where SAPIEN finds a Vulkan device; elsewhere it must say why, clearly, up front."""

import pytest

pytest.importorskip("mani_skill")

from vlamux.envs.maniskill import ManiSkillEnv, ManiSkillUnavailable, render_device  # noqa: E402


def _available() -> bool:
    try:
        render_device()
        return True
    except ManiSkillUnavailable:
        return False


def test_tasks_needing_downloads_are_refused_without_trying():
    with pytest.raises(ManiSkillUnavailable, match="needs downloaded assets"):
        ManiSkillEnv("PickSingleYCB-v1")


@pytest.mark.skipif(_available(), reason="this machine can render ManiSkill")
def test_unavailable_renderer_is_reported_clearly():
    with pytest.raises(ManiSkillUnavailable, match="Vulkan"):
        ManiSkillEnv("PushCube-v1")


@pytest.mark.skipif(not _available(), reason="no Vulkan device SAPIEN supports on this machine")
def test_smoke_render_steps():
    env = ManiSkillEnv("PushCube-v1", image_size=64)
    obs, _ = env.reset(seed=0)
    for _ in range(10):
        obs, _, _, _, info = env.step(env.action_space.sample())
    assert obs["images"]["agentview"].shape == (3, 64, 64) and obs["images"]["agentview"].std() > 1
    assert isinstance(info["is_success"], bool)
    env.close()
