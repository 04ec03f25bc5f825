"""Several backbones in one service, an hf one among them: slots and job specs name theirs, requests for
different backbones form different groups, an SFT job on the hf backbone learns, and the API, SDK and
CLI list what the service holds."""

import json
import re

import pytest
import torch
from api_server import running_server
from click.testing import CliRunner

from vlamux.errors import UnknownBackboneError
from vlamux.model import BackboneSpec, HeadSpec, OptimizerSpec
from vlamux.model.backbones.hf.random_init import write_random_model
from vlamux.policy import snapshot_of
from vlamux.services.queues import InferenceQueueConfig
from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig
from vlamux.model.synthetic import TaskProfile, make_batch

pytest.importorskip("transformers")
HEAD = HeadSpec("gaussian", action_dim=4, horizon=4, state_dim=8, width=64, depth=1)
PROFILE = TaskProfile({"agentview": (32, 32), "wrist": (32, 32)}, 4, 4, 8, "touch the {color} cube")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return write_random_model("qwen2_5_vl", "tiny", tmp_path_factory.mktemp("hf") / "qwen-tiny")


OTHER_FAMILIES = ["qwen3_vl", "smolvlm", "paligemma"]


@pytest.fixture(scope="module")
def runtime(qwen_dir, tmp_path_factory):
    others = {f: BackboneSpec(kind="hf", path=str(write_random_model(f, "tiny", tmp_path_factory.mktemp(f) / "m")),
                              image_size=56) for f in OTHER_FAMILIES}
    # uncapped groups: learning five backbones' caps at the start took 20 s (test_calibrate is about them)
    cfg = RuntimeConfig(backbone=BackboneSpec(preset="tiny"), device="cpu",
                        backbones={"qwen": BackboneSpec(kind="hf", path=str(qwen_dir), image_size=56), **others},
                        inference_queue=InferenceQueueConfig(batch_rows=8, max_wait_s=0.005), group_cap=None)
    with EmbeddedRuntime(cfg) as rt:
        yield rt


def test_the_service_lists_its_backbones(runtime, qwen_dir):
    listed = runtime.describe_backbones()
    assert [b["name"] for b in listed] == ["tiny", "qwen", *OTHER_FAMILIES]
    assert listed[0]["default"] and not any(b["default"] for b in listed[1:])
    assert [b["family"] for b in listed[1:]] == ["qwen2_5_vl", *OTHER_FAMILIES]
    hf = listed[1]
    assert hf["kind"] == "hf" and hf["family"] == "qwen2_5_vl" and hf["random_weights"] is True
    assert hf["parameters"] > 0 and hf["resident_bytes"] >= 4 * hf["parameters"] and hf["dtype"] == "float32"
    assert hf["tokens_per_camera"] == 4 and qwen_dir.name in hf["id"]


def test_slots_name_their_backbone_and_groups_keep_apart(runtime):
    runtime.create_slot("on-qwen", HEAD, OptimizerSpec(lr=1e-3), backbone="qwen").result(60)
    runtime.create_slot("on-tiny", HEAD, OptimizerSpec(lr=1e-3)).result(60)
    assert runtime.publisher.flush(10)
    slots = runtime.training.runner.slots
    assert slots["on-qwen"].backbone_id == runtime.backbone_id("qwen")
    assert slots["on-tiny"].backbone_id == runtime.backbone_id("tiny")
    obs, actions = make_batch(PROFILE, 2, torch.Generator().manual_seed(0))
    a = runtime.predict("on-qwen", obs).result(60)
    b = runtime.predict("on-tiny", obs).result(60)
    assert a["actions"].shape == b["actions"].shape == (2, 4, 4)
    runtime.forward_backward("on-qwen", obs, actions).result(60)
    assert runtime.optim_step("on-qwen").result(60)["policy_version"] == 1
    with pytest.raises(UnknownBackboneError, match="qwen"):
        runtime.create_slot("nowhere", HEAD, backbone="llama")


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    from demos import demo_dataset

    data = tmp_path_factory.mktemp("demos") / "tiny"
    demo_dataset(data, 4)
    return data  # read only: every job below samples it


