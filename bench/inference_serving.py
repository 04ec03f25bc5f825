"""Inference serving benchmark: K concurrent tenant sessions sending action requests.

For K in {1, 8, 32} sessions (each its own tenant and head; heads cycle l1_chunk, flow, gaussian,
bins), on the `small` preset with two 128x128 cameras, in one run:
  grouped    the Inference Model Service with group batching (B = K rows, T = --max-wait-ms)
  baseline   the same service with B = 1: every request runs alone (no batching)
  limit      the plain model, apart from vlamux's group path: the backbone on one dense batch of K
             rows of a single shape, then each head on its row, vs K (backbone, head) calls of one row
  packed     the runner's own grouped execution vs its serial one (`packed_speedup`, the old limit)
The service's group cap is learned from this hardware at its start (`--no-cap`: none).
Clients are closed-loop: each sends a request, waits for its chunk, sends the next.
It also measures the scheduler's own cost per request with a no-op model (scheduler_overhead_us), a
CPU-only figure: on a GPU run it is skipped unless asked for (--scheduler-overhead yes).
Writes bench/results/inference_serving.json, as each K's limit, baseline and grouped runs finish
("partial" until the run ends: bench/common.py's ResultFile).

    python bench/inference_serving.py [--quick] [--seconds 8]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ResultFile, environment, interleaved_medians, plain_model, print_table  # noqa: E402

from vlamux.model import BackboneSpec, HeadSpec, Result, Sample, build_backbone  # noqa: E402
from vlamux.model.backbones import spec_from_arg  # noqa: E402
from vlamux.model.calibrate import measured  # noqa: E402
from vlamux.model.device import Lane, add_device_arguments, parse_device_arguments  # noqa: E402
from vlamux.model.slot import Slot  # noqa: E402
from vlamux.services.inference import InferenceModelService  # noqa: E402
from vlamux.services.queues import InferenceQueueConfig  # noqa: E402
from vlamux.model.synthetic import TaskProfile, make_batch  # noqa: E402

HEAD_KINDS = ["l1_chunk", "flow", "gaussian", "bins"]
TEMPLATES = ["pick up the {color} block", "push {color} cube away", "touch the {color} ball", "grab {color} box now"]


def tenants(k: int, backbone):
    """K tenants' serving slots and one observation each (b = 1)."""
    g = torch.Generator().manual_seed(k)
    out = []
    for i in range(k):
        spec = HeadSpec(HEAD_KINDS[i % 4], action_dim=7, horizon=8, state_dim=8)
        slot = Slot(f"tenant{i}", spec, backbone.meta, seed=i, device=backbone.device)
        obs, _ = make_batch(TaskProfile({"agentview": (128, 128), "wrist": (128, 128)}, 7, 8, 8, TEMPLATES[i % 4]),
                            1, g)
        out.append((slot, obs))
    return out


