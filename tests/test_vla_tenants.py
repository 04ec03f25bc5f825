"""Imported LeRobot policies as tenants (ModelRunner.import_lerobot): on a runner whose backbone is a
checkpoint's VLM, a tenant's grouped Sample and ForwardBackward equal lerobot's references and the
standalone policy; two tenants of different experts share one backbone object; a checkpoint of
another VLM is refused; an SFT step lowers a tenant's loss and leaves its neighbour byte-identical
(tests/fixtures/lerobot_vla: random-weight tiny checkpoints written by lerobot, see PROVENANCE.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_vla_import import FIX, VLM_DIR, frames, reference
from vlamux.errors import IncompatibleError
from vlamux.model.backbones import BackboneSpec, build_backbone
from vlamux.model.batch import Observation
from vlamux.model.group import ForwardBackward, Sample
from vlamux.model.runner import ModelRunner
from vlamux.model.vla import LeRobotCheckpoint, VLAPolicy

TOL = 1e-4


def runner_for(family: str) -> ModelRunner:
    return ModelRunner(build_backbone(BackboneSpec(kind="lerobot", path=str(FIX / family),
                                                   vlm=str(VLM_DIR[family]))))


def observation(ref: dict, meta: dict, batch: str) -> Observation:
    return Observation(frames(ref, batch), list(meta["tasks"][batch]), ref[f"{batch}.observation.state"])


def other_expert(tmp: Path, family: str = "smolvla", seed: int = 5) -> Path:
    """The fixture with its expert's weights changed (the VLM's untouched): a second tenant's policy."""
    out = tmp / f"{family}_other{seed}"
    shutil.copytree(FIX / family, out)
    tensors = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    vlm = "model.vlm_with_expert.vlm." if family == "smolvla" else "model.paligemma_with_expert.paligemma."
    for k, v in tensors.items():
        if not k.startswith(vlm) and v.is_floating_point():
            tensors[k] = v + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("family", ["smolvla", "pi0", "pi05"])
def test_imported_tenant_equals_lerobot(family):
    ref, meta = reference(family)
    runner = runner_for(family)
    runner.import_lerobot("a", FIX / family)
    # both batches in one call: two requests of one tenant share the VLM forward
    out = runner.execute([Sample("a", observation(ref, meta, b), noise=ref[f"{b}.noise"]) for b in ("batch0", "batch1")])
    for b, r in zip(("batch0", "batch1"), out):
        assert (r.unwrap()["actions"] - ref[f"{b}.action"]).abs().max() <= TOL, (family, b)
    obs = observation(ref, meta, "train")
    [r] = runner.execute([ForwardBackward("a", obs, ref["train.action"], noise=ref["train.noise"],
                                          time=ref["train.time"])])
    assert abs(r.unwrap()["loss"] - ref["train.loss"].item()) <= TOL * max(1.0, ref["train.loss"].item()), family


def test_two_smolvla_tenants_share_one_backbone(tmp_path):
    ref, meta = reference("smolvla")
    other = other_expert(tmp_path)
    runner = runner_for("smolvla")
    a, b = runner.import_lerobot("a", FIX / "smolvla"), runner.import_lerobot("b", other)
    assert len(runner.backbones) == 1 and a.backbone_id == b.backbone_id
    mine = VLAPolicy(other, VLM_DIR["smolvla"])  # the second tenant's own reference: its policy alone
    obs0, obs1 = observation(ref, meta, "batch0"), observation(ref, meta, "batch1")
    want_b = mine.act(obs1.images, obs1.instruction, obs1.state, ref["batch1.noise"])
    for grouped in (True, False):
        ra, rb = runner.execute([Sample("a", obs0, noise=ref["batch0.noise"]),
                                 Sample("b", obs1, noise=ref["batch1.noise"])], grouped=grouped)
        assert (ra.unwrap()["actions"] - ref["batch0.action"]).abs().max() <= TOL
        assert (rb.unwrap()["actions"] - want_b).abs().max() <= TOL
        assert (want_b - ref["batch1.action"]).abs().max() > 1e-3  # the experts do differ
        assert ra.group_size == (2 if grouped else 1)


def test_checkpoint_of_another_vlm_is_refused():
    runner = runner_for("smolvla")
    pi0, smol = (LeRobotCheckpoint.read(FIX / f).vlm_sha256() for f in ("pi0", "smolvla"))
    assert pi0 != smol
    with pytest.raises(IncompatibleError) as e:
        runner.import_lerobot("a", FIX / "pi0")
    assert pi0 in str(e.value) and smol in str(e.value)
    assert "a" not in runner.slots


