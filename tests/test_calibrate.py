"""A group size learned from the hardware (vlamux.model.calibrate): the cap follows the measured
curve, the runner splits groups at it without changing anyone's outputs, and the services measure
it at start, show it (describe_backbones, /metrics) and measure again on request."""

from __future__ import annotations

import pytest
import torch

from vlamux.model import BackboneSpec, HeadSpec, ModelRunner, OptimizerSpec, Sample, build_backbone
from vlamux.model.calibrate import GroupCurve, choose_cap, measure, measured
from vlamux.model.synthetic import TaskProfile, make_batch


@pytest.mark.parametrize("seconds, budget, cap", [
    ([0.040, 0.050, 0.070, 0.120, 0.300], None, 8),  # per-call overhead amortised up to 8 rows, then caches spill
    ([0.010, 0.020, 0.040, 0.080], None, 8),  # time in proportion to rows: grouping saves nothing, costs nothing
    ([0.010, 0.020, 0.045, 0.100], None, 2),  # rows cost more past 2: stop there
    ([0.010, 0.011, 0.012, 0.013, 0.014], None, 16),  # overhead everywhere: the biggest measured
    ([0.040, 0.050, 0.070, 0.120, 0.230], 0.1, 4),  # the latency budget binds first
    ([0.010, 0.0199, 0.0397, 0.0830], None, 4),  # 8 rows cost 4% more a row than 4
])
def test_the_cap_follows_the_curve(seconds, budget, cap):
    rows = [2 ** i for i in range(len(seconds))]
    got, why = choose_cap(rows, seconds, budget)
    assert got == cap, why
    assert f"{cap} rows" in why and (budget is None or "budget" in why or cap == rows[-1])


def test_measuring_stops_once_bigger_groups_stop_paying():
    class Lane:  # a fake clock: a forward of r rows "takes" 1 + max(0, r - 4) ms
        t = 0.0

        def mark(self):
            return self.t

        def seconds(self, start, end):
            return end - start

    lane = Lane()

    class Backbone:
        schema = type("S", (), {"image_size": 32})()
        backbone_id = "fake"

        def prepare(self, obs):
            return obs

        def forward_group(self, batches):
            lane.t += 1e-3 * (1.0 + max(0, len(batches) - 4))  # a group of one-row requests

    rows, seconds = measure(Backbone(), lane, max_rows=256, repeats=1)
    assert rows[-1] < 256 and choose_cap(rows, seconds)[0] == 4  # the per-row cost is lowest at 4 rows


def test_a_second_start_takes_the_curve_this_process_measured_and_a_request_measures_again():
    """The probe costs seconds; a runner started again on an equal backbone (a rebuilt one, the same
    device, precision and cores) takes the curve as it is, one with another budget or precision measures
    its own, and calibrate(force=True) always measures."""
    from vlamux.model.device import Lane

    spec = BackboneSpec(preset="tiny", seed=7)
    first = ModelRunner(build_backbone(spec)).calibrate(0.05, force=False, max_rows=4)
    bid = build_backbone(spec).backbone_id
    again = ModelRunner(build_backbone(spec)).calibrate(0.05, force=False, max_rows=4)
    assert again[bid] is first[bid]
    other_budget = ModelRunner(build_backbone(spec)).calibrate(0.04, force=False, max_rows=4)
    assert other_budget[bid] is not first[bid] and other_budget[bid].budget_s == 0.04
    autocast = ModelRunner(build_backbone(spec))
    autocast.lane = Lane("cpu", torch.bfloat16)
    assert autocast.calibrate(0.05, force=False, max_rows=4)[bid] is not first[bid]
    forced = ModelRunner(build_backbone(spec)).calibrate(0.05, force=True, max_rows=4)
    assert forced[bid] is not first[bid] and forced[bid].rows == [1, 2, 4]
    probed = ModelRunner(build_backbone(spec)).calibrate(0.03, force=True)[bid]  # the default extent
    assert measured(build_backbone(spec), 0.03) is probed and measured(build_backbone(spec), 0.02) is None


def test_the_runner_splits_groups_at_the_cap_and_outputs_stay_the_same():
    backbone = build_backbone(BackboneSpec(preset="tiny"))
    capped, free = ModelRunner(backbone), ModelRunner(backbone)
    capped.group_curves[backbone.backbone_id] = GroupCurve(backbone.backbone_id, [1, 2], [0.01, 0.01], cap=2)
    g = torch.Generator().manual_seed(0)
    profile = TaskProfile({"agentview": (32, 32)}, 4, 4, 8, "touch the {color} cube")
    reqs = []
    for i in range(4):
        for r in (capped, free):
            r.create_slot(f"t{i}", HeadSpec("l1_chunk", 4, 4, 8, width=32, depth=1), OptimizerSpec(), seed=i)
        reqs.append(Sample(f"t{i}", make_batch(profile, 1, g)[0], deterministic=True))
    a, b = capped.execute(reqs), free.execute(reqs)
    assert [r.group_size for r in a] == [2, 2, 2, 2] and [r.group_size for r in b] == [4, 4, 4, 4]
    for x, y in zip(a, b):
        assert (x.unwrap()["actions"] - y.unwrap()["actions"]).abs().max() <= 1e-5
    capped.max_group_rows = 1  # a configured cap below the learned one wins
    assert [r.group_size for r in capped.execute(reqs)] == [1, 1, 1, 1]


def test_services_learn_their_cap_at_start_show_it_and_measure_again_on_request():
    from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig

    with EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny"), group_budget_s=5.0)) as rt:
        caps = rt.describe_backbones()[0]["group_caps"]
        assert set(caps) == {"training", "inference-0"}
        for c in caps.values():
            rows = [r for r, _ in c["curve"]]
            assert rows == sorted(rows) and rows[0] == 1 and c["rows"] in rows and c["budget_s"] == 5.0
        assert rt.metrics()["training"]["group_caps"]
        again = rt.calibrate()
        assert set(again) == {"training", "inference-0"}
    with EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny"), group_cap=None)) as rt:
        assert rt.describe_backbones()[0]["group_caps"] == {}


def test_the_api_and_cli_show_the_cap_and_the_admin_can_measure_again(tmp_path):
    import httpx
    from api_server import running_server
    from click.testing import CliRunner

    from vlamux.cli import main
    from vlamux.sdk import Client

    with running_server(tmp_path / "svc", group_cap="learned") as (url, admin_key, host):
        _, key = Client(url, admin_key).admin.create_tenant("caps")
        listed = httpx.get(f"{url}/v1/backbones", headers={"Authorization": f"Bearer {key}"}).json()["backbones"]
        cap = listed[0]["group_caps"]["training"]["rows"]
        assert isinstance(cap, int) and cap >= 1
        metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {admin_key}"}).text
        assert "vlamux_group_cap_rows{" in metrics and "vlamux_backbone_forward_seconds{" in metrics
        assert httpx.post(f"{url}/v1/backbones/calibrate", headers={"Authorization": f"Bearer {key}"}).status_code == 403
        r = httpx.post(f"{url}/v1/backbones/calibrate", headers={"Authorization": f"Bearer {admin_key}"}, timeout=120)
        assert r.status_code == 200 and set(r.json()["group_caps"]) >= {"training"}
        out = CliRunner(env={"VLAMUX_URL": None, "VLAMUX_API_KEY": None}).invoke(
            main, ["--url", url, "--key", key, "backbones"])
        assert out.exit_code == 0 and "GROUP_CAP" in out.output, out.output
