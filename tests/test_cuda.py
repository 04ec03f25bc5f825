"""The accelerator path on a GPU: placement, streams, host transfers, the dual pools, fused heads and
the RL and evaluation workflows with the model services on CUDA. Every test here is marked `cuda`:
skipped on a machine without one, run by scripts/device_check.py on the lent GPU."""

import pytest
import torch

from conftest import TENANTS, make_runner, tenant_batches
from vlamux.envs import EnvSpec
from vlamux.model import BackboneSpec, ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, Sample, build_backbone
from vlamux.services.queues import InferenceQueueConfig
from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig
from vlamux.model.synthetic import TaskProfile

pytestmark = pytest.mark.cuda
ENV = EnvSpec(task="goal/touch-red-cube", image_size=16, max_steps=12, n_action_steps=2)
HEAD = HeadSpec("gaussian", action_dim=4, horizon=4, state_dim=8, width=32, depth=1)
PROFILE = TaskProfile({"top": (40, 56)}, 4, 4, 8, "reach the {color} block")


@pytest.fixture(scope="module")
def gpu_backbone():
    return build_backbone(BackboneSpec(preset="tiny", seed=0), device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module")
def runtime():
    rt = EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny"), device="cuda",
                                       inference_queue=InferenceQueueConfig(batch_rows=8, max_wait_s=0.005))).start()
    yield rt
    rt.stop()


def test_auto_places_bf16_backbone_and_fp32_heads_on_cuda(runtime):
    assert runtime.backbone.device.type == "cuda" and runtime.backbone.dtype == torch.bfloat16
    runtime.create_slot("placed", HEAD, OptimizerSpec(lr=1e-4)).result(60)
    slot = runtime.training.runner.slot("placed")
    assert slot.head.step_pos.device.type == "cuda" and slot.head.step_pos.dtype == torch.float32
    assert slot.generator.device.type == "cpu"


def test_each_service_has_its_own_stream(runtime):
    lanes = [runtime.training.runner.lane] + [s.runner.lane for s in runtime.replicas.values()]
    streams = {lane.stream.cuda_stream for lane in lanes} | {lane.copy_stream.cuda_stream for lane in lanes}
    assert len(streams) == 2 * len(lanes)
    assert torch.cuda.default_stream().cuda_stream not in streams


def test_inference_streams_are_scheduled_before_training(runtime):
    """Inference lanes' streams have a higher CUDA priority (a lower number) than training's; the
    training engine's thread keeps its OS priority on CUDA (the stream priority is the mechanism)."""
    import os

    train = runtime.training.runner.lane
    infer = [s.runner.lane for s in runtime.replicas.values()]
    assert all(lane.stream.priority < train.stream.priority for lane in infer)
    assert os.getpriority(os.PRIO_PROCESS, runtime.training._thread.native_id) == os.getpriority(os.PRIO_PROCESS, 0)


def test_outputs_leave_the_services_on_the_host(runtime):
    runtime.create_slot("host", HEAD, OptimizerSpec(lr=1e-4)).result(60)
    assert runtime.publisher.flush(10)
    obs, actions = tenant_batches(batch=2, tenants={"host": (HEAD, PROFILE)})["host"]
    out = runtime.predict("host", obs).result(60)
    assert all(v.device.type == "cpu" for v in out.values() if isinstance(v, torch.Tensor))
    fb = runtime.forward_backward("host", obs, actions).result(60)
    assert isinstance(fb["loss"], float)
    assert isinstance(runtime.optim_step("host").result(60)["grad_norm"], float)


def test_no_device_wide_synchronize_while_serving(gpu_backbone, monkeypatch):
    runner = make_runner(gpu_backbone)
    data = tenant_batches(batch=2)
    runner.execute([Sample(t, obs) for t, (obs, _) in data.items()])  # warm-up

    def refuse(*a, **k):
        raise AssertionError("torch.cuda.synchronize on the hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    for r in runner.execute([Sample(t, obs) for t, (obs, _) in data.items()]
                            + [ForwardBackward(t, obs, act) for t, (obs, act) in data.items()]):
        assert r.ok, r.error
        assert r.head_s > 0 and r.backbone_s > 0  # timed by CUDA events
    for t in TENANTS:
        assert runner.optim_step(t).ok


def test_rollout_inputs_land_in_the_rollout_pool(gpu_backbone):
    runner = make_runner(gpu_backbone)
    if not runner.pools.separate:
        pytest.skip("this torch has no torch.cuda.MemPool")
    data = tenant_batches(batch=16)
    runner.execute([Sample(t, obs) for t, (obs, _) in data.items()])
    stats = runner.pools.stats()
    assert stats["rollout"]["reserved_bytes"] > 0 and stats["model"]["reserved_bytes"] > 0
    assert stats["rollout"]["peak_allocated_bytes"] >= stats["rollout"]["allocated_bytes"]


def test_fused_heads_equal_the_loop_on_cuda_in_fp32(gpu_backbone):
    runner = ModelRunner(gpu_backbone)
    for i in range(6):
        runner.create_slot(f"t{i}", HEAD, OptimizerSpec(lr=1e-3 * (i + 1)), seed=i)
    data = tenant_batches(batch=3, tenants={f"t{i}": (HEAD, PROFILE) for i in range(6)})
    reqs = [Sample(t, obs) for t, (obs, _) in data.items()]
    from vlamux.model import canonicalize

    with torch.no_grad():
        feats = gpu_backbone.forward_group([canonicalize(r.obs, gpu_backbone.schema, gpu_backbone.tokenizer, "cuda")
                                            for r in reqs])
    state = [s.generator.get_state() for s in runner.slots.values()]
    calls = runner.fused.calls
    fused = runner.run_heads(reqs, feats, fuse=True)
    assert runner.fused.calls == calls + 1  # fused, not fallen back to the loop
    for s, st in zip(runner.slots.values(), state):
        s.generator.set_state(st)  # the same draws again
    loop = runner.run_heads(reqs, feats, fuse=False)
    for a, b in zip(fused, loop):
        assert (a.output["actions"] - b.output["actions"]).abs().max() <= 1e-4


