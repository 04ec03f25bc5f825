import os
import time

import pytest
import torch

from vlamux.model import BackboneSpec, HeadSpec, ModelRunner, OptimizerSpec, build_backbone
from vlamux.model.synthetic import TaskProfile, make_batch

# The servers the tests start (`vlamux serve` children, tests/api_server.py's in-process ones) skip the
# group-cap calibration at start, a second or two of timed forwards a service: only the tests about the
# caps ask for it (test_calibrate), and the suite starts dozens of servers.
os.environ.setdefault("VLAMUX_GROUP_CAP", "none")

# Four tenants that differ in head, action/state dims, horizon, camera count, image size and phrasing.
TENANTS = {
    "acme": (HeadSpec("l1_chunk", 4, 8, 4), TaskProfile({"top": (64, 64)}, 4, 8, 4, "reach the {color} block")),
    "bolt": (HeadSpec("flow", 3, 6, 0, options={"steps": 4}),
             TaskProfile({"top": (48, 48), "wrist": (32, 32)}, 3, 6, 0,
                         "please move the arm over to the {color} block, slowly")),
    "cobalt": (HeadSpec("gaussian", 4, 8, 4), TaskProfile({"top": (40, 56)}, 4, 8, 4, "{color}")),
    "delta": (HeadSpec("bins", 5, 4, 2, options={"n_bins": 32}),
              TaskProfile({"top": (32, 32), "wrist": (64, 64), "side": (32, 48)}, 5, 4, 2, "go {color}")),
}


# How `make test` spreads the files over its workers (--dist loadgroup --no-loadscope-reorder): each
# file is one group, so its module fixtures are built once; the files that start a Ray instance share
# one group (one instance at a time, on one worker); the two stores' end-to-end runs are a group each.
# Groups go out in this order, the longest first (worker-seconds measured in a run of the suite,
# docs/plans/suite-speed.md), so that no long file starts last while the other worker idles; the rest
# follow in collection order.
LONGEST_FIRST = ("test_device_check", "ray", "test_main_job", "test_e2e_service[postgresql]", "test_e2e_service[sqlite]",
                 "test_hf_services", "test_entry_points", "test_api", "test_abuse", "test_dashboard",
                 "test_env_libero", "test_lora", "test_workflows", "test_e2e_tenant_data", "test_fused",
                 "test_calibrate", "test_served_isolation", "test_job_events", "test_dataset_paths",
                 "test_lane_isolation", "test_e2e_lerobot")
RAY_FILES = ("test_ray_runtime", "test_api_ray")


def _group(item) -> str:
    stem = item.path.stem
    if stem in RAY_FILES:
        return "ray"
    if stem == "test_e2e_service":
        return f"{stem}[{item.callspec.id}]"
    return stem


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: a file keeps its own order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (scripts/device_check.py runs these on a GPU)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_node_collection_finished(node, ids):
    """Under --dist loadgroup every id a worker collected must carry its group, or each test is a group
    of its own and module fixtures are built on both workers, silently (pytest 9.2 with pytest-xdist 3.8)."""
    if node.config.getoption("dist") == "loadgroup" and any("@" not in i for i in ids):
        pytest.exit(f"pytest {pytest.__version__} lost pytest-xdist's group suffix from the node ids (--dist "
                    "loadgroup would not group the tests); see the pin on pytest in pyproject.toml", returncode=4)


@pytest.fixture(scope="session")
def backbone():
    return build_backbone(BackboneSpec(preset="tiny", seed=0))


@pytest.fixture(scope="module")
def runtime():
    """An embedded runtime of the tiny backbone for one test module (a module defining its own
    `runtime` fixture uses that one)."""
    from vlamux.services.queues import InferenceQueueConfig
    from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig

    rt = EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny"),
                                       inference_queue=InferenceQueueConfig(batch_rows=8, max_wait_s=0.005))).start()
    yield rt
    rt.stop()


def make_runner(backbone, tenants=TENANTS, lr=1e-3, **kw) -> ModelRunner:
    runner = ModelRunner(backbone, **kw)
    for i, (name, (spec, _)) in enumerate(tenants.items()):
        runner.create_slot(name, spec, OptimizerSpec(lr=lr), seed=100 + i)
    return runner


