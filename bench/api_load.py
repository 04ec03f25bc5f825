"""API load: many tenants' SDK clients against one `vlamux serve`, at once.

The server runs as its own process (`vlamux serve`, embedded runtime, tiny backbone). The admin
creates the tenants; each tenant's client, on its own thread, creates a training slot, then loops
over a request mix a tenant's tooling makes: an action chunk for its policy (msgpack observation),
its job list, its usage. Every request's latency is recorded; any exception counts as an error.

    python bench/api_load.py [--quick] [--clients 32] [--seconds 30] [--uploads 10 --upload-mb 50] [--watchers 32]
Writes bench/results/api_load.json (quick: api_load_quick.json): clients, requests_per_s, p99_ms, errors.
In the same window, `--uploads` tenants each upload a dataset of `--upload-mb` MB at once (an HDF5
file of noise images, so nothing compresses; the SDK sends it in resumable chunks), and `--watchers`
Server-Sent-Event streams follow running SFT jobs (8 per job's tenant, its long-poll limit), each
checking that event ids arrive in order, none twice. The server's peak RSS (its process tree,
sampled every 0.25 s) is reported beside.

    python bench/api_load.py --noisy-neighbour [--quick]
The same ordinary clients, plus a light tenant (one request every 100 ms) and, in alternate windows
of the same run, one flooding tenant (its own process: 8 connections, no back-off, its default
quota of 50 requests/s). Reports the ordinary clients' throughput and p99 and the light tenant's p50
with and without the flooder, and every 5xx anyone saw. Writes bench/results/api_noisy.json (quick:
api_noisy_quick.json). Targets: ordinary throughput with >= 0.8 x without; light p50 with <= 2 x
without; no 5xx.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
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


def client_loop(url: str, key: str, seconds: float, seed: int, out: dict, stamps: list | None = None) -> None:
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
            if stamps is not None:  # (when it started, how long it took): for the noisy-neighbour windows
                stamps.append((t0, lat[name][-1]))
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


def flood(url: str, key: str, windows: list[tuple[float, float]], connections: int, q) -> None:
    """The flooding tenant, in a process of its own: inside each (start, end) window (wall clock),
    `connections` threads ask as fast as answers come, no back-off. Puts its status counts on q."""
    import collections

    import httpx

    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def one() -> None:
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {key}"}) as c:
            for start, end in windows:
                while time.time() < start:
                    time.sleep(0.01)
                while time.time() < end:
                    try:
                        code = c.get(f"{url}/v1/jobs").status_code
                    except httpx.HTTPError as e:
                        code = type(e).__name__
                    with lock:
                        counts[code] += 1

    threads = [threading.Thread(target=one) for _ in range(connections)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    q.put(dict(counts))


def light_loop(url: str, key: str, until: float, stamps: list, errors: list) -> None:
    """A light tenant: one GET /v1/jobs every 100 ms, each (start, latency) recorded."""
    import httpx

    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {key}"}) as c:
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            r = c.get(f"{url}/v1/jobs")
            if r.status_code >= 500:
                errors.append(f"light: {r.status_code}")
            stamps.append((t0, time.perf_counter() - t0))
            time.sleep(0.1)


def _in(stamps: list, windows: list[tuple[float, float]]) -> list[float]:
    return [lat for t, lat in stamps if any(a <= t < b for a, b in windows)]


def noisy_neighbour(args, device, dtype) -> int:
    import multiprocessing as mp

    from vlamux.sdk.process import spawn, stop
    from vlamux.model.device import dtype_name
    from vlamux.sdk import Client

    clients = args.clients or (8 if args.quick else 32)
    per_window = (args.seconds or (12.0 if args.quick else 30.0)) / 2  # two windows of each, alternating
    data_dir = Path(tempfile.mkdtemp(prefix="vlamux-api-noisy-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn(data_dir, port, extra_args=("--log-level", "warning", "--device", str(device),
                                             "--dtype", dtype_name(dtype), "--backbone", args.backbone))
    try:
        admin_key = (data_dir / "admin.key").read_text().strip()
        admin = Client(url, admin_key)
        keys = [admin.admin.create_tenant(f"ordinary-{i}", quotas={"requests_per_s": 1000.0})[1] for i in range(clients)]
        light_key = admin.admin.create_tenant("light", quotas={"requests_per_s": 1000.0})[1]
        flood_key = admin.admin.create_tenant("flooder")[1]  # the default quotas: 50 requests/s
        warmup = min(8.0, 2.0 + 0.25 * clients)  # the clients make their training slots first (32: 8 s)
        t_wall, t_perf = time.time() + warmup, time.perf_counter() + warmup
        order = ["without", "with", "without", "with"]
        windows = {k: [] for k in ("with", "without")}
        for i, kind in enumerate(order):
            windows[kind].append((t_perf + i * per_window, t_perf + (i + 1) * per_window))
        flood_wall = [(t_wall + i * per_window, t_wall + (i + 1) * per_window) for i, k in enumerate(order) if k == "with"]
        q = mp.get_context("spawn").Queue()
        flooder = mp.get_context("spawn").Process(target=flood, args=(url, flood_key, flood_wall, 8, q))
        flooder.start()
        total = warmup + len(order) * per_window
        print(f"noisy neighbour: {clients} ordinary clients + a light tenant, a flooder in alternate {per_window:.0f} s "
              f"windows ({total:.0f} s) against {url}", flush=True)
        results, stamps, light, light_errors = {}, [], [], []
        threads = [threading.Thread(target=client_loop, args=(url, k, total, i, results, stamps))
                   for i, k in enumerate(keys)]
        threads.append(threading.Thread(target=light_loop, args=(url, light_key, t_perf + len(order) * per_window,
                                                                  light, light_errors)))
        for th in threads:
            th.start()
        for th in threads:
            th.join(total + 120)
        flooder.join(120)
        flooded = q.get(timeout=30) if not q.empty() else {}
    finally:
        stop(proc)
        shutil.rmtree(data_dir, ignore_errors=True)
    errors = [e for _, errs in results.values() for e in errs] + light_errors
    errors_5xx = sum(1 for e in errors if re.search(r"\b5\d\d\b|ServerError|ServiceUnavailable", e))
    errors_5xx += sum(v for k, v in flooded.items() if isinstance(k, int) and k >= 500)
    out = {}
    for kind, ws in windows.items():
        lat = _in(stamps, ws)
        seconds = sum(b - a for a, b in ws)
        lt = _in(light, ws)
        out[kind] = {"rps": len(lat) / seconds, "p99_ms": 1e3 * float(np.percentile(lat, 99)) if lat else None,
                     "light_p50_ms": 1e3 * float(np.percentile(lt, 50)) if lt else None, "requests": len(lat)}
    payload = {
        "what": "32 ordinary tenants' clients and a light tenant, with and without one flooding tenant "
                "(8 connections, no back-off), in alternating windows of one run (bench/api_load.py --noisy-neighbour)",
        "clients": clients, "window_s": per_window, "windows": order,
        "ordinary_rps_with": out["with"]["rps"], "ordinary_rps_without": out["without"]["rps"],
        "ordinary_p99_ms_with": out["with"]["p99_ms"], "ordinary_p99_ms_without": out["without"]["p99_ms"],
        "light_p50_ms_with": out["with"]["light_p50_ms"], "light_p50_ms_without": out["without"]["light_p50_ms"],
        "errors_5xx": errors_5xx, "errors": len(errors), "error_samples": errors[:10],
        "flooder_answers": {str(k): v for k, v in flooded.items()},
        "environment": environment(device, dtype), "cpus": os.cpu_count(),
    }
    payload["throughput_ratio"] = payload["ordinary_rps_with"] / payload["ordinary_rps_without"]
    payload["light_p50_ratio"] = payload["light_p50_ms_with"] / payload["light_p50_ms_without"]
    payload["targets_met"] = {"throughput_ratio>=0.8": payload["throughput_ratio"] >= 0.8,
                              "light_p50_ratio<=2": payload["light_p50_ratio"] <= 2.0, "no_5xx": errors_5xx == 0}
    print(f"ordinary: {payload['ordinary_rps_without']:.1f} -> {payload['ordinary_rps_with']:.1f} req/s with the "
          f"flooder ({payload['throughput_ratio']:.2f}x), p99 {payload['ordinary_p99_ms_without']:.0f} -> "
          f"{payload['ordinary_p99_ms_with']:.0f} ms; light p50 {payload['light_p50_ms_without']:.1f} -> "
          f"{payload['light_p50_ms_with']:.1f} ms ({payload['light_p50_ratio']:.2f}x); 5xx {errors_5xx}; "
          f"flooder got {payload['flooder_answers']}")
    path = write_json("api_noisy_quick.json" if args.quick else "api_noisy.json", payload, args.out)
    print(f"wrote {path}")
    return 0 if all(payload["targets_met"].values()) else 1


def big_dataset(path: Path, mb: float) -> Path:
    """A robomimic-layout HDF5 file of about `mb` MB: noise images (incompressible), 4-d actions."""
    import h5py

    rng = np.random.default_rng(0)
    frames = max(2, int(mb * (1 << 20) / (64 * 64 * 3 * 2 + 48)))  # two 64 px cameras a frame
    demos = 8
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        for i in range(demos):
            n = frames // demos
            g = data.create_group(f"demo_{i}")
            g.create_dataset("actions", data=rng.uniform(-1, 1, (n, 4)).astype(np.float32))
            g.create_dataset("obs/state", data=rng.normal(size=(n, 8)).astype(np.float32))
            for cam in ("agentview_rgb", "eye_in_hand_rgb"):
                g.create_dataset(f"obs/{cam}", data=rng.integers(0, 255, (n, 64, 64, 3), dtype=np.uint8))
    return path


def uploader(url: str, key: str, path: Path, name: str, out: dict) -> None:
    from vlamux.sdk import Client

    t0 = time.perf_counter()
    try:
        Client(url, key, timeout_s=300).upload_dataset(str(path), name=name, timeout_s=600)
        out[name] = {"seconds": time.perf_counter() - t0, "end": time.perf_counter(), "error": None}
    except Exception as e:  # noqa: BLE001 - every failure is an error of the run
        out[name] = {"seconds": time.perf_counter() - t0, "end": time.perf_counter(),
                     "error": f"{type(e).__name__}: {e}"}


def watcher(url: str, key: str, job_id: str, seconds: float, out: list) -> None:
    """Follow a job's events for `seconds`: how many, and whether any came out of order or twice."""
    from vlamux.sdk import Client

    c = Client(url, key, timeout_s=60)
    got, bad, error = 0, 0, None
    last = 0
    try:
        for ev in c.job(job_id).events(timeout_s=seconds):
            if ev.id is None:
                continue
            if ev.id != last + 1:
                bad += 1
            last, got = ev.id, got + 1
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    out.append({"events": got, "out_of_order": bad, "error": error})


