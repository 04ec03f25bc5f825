"""The shared backbone: presets, seeded init, persistence, row independence, padding invariance, tokenizer."""

import pytest
import torch
from safetensors.torch import save_file

from conftest import tenant_batches
from vlamux.model import BackboneSpec, CanonicalBatch, TokenType, build_backbone, canonicalize, load_backbone, save_backbone
from vlamux.model.feature import token_index
from vlamux.model.tokenizer import BOS, EOS, PAD, ByteTokenizer

TOL = 1e-5


def canonical(backbone, batch=3, seed=0, tenant="delta", instruction=None) -> CanonicalBatch:
    obs, _ = tenant_batches(batch=batch, seed=seed)[tenant]
    if instruction is not None:
        obs.instruction = instruction
    return canonicalize(obs, backbone.schema, backbone.tokenizer)


def rows(batch: CanonicalBatch, idx: slice) -> CanonicalBatch:
    return CanonicalBatch(batch.pixels[idx], batch.camera_mask[idx], batch.tokens[idx], batch.token_mask[idx])


# ---- presets and init ---------------------------------------------------------------------------

@pytest.mark.parametrize("preset, low, high", [("tiny", 0.5e6, 1.5e6), ("small", 15e6, 25e6), ("base", 80e6, 100e6)])
def test_preset_parameter_counts(preset, low, high):
    b = build_backbone(BackboneSpec(preset=preset))
    assert low <= b.num_parameters() <= high, (preset, b.num_parameters())
    assert b.meta.hidden_dim == b.config.dim and b.meta.n_layers == b.config.depth


def test_same_spec_builds_identical_weights_and_other_seed_differs():
    a = build_backbone(BackboneSpec(preset="tiny", seed=3)).state_dict()
    b = build_backbone(BackboneSpec(preset="tiny", seed=3)).state_dict()
    c = build_backbone(BackboneSpec(preset="tiny", seed=4)).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_building_does_not_disturb_global_rng():
    torch.manual_seed(1234)
    reference = torch.rand(16)
    torch.manual_seed(1234)
    build_backbone(BackboneSpec(preset="tiny", seed=9))
    assert torch.equal(torch.rand(16), reference)


# ---- persistence --------------------------------------------------------------------------------

def test_save_load_round_trip(backbone, tmp_path):
    path = tmp_path / "bb.safetensors"
    save_backbone(backbone, path)
    loaded = load_backbone(path)
    assert loaded.backbone_id == backbone.backbone_id and loaded.config == backbone.config
    sa, sb = backbone.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training
    batch = canonical(backbone)
    with torch.no_grad():
        fa, fb = backbone(batch, n_layers=2), loaded(batch, n_layers=2)
    assert torch.equal(fa.hidden, fb.hidden) and all(torch.equal(x, y) for x, y in zip(fa.layers, fb.layers))
    # loading through a spec gives the same weights
    via_spec = build_backbone(BackboneSpec(weights=str(path)))
    assert all(torch.equal(v, via_spec.state_dict()[k]) for k, v in sa.items())


