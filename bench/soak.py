"""Soak: many tenants using one `vlamux serve` continuously, and what the server holds over time.

The server runs as its own process (`vlamux serve`, embedded runtime, tiny backbone, the job queue
on: --max-running-jobs, a short job history: --job-history). Each of --tenants tenants, on its own thread with its own SDK client, goes
round short SFT, RL and eval jobs and an env session (a simulator stepped by hand), one after the
other, until the time is up; a job is submitted and waited for, so each tenant has one thing going
at a time and the service always has work queued.

Looked at every --look-s from outside the server (psutil, the file system), and averaged over each
--sample-s (a minute): its resident memory (the server process alone, and with its simulator
processes), open files, threads, the store's size (the SQLite database with its WAL) and the data
directory's. After --warm-min minutes, no metric should grow: each one's growth is the least-squares
line through the minutes after the warm-up, from its value at the warm-up's end to the last minute,
over that value (means and a line, so that a simulator process or a job's threads coming or going at
the moment of a look does not decide it); the last minute over the first is reported beside. Also counted: jobs by end state (target: none failed) and HTTP answers by status class, from
the server's own /metrics (target: no 5xx), and every error a client met.

    python bench/soak.py [--quick] [--minutes 25] [--tenants 20]
Writes bench/results/soak.json (quick: soak_quick.json). Target: every metric's growth after the
warm-up <= 5%; 0 failed jobs; 0 5xx.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from api_load import free_port  # noqa: E402
from common import environment, write_json  # noqa: E402

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}
ENV = {"task": "goal/touch-red-cube", "image_size": 32, "max_steps": 20, "n_action_steps": 2}
ACTIVITIES = ("sft", "rl", "eval", "env")
METRICS = ("server_rss_bytes", "tree_rss_bytes", "open_files", "threads", "store_bytes", "data_bytes")


def job_spec(kind: str, n: int) -> dict:
    """A short job of `kind` (seconds alone on this machine)."""
    spec = {"name": f"soak-{kind}-{n}", "kind": kind, "head": HEAD, "seed": n, "checkpoint_every": 10}
    if kind == "sft":
        spec.update(sft={"dataset": "demos", "steps": 20, "batch_size": 8}, eval=None)
    elif kind == "rl":
        spec.update(rl={"env": ENV, "env_steps": 64, "n_envs": 1, "sub_batches": 1, "segment_steps": 8},
                    checkpoint_every=2, eval=None)
    else:
        spec.update(eval={"episodes": 2, "n_envs": 1, "env": ENV})
    return spec


class Tally:
    """What the tenants' threads met, under one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.done: Counter = Counter()  # "sft:succeeded", "env:ok", ...
        self.failed: list[dict] = []  # jobs that ended other than succeeded
        self.errors: list[dict] = []  # exceptions a client met

    def add(self, key: str, failed: dict | None = None, error: dict | None = None) -> None:
        with self.lock:
            self.done[key] += 1
            if failed is not None:
                self.failed.append(failed)
            if error is not None:
                self.errors.append(error)


def tenant_loop(url: str, key: str, index: int, until: float, tally: Tally) -> None:
    from vlamux.sdk import Client
    from vlamux.sdk.errors import VlamuxAPIError

    client = Client(url, key, timeout_s=120.0)
    n = index
    while time.monotonic() < until:
        kind = ACTIVITIES[n % len(ACTIVITIES)]
        n += 1
        try:
            if kind == "env":
                env = client.env_session(ENV, n_envs=1, seed=n)
                env.reset(seed=n)
                for _ in range(30):
                    out = env.step(np.zeros((1, 4), dtype=np.float32))
                    if out["terminated"][0] or out["truncated"][0]:
                        env.reset()
                env.close()
                tally.add("env:ok")
                continue
            job = client.submit(job_spec(kind, n))
            job.wait(timeout_s=1800, progress=False)
            ok = job.state == "succeeded"
            tally.add(f"{kind}:{job.state}", failed=None if ok else {"kind": kind, "job": job.id, "state": job.state,
                                                                      "error": job.error})
        except VlamuxAPIError as e:
            tally.add(f"{kind}:error", error={"kind": kind, "status": e.status, "error": f"{type(e).__name__}: {e}"})
        except Exception as e:  # noqa: BLE001 - counted, and the tenant goes on
            tally.add(f"{kind}:error", error={"kind": kind, "status": None, "error": f"{type(e).__name__}: {e}"})


