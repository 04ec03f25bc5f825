"""Every entry point takes --device and --dtype and they reach the model services: each test asks for
bfloat16 (not the CPU's default) and reads the dtype back from what was built, not from the flags.
The benchmarks the device check runs (group_batching, fused_heads, lora_groups, inference_serving,
async_rl, multi_tenant, vla_groups) are checked the same way by its dry run, each in bfloat16
(tests/test_device_check.py)."""

import json
import multiprocessing.util
import sys
import tempfile
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_serve_places_the_services_as_asked(tmp_path):
    from vlamux.api.host import ServiceHost
    from vlamux.cli.server import serve_config

    config = serve_config(tmp_path, "tiny", "cpu", "bfloat16", "cpu", "cpu,cpu", 2, None, None, 8.0, group_cap=None)
    assert config.inference_devices == ("cpu", "cpu") and config.inference_replicas == 2
    host = ServiceHost(config)
    host.start()
    try:
        assert host.runtime.describe_backbones()[0]["group_caps"] == {}  # --group-cap none: nothing timed
        m = host.runtime.metrics()
        assert (m["training"]["device"], m["training"]["dtype"]) == ("cpu", "bfloat16")
        assert [(r["device"], r["dtype"]) for r in m["inference"].values()] == [("cpu", "bfloat16")] * 2
        assert host.runtime.backbone.dtype == torch.bfloat16
        from vlamux.api.prometheus import render

        text = render(host).decode()
        assert 'vlamux_service_placement{device="cpu",dtype="bfloat16",fuse_heads="true",service="training"}' in text
    finally:
        host.stop()


@pytest.mark.parametrize("args, hint", [(["--device", "cuda:7"], "--device"), (["--dtype", "float16"], "--dtype"),
                                        (["--inference-devices", "cpu,quantum"], "--inference-devices"),
                                        (["--group-cap", "sometimes"], "--group-cap")])
def test_serve_refuses_a_placement_this_machine_cannot_run(tmp_path, args, hint):
    from vlamux.cli import main

    res = CliRunner().invoke(main, ["serve", "--data-dir", str(tmp_path), *args])
    assert res.exit_code == 2 and hint in res.output, res.output
    assert not (tmp_path / "store.sqlite").exists()


def test_serve_config_checks_every_role_device():
    from vlamux.cli.server import serve_config

    with pytest.raises(click.BadParameter) as e:
        serve_config(Path("x"), "tiny", "cpu", "auto", "cuda:3", None, 1, None, None, 8.0)
    assert e.value.param_hint == "--training-device" and "cuda:3" in str(e.value)


def test_runtime_places_roles_on_their_devices():
    from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig

    cfg = RuntimeConfig(device="cpu", dtype="bfloat16", inference_devices=("cpu",), inference_replicas=2)
    assert cfg.role_device("training") == "cpu" and cfg.role_device("inference", 1) == "cpu"
    with EmbeddedRuntime(cfg) as rt:
        assert len(rt.replicas) == 2
        assert all(s.backbone is rt.backbone for s in rt.replicas.values())  # one resident copy per device
        assert rt.training.runner.lane.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="cuda"):
        EmbeddedRuntime(RuntimeConfig(training_device="cuda:5"))


def test_ray_runtime_config_names_each_roles_device():
    pytest.importorskip("ray")
    from vlamux.services.ray_runtime import RayRuntimeConfig

    cfg = RayRuntimeConfig(device="auto", training_device="cuda:0", inference_devices=("cuda:1", "cuda:2"))
    assert [cfg.role_device("inference", i) for i in range(3)] == ["cuda:1", "cuda:2", "cuda:1"]
    assert cfg.role_device("training") == "cuda:0"


def test_demo_runs_in_the_chosen_precision(capsys):
    from vlamux import demo

    assert demo.main(["--steps", "2", "--batch", "2", "--timing-steps", "1", "--device", "cpu", "--dtype",
                      "bfloat16"]) == 0
    assert "on cpu (bfloat16)" in capsys.readouterr().out