@pytest.mark.parametrize("backbone,query_tokens", [("qwen", 0), ("qwen", 4), *[(f, 0) for f in OTHER_FAMILIES]])
def test_an_sft_job_on_the_hf_backbone_lowers_its_loss(runtime, demos, tmp_path, backbone, query_tokens):
    """On each family, in one service beside the others; also with learned query tokens appended to the
    prompt (and nothing else of the backbone adapted)."""
    from vlamux.jobs import JobSpecError
    from vlamux.jobs.master import MasterService

    data = demos
    master = MasterService(runtime, tmp_path / "jobs")
    tenant = f"hf-sft-{backbone.replace('_', '-')}-q{query_tokens}"
    spec = {"name": tenant, "tenant": tenant, "kind": "sft", "backbone": backbone,
            "head": {"kind": "l1_chunk", "action_dim": 4, "horizon": 4, "state_dim": 8, "width": 64, "depth": 1,
                     "query_tokens": query_tokens},
            "optimizer": {"lr": 1e-3}, "sft": {"dataset": str(data), "steps": 120, "batch_size": 8, "camera_map": {
                "observation.images.agentview": "agentview", "observation.images.wrist": "wrist"}},
            "eval": None, "checkpoint_every": 100}
    job = master.wait(master.submit(spec), 600)
    assert job.state == "succeeded", job.error
    rows = (job.dir / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    losses = [float(r.split(",")[header.index("loss")]) for r in rows[1:]]
    assert sum(losses[-10:]) / 10 < 0.85 * sum(losses[:10]) / 10, losses
    assert tenant not in runtime.training.tenants()  # freed at the job's end: its checkpoint holds it
    snap = snapshot_of(job.dir / "checkpoint.safetensors")
    assert snap.backbone_id == runtime.backbone_id(backbone)
    assert any(k.startswith("queries.") for k in snap.tensors) == bool(query_tokens)
    with pytest.raises(JobSpecError, match="qwen"):
        master.submit({**spec, "name": "x", "tenant": "x", "backbone": "llama"})


def test_api_sdk_and_cli_list_the_backbones_and_slots_pick_one(qwen_dir, tmp_path):
    import vlamux
    from vlamux.cli import main
    from vlamux.sdk.errors import InvalidInputError

    with running_server(tmp_path, device="cpu", extra_backbones=(f"qwen={qwen_dir}",)) as (url, admin, host):
        c = vlamux.Client(url, admin)
        _, key = c.admin.create_tenant("acme")
        acme = vlamux.Client(url, key)
        listed = acme.backbones()
        assert [b["name"] for b in listed] == ["tiny", "qwen"] and listed[1]["family"] == "qwen2_5_vl"
        tc = acme.training_client(head={"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8},
                                  backbone="qwen")
        slot = next(s for k, s in host.runtime.training.runner.slots.items() if k.endswith(tc.info["id"]))
        assert slot.backbone_id == host.runtime.backbone_id("qwen")
        with pytest.raises(InvalidInputError) as e:
            acme.training_client(head={"kind": "gaussian", "action_dim": 4, "horizon": 4}, backbone="llama")
        assert "backbone" in str(e.value) and "qwen" in str(e.value)
        r = CliRunner(env={"VLAMUX_URL": None, "VLAMUX_API_KEY": None}).invoke(main, ["--url", url, "--key", key,
                                                                                     "backbones"])
        assert r.exit_code == 0, r.output
        assert re.search(r"qwen\s+qwen2_5_vl\s+hf-qwen2_5_vl@", r.output) and re.search(r"tiny\s+builtin", r.output)


def test_backbone_init_and_inspect(tmp_path):
    from vlamux.cli import main

    out = tmp_path / "smol"
    r = CliRunner().invoke(main, ["backbone", "init", "--family", "smolvlm", "--size", "tiny", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["vlamux_random_weights"] is True
    r = CliRunner().invoke(main, ["backbone", "inspect", str(out), "--load"])
    assert r.exit_code == 0 and "family: smolvlm" in r.output and "random" in r.output
    assert json.loads(r.output.strip().splitlines()[-1])["tokens_per_camera"] == 4
    r = CliRunner().invoke(main, ["backbone", "init", "--family", "smolvlm", "--out", str(out)])
    assert r.exit_code == 1 and "not empty" in r.output
    r = CliRunner().invoke(main, ["backbone", "inspect", str(tmp_path)])
    assert r.exit_code == 1 and "config.json" in r.output