def dir_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:  # removed while walked (a pruned job's files)
            pass
    return total


def sample(proc, data_dir: Path) -> dict:
    import psutil

    server = psutil.Process(proc.pid)
    children = server.children(recursive=True)
    rss = server.memory_info().rss
    tree = rss
    for c in children:
        try:
            tree += c.memory_info().rss
        except psutil.Error:
            pass
    store = sum(p.stat().st_size for p in data_dir.glob("vlamux.db*") if p.is_file())
    return {"server_rss_bytes": rss, "tree_rss_bytes": tree, "open_files": server.num_fds(),
            "threads": server.num_threads(), "children": len(children), "store_bytes": store,
            "data_bytes": dir_bytes(data_dir)}


def mean_of(looks: list[dict]) -> dict:
    """A sample: each metric's mean over its looks, at their mean time (t_s), up to the last (t_end_s)."""
    out = {k: float(np.mean([x[k] for x in looks])) for k in (*METRICS, "children", "t_s")}
    out["t_end_s"], out["looks"] = looks[-1]["t_s"], len(looks)
    return out


def growth(times: list[float], values: list[float], start: float) -> dict:
    """The least-squares line through the samples from `start` on: its rise from `start` to the last
    sample over its value at `start`; and the last sample over the first (from `start` on)."""
    pts = [(t, v) for t, v in zip(times, values) if t >= start]
    if len(pts) < 3:
        return {"fit": None, "last_over_first": None, "samples": len(pts)}
    t = np.array([p[0] for p in pts])
    v = np.array([p[1] for p in pts], dtype=float)
    slope, intercept = np.polyfit(t, v, 1)
    at_start = slope * t[0] + intercept
    return {"fit": float(slope * (t[-1] - t[0]) / at_start) if at_start > 0 else None,
            "last_over_first": float(v[-1] / v[0] - 1) if v[0] > 0 else None, "samples": len(pts),
            "first": float(v[0]), "last": float(v[-1])}