def tenant_batches(batch=3, seed=0, tenants=TENANTS):
    g = torch.Generator().manual_seed(seed)
    return {name: make_batch(profile, batch, g) for name, (_, profile) in tenants.items()}


def snapshot(slot) -> dict:
    """Every tensor of a slot's state, copied, for byte-identity checks."""
    tensors, meta = slot.state_tensors()
    return {k: v.clone() for k, v in tensors.items()}


def same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def chunks_while_training(predict, train_step, steps: int, settle) -> list[dict]:
    """Action chunks requested in a loop from another thread while `train_step` runs `steps` times;
    `settle()` waits for the last version to reach the replicas."""
    import threading

    seen, stop = [], threading.Event()

    def client():
        while not stop.is_set():
            seen.append(predict())

    th = threading.Thread(target=client)
    th.start()
    for _ in range(steps):
        train_step()
    settle()
    stop.set()
    th.join()
    return seen


def light_latency_alone_and_flooded(predict_light, submit_flood, batch_rows: int, in_flight: int = 160,
                                    n: int = 11):
    """Median latency of a light tenant's sequential requests, alone and while a flooding tenant keeps
    `in_flight` requests outstanding, and the flood's group period (seconds per `batch_rows` rows served)
    measured over the same window. predict_light() blocks for one request; submit_flood() returns a future.

    The period is the machine-independent yardstick: least-served-first puts the light request into the
    next group (a wait of at most about two periods), FIFO behind in_flight / batch_rows groups (20)."""
    import threading
    import time

    def median():
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            predict_light()
            lat.append(time.perf_counter() - t0)
        return sorted(lat)[n // 2]

    for _ in range(3):  # warm-up
        predict_light()
    alone = median()
    stop, counting = threading.Event(), threading.Event()
    served = [0]

    def flood():
        pending = []
        while not stop.is_set():
            left = [f for f in pending if not f.done()]
            if counting.is_set():
                served[0] += len(pending) - len(left)
            pending = left
            while len(pending) < in_flight:
                pending.append(submit_flood())
            time.sleep(0.002)

    th = threading.Thread(target=flood)
    th.start()
    time.sleep(0.3)
    try:
        counting.set()
        t0 = time.perf_counter()
        flooded = median()
        window = time.perf_counter() - t0
        counting.clear()
    finally:
        stop.set()
        th.join()
    period = window * batch_rows / max(served[0], 1)
    print(f"light tenant median latency: alone {alone * 1e3:.1f} ms, next to a flooding tenant {flooded * 1e3:.1f} ms;"
          f" the flood's group period {period * 1e3:.1f} ms ({served[0]} rows in {window:.2f} s)")
    return alone, flooded, period


# bf16 (the CUDA default): the losses of a tenant's grouped and serial training runs agree to within
# this relative gap (tests/test_device.py states the bound and its measurement)
BF16_LOSS_REL = 0.02


def assert_losses_agree(losses: dict, rel: float) -> None:
    """`losses`: tenant -> (grouped, serial) per-step losses; each step within `rel` of the other."""
    for t, (g, s) in losses.items():
        gap = max(abs(x - y) / max(abs(y), 1e-3) for x, y in zip(g, s))
        assert gap <= rel, (t, gap)


def train_grouped_and_serial(grouped, serial, requests_at, steps: int, tenants) -> dict:
    """`steps` training steps of the same requests (`requests_at(step)`) on two runners, one grouped, one
    serial; returns tenant -> (grouped, serial) losses, for `assert_losses_agree`."""
    losses = {t: ([], []) for t in tenants}
    for step in range(steps):
        reqs = requests_at(step)
        for k, (runner, grouped_mode) in enumerate(((grouped, True), (serial, False))):
            for r in runner.execute(reqs, grouped=grouped_mode):
                losses[r.tenant][k].append(r.unwrap()["loss"])
            for t in tenants:
                runner.optim_step(t).unwrap()
    return losses


@pytest.fixture(scope="session")
def postgres_url():
    """A PostgreSQL server of the test session's own (tests/postgres.py), started on first use."""
    from postgres import postgres_server

    with postgres_server() as url:
        yield url


def wait_until(cond, timeout_s: float, what: str = "the condition", every_s: float = 0.05):
    """cond()'s first true value, asked every `every_s` until `timeout_s`; else the test fails naming `what`."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
