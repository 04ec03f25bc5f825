"""Slot lifecycle: many short SFT jobs through one `vlamux serve`, and the server's resident memory.

A job's slot (head, optimizer state, statistics; its serving copy on each replica) is freed when the
job ends, so a server that has run 200 jobs holds what one that has run 20 holds. The server runs as
its own process (embedded runtime, tiny backbone); one tenant submits `--jobs` SFT jobs of `--steps`
steps each (four at a time, its default max_concurrent_jobs) on a generated LeRobot dataset. After
each checkpoint count of jobs (`--marks`) the server's RSS (its own process: the model services and
their slots live there) and the slots each model service reports (/metrics, vlamux_service_slots)
are read, once every job so far has ended.

    python bench/slot_lifecycle.py [--jobs 200] [--marks 20,100,200] [--steps 2] [--quick]
Writes bench/results/slot_lifecycle.json (quick: slot_lifecycle_quick.json). Target: RSS after the
last mark within 5% of the RSS after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2 ** 20


def service_slots(url: str, admin_key: str) -> dict[str, int]:
    import httpx

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30).text
    return {m.group(1): int(float(m.group(2)))
            for m in re.finditer(r'^vlamux_service_slots\{service="([^"]+)"\} (\S+)$', text, re.M)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--marks", default="20,100,200", help="job counts at which memory is read")
    ap.add_argument("--steps", type=int, default=2, help="SFT steps per job")
    ap.add_argument("--at-once", type=int, default=4, help="jobs in flight at a time (the default quota)")
    ap.add_argument("--quick", action="store_true", help="30 jobs, marks 10,30 (a smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.marks = 30, "10,30"
    marks = sorted({int(m) for m in args.marks.split(",")})
    if not marks or marks[-1] > args.jobs:
        raise SystemExit(f"--marks must be job counts up to --jobs ({args.jobs})")

    from vlamux.sdk.process import spawn, stop
    from vlamux.data.demos import generate
    from vlamux.sdk import Client

    work = Path(tempfile.mkdtemp(prefix="vlamux-slot-lifecycle-"))
    data_dir = work / "service"
    generate(["goal/touch-red-cube"], 4, data_dir / "datasets" / "demos", image_size=32, workers=1, progress=None)
    port = _port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn(data_dir, port, log=(work / "server.log").open("a"), env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = {"jobs": args.jobs, "steps_per_job": args.steps, "marks": [], "command": "python " + " ".join(sys.argv)}
    try:
        admin_key = (data_dir / "admin.key").read_text().strip()
        admin = Client(url, admin_key)
        _, key = admin.admin.create_tenant("acme", {"requests_per_s": 1000, "max_concurrent_jobs": args.at_once})
        acme = Client(url, key)
        out["rss_mb_at_start"] = round(rss_mb(proc.pid), 1)
        running, done, failed, t0 = [], 0, 0, time.monotonic()
        for i in range(args.jobs):
            while len(running) >= args.at_once:
                running[0].wait(timeout_s=300, progress=False)
                failed += running.pop(0).state != "succeeded"
                done += 1
            running.append(acme.submit({"name": f"job-{i}", "kind": "sft", "head": HEAD, "eval": None,
                                        "checkpoint_every": 1000,
                                        "sft": {"dataset": "demos", "steps": args.steps, "batch_size": 4}}))
            if i + 1 in marks:
                for job in running:
                    job.wait(timeout_s=300, progress=False)
                    failed += job.state != "succeeded"
                    done += 1
                running = []
                time.sleep(1.0)  # the last job's slot is freed before its end is told; its replica copy just after
                mark = {"jobs": i + 1, "rss_mb": round(rss_mb(proc.pid), 1), "slots": service_slots(url, admin_key),
                        "failed": failed, "wall_s": round(time.monotonic() - t0, 1)}
                out["marks"].append(mark)
                print(json.dumps(mark), flush=True)
        first, last = out["marks"][0], out["marks"][-1]
        out["rss_ratio_last_to_first"] = round(last["rss_mb"] / first["rss_mb"], 4)
        out["target"] = "rss after the last mark within 5% of the first (ratio <= 1.05)"
        out["met"] = out["rss_ratio_last_to_first"] <= 1.05 and failed == 0
    finally:
        stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    path = Path(args.out) if args.out else RESULTS / ("slot_lifecycle_quick.json" if args.quick else "slot_lifecycle.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"RSS {first['rss_mb']} MB after {first['jobs']} jobs, {last['rss_mb']} MB after {last['jobs']} "
          f"(ratio {out['rss_ratio_last_to_first']}); slots now {last['slots']}; wrote {path}")


if __name__ == "__main__":
    main()