def serve(backbone, population, batch_rows: int, max_wait_s: float, seconds: float, cap: str | None) -> dict:
    svc = InferenceModelService(backbone, InferenceQueueConfig(batch_rows=batch_rows, max_wait_s=max_wait_s,
                                                               deadline_s=600), group_cap=cap)
    for slot, _ in population:
        svc.stage_policy(slot.export_policy())
    svc.start()
    latencies: list[float] = []
    lock, stop, errors = threading.Lock(), threading.Event(), []

    def client(tenant, obs):
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                svc.predict(tenant, obs).result(600)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                return
            with lock:
                latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client, args=(s.tenant, o)) for s, o in population]
    for slot, obs in population[:1]:  # warm-up group
        svc.predict(slot.tenant, obs).result(600)
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    svc.stop()
    if errors:
        raise errors[0]
    lat = sorted(latencies)
    return {"requests_per_s": len(lat) / wall, "p50_ms": 1e3 * lat[len(lat) // 2],
            "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], "requests": len(lat),
            "group_rows_mean": svc.queue.stats.snapshot()["group_rows_mean"]}


def limit(backbone, population, repeats: int, min_seconds: float = 1.0) -> dict:
    """The plain model's dense-batch speedup for K one-row requests (the limit), and the runner's own
    grouped against serial execution (packed), timed interleaved in one run."""
    from vlamux.model import ModelRunner

    runner = ModelRunner(backbone)
    for slot, _ in population:
        runner.add_slot(slot)
    reqs = [Sample(s.tenant, o) for s, o in population]
    runner.execute(reqs)
    profile = TaskProfile({"agentview": (128, 128), "wrist": (128, 128)}, 7, 8, 8, TEMPLATES[0])
    contenders = {"grouped": lambda: runner.execute(reqs, grouped=True),
                  "serial": lambda: runner.execute(reqs, grouped=False),
                  **plain_model(backbone, [s.head for s, _ in population], 1, "inference", profile)}
    for fn in contenders.values():
        fn()
    t = interleaved_medians(contenders, repeats, str(backbone.device), min_seconds)
    return {"limit_speedup": t["dense_split"] / t["dense_one"], "packed_speedup": t["serial"] / t["grouped"],
            "dense_one_ms": t["dense_one"] * 1e3, "dense_split_ms": t["dense_split"] * 1e3,
            "grouped_forward_ms": t["grouped"] * 1e3, "separate_forward_ms": t["serial"] * 1e3}


class _NoopRunner:
    """Stands in for the model in the scheduler-overhead measurement: returns at once."""

    slots: dict = {}
    lane = Lane()  # the CPU's: no stream to enter

    def execute(self, reqs):
        return [Result(r.tenant, {"actions": None, "policy_version": 0}) for r in reqs]


def scheduler_overhead_us(n: int = 20000, batch_rows: int = 32) -> float:
    """Per-request cost of queue + engine + futures with a no-op model, open loop."""
    backbone = build_backbone(BackboneSpec(preset="tiny"))
    svc = InferenceModelService(backbone, InferenceQueueConfig(batch_rows=batch_rows, max_wait_s=0.0005))
    svc.runner = _NoopRunner()
    svc.serves = lambda tenant: True
    obs, _ = make_batch(TaskProfile(), 1, torch.Generator().manual_seed(0))
    svc.start()
    t0 = time.perf_counter()
    futures = [svc.predict(f"t{i % 32}", obs) for i in range(n)]
    for f in futures:
        f.result(60)
    per = (time.perf_counter() - t0) / n
    svc.stop()
    return per * 1e6


def headline(rows: list[dict], limits: dict, k: int, max_wait_ms: float) -> dict:
    """The figures at K sessions: grouped throughput against its limit and the baseline, its p99 and bound."""
    base = next(r for r in rows if r["sessions"] == k and r["mode"] == "baseline")
    grp = next(r for r in rows if r["sessions"] == k and r["mode"] == "grouped")
    return {f"throughput_vs_limit_at_{k}": grp["requests_per_s"] / (limits[k]["limit_speedup"] * base["requests_per_s"]),
            f"speedup_at_{k}": grp["requests_per_s"] / base["requests_per_s"], f"p99_ms_at_{k}": grp["p99_ms"],
            "p99_bound_ms": max_wait_ms + 2 * limits[k]["grouped_forward_ms"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny preset, short runs: under a minute")
    ap.add_argument("--preset", "--backbone", dest="preset", default=None, metavar="PRESET_OR_DIR",
                    help="the backbone: a built-in preset or a model directory (default small; --quick tiny)")
    ap.add_argument("--seconds", type=float, default=None, help="measuring time per (K, mode)")
    ap.add_argument("--max-wait-ms", type=float, default=20.0, help="T of the grouped mode")
    ap.add_argument("--sessions", default="1,8,32", help="K values, comma-separated")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-cap", action="store_true", help="the services' groups uncapped (no calibration)")
    ap.add_argument("--limit-seconds", type=float, default=1.0,
                    help="time each contender of the limit at least this long per K")
    ap.add_argument("--scheduler-overhead", choices=("auto", "yes", "no"), default="auto",
                    help="measure the scheduler's cost with a no-op model (CPU-only; auto: not on a GPU run)")
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)
    preset = args.preset or ("tiny" if args.quick else "small")
    seconds = args.seconds or (3.0 if args.quick else 12.0)
    T = args.max_wait_ms / 1e3
    backbone = build_backbone(spec_from_arg(preset), device=device, dtype=dtype)
    env = environment(backbone.device, backbone.dtype)  # as built, not as asked
    print(f"inference serving: preset={preset}, device={device}, dtype={env['dtype']}, threads={env['threads']}, "
          f"{seconds:g}s per cell, T={args.max_wait_ms}ms", flush=True)
    ks = [int(k) for k in args.sessions.split(",")]
    cap = None if args.no_cap else "learned"
    name = "inference_serving_quick.json" if args.quick else "inference_serving.json"
    config = {"preset": preset, "max_wait_ms": args.max_wait_ms, "seconds": seconds,
              "limit_seconds": args.limit_seconds, **env}
    result = ResultFile(name, args.out, [f"K={k} {part}" for k in ks for part in ("limit", "baseline", "grouped")],
                        cells=[], limits=[], config=config)
    rows, limits = result.payload["cells"], {}
    for k in ks:
        population = tenants(k, backbone)
        limits[k] = {"sessions": k, **limit(backbone, population, 3, args.limit_seconds)}
        result.payload["limits"].append(limits[k])
        result.mark(f"K={k} limit")
        speedup = limits[k]["limit_speedup"]
        for mode, b, t in (("baseline", 1, 0.0), ("grouped", k, T)):
            r = serve(backbone, population, b, t, seconds, cap)
            rows.append({"sessions": k, "mode": mode, **r})
            if k == max(ks) and mode == "grouped":  # the headline, kept even if the run is cut short after it
                result.payload["summary"] = headline(rows, limits, k, args.max_wait_ms)
            result.mark(f"K={k} {mode}")
            print(f"  K={k:2d} {mode:8s}: {r['requests_per_s']:7.1f} req/s  p50 {r['p50_ms']:7.1f} ms  "
                  f"p99 {r['p99_ms']:7.1f} ms  (limit {speedup:.2f}x)", flush=True)
    on_cpu = str(backbone.device) == "cpu"
    measure_overhead = args.scheduler_overhead == "yes" or (args.scheduler_overhead == "auto" and on_cpu)
    overhead = scheduler_overhead_us() if measure_overhead else None
    print()
    print_table(rows, [("sessions", "d"), ("mode", "s"), ("requests_per_s", ".1f"), ("p50_ms", ".1f"),
                       ("p99_ms", ".1f"), ("group_rows_mean", ".1f")])
    k = max(ks)
    grp = next(r for r in rows if r["sessions"] == k and r["mode"] == "grouped")
    curve = measured(backbone)  # what the services learned at start (none with --no-cap)
    summary = {**headline(rows, limits, k, args.max_wait_ms), "scheduler_overhead_us": overhead,
               "group_cap": curve.describe() if curve is not None else None}
    ratio, speedup, p99_bound = (summary[f"throughput_vs_limit_at_{k}"], summary[f"speedup_at_{k}"],
                                 summary["p99_bound_ms"])
    print(f"\nK={k}: grouped throughput = {speedup:.2f} x baseline = {ratio:.2f} x (limit_speedup x baseline) "
          f"(targets >= 0.97 and >= 0.90); p99 {grp['p99_ms']:.0f} ms vs bound T + 2 x grouped forward = "
          f"{p99_bound:.0f} ms; learned cap {curve.cap if curve is not None else None} rows")
    if overhead is None:
        print("scheduler overhead with a no-op model: not measured (a CPU-only figure; --scheduler-overhead yes)")
    else:
        print(f"scheduler overhead with a no-op model: {overhead:.0f} us per request (target <= 200)")
    result.payload["summary"] = summary
    out = result.finish()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