def test_sft_step_lowers_loss_and_leaves_the_neighbour(tmp_path):
    ref, meta = reference("smolvla")
    runner = runner_for("smolvla")
    a = runner.import_lerobot("a", FIX / "smolvla")
    b = runner.import_lerobot("b", other_expert(tmp_path))
    before_b = {k: v.clone() for k, v in b.policy_tensors().items()}
    obs = observation(ref, meta, "train")
    fixed = {"noise": ref["train.noise"], "time": ref["train.time"]}
    backbone = next(iter(runner.backbones.values()))
    vlm_before = {k: v.clone() for k, v in backbone.state_dict().items()}
    losses = []
    for _ in range(4):
        [ra, rb] = runner.execute([ForwardBackward("a", obs, ref["train.action"], **fixed),
                                   ForwardBackward("b", obs, ref["train.action"], **fixed)])
        losses.append(ra.unwrap()["loss"])
        rb.unwrap()
        runner.optim_step("a").unwrap()  # only a steps; b's gradients are computed and dropped
    assert losses[-1] < losses[0]
    assert a.version == 4 and b.version == 0
    after_b = b.policy_tensors()
    assert all(torch.equal(before_b[k], after_b[k]) for k in before_b)
    assert all(torch.equal(vlm_before[k], v) for k, v in backbone.state_dict().items())


def test_memory_is_one_vlm_plus_each_expert(tmp_path):
    """N imported tenants: one VLM (the runner's one backbone) and N experts with their optimizer state,
    as each slot reports it (what the services' metrics show per tenant)."""
    ref, meta = reference("smolvla")
    runner = runner_for("smolvla")
    slots = [runner.import_lerobot(f"t{i}", other_expert(tmp_path, seed=i)) for i in range(3)]
    obs = observation(ref, meta, "train")
    runner.execute([ForwardBackward(s.tenant, obs, ref["train.action"]) for s in slots])
    for s in slots:
        runner.optim_step(s.tenant).unwrap()
    expert_bytes = meta["n_params"]["expert"] * 4
    for s in slots:
        mem = s.memory_bytes()
        assert mem["head"] == expert_bytes and mem["adapter"] == mem["queries"] == 0
        # AdamW: two moments per parameter, and a step counter per tensor
        n_tensors = len(list(s.head.parameters()))
        assert mem["optimizer"] == 2 * expert_bytes + 4 * n_tensors
    [backbone] = runner.backbones.values()
    assert all(s.backbone_id == backbone.backbone_id for s in slots)
    vlm_bytes = sum(p.numel() * p.element_size() for p in backbone.vlm.parameters())
    assert vlm_bytes <= meta["n_params"]["vlm"] * 4  # one VLM (its tied lm_head is not kept)
    assert backbone.describe()["resident_bytes"] >= vlm_bytes


@pytest.mark.parametrize("family", ["smolvla", "pi05"])
def test_standalone_policy_and_its_lerobot_export(tmp_path, family):
    """vlamux.policy.load of a checkpoint equals lerobot; after an SFT step, save_lerobot writes the
    layout lerobot wrote (same files, keys, shapes, dtypes, JSON) and re-imported acts the same."""
    import vlamux.policy

    ref, meta = reference(family)
    policy = vlamux.policy.load(FIX / family, vlm=VLM_DIR[family])
    obs = {"images": frames(ref, "batch1"), "instructions": meta["tasks"]["batch1"],
           "state": ref["batch1.observation.state"].numpy()}
    got = torch.as_tensor(policy.act(obs, noise=ref["batch1.noise"]))
    assert (got - ref["batch1.action"]).abs().max() <= TOL
    train = observation(ref, meta, "train")
    for _ in range(2):
        policy.runner.execute([ForwardBackward("policy", train, ref["train.action"])])[0].unwrap()
        policy.runner.optim_step("policy").unwrap()
    trained = torch.as_tensor(policy.act(obs, noise=ref["batch1.noise"]))
    assert (trained - got).abs().max() > 1e-4  # the step changed the expert
    out = policy.save_lerobot(tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (FIX / family).iterdir())
    theirs, mine = LeRobotCheckpoint.read(FIX / family), LeRobotCheckpoint.read(out)
    assert {k: (v.shape, v.dtype) for k, v in mine.tensors.items()} == \
        {k: (v.shape, v.dtype) for k, v in theirs.tensors.items()}
    assert mine.metadata.keys() - {"format"} == theirs.metadata.keys() - {"format"}
    assert (mine.config, mine.pre, mine.post) == (theirs.config, theirs.pre, theirs.post)
    assert mine.vlm_sha256() == theirs.vlm_sha256()
    again = VLAPolicy(out, VLM_DIR[family]).act(obs["images"], obs["instructions"], ref["batch1.observation.state"],
                                                ref["batch1.noise"])
    assert (again - trained).abs().max() <= TOL