def test_demo_refuses_a_device_it_cannot_use(capsys):
    from vlamux import demo

    with pytest.raises(SystemExit) as e:
        demo.main(["--device", "cuda:9"])
    assert e.value.code == 2 and "cuda:9" in capsys.readouterr().err


def _private_tempdir(tmp_path, monkeypatch):
    # multiprocessing keeps one directory a process for its sockets, made on first use under the temp
    # dir of that moment and kept: made under this long scratch path, the fork server's socket path
    # would pass the 108-byte limit for every later test in this worker process
    multiprocessing.util.get_temp_dir()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


def test_api_load_benchmark_reads_the_servers_placement(tmp_path, monkeypatch):
    """...and leaves nothing in the temp dir (a full run's server data dir is about 1 GB)."""
    import api_load

    scratch = _private_tempdir(tmp_path, monkeypatch)
    out = tmp_path / "api_load.json"
    api_load.main(["--clients", "1", "--seconds", "1", "--uploads", "1", "--upload-mb", "1", "--watchers", "1",
                   "--device", "cpu", "--dtype", "bfloat16", "--out", str(out)])
    placement = json.loads(out.read_text())["placement"]
    assert placement["training"] == {"device": "cpu", "dtype": "bfloat16"}
    assert not list(scratch.iterdir())


def test_env_throughput_takes_a_render_device_instead():
    """It runs no model (so no --device/--dtype): its device choice is where EGL renders (recorded and
    ignored under OSMesa, as here)."""
    import env_throughput

    spec = env_throughput.BACKENDS["tabletop"]
    assert env_throughput.measure(spec.__class__(task=spec.task, image_size=32), 1, 1, 0.3, render_device=0) > 0


@pytest.mark.serial  # the flooder must reach its rate limit
def test_api_load_noisy_neighbour_reports_both_windows_and_the_flooders_refusals(tmp_path, monkeypatch):
    """A smoke run of `bench/api_load.py --noisy-neighbour` (2 clients, 2 s windows): every field the
    issue names is written and the flooder met the rate limit. Speed is the benchmark's business."""
    import api_load

    scratch = _private_tempdir(tmp_path, monkeypatch)
    out = tmp_path / "api_noisy.json"
    api_load.main(["--noisy-neighbour", "--clients", "2", "--seconds", "4", "--device", "cpu", "--out", str(out)])
    r = json.loads(out.read_text())
    for k in ("ordinary_rps_with", "ordinary_rps_without", "ordinary_p99_ms_with", "ordinary_p99_ms_without",
              "light_p50_ms_with", "light_p50_ms_without", "errors_5xx"):
        assert r[k] is not None, k
    assert r["errors_5xx"] == 0 and r["flooder_answers"].get("429", 0) > 0, r["flooder_answers"]
    assert not list(scratch.iterdir())


def test_many_tenants_benchmark_smoke(tmp_path):
    """A bounded run of `bench/many_tenants.py` on the tiny backbone: 20 and 60 tenants with room for 10
    resident and 20 parked, so slots are parked, stored and read back under load; every figure the
    issue names is written and the resident tier stayed within its budget. Speed is the benchmark's."""
    import many_tenants

    out = tmp_path / "mt.json"
    many_tenants.main(["--backbone", "tiny", "--image-size", "32", "--tenants", "20,60", "--kinds", "heads",
                       "--clients", "6", "--hot-clients", "1", "--resident-slots", "10", "--parked-slots", "20",
                       "--seconds", "1.5", "--rounds", "1", "--think-s", "0", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["partial"] is False and data["done"] == ["heads:20", "heads:60"]
    small, big = data["cells"]
    for cell in data["cells"]:
        assert cell["within_budget"] and cell["max_resident_count"] <= 10, cell
        for key in ("hot_p50_s", "hot_p99_s", "requests_per_s", "hit_rate", "rss_growth_over_formula",
                    "load_wait_p99_over_limit", "hot_p99_over_smallest_n"):
            assert key in cell
        assert cell["limits"]["cold_limit_s"] > 0
    assert sum(big["tiers"][t]["count"] for t in ("resident", "parked", "stored")) == 60
    assert big["tiers"]["stored"]["count"] > 0 and big["moves"]["load"] > 0 and big["hit_rate"] < 1
