"""API load: many tenants' SDK clients against one `vlamux serve`, at once.

The server runs as its own process (`vlamux serve`, embedded runtime, tiny backbone). The admin
creates the tenants; each tenant's client, on its own thread, creates a training slot, then loops
over a request mix a tenant's tooling makes: an action chunk for its policy (msgpack observation),
its job list, its usage. Every request's latency is recorded; any exception counts as an error.

    python bench/api_load.py [--quick] [--clients 32] [--seconds 30]
Writes bench/results/api_load.json (quick: api_load_quick.json): clients, requests_per_s, p99_ms, errors.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import environment, write_json  # noqa: E402

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def observation(rng: np.random.Generator, size: int = 32) -> dict:
    return {"images": {"agentview": rng.integers(0, 255, (1, 3, size, size), dtype=np.uint8),
                       "wrist": rng.integers(0, 255, (1, 3, size, size), dtype=np.uint8)},
            "state": rng.standard_normal((1, 8)).astype(np.float32),
            "instructions": ["touch the red cube"]}


def client_loop(url: str, key: str, seconds: float, seed: int, out: dict) -> None:
    from vlamux.sdk import Client

    rng = np.random.default_rng(seed)
    lat: dict[str, list[float]] = {"predict": [], "jobs": [], "usage": []}
    errors: list[str] = []
    c = Client(url, key, timeout_s=60)
    try:
        policy = c.training_client(HEAD, seed=seed).policy()
        calls = {"predict": lambda: policy.predict(observation(rng)), "jobs": c.jobs, "usage": c.usage}
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            name = ("predict", "predict", "jobs", "usage")[i % 4]
            i += 1
            t0 = time.perf_counter()
            try:
                calls[name]()
            except Exception as e:  # noqa: BLE001 - every failure is an error of the run
                errors.append(f"{name}: {type(e).__name__}: {e}")
                continue
            lat[name].append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001
        errors.append(f"setup: {type(e).__name__}: {e}")
    finally:
        c.close()
    out[seed] = (lat, errors)


def _placement(url: str, admin_key: str) -> dict:
    """Where the server's model services run, as its /metrics says."""
    import httpx

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30).text
    out = {}
    for labels in re.findall(r"^vlamux_service_placement\{([^}]*)\}", text, re.M):
        kv = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[kv["service"]] = {"device": kv["device"], "dtype": kv["dtype"]}
    return out


def main(argv=None) -> int:
    from vlamux.model.device import add_device_arguments, parse_device_arguments

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 clients for 8 s")
    ap.add_argument("--clients", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--backbone", default="tiny", metavar="PRESET_OR_DIR", help="the server's backbone")
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)  # checked here, used by the server process
    clients = args.clients or (8 if args.quick else 32)
    seconds = args.seconds or (8.0 if args.quick else 30.0)

    from vlamux.api.server import spawn, stop
    from vlamux.model.device import dtype_name
    from vlamux.sdk import Client

    data_dir = Path(tempfile.mkdtemp(prefix="vlamux-api-load-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"api load: {clients} tenants' clients for {seconds:.0f}s against {url}", flush=True)
    proc = spawn(data_dir, port, extra_args=("--log-level", "warning", "--device", str(device),
                                             "--dtype", dtype_name(dtype), "--backbone", args.backbone))
    try:
        admin_key = (data_dir / "admin.key").read_text().strip()
        admin = Client(url, admin_key)
        placement = _placement(url, admin_key)
        keys = []
        for i in range(clients):
            _, key = admin.admin.create_tenant(f"load-{i}", quotas={"requests_per_s": 1000.0, "max_env_sessions": 1})
            keys.append(key)
        results: dict = {}
        threads = [threading.Thread(target=client_loop, args=(url, k, seconds, i, results)) for i, k in enumerate(keys)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join(seconds + 120)
        wall = time.perf_counter() - t0
    finally:
        stop(proc)
    per_kind: dict[str, list[float]] = {}
    errors = [e for _, errs in results.values() for e in errs]
    errors += [f"client {i}: no result (hung)" for i in range(clients) if i not in results]
    for lat, _ in results.values():
        for k, v in lat.items():
            per_kind.setdefault(k, []).extend(v)
    every = [x for v in per_kind.values() for x in v]
    n = len(every)
    payload = {
        "clients": clients, "seconds": seconds, "requests": n, "requests_per_s": n / wall,
        "p50_ms": 1e3 * float(np.percentile(every, 50)) if every else None,
        "p99_ms": 1e3 * float(np.percentile(every, 99)) if every else None,
        "errors": len(errors), "error_samples": errors[:10],
        "per_kind": {k: {"requests": len(v), "p50_ms": 1e3 * float(np.percentile(v, 50)),
                         "p99_ms": 1e3 * float(np.percentile(v, 99))} for k, v in per_kind.items() if v},
        "environment": environment(device, dtype), "cpus": os.cpu_count(), "placement": placement,
    }
    print(f"{n} requests in {wall:.1f}s: {payload['requests_per_s']:.1f} req/s, p50 {payload['p50_ms']:.1f} ms, "
          f"p99 {payload['p99_ms']:.1f} ms, errors {len(errors)}")
    for k, v in payload["per_kind"].items():
        print(f"  {k:8s} {v['requests']:6d} requests, p50 {v['p50_ms']:.1f} ms, p99 {v['p99_ms']:.1f} ms")
    for e in errors[:5]:
        print(f"  error: {e}")
    path = write_json("api_load_quick.json" if args.quick else "api_load.json", payload, args.out)
    print(f"wrote {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