class PeakRSS(threading.Thread):
    """The largest resident memory of a process and its children, sampled every 0.25 s."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop_event = pid, 0, threading.Event()
        self.samples: list[tuple[float, int]] = []  # (perf_counter, bytes)

    def peak_between(self, t0: float, t1: float) -> int:
        return max((r for t, r in self.samples if t0 <= t <= t1), default=0)

    def run(self) -> None:
        import psutil

        proc = psutil.Process(self.pid)
        while not self.stop_event.wait(0.25):
            try:
                rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
            except psutil.Error:
                continue
            self.peak = max(self.peak, rss)
            self.samples.append((time.perf_counter(), rss))


def main(argv=None) -> int:
    from vlamux.model.device import add_device_arguments, parse_device_arguments

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 clients for 8 s")
    ap.add_argument("--clients", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--backbone", default="tiny", metavar="PRESET_OR_DIR", help="the server's backbone")
    ap.add_argument("--uploads", type=int, default=None, help="tenants uploading a dataset at once (10; quick 2)")
    ap.add_argument("--upload-mb", type=float, default=None, help="each upload's size (50; quick 20)")
    ap.add_argument("--watchers", type=int, default=None, help="event streams following jobs (32; quick 8)")
    ap.add_argument("--noisy-neighbour", action="store_true",
                    help="ordinary clients with and without one flooding tenant (bench/results/api_noisy.json)")
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)  # checked here, used by the server process
    if args.noisy_neighbour:
        return noisy_neighbour(args, device, dtype)
    clients = args.clients or (8 if args.quick else 32)
    seconds = args.seconds or (8.0 if args.quick else 30.0)
    n_uploads = args.uploads if args.uploads is not None else (2 if args.quick else 10)
    upload_mb = args.upload_mb or (20.0 if args.quick else 50.0)
    n_watchers = args.watchers if args.watchers is not None else (8 if args.quick else 32)

    from vlamux.sdk.process import spawn, stop
    from vlamux.data.demos import generate
    from vlamux.model.device import dtype_name
    from vlamux.sdk import Client

    data_dir = Path(tempfile.mkdtemp(prefix="vlamux-api-load-"))
    if n_watchers:  # the watched jobs train on the service's own demonstrations
        generate(["goal/touch-red-cube"], 4, data_dir / "datasets" / "demos", image_size=32, workers=1, progress=None)
    big = big_dataset(data_dir.parent / f"{data_dir.name}-upload.hdf5", upload_mb) if n_uploads else None
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"api load: {clients} tenants' clients for {seconds:.0f}s against {url}, with {n_uploads} uploads of "
          f"{upload_mb:.0f} MB and {n_watchers} event streams", flush=True)
    proc = spawn(data_dir, port, extra_args=("--log-level", "warning", "--device", str(device),
                                             "--dtype", dtype_name(dtype), "--backbone", args.backbone))
    rss = PeakRSS(proc.pid)
    rss.start()
    uploads: dict = {}
    alone: dict = {}
    alone_rss = (0, 0)
    streams: list = []
    try:
        admin_key = (data_dir / "admin.key").read_text().strip()
        admin = Client(url, admin_key)
        placement = _placement(url, admin_key)
        keys = []
        for i in range(clients):
            _, key = admin.admin.create_tenant(f"load-{i}", quotas={"requests_per_s": 1000.0, "max_env_sessions": 1})
            keys.append(key)
        up_keys = [admin.admin.create_tenant(f"upload-{i}", quotas={"requests_per_s": 1000.0})[1]
                   for i in range(n_uploads)]
        watched = []
        for i in range(-(-n_watchers // 8)):
            key = admin.admin.create_tenant(f"watched-{i}", quotas={"requests_per_s": 1000.0})[1]
            job = Client(url, key).submit({"name": f"watched-{i}", "kind": "sft", "eval": None, "head": HEAD,
                                           "sft": {"dataset": "demos", "steps": 10**6, "batch_size": 8}})
            watched.append((key, job))
        if n_uploads:  # first the uploads alone: what they cost the server in memory, unmixed
            time.sleep(1.0)
            a0 = time.perf_counter()
            ups = [threading.Thread(target=uploader, args=(url, k, big, f"alone-{i}", alone))
                   for i, k in enumerate(up_keys)]
            for th in ups:
                th.start()
            for th in ups:
                th.join(600)
            time.sleep(0.5)
            alone_rss = (rss.peak_between(a0 - 1.0, a0), rss.peak_between(a0, time.perf_counter()))
        results: dict = {}
        threads = [threading.Thread(target=client_loop, args=(url, k, seconds, i, results)) for i, k in enumerate(keys)]
        threads += [threading.Thread(target=uploader, args=(url, k, big, f"big-{i}", uploads))
                    for i, k in enumerate(up_keys)]
        threads += [threading.Thread(target=watcher, args=(url, watched[i // 8][0], watched[i // 8][1].id, seconds,
                                                            streams)) for i in range(n_watchers)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join(seconds + 600)
        wall = time.perf_counter() - t0
        for key, job in watched:
            Client(url, key).job(job.id).cancel()
    finally:
        rss.stop_event.set()
        stop(proc)
        shutil.rmtree(data_dir, ignore_errors=True)  # the tenants' checkpoints: about 1 GB in a full run
        if big is not None:
            big.unlink(missing_ok=True)
    per_kind: dict[str, list[float]] = {}
    errors = [e for _, errs in results.values() for e in errs]
    errors += [f"client {i}: no result (hung)" for i in range(clients) if i not in results]
    errors += [f"upload {n}: {u['error']}" for n, u in {**alone, **uploads}.items() if u["error"]]
    errors += [f"upload {i}: no result (hung)" for i in range(n_uploads - len(uploads))]
    errors += [f"stream: {s['error']}" for s in streams if s["error"]]
    errors += [f"stream: {s['out_of_order']} events out of order or repeated" for s in streams if s["out_of_order"]]
    errors += [f"stream {i}: no result (hung)" for i in range(n_watchers - len(streams))]
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
        "uploads": {"tenants": n_uploads, "mb_each": upload_mb,
                    "seconds": sorted(round(u["seconds"], 2) for u in uploads.values()),
                    "mb_per_s_total": (n_uploads * upload_mb / max(u["seconds"] for u in uploads.values()))
                    if uploads else None},
        "streams": {"watchers": n_watchers, "events": sum(s["events"] for s in streams),
                    "events_min": min((s["events"] for s in streams), default=0),
                    "out_of_order": sum(s["out_of_order"] for s in streams)},
        "server_peak_rss_mb": rss.peak / (1 << 20),
        # what the uploads cost in memory, measured with them alone first (same uploads, nothing else)
        "uploads_alone": {"seconds": sorted(round(u["seconds"], 2) for u in alone.values()),
                          "errors": sum(1 for u in alone.values() if u["error"]),
                          "server_rss_before_mb": alone_rss[0] / (1 << 20) if n_uploads else None,
                          "server_peak_rss_mb": alone_rss[1] / (1 << 20) if n_uploads else None},
    }
    print(f"{n} requests in {wall:.1f}s: {payload['requests_per_s']:.1f} req/s, p50 {payload['p50_ms']:.1f} ms, "
          f"p99 {payload['p99_ms']:.1f} ms, errors {len(errors)}")
    for k, v in payload["per_kind"].items():
        print(f"  {k:8s} {v['requests']:6d} requests, p50 {v['p50_ms']:.1f} ms, p99 {v['p99_ms']:.1f} ms")
    u, st = payload["uploads"], payload["streams"]
    if n_uploads:
        print(f"  uploads  {n_uploads} x {upload_mb:.0f} MB in {u['seconds']} s ({u['mb_per_s_total']:.1f} MB/s together)")
    print(f"  streams  {n_watchers} watchers, {st['events']} events (at least {st['events_min']} each), "
          f"{st['out_of_order']} out of order; server peak RSS {payload['server_peak_rss_mb']:.0f} MB")
    if n_uploads:
        a = payload["uploads_alone"]
        print(f"  uploads alone first: {n_uploads} x {upload_mb:.0f} MB in {a['seconds']} s, server RSS "
              f"{a['server_rss_before_mb']:.0f} -> {a['server_peak_rss_mb']:.0f} MB")
    for e in errors[:5]:
        print(f"  error: {e}")
    path = write_json("api_load_quick.json" if args.quick else "api_load.json", payload, args.out)
    print(f"wrote {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
