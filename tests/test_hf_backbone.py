"""Transformers VLMs as the shared backbone, from local model directories (random weights, made by
`write_random_model`, in the hub's layout): the features are the transformers model's own, grouping
stays invisible, the directory is checked file by file, and nothing reaches the network."""

import json
import shutil
import socket

import pytest
import torch

from vlamux.model import BackboneSpec, ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, Sample, Slot, build_backbone
from vlamux.model.backbones.hf import ModelDirError
from vlamux.model.backbones.hf.random_init import write_random_model
from vlamux.model.feature import TokenType
from vlamux.model.synthetic import TaskProfile, make_batch

pytest.importorskip("transformers")
FAMILIES = ["qwen2_5_vl", "qwen3_vl", "smolvlm", "paligemma"]
TOL = 1e-5
# three tenants: different heads, instruction lengths, camera counts and image sizes
TENANTS = {
    "acme": (HeadSpec("gaussian", 4, 8, 4, width=64), TaskProfile({"top": (64, 64)}, 4, 8, 4, "reach the {color} block")),
    "bolt": (HeadSpec("l1_chunk", 3, 6, 0, width=64),
             TaskProfile({"top": (48, 48), "wrist": (32, 32)}, 3, 6, 0, "please push the {color} cube to the left")),
    "cobalt": (HeadSpec("bins", 5, 4, 2, width=64, options={"n_bins": 16}),
               TaskProfile({"top": (32, 48), "wrist": (64, 64), "side": (32, 32)}, 5, 4, 2, "{color}")),
}


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory):
    return write_random_model(request.param, "tiny", tmp_path_factory.mktemp(request.param) / "model")


@pytest.fixture(scope="module")
def hf(model_dir):
    return build_backbone(BackboneSpec(kind="hf", path=str(model_dir), image_size=56))


def batches(seed=0, rows=2):
    g = torch.Generator().manual_seed(seed)
    return {t: make_batch(p, rows, g) for t, (_, p) in TENANTS.items()}


def runner(backbone, **kw):
    r = ModelRunner(backbone, **kw)
    for i, (t, (spec, _)) in enumerate(TENANTS.items()):
        r.create_slot(t, spec, OptimizerSpec(lr=1e-3), seed=i)
    return r


def test_features_are_the_transformers_models_own(hf):
    """vlamux's features equal a direct forward of the transformers model on `encode(batch)`."""
    obs, _ = batches()["bolt"]
    batch = hf.prepare(obs)
    feature = hf.forward(batch, n_layers=2)
    with torch.no_grad():
        direct = hf.model(**hf.encode([batch]), output_hidden_states=True)
    assert (feature.hidden - direct.last_hidden_state).abs().max() <= TOL
    for mine, theirs in zip(feature.layers, direct.hidden_states[-2:]):
        assert (mine - theirs).abs().max() <= TOL
    assert feature.hidden.shape[-1] == hf.meta.hidden_dim


def test_token_types_name_each_camera_and_the_instruction(hf):
    obs, _ = batches()["bolt"]
    batch = hf.prepare(obs)
    types, ids = batch.token_types[0], batch.rows[0].input_ids
    cams = [t for t in types.unique().tolist() if t >= TokenType.CAMERA]
    assert cams == [TokenType.CAMERA, TokenType.CAMERA + 1]  # top, wrist
    assert (types == TokenType.CAMERA).sum() == (types == TokenType.CAMERA + 1).sum() == hf.tokens_per_camera()
    text = hf.tokenizer.decode(ids[types == TokenType.TEXT])
    assert text.strip() == obs.instruction[0]
    assert (types == TokenType.PROMPT).any()  # the chat template's own tokens


def test_an_absent_camera_costs_no_tokens(hf):
    obs, _ = batches()["bolt"]
    obs.camera_mask = {"wrist": torch.tensor([True, False])}
    batch = hf.prepare(obs)
    assert (batch.token_types[0] == TokenType.CAMERA + 1).any()
    assert not (batch.token_types[1] == TokenType.CAMERA + 1).any()


def test_grouped_equals_serial_on_an_hf_backbone(hf):
    """Three tenants with different heads, instructions and cameras padded into one forward: each gets
    what it gets alone (fp32, 1e-5; the padding is masked and the model's positions ignore it)."""
    grouped, serial = runner(hf), runner(hf)
    for step in range(3):
        data = batches(step)
        reqs = [Sample(t, obs) for t, (obs, _) in data.items()] + \
            [ForwardBackward(t, obs, act) for t, (obs, act) in data.items()]
        a, b = grouped.execute(reqs, grouped=True), serial.execute(reqs, grouped=False)
        for x, y in zip(a, b):
            assert x.ok and y.ok, (x.error, y.error)
            assert x.group_size == len(reqs) and y.group_size == 1
            for k, v in x.output.items():
                if isinstance(v, torch.Tensor):
                    assert (v - y.output[k]).abs().max() <= TOL, (x.tenant, k)
                elif isinstance(v, float):
                    assert abs(v - y.output[k]) <= TOL * max(1.0, abs(v)), (x.tenant, k)
        for t in TENANTS:
            grouped.optim_step(t), serial.optim_step(t)