def http_answers(url: str, admin_key: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'vlamux_http_responses_total\{code="(\dxx)"\} (\S+)', text)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 tenants for 1.5 minutes, sampled every 10 s")
    ap.add_argument("--minutes", type=float, default=None, help="how long the tenants run (25; quick 1.5)")
    ap.add_argument("--warm-min", type=float, default=None, help="not judged before this (5; quick 0.5)")
    ap.add_argument("--tenants", type=int, default=None, help="(20; quick 3)")
    ap.add_argument("--sample-s", type=float, default=None, help="a sample: the mean of its looks (60; quick 10)")
    ap.add_argument("--look-s", type=float, default=None, help="(5; quick 2)")
    ap.add_argument("--max-running-jobs", type=int, default=6)
    ap.add_argument("--job-history", type=int, default=3,
                    help="finished jobs the server keeps per tenant (the service's default is 100: a tenant "
                         "here ends a job every minute or so, and the run must reach the steady state it "
                         "would reach in a day)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    minutes = args.minutes or (1.5 if args.quick else 25.0)
    warm_min = args.warm_min if args.warm_min is not None else (0.5 if args.quick else 5.0)
    tenants = args.tenants or (3 if args.quick else 20)
    sample_s = args.sample_s or (10.0 if args.quick else 60.0)
    look_s = args.look_s or (2.0 if args.quick else 5.0)

    from vlamux.data.demos import generate
    from vlamux.sdk import Client
    from vlamux.sdk.process import spawn, stop

    data_dir = Path(tempfile.mkdtemp(prefix="vlamux-soak-"))
    generate(["goal/touch-red-cube"], 4, data_dir / "datasets" / "demos", image_size=32, workers=1, progress=None)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = data_dir.parent / f"{data_dir.name}.log"
    print(f"soak: {tenants} tenants for {minutes:g} min against {url} (server log {log_path})", flush=True)
    proc = spawn(data_dir, port, log=log_path.open("a"),
                 extra_args=("--log-level", "warning", "--backbone", "tiny", "--group-cap", "none",
                             "--max-running-jobs", str(args.max_running_jobs), "--job-history", str(args.job_history)))
    tally, samples, looks = Tally(), [], []
    try:
        admin_key = (data_dir / "admin.key").read_text().strip()
        admin = Client(url, admin_key)
        keys = [admin.admin.create_tenant(f"soak-{i}", quotas={"requests_per_s": 1000.0})[1] for i in range(tenants)]
        t0 = time.monotonic()
        until = t0 + 60 * minutes
        threads = [threading.Thread(target=tenant_loop, args=(url, k, i, until, tally), daemon=True)
                   for i, k in enumerate(keys)]
        for th in threads:
            th.start()
        while True:
            now = time.monotonic()
            look = sample(proc, data_dir)
            look["t_s"] = now - t0
            looks.append(look)
            if len(looks) > 1 and int(look["t_s"] // sample_s) != int(looks[-2]["t_s"] // sample_s) or now >= until:
                s = mean_of([x for x in looks if x["t_s"] > (samples[-1]["t_end_s"] if samples else -1)])
                with tally.lock:
                    s["done"] = sum(tally.done.values())
                samples.append(s)
                print(f"  {s['t_end_s'] / 60:5.1f} min: rss {s['server_rss_bytes'] / 2**20:.0f} MiB "
                      f"(tree {s['tree_rss_bytes'] / 2**20:.0f}), files {s['open_files']:.0f}, threads "
                      f"{s['threads']:.0f}, store {s['store_bytes'] / 2**20:.2f} MiB, data "
                      f"{s['data_bytes'] / 2**20:.1f} MiB, {s['done']} done", flush=True)
            if now >= until:
                break
            time.sleep(max(0.0, min(look_s, until - time.monotonic()) - (time.monotonic() - now)))
        for th in threads:  # each finishes what it was doing
            th.join(1800)
        answers = http_answers(url, admin_key)
    finally:
        stop(proc)
        shutil.rmtree(data_dir, ignore_errors=True)
    warm_s = 60 * warm_min
    times = [s["t_s"] for s in samples]
    grew = {m: growth(times, [s[m] for s in samples], warm_s) for m in METRICS}
    failed_jobs = len(tally.failed)
    five = int(answers.get("5xx", 0))
    met = (all(g["fit"] is not None and g["fit"] <= 0.05 for g in grew.values()) and failed_jobs == 0 and five == 0
           and not tally.errors)
    payload = {"benchmark": "soak", "tenants": tenants, "minutes": minutes, "warm_min": warm_min, "sample_s": sample_s,
               "setting": {"backbone": "tiny", "max_running_jobs": args.max_running_jobs,
                           "job_history": args.job_history, "activities": list(ACTIVITIES), "env": ENV, "head": HEAD},
               "look_s": look_s, "samples": samples, "looks": looks, "growth": grew, "done": dict(tally.done), "failed_jobs": tally.failed,
               "client_errors": tally.errors, "http_answers": answers, "target_met": met,
               "environment": environment("cpu")}
    out = write_json("soak_quick.json" if args.quick else "soak.json", payload, args.out)
    print(f"growth after {warm_min:g} min (line fit / last over first):")
    for m, g in grew.items():
        fit, last = g["fit"], g["last_over_first"]
        print(f"  {m:18s} {'-' if fit is None else f'{100 * fit:+.1f}%':>8s} {'-' if last is None else f'{100 * last:+.1f}%':>8s}")
    print(f"done: {dict(tally.done)}; failed jobs {failed_jobs}; client errors {len(tally.errors)}; "
          f"HTTP answers {answers}; target met: {met}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