def test_a_slot_resumes_on_another_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    a = build_backbone(BackboneSpec(preset="tiny"), device="cuda:0")
    b = build_backbone(BackboneSpec(preset="tiny"), device="cuda:1")
    ra, rb = ModelRunner(a), ModelRunner(b)
    slot = ra.create_slot("x", HEAD)
    slot.save(tmp_path / "x.safetensors")
    other = rb.create_slot("x", HEAD)
    other.load_state(tmp_path / "x.safetensors")
    assert torch.equal(other.generator.get_state(), slot.generator.get_state())


def test_rl_and_evaluation_run_with_the_services_on_cuda(runtime):
    """The workflows turn the services' actions into simulator steps: on CUDA they must not call
    .numpy() on a device tensor (the crash this issue began with)."""
    from vlamux.workflows.evaluate import evaluate
    from vlamux.workflows.rl import RLConfig, RLRun

    runtime.create_slot("rl", HEAD, OptimizerSpec(lr=1e-4)).result(60)
    assert runtime.publisher.flush(10)
    for mode in ("async", "sync"):
        cfg = RLConfig(env=ENV, mode=mode, env_steps=64, n_envs=2, sub_batches=2, segment_steps=4, max_staleness=1,
                       minibatch_rows=4)
        stats = RLRun(runtime, "rl", cfg).run()
        assert stats.env_steps >= 64 and stats.segments_trained >= 1
    assert runtime.publisher.flush(10)
    res = evaluate(runtime, "rl", ENV, [ENV.task], episodes=2, n_envs=2)
    assert res["tasks"][ENV.task]["episodes"] == 2


def test_a_large_builtin_preset_is_built_on_its_gpu(monkeypatch):
    """A preset at or over ON_DEVICE_PARAMS bound for a GPU is drawn there (here the threshold is
    lowered so the tiny preset takes that path): the same weights for the same seed, a digest of its
    recipe (no host copy of the weights), and the CPU's random stream untouched."""
    import vlamux.model.backbones as backbones

    monkeypatch.setattr(backbones, "ON_DEVICE_PARAMS", 0)
    cpu_state = torch.random.get_rng_state()
    a = build_backbone(BackboneSpec(preset="tiny", seed=3), device="cuda", dtype=torch.bfloat16)
    b = build_backbone(BackboneSpec(preset="tiny", seed=3), device="cuda", dtype=torch.bfloat16)
    assert torch.equal(torch.random.get_rng_state(), cpu_state)
    assert a.device.type == "cuda" and a.dtype == torch.bfloat16
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.content_sha256 == b.content_sha256 != build_backbone(BackboneSpec(preset="tiny", seed=3)).content_sha256


def test_a_replica_pages_its_slots_on_cuda_and_answers_as_one_that_does_not(gpu_backbone, monkeypatch):
    """Slots paged between the GPU, pinned host memory and disk by the mover on the lane's page stream,
    beside the groups: six tenants with room for two answer as an unpaged replica does, and nothing on
    the way synchronizes the whole device."""
    from vlamux.services.inference import InferenceModelService
    from vlamux.services.pager import SlotBudget

    trainer = ModelRunner(gpu_backbone)
    for i in range(6):
        trainer.create_slot(f"p{i}", HEAD, OptimizerSpec(), seed=i)
    one = sum(v.numel() * v.element_size() for v in trainer.slot("p0").module_state().values())

    def replica(budget):
        svc = InferenceModelService(gpu_backbone, InferenceQueueConfig(batch_rows=4, max_wait_s=0.002),
                                    slot_budget=budget, group_cap=None)
        for slot in trainer.slots.values():
            svc.stage_policy(slot.export_policy())
        return svc.start()

    paged, free = replica(SlotBudget(resident_bytes=2 * one, parked_bytes=2 * one)), replica(None)

    def refuse(*a, **k):
        raise AssertionError("torch.cuda.synchronize while paging")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    try:
        from vlamux.model.synthetic import make_batch

        g = torch.Generator().manual_seed(0)
        obs = {t: make_batch(PROFILE, 1, g)[0] for t in trainer.slots}
        for turn in range(3):
            for t in sorted(trainer.slots):
                a, b = paged.predict(t, obs[t]).result(60), free.predict(t, obs[t]).result(60)
                assert torch.allclose(a["actions"], b["actions"], atol=1e-5), (turn, t)
        slots = paged.metrics()["slots"]
        assert slots["moves"]["load"] > 0 and slots["moves"]["store"] > 0 and slots["resident"]["count"] <= 2
        parked = next(iter(paged.tiers.parked.values()), None)
        assert parked is None or all(v.is_pinned() for k, v in parked.tensors.items() if k.startswith("head."))
        assert all(s.head.step_pos.device.type == "cuda" for s in paged.runner.slots.values())
    finally:
        paged.stop()
        free.stop()


def test_an_auto_slot_budget_on_a_gpu_is_a_quarter_of_its_free_memory():
    from vlamux.services.pager import AUTO_FRACTION, SlotBudget

    free, _ = torch.cuda.mem_get_info(0)
    got = SlotBudget("auto", parked_bytes=7).placed("cuda:0")
    assert got.parked_bytes == 7 and abs(got.resident_bytes - AUTO_FRACTION * free) <= 0.05 * free
