"""The D-VLA experiment on this machine: env steps/s of the four-lane asynchronous RL pipeline
against the synchronous mode (roll out, then train, then sync weights), same env, model, tenants and
hardware, in one run; success-rate-vs-env-steps curves of both; and the overlap limit.

The overlap limit is the speedup if the slowest lane were the only cost: the synchronous run's wall
time over the largest per-lane busy time in it (sampling = the Environment Service's simulator busy
time, inference = the Inference Model Service's, training = the Training Model Service's,
distribution = the control plane's). On a machine whose lanes share the same few cores, overlapping
them cannot beat that bound, and contention keeps it lower still.

    python bench/async_rl.py [--quick] [--env-steps N] [--tenants K] [--warm-start STEPS]

With --warm-start, both modes start RL from the same behaviour-cloned policy (SFT on scripted
demonstrations through the services), so the success curves compare sample efficiency where there is
success to compare; from a random initialisation both stay near zero at this budget.
Writes bench/results/async_rl.json (quick runs: async_rl_quick.json), rewritten as each mode's run
finishes ("partial" until the run ends: bench/common.py's ResultFile; a run cut short keeps its modes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
ROOT = Path(__file__).resolve().parent.parent

from common import AllocatorPeaks, ResultFile, cpu_seconds, environment, print_table, split_cores  # noqa: E402
from vlamux.envs import EnvSpec  # noqa: E402
from vlamux.model import HeadSpec, OptimizerSpec  # noqa: E402
from vlamux.model.backbones import spec_from_arg  # noqa: E402
from vlamux.model.device import add_device_arguments, dtype_name, parse_device_arguments  # noqa: E402
from vlamux.services.queues import InferenceQueueConfig  # noqa: E402
from vlamux.services.contract import Runtime  # noqa: E402
from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig  # noqa: E402
from vlamux.workflows.evaluate import wilson  # noqa: E402
from vlamux.workflows.rl import RLConfig, RLRun  # noqa: E402
from vlamux.workflows.sft import SFTConfig, SFTRun  # noqa: E402


def lane_counters(rt: Runtime) -> dict:
    """Busy seconds so far per lane (on Ray the publisher's busy time stays inside the Training actor)."""
    busy = {name: a["busy_s"] for name, a in rt.accounting().items()}
    return {"sampling": rt.environment.utilization()["busy_s"],
            "inference": sum(busy[name] for name in rt.replica_names()),
            "training": busy["training"],
            "distribution": rt.metrics()["control_plane"].get("busy_s", 0.0)}


def make_runtime(kind: str, preset: str, batch_rows: int, threads: int, device: str = "auto", dtype: str = "auto",
                 split: bool = False, prioritize: bool = True):
    """The services in this process (embedded), or as Ray actors in processes of their own. split: the
    model services on their cores, the simulator workers on the others (`split_cores`; embedded only).
    prioritize: inference before training where they share cores (RuntimeConfig.prioritize_inference)."""
    queue = InferenceQueueConfig(batch_rows=batch_rows, max_wait_s=0.005)
    place = {"backbone": spec_from_arg(preset), "device": device, "dtype": dtype, "prioritize_inference": prioritize}
    if kind == "embedded":
        return EmbeddedRuntime(RuntimeConfig(**place, inference_queue=queue, **(split_cores() if split else {}))).start()
    import ray

    from vlamux.services.ray_runtime import RayRuntime, RayRuntimeConfig

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(include_dashboard=False, log_to_driver=False)
    return RayRuntime(RayRuntimeConfig(**place, inference_queue=queue, torch_threads=threads)).start()


def warm_start(rt: Runtime, head: HeadSpec, tenant: str, image: int, steps: int, demos: int,
               out: Path) -> None:
    """Behaviour-clone `tenant`'s slot on scripted demonstrations and save it to `out` (checkpoints
    belong to their tenant, so each mode's run of this tenant starts by loading it back)."""
    from vlamux.experiments.multi_tenant import Budget, ensure_demos

    dataset = ensure_demos(Budget(image_size=image, demos=demos), ROOT / "data" / "demos")
    run = SFTRun(rt, tenant, head.horizon, SFTConfig(dataset=str(dataset), steps=steps, batch_size=64, lr=1e-3,
                                                      schedule="cosine", warmup_steps=100))
    rt.create_slot(tenant, head, OptimizerSpec(lr=1e-3), 0, run.open()).result(60)
    t0 = time.perf_counter()
    run.on_step = lambda st: st.step % 250 == 0 and print(f"  warm start {tenant}: step {st.step}/{steps}, loss "
                                                         f"{st.losses[-1]:.3f}", flush=True)
    run.run()
    rt.save_state(tenant, out).result(60)
    print(f"  warm start {tenant}: {steps} SFT steps in {time.perf_counter() - t0:.0f}s", flush=True)


def run_mode(rt: Runtime, mode: str, tenants: list[str], head: HeadSpec, cfg: RLConfig,
             warm: dict[str, Path] | None = None) -> dict:
    import threading

    if warm:  # the same tenants, rolled back to their warm-start checkpoints
        names = list(tenants)
        for name in names:
            rt.load_state(name, warm[name]).result(60)
    else:  # fresh tenants per mode, from the same seeds
        names = [f"{t}-{mode}" for t in tenants]
        for i, name in enumerate(names):
            rt.create_slot(name, head, OptimizerSpec(lr=cfg_lr), seed=100 + i).result(60)
    assert rt.flush(30)
    stats, errors = {}, []
    before = lane_counters(rt)

    def job(name, i):
        try:
            c = RLConfig(**{**cfg.__dict__, "mode": mode, "seed": 1000 * i})
            stats[name] = RLRun(rt, name, c).run()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t0, cpu0, main0 = time.perf_counter(), cpu_seconds(), time.process_time()
    threads = [threading.Thread(target=job, args=(n, i)) for i, n in enumerate(names)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall, cpu, main_cpu = time.perf_counter() - t0, cpu_seconds() - cpu0, time.process_time() - main0
    if errors:
        raise errors[0]
    after = lane_counters(rt)
    busy = {k: after[k] - before[k] for k in before}
    steps = sum(s.env_steps for s in stats.values())
    episodes = sorted((e for s in stats.values() for e in s.episodes), key=lambda e: e[0])
    successes = sum(ok for _, ok in episodes)
    return {"mode": mode, "wall_s": wall, "cpu_s": cpu, "main_process_cpu_s": main_cpu, "env_steps": steps, "steps_per_s": steps / wall,
            "lane_busy_s": busy,
            "episodes": len(episodes), "success_rate": successes / max(1, len(episodes)),
            "success_ci95": wilson(successes, len(episodes)),
            "segments_trained": sum(s.segments_trained for s in stats.values()),
            "rows_dropped": sum(s.rows_dropped for s in stats.values()),
            "max_lag": max((max(s.lags, default=0) for s in stats.values()), default=0),
            "curve": curve(stats)}


def curve(stats: dict, window: int = 20) -> list[list[float]]:
    """(env steps per tenant, success rate over the last `window` episodes) after each episode, all tenants."""
    eps = sorted((steps, ok) for s in stats.values() for steps, ok in s.episodes)
    out = []
    for i in range(len(eps)):
        recent = eps[max(0, i - window + 1): i + 1]
        out.append([eps[i][0], sum(ok for _, ok in recent) / len(recent)])
    return out


cfg_lr = 1e-4


def measure(args, split: bool, steps: int, image: int, env, head, cfg, device, dtype,
            result: ResultFile | None = None) -> dict:
    """Sync then async on one runtime (shared cores, or split: services on core 0, simulators on core
    1): both modes' figures and the bounds of their speedup from the same run. `result`: each mode's
    figures go there as it finishes (top level, or under "split")."""
    rt = make_runtime(args.runtime, args.preset, args.batch_rows or args.n_envs, args.threads, str(device),
                      dtype_name(dtype), split=split, prioritize=not args.no_priority)
    tenants = [f"tenant{i}" for i in range(args.tenants)]
    placement = {k: rt.metrics()["training"][k] for k in ("device", "dtype")}  # as the services run
    print(f"async RL: preset={args.preset}, {args.tenants} tenants x {steps} env steps, {env.task} at {image}px, "
          f"{cfg.sub_batches} sub-batches x {cfg.n_envs} envs, threads={torch.get_num_threads()}, "
          f"model services on {device} ({dtype_name(dtype)}), "
          f"{'split: ' + str(split_cores()) if split else 'shared cores'}", flush=True)
    tmp = None
    try:
        warm = None
        if args.warm_start:
            import tempfile

            tmp = Path(tempfile.mkdtemp(prefix="vlamux-async-rl-"))
            warm = {t: tmp / f"{t}.safetensors" for t in tenants}
            for t in tenants:
                warm_start(rt, head, t, image, args.warm_start, args.warm_demos, warm[t])
        results = {}
        with AllocatorPeaks(device) as pools:
            for mode in ("sync", "async"):
                results[mode] = r = run_mode(rt, mode, tenants, head, cfg, warm)
                if result is not None:
                    section = result.payload.setdefault("split", {}) if split else result.payload
                    section[mode] = r
                    result.mark(f"{'split' if split else 'shared'} {mode}")
                print(f"  {mode:5s}: {r['steps_per_s']:7.1f} env steps/s over {r['wall_s']:.1f}s; lanes busy "
                      + ", ".join(f"{k} {v:.1f}s" for k, v in r["lane_busy_s"].items()), flush=True)
    finally:
        rt.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if args.runtime == "ray":
            import ray

            ray.shutdown()
    s, a = results["sync"], results["async"]
    overlap_limit = s["wall_s"] / max(s["lane_busy_s"].values())
    # lanes here share the same few cores: no schedule finishes the sync run's CPU work faster than
    # all cores busy all the time
    cores = os.cpu_count() or 1
    cpu_limit = s["wall_s"] / max(max(s["lane_busy_s"].values()), s["cpu_s"] / cores)
    # one process holds every service (the embedded runtime): its Python work runs under one GIL, so
    # its CPU time in the sync run is a floor for any schedule of the same work in that process
    process_limit = s["wall_s"] / max(max(s["lane_busy_s"].values()), s["main_process_cpu_s"])
    speedup = a["steps_per_s"] / s["steps_per_s"]
    print()
    print_table([{k: v for k, v in r.items() if not isinstance(v, (dict, list, tuple))} for r in (s, a)],
                [("mode", "s"), ("steps_per_s", ".1f"), ("wall_s", ".1f"), ("episodes", "d"), ("success_rate", ".2f"),
                 ("segments_trained", "d"), ("rows_dropped", "d"), ("max_lag", "d")])
    target = min(1.86, 0.9 * overlap_limit)
    print(f"\nCPU: sync {s['cpu_s']:.1f}s over {s['wall_s']:.1f}s wall ({s['cpu_s'] / s['wall_s'] / cores:.0%} of "
          f"{cores} cores), async {a['cpu_s']:.1f}s over {a['wall_s']:.1f}s ({a['cpu_s'] / a['wall_s'] / cores:.0%}); "
          f"the services' process: {s['main_process_cpu_s'] / s['wall_s']:.2f} / {a['main_process_cpu_s'] / a['wall_s']:.2f} "
          f"cores busy; "
          f"bound with all cores busy: {cpu_limit:.2f}x; with the services' process at one core: {process_limit:.2f}x")
    print(f"speedup {speedup:.2f}x; overlap limit {overlap_limit:.2f}x (sync wall / slowest lane); "
          f"target {target:.2f}x ({'met' if speedup >= target else 'NOT met'})")
    print(f"success: sync {s['success_rate']:.2f} {tuple(round(x, 2) for x in s['success_ci95'])}, "
          f"async {a['success_rate']:.2f} {tuple(round(x, 2) for x in a['success_ci95'])}")
    payload = {"sync_steps_per_s": s["steps_per_s"], "async_steps_per_s": a["steps_per_s"], "speedup": speedup,
               "overlap_limit": overlap_limit, "cpu_limit": cpu_limit, "process_limit": process_limit, "cores": cores, "target": target, "sync": s, "async": a,
               "curves": {"sync": s["curve"], "async": a["curve"]},
               "config": {"preset": args.preset, "tenants": args.tenants, "env_steps_per_tenant": steps,
                          "image_size": image, "sub_batches": cfg.sub_batches, "n_envs": cfg.n_envs,
                          "segment_steps": cfg.segment_steps, "max_staleness": cfg.max_staleness,
                          "warm_start_steps": args.warm_start, "lr": cfg.lr or cfg_lr, "epochs": cfg.epochs,
                          "runtime": args.runtime, "prioritize_inference": not args.no_priority},
               "environment": environment(device, dtype), "memory": pools.last,
               "placement": {**placement, **({k: list(v) for k, v in split_cores().items()} if split
                                             else {"cores": "shared"})}}
    return payload


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny budget: under a minute")
    ap.add_argument("--preset", "--backbone", dest="preset", default="tiny", metavar="PRESET_OR_DIR",
                    help="the backbone: a built-in preset or a model directory")
    ap.add_argument("--env-steps", type=int, default=None, help="per tenant")
    ap.add_argument("--tenants", type=int, default=1, help="RL tenants per mode (D-VLA's experiment: one)")
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("--sub-batches", type=int, default=2)
    ap.add_argument("--n-envs", type=int, default=4, help="envs per sub-batch")
    ap.add_argument("--batch-rows", type=int, default=None,
                    help="Inference Queue B (default: one sub-batch, so a chunk never waits T for rows that "
                         "a synchronous round could not send)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per op (1: the lanes' ops run side by side instead of fighting for cores)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="Python's GIL switch interval (default 5 ms)")
    ap.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                    help="SFT steps on scripted demonstrations before RL, the same start for both modes "
                         "(RL then runs at lr 3e-5, 2 passes per segment, PPO critic warm-up)")
    ap.add_argument("--warm-demos", type=int, default=200)
    ap.add_argument("--runtime", choices=("embedded", "ray"), default="embedded",
                    help="ray: the services as Ray actors, each in a process of its own (no shared GIL)")
    ap.add_argument("--placement", choices=("shared", "split", "both"), default="both",
                    help="shared cores, the papers' split (services on a quarter of the cores, simulators on the "
                         "rest: one each on two), or both in one "
                         "run (the split's figures go in the result's `split` section)")
    ap.add_argument("--no-priority", action="store_true",
                    help="inference and training at the same OS/CUDA priority (default: inference first)")
    ap.add_argument("--out", default=None)
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    steps = args.env_steps or (480 if args.quick else 6000)
    image = args.image_size or (32 if args.quick else 64)
    env = EnvSpec(task="goal/touch-red-cube", image_size=image, max_steps=60, n_action_steps=2)
    head = HeadSpec("gaussian", 4, 4, 8)
    cfg = RLConfig(env=env, env_steps=steps, n_envs=args.n_envs, sub_batches=args.sub_batches, segment_steps=8,
                   max_staleness=2, minibatch_rows=32)
    if args.warm_start:  # the gentle settings that keep a cloned policy (docs/RESULTS.md, RL from SFT)
        cfg = RLConfig(**{**cfg.__dict__, "lr": 3e-5, "epochs": 2, "critic_warmup": 30, "max_staleness": 4})
    settings = ["shared", "split"] if args.placement == "both" else [args.placement]
    if args.runtime == "ray" and "split" in settings:
        ap.error("--placement split is the embedded runtime's (Ray places actors by its own resources)")
    result = ResultFile("async_rl_quick.json" if args.quick else "async_rl.json", args.out,
                        [f"{setting} {mode}" for setting in settings for mode in ("sync", "async")])
    payload = result.payload
    for setting in settings:
        out = measure(args, setting == "split", steps, image, env, head, cfg, device, dtype, result)
        if setting == "shared":
            payload.update(out)
        else:
            payload["split"] = out
    if "split" in settings and "shared" not in settings:
        payload = {**payload["split"], "split": payload["split"]}
    path = result.finish(payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