@pytest.mark.parametrize("family", ["smolvla", "pi0", "pi05"])
def test_fused_experts_equal_one_by_one(tmp_path, family):
    """Three imported tenants' experts as one fused call (stacked parameters, each on its own rows and
    prefix, of different batch sizes) equal the per-tenant calls: samples, training losses and steps.
    π0/π0.5's gradients stop at the expert; SmolVLA's also pass through the shared VLM to each tenant's
    own state projection (its prefix token: the joint backward, with the experts stacked in it)."""
    ref, meta = reference(family)
    ckpts = [FIX / family] + [other_expert(tmp_path, family, seed) for seed in (5, 6)]
    obs = [observation(ref, meta, b) for b in ("batch0", "batch1", "train")]
    runs = {}
    for fuse in (True, False):
        backbone = build_backbone(BackboneSpec(kind="lerobot", path=str(FIX / family), vlm=str(VLM_DIR[family])))
        runner = ModelRunner(backbone, fuse_heads=fuse)
        for i, c in enumerate(ckpts):
            runner.import_lerobot(f"t{i}", c, seed=i)
        samples = runner.execute([Sample(f"t{i}", o) for i, o in enumerate(obs)])
        losses = []
        for _ in range(3):
            out = runner.execute([ForwardBackward(f"t{i}", o, torch.randn(o.batch_size, 50, 7,
                                                                          generator=torch.Generator().manual_seed(i)))
                                  for i, o in enumerate(obs)])
            losses.append([r.unwrap()["loss"] for r in out])
            for i in range(3):
                runner.optim_step(f"t{i}").unwrap()
        weights = [runner.slot(f"t{i}").head.expert.action_out_proj.weight for i in range(3)]
        if family == "smolvla":  # the state projection: its gradient came back through the VLM
            weights += [runner.slot(f"t{i}").head.expert.state_proj.weight for i in range(3)]
            fresh = ModelRunner(backbone).import_lerobot("x", ckpts[0]).head.expert.state_proj.weight
            assert (weights[3] - fresh).abs().max() > 0  # it trained
        runs[fuse] = ([r.unwrap()["actions"] for r in samples], losses, [w.detach().clone() for w in weights],
                      runner.fused.calls if fuse else 0)
    (a_f, l_f, w_f, calls), (a_s, l_s, w_s, _) = runs[True], runs[False]
    assert calls >= 4  # the fused path ran: the samples and each training step
    for x, y in zip(a_f, a_s):
        assert x.shape == y.shape and (x - y).abs().max() <= 1e-5
    for x, y in zip(l_f, l_s):
        assert max(abs(p - q) for p, q in zip(x, y)) <= 1e-5
    for x, y in zip(w_f, w_s):
        assert (x - y).abs().max() <= 1e-5


def test_imported_tenants_on_a_bf16_backbone():
    """The VLM in bfloat16 (a GPU's default; here on the CPU, under the lane's autocast for training):
    actions near fp32's, a training step finite."""
    ref, meta = reference("pi0")
    runner = ModelRunner(build_backbone(BackboneSpec(kind="lerobot", path=str(FIX / "pi0"), vlm=str(VLM_DIR["pi0"])),
                                        dtype=torch.bfloat16))
    runner.import_lerobot("a", FIX / "pi0")
    [r] = runner.execute([Sample("a", observation(ref, meta, "batch1"), noise=ref["batch1.noise"])])
    assert (r.unwrap()["actions"] - ref["batch1.action"]).abs().max() < 0.1  # bf16 prefix, fp32 expert
    [r] = runner.execute([ForwardBackward("a", observation(ref, meta, "train"), ref["train.action"])])
    assert torch.isfinite(torch.tensor(r.unwrap()["loss"]))
    runner.optim_step("a").unwrap()