def test_tenants_share_the_resident_backbone(hf):
    before = {id(p): p.data_ptr() for p in hf.parameters()}
    r = runner(hf)
    for i in range(8):
        r.create_slot(f"more{i}", HeadSpec("gaussian", 4, 8, 4, width=64))
    assert {id(p): p.data_ptr() for p in hf.parameters()} == before  # the backbone was neither copied nor moved
    backbone = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    for s in r.slots.values():  # a slot's memory is its head and optimizer state: none of the backbone's
        own = {t.untyped_storage().data_ptr() for t in [*s.head.parameters(), *s.head.buffers()]}
        assert not own & backbone
        assert sum(p.numel() for p in s.head.parameters()) == sum(
            p.numel() for p in type(s.head)(s.head_spec, hf.meta.hidden_dim).parameters())
    assert all(not p.requires_grad for p in hf.parameters())


def test_a_slot_on_an_hf_backbone_saves_and_resumes_bit_identically(hf, tmp_path):
    r = runner(hf)
    data = batches(5)
    for _ in range(2):
        r.execute([ForwardBackward("acme", *data["acme"])])
        r.optim_step("acme")
    r.slot("acme").save(tmp_path / "acme.safetensors")
    back = Slot.from_file(tmp_path / "acme.safetensors", hf.meta)
    obs = data["acme"][0]
    a = r.execute([Sample("acme", obs)])[0].unwrap()
    other = ModelRunner(hf)
    other.add_slot(back)
    b = other.execute([Sample("acme", obs)])[0].unwrap()
    assert torch.equal(a["actions"], b["actions"]) and a["policy_version"] == b["policy_version"]


def test_a_slot_of_another_backbone_is_refused_naming_both(hf, tmp_path):
    builtin = build_backbone(BackboneSpec(preset="tiny"))
    slot = Slot("acme", TENANTS["acme"][0], builtin.meta)
    slot.save(tmp_path / "s.safetensors")
    mine = Slot("acme", TENANTS["acme"][0], hf.meta)
    with pytest.raises(Exception) as e:
        mine.load_state(tmp_path / "s.safetensors")
    assert builtin.backbone_id in str(e.value) and hf.backbone_id in str(e.value)


def test_the_id_names_the_family_directory_and_content(model_dir, hf, tmp_path):
    assert hf.backbone_id.startswith("hf-") and model_dir.name in hf.backbone_id
    other = write_random_model(hf.family.name, "tiny", tmp_path / "model", seed=1)
    assert build_backbone(BackboneSpec(kind="hf", path=str(other), image_size=56)).backbone_id != hf.backbone_id


def test_loading_never_reaches_the_network(model_dir, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE, an empty cache, and every socket refused: the directory alone suffices."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))

    def refuse(*a, **k):
        raise AssertionError(f"a network connection was attempted: {a}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    bb = build_backbone(BackboneSpec(kind="hf", path=str(model_dir)))
    obs, _ = batches()["acme"]
    assert bb.forward(bb.prepare(obs)).hidden.shape[0] == obs.batch_size


@pytest.mark.parametrize("damage, named", [
    ("config.json", "config.json"), ("model.safetensors", "model.safetensors"), ("tokenizer.json", "tokenizer"),
    ("preprocessor_config.json", "preprocessor_config.json"), ("tokenizer_config.json", "tokenizer_config.json"),
])
@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_a_broken_directory_fails_naming_the_file(model_dir, tmp_path, damage, named, how):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    if how == "missing":
        (broken / damage).unlink()
    else:
        (broken / damage).write_bytes(b"\x00not what it should be" * 10)
    with pytest.raises(ModelDirError) as e:
        build_backbone(BackboneSpec(kind="hf", path=str(broken)))
    assert named in str(e.value), str(e.value)


def test_a_directory_of_another_family_than_asked_is_refused(model_dir):
    from vlamux.model.backbones.hf.directory import open_model_dir

    config = json.loads((model_dir / "config.json").read_text())
    other = "smolvlm" if config["model_type"] != "smolvlm" else "paligemma"
    with pytest.raises(ModelDirError, match="model_type"):
        open_model_dir(model_dir, (other,), other)
    assert config["vlamux_random_weights"] is True  # random directories say so


def test_an_unknown_family_is_refused(model_dir, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(model_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ModelDirError, match="llama"):
        build_backbone(BackboneSpec(kind="hf", path=str(odd)))


def test_layer_choice_and_truncation(model_dir):
    full = build_backbone(BackboneSpec(kind="hf", path=str(model_dir), image_size=56))
    first = build_backbone(BackboneSpec(kind="hf", path=str(model_dir), image_size=56, layer=1))
    cut = build_backbone(BackboneSpec(kind="hf", path=str(model_dir), image_size=56, max_layers=1))
    assert cut.meta.n_layers == 1 and len(cut.family.text_model(cut.model).layers) == 1
    assert len({full.backbone_id, first.backbone_id, cut.backbone_id}) == 3
    obs, _ = batches()["acme"]
    with torch.no_grad():
        states = full.model(**full.encode([full.prepare(obs)]), output_hidden_states=True).hidden_states
    assert (first.forward(first.prepare(obs)).hidden - states[1]).abs().max() <= TOL
    with pytest.raises(ValueError, match="layer"):
        build_backbone(BackboneSpec(kind="hf", path=str(model_dir), layer=99))