def test_load_rejects_foreign_safetensors(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not a vlamux backbone"):
        load_backbone(path)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_backbone(tmp_path / "nope.safetensors")


# ---- row independence and padding ---------------------------------------------------------------

def test_row_features_do_not_depend_on_batch_partners(backbone):
    batch = canonical(backbone, batch=4)
    with torch.no_grad():
        full = backbone(batch, n_layers=backbone.config.depth)
        for i in range(batch.batch_size):
            alone = backbone(rows(batch, slice(i, i + 1)), n_layers=backbone.config.depth)
            assert (alone.hidden - full.hidden[i:i + 1]).abs().max() <= TOL
            for la, lf in zip(alone.layers, full.layers):
                assert (la - lf[i:i + 1]).abs().max() <= TOL


def test_padding_text_and_absent_camera_do_not_change_real_tokens(backbone):
    # 2 cameras; instructions of different lengths so rows carry their own text padding too
    batch = canonical(backbone, batch=3, tenant="bolt", instruction=["go left", "pick up the red block", "x"])
    k, t = batch.n_cameras, batch.text_len
    extra_t = 5
    assert t + extra_t <= backbone.config.max_text_tokens and k < backbone.config.max_cameras
    b = batch.batch_size
    padded = CanonicalBatch(
        pixels=torch.cat([batch.pixels, torch.zeros_like(batch.pixels[:, :1])], dim=1),
        camera_mask=torch.cat([batch.camera_mask, torch.zeros(b, 1, dtype=torch.bool)], dim=1),
        tokens=torch.cat([batch.tokens, torch.zeros(b, extra_t, dtype=torch.long)], dim=1),
        token_mask=torch.cat([batch.token_mask, torch.zeros(b, extra_t, dtype=torch.bool)], dim=1),
    )
    depth = backbone.config.depth
    with torch.no_grad():
        plain = backbone(batch, n_layers=depth)
        wide = backbone(padded, n_layers=depth)
    m = backbone.meta
    index = token_index(m.n_query, m.patches_per_camera, k, t, k + 1)
    assert wide.seq_len == plain.seq_len + m.patches_per_camera + extra_t
    trimmed = wide.select(slice(None), index)
    assert torch.equal(trimmed.mask, plain.mask) and torch.equal(trimmed.token_type, plain.token_type)
    real = plain.mask  # padded positions of `plain` itself (shorter instructions) are not compared
    assert (trimmed.hidden - plain.hidden)[real].abs().max() <= TOL
    for lw, lp in zip(trimmed.layers, plain.layers):
        assert (lw - lp)[real].abs().max() <= TOL


# ---- frozen module and forward contract ---------------------------------------------------------

def test_frozen_and_layers(backbone):
    assert not backbone.training
    assert not any(p.requires_grad for p in backbone.parameters())
    batch = canonical(backbone, batch=2)
    depth = backbone.config.depth
    with torch.no_grad():
        for k in (0, 1, depth):
            f = backbone(batch, n_layers=k)
            assert len(f.layers) == k
            assert all(x.shape == f.hidden.shape == (2, f.seq_len, backbone.config.dim) for x in f.layers)
            assert not f.hidden.requires_grad
        f = backbone(batch, n_layers=depth)
        # the last returned layer is the final block's output (before the final norm)
        assert torch.allclose(backbone.norm(f.layers[-1]), f.hidden, atol=TOL)
        for bad in (-1, depth + 1):
            with pytest.raises(ValueError, match="n_layers"):
                backbone(batch, n_layers=bad)


def test_unavailable_and_unknown_backbones():
    with pytest.raises(ValueError, match="hf.*path"):  # an hf backbone is a directory (tests/test_hf_backbone.py)
        build_backbone(BackboneSpec(kind="hf"))
    with pytest.raises(ValueError, match="'huge'"):
        build_backbone(BackboneSpec(preset="huge"))
    with pytest.raises(ValueError, match="'onnx'"):
        build_backbone(BackboneSpec(kind="onnx"))


def test_feature_fields(backbone):
    batch = canonical(backbone, batch=2, tenant="delta")  # 3 cameras
    batch.camera_mask[1, 2] = False  # row 1 lacks its third camera
    with torch.no_grad():
        f = backbone(batch)
    m = backbone.meta
    p, nq, k, t = m.patches_per_camera, m.n_query, batch.n_cameras, batch.text_len
    assert f.mask.dtype == torch.bool and f.token_type.dtype == torch.int64
    assert f.hidden.shape == (2, nq + k * p + t, m.hidden_dim)
    assert f.mask.shape == f.token_type.shape == (2, f.seq_len)
    for row in range(2):
        tt = f.token_type[row]
        assert (tt[:nq] == TokenType.QUERY).all()
        for cam in range(k):
            assert (tt[nq + cam * p: nq + (cam + 1) * p] == TokenType.CAMERA + cam).all()
        assert (tt[nq + k * p:] == TokenType.TEXT).all()
    assert f.mask[:, :nq].all()
    assert f.mask[0, nq:nq + k * p].all()
    assert not f.mask[1, nq + 2 * p: nq + 3 * p].any() and f.mask[1, nq: nq + 2 * p].all()
    assert torch.equal(f.mask[:, nq + k * p:], batch.token_mask)


# ---- tokenizer ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "reach the red block", "grüne Kugel greifen", "拿起红色的方块 🤖"])
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer(128)
    ids = tok.encode(text)
    assert ids[0] == BOS and ids[-1] == EOS and len(ids) == len(text.encode("utf-8")) + 2
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_truncates_long_text():
    tok = ByteTokenizer(10)
    ids = tok.encode("a" * 100)
    assert len(ids) == 10 and ids[0] == BOS and ids[-1] == EOS
    assert tok.decode(ids) == "a" * 8
    with pytest.raises(ValueError):
        ByteTokenizer(2)


def test_tokenizer_batch_pads_and_masks():
    tok = ByteTokenizer(16)
    ids, mask = tok(["ab", "abcdef", "x" * 40])
    assert ids.shape == mask.shape == (3, 16) and ids.dtype == torch.long and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [4, 8, 16]
    assert (ids[~mask] == PAD).all()
    assert ids[0, :4].tolist() == tok.encode("ab") and ids[1, :8].tolist() == tok.encode("abcdef")
    assert ids[2, -1] == EOS


def test_the_shipped_pretrained_backbone_loads_by_name():
    from vlamux.model import BackboneSpec, build_backbone
    from vlamux.model.backbones import PRESETS, SHIPPED

    assert SHIPPED["tiny-tabletop"].is_file(), "the pretrained weights ship with the package"
    shipped = build_backbone(BackboneSpec(preset="tiny", weights="tiny-tabletop"))
    random = build_backbone(BackboneSpec(preset="tiny"))
    assert shipped.config == PRESETS["tiny"]
    # trained, not the seeded initialisation
    a, b = dict(shipped.named_parameters()), dict(random.named_parameters())
    assert set(a) == set(b) and any((a[k] - b[k]).abs().max() > 1e-3 for k in a)
    assert all(not p.requires_grad for p in shipped.parameters())  # frozen, like every backbone
