"""SFT probe: does behaviour cloning of a per-tenant action head on the FROZEN, randomly initialised
built-in backbone solve the tabletop touch tasks?

Three sub-commands:

    # 1. expert demonstrations as a LeRobot dataset (seeds 0.. per task, see vlamux.data.demos)
    python scripts/sft_probe/probe.py gen --task goal/touch-red-cube --episodes 200 --image-size 32 \
        --out data/sft_probe/goal-red-200-32

    # 2. train one head on the frozen backbone, evaluate it in the simulator, append a result line
    python scripts/sft_probe/probe.py run --data data/sft_probe/goal-red-200-32 --preset tiny \
        --head l1_chunk --horizon 8 --exec 4 --steps 2000 --eval-episodes 50

    # 3. the table of every run so far
    python scripts/sft_probe/probe.py table

Training. The backbone is frozen and there is no image augmentation, so its features for a dataset
frame never change: by default (`--path cached`) every frame goes through the backbone once and the
head trains on those features through the slot's own `forward_backward` / `optim_step` (the exact
operations `ModelRunner.execute` performs after the backbone forward). `--path runner` trains through
`runner.execute([ForwardBackward(...)])` instead (backbone forward every step). Either way
`--bench-runner-steps` times the full runner path (sampler batch -> ForwardBackward -> optim_step) so
the steps/s of a real SFT job is known.

Evaluation always goes through the runner (`Sample`, deterministic, full backbone forward on the
live render): `--eval-episodes` seeded episodes per task, seeds from 10_000_000 (the demo generator
uses seeds 0 + 100_000 * task index upwards, so they are disjoint), envs stepped in lock-step in this
process, receding horizon: the first `--exec` actions of each chunk are executed, then a new chunk.

Runs use one torch thread (`torch.set_num_threads(1)`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "data" / "sft_probe" / "results.jsonl"
EVAL_SEED0 = 10_000_000


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


# ---- demos ----------------------------------------------------------------------------------------

def cmd_gen(args) -> int:
    from vlamux.data.demos import generate
    cams = tuple(args.cameras.split(","))
    r = generate(args.task, args.episodes, args.out, image_size=args.image_size, cameras=cams, workers=1,
                 overwrite=args.overwrite)
    (Path(args.out) / "probe_tasks.json").write_text(json.dumps(args.task))
    print(json.dumps(r))
    return 0


# ---- backbone -------------------------------------------------------------------------------------

def make_backbone(preset: str, image_size: int | None, seed: int, weights: str | None = None):
    """The built-in backbone; `image_size` overrides the preset's input size (same patch size, so
    fewer patches), which the `small` preset needs to run at 32/64 px; `weights`: a pretrained file
    (vlamux.pretrain)."""
    from vlamux.model import BackboneSpec, build_backbone
    if weights:
        return build_backbone(BackboneSpec(preset=preset, weights=weights))
    if not image_size:
        return build_backbone(BackboneSpec(preset=preset, seed=seed))
    from dataclasses import replace
    from vlamux.model.backbones.builtin import PRESETS, BuiltinBackbone
    from vlamux.utils.seeding import seeded  # same seeding as build_backbone
    cfg = replace(PRESETS[preset], image_size=image_size)
    with seeded(seed):
        bb = BuiltinBackbone(cfg, f"builtin-{preset}@{image_size}px-seed{seed}")
    return bb.freeze()


# ---- feature cache --------------------------------------------------------------------------------

@torch.no_grad()
def cache_features(backbone, sampler, n_layers: int, chunk: int = 256):
    """Every frame of the sampler through the backbone once: hidden [N, L, D] (+ layers), mask, token
    type, state [N, S], actions [N, H, A], action mask [N, H] (padded to one L across chunks)."""
    from vlamux.model.batch import canonicalize
    n = sampler.num_samples
    hid, lay, msk, typ, st, act, am = [], [], [], [], [], [], []
    for s in range(0, n, chunk):
        obs, a, m = sampler.batch(list(range(s, min(n, s + chunk))))
        cb = canonicalize(obs, backbone.schema, backbone.tokenizer, "cpu")
        f = backbone.forward(cb, n_layers=n_layers)
        hid.append(f.hidden)
        lay.append(f.layers)
        msk.append(f.mask)
        typ.append(f.token_type)
        st.append(obs.state)
        act.append(a)
        am.append(m)
    length = max(h.shape[1] for h in hid)

    def pad(t, fill=0):
        if t.shape[1] == length:
            return t
        shape = list(t.shape)
        shape[1] = length - t.shape[1]
        return torch.cat([t, t.new_full(shape, fill)], dim=1)

    meta = backbone.meta
    return {
        "hidden": torch.cat([pad(h) for h in hid]),
        "layers": tuple(torch.cat([pad(ls[i]) for ls in lay]) for i in range(n_layers)),
        "mask": torch.cat([pad(m, False) for m in msk]),
        "token_type": torch.cat([pad(t) for t in typ]),
        "state": torch.cat(st), "actions": torch.cat(act), "action_mask": torch.cat(am), "meta": meta,
    }


def cached_batch(cache, idx):
    from vlamux.model.feature import VLAFeature
    f = VLAFeature(cache["hidden"][idx], cache["mask"][idx], cache["token_type"][idx], cache["meta"],
                   tuple(t[idx] for t in cache["layers"]))
    return f, cache["state"][idx], cache["actions"][idx], cache["action_mask"][idx]


# ---- evaluation -----------------------------------------------------------------------------------

def evaluate(runner, tenant: str, tasks: list[str], episodes: int, image_size: int, cameras: tuple[str, ...],
             camera_names: dict[str, str], n_exec: int, max_steps: int, use_state: bool) -> dict:
    from vlamux.envs.tabletop.env import TabletopEnv
    from vlamux.model import Sample
    from vlamux.model.batch import Observation

    per_task = {}
    for t_i, task in enumerate(tasks):
        envs = [TabletopEnv(task, image_size, cameras, max_steps) for _ in range(episodes)]
        obs = [e.reset(seed=EVAL_SEED0 + 1000 * t_i + k)[0] for k, e in enumerate(envs)]
        done = [False] * episodes
        success = [False] * episodes
        steps = [0] * episodes
        queue: list[list[np.ndarray]] = [[] for _ in envs]
        while not all(done):
            need = [i for i in range(episodes) if not done[i] and not queue[i]]
            if need:
                o = Observation(
                    images={camera_names[c]: torch.from_numpy(np.stack([obs[i]["images"][c] for i in need]))
                            for c in cameras},
                    instruction=[obs[i]["instruction"] for i in need],
                    state=torch.from_numpy(np.stack([obs[i]["state"] for i in need])) if use_state else None)
                chunk = runner.execute([Sample(tenant, o, deterministic=True)])[0].unwrap()["actions"].numpy()
                for j, i in enumerate(need):
                    queue[i] = list(chunk[j, :n_exec])
            for i in range(episodes):
                if done[i]:
                    continue
                a = np.clip(queue[i].pop(0), -1.0, 1.0).astype(np.float32)
                obs[i], _, term, trunc, info = envs[i].step(a)
                steps[i] += 1
                if term or trunc:
                    done[i], success[i] = True, bool(info["is_success"])
        for e in envs:
            e.close()
        k = sum(success)
        per_task[task] = {"success": k, "episodes": episodes,
                          "mean_len_success": float(np.mean([s for s, ok in zip(steps, success) if ok])) if k else None}
    k = sum(v["success"] for v in per_task.values())
    n = sum(v["episodes"] for v in per_task.values())
    return {"success": k, "episodes": n, "rate": k / n, "wilson": wilson(k, n), "per_task": per_task}


# ---- one run --------------------------------------------------------------------------------------

def cmd_run(args) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    from vlamux.data.lerobot import LeRobotDataset
    from vlamux.data.sampler import ChunkSampler
    from vlamux.model import ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec

    t_start = time.perf_counter()
    ds = LeRobotDataset(args.data, video_cache_mb=2048)
    info = json.loads((Path(args.data) / "meta" / "info.json").read_text())
    feats = info["features"]
    cam_keys = [k for k in ds.camera_keys if k.split(".")[-1] in args.cameras.split(",")]
    cameras = tuple(k.split(".")[-1] for k in cam_keys)
    image_size = feats[cam_keys[0]]["shape"][0]
    camera_map = {k: k.split(".")[-1] for k in cam_keys}
    tasks = sorted({ds.frame_tasks(e)[0] for e in range(ds.num_episodes)})
    from vlamux.envs.tabletop.tasks import TASKS
    task_ids = [tid for tid, t in TASKS.items() if t.instruction in tasks]
    if (Path(args.data) / "probe_tasks.json").exists():
        task_ids = json.loads((Path(args.data) / "probe_tasks.json").read_text())
    if args.eval_tasks:
        task_ids = args.eval_tasks.split(",")
    episodes = list(range(ds.num_episodes))
    if args.max_episodes:
        episodes = episodes[:args.max_episodes]
    use_state = not args.no_state
    sampler = ChunkSampler(ds, args.horizon, args.batch, camera_map,
                           state_key="observation.state" if use_state else None, seed=args.seed, episodes=episodes)
    stats = sampler.norm_stats()

    backbone = make_backbone(args.preset, args.backbone_image_size, args.backbone_seed, args.weights)
    runner = ModelRunner(backbone)
    options = {}
    if args.head == "gaussian":
        options["init_log_std"] = args.init_log_std
    spec = HeadSpec(args.head, 4, args.horizon, 8 if use_state else 0, width=args.width, depth=args.depth,
                    feature_layers=args.depth if args.feature_layers else 0,
                    instruction_cond=args.instruction_cond, options=options)
    slot = runner.create_slot("probe", spec, OptimizerSpec(lr=args.lr, weight_decay=args.wd), seed=args.seed)
    slot.set_stats(stats["action"], stats["state"])
    if args.cosine:
        sched = torch.optim.lr_scheduler.LambdaLR(
            slot.optimizer, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    else:
        sched = None
    n_params = sum(p.numel() for p in slot.head.parameters())
    print(f"data {args.data}: {len(episodes)} episodes, {sampler.num_samples} frames, cameras {cameras} "
          f"{image_size}px, tasks {task_ids}; backbone {backbone.backbone_id} "
          f"({backbone.num_parameters() / 1e6:.2f}M frozen), head {args.head} {n_params / 1e6:.2f}M", flush=True)

    # Cost of the real runner path: sampler batch -> ForwardBackward -> optim_step.
    bench = None
    if args.bench_runner_steps:
        import copy
        twin = ModelRunner(backbone)
        twin.add_slot(copy.deepcopy(slot))
        it = iter(sampler)
        t0 = time.perf_counter()
        t_data = 0.0
        for _ in range(args.bench_runner_steps):
            td = time.perf_counter()
            obs, a, m = next(it)
            t_data += time.perf_counter() - td
            twin.execute([ForwardBackward("probe", obs, a, m)])[0].unwrap()
            twin.optim_step("probe").unwrap()
        dt = time.perf_counter() - t0
        bench = {"runner_steps_per_s": args.bench_runner_steps / dt, "data_s_per_step": t_data / args.bench_runner_steps,
                 "seconds": dt}
        print(f"runner path: {bench['runner_steps_per_s']:.2f} steps/s at batch {args.batch} "
              f"(data loading {bench['data_s_per_step'] * 1000:.0f} ms/step)", flush=True)
        del twin

    t_setup = time.perf_counter() - t_start - (bench["seconds"] if bench else 0.0)
    t0 = time.perf_counter()
    cache = None
    if args.path == "cached":
        cache = cache_features(backbone, ChunkSampler(ds, args.horizon, args.batch, camera_map,
                                                      state_key="observation.state" if use_state else None,
                                                      episodes=episodes),
                               spec.feature_layers)
        print(f"feature cache: {cache['hidden'].shape} in {time.perf_counter() - t0:.1f}s", flush=True)
    t_cache = time.perf_counter() - t0

    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(args.seed)
    it = iter(sampler) if cache is None else None
    losses, curve = [], []
    n = sampler.num_samples
    for step in range(1, args.steps + 1):
        if cache is None:
            obs, a, m = next(it)
            loss = runner.execute([ForwardBackward("probe", obs, a, m)])[0].unwrap()["loss"]
        else:
            idx = torch.randint(0, n, (args.batch,), generator=g)
            f, s, a, m = cached_batch(cache, idx)
            loss = slot.forward_backward(f, s if use_state else None, a, m)["loss"]
        runner.optim_step("probe").unwrap()
        if sched is not None:
            sched.step()
        losses.append(loss)
        if step % max(1, args.steps // 10) == 0 or step == args.steps:
            curve.append((step, float(np.mean(losses[-max(1, args.steps // 10):]))))
            print(f"  step {step:5d}  {time.perf_counter() - t0:6.1f}s  loss {curve[-1][1]:.4f}", flush=True)
    t_train = time.perf_counter() - t0
    final_loss = float(np.mean(losses[-max(1, min(100, args.steps // 10)):]))

    for n_exec in [int(x) for x in str(args.exec).split(",")]:
        t0 = time.perf_counter()
        ev = evaluate(runner, "probe", task_ids, args.eval_episodes, image_size, cameras, {c: c for c in cameras},
                      n_exec, args.max_steps, use_state)
        t_eval = time.perf_counter() - t0
        lo, hi = ev["wilson"]
        print(f"exec {n_exec}: success {ev['success']}/{ev['episodes']} = {ev['rate']:.0%} (95% CI {lo:.0%}-{hi:.0%}); "
              f"per task: " + ", ".join(f"{t}: {v['success']}/{v['episodes']}" for t, v in ev["per_task"].items()),
              flush=True)
        row = {
            "tag": args.tag, "data": str(args.data), "episodes": len(episodes), "frames": n, "cameras": list(cameras),
            "image_size": image_size, "tasks": task_ids, "preset": args.preset,
            "backbone_image_size": args.backbone_image_size, "head": args.head, "horizon": args.horizon,
            "exec": n_exec, "width": args.width, "depth": args.depth, "feature_layers": spec.feature_layers,
            "state": use_state, "instruction_cond": args.instruction_cond, "batch": args.batch, "lr": args.lr, "cosine": args.cosine, "steps": args.steps,
            "path": args.path, "final_loss": final_loss, "curve": curve, "train_s": t_train, "cache_s": t_cache,
            "train_steps_per_s": args.steps / t_train, "eval_s": t_eval,
            "wall_s": t_setup + t_cache + t_train + t_eval, "bench": bench, "eval": ev, "head_params": n_params,
        }
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with open(args.results or RESULTS, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(f"train {t_train:.0f}s ({args.steps / t_train:.1f} steps/s), cache {t_cache:.0f}s, eval {t_eval:.0f}s, "
              f"wall {row['wall_s']:.0f}s (setup {t_setup:.0f}s excl. runner bench)", flush=True)
    return 0


def cmd_table(args) -> int:
    rows = [json.loads(x) for x in open(args.results or RESULTS) if x.strip()]
    hdr = (f"{'#':>2} {'tag':24s} {'preset':9s} {'head':8s} {'cams':5s} {'px':>3} {'eps':>4} {'H/ex':>5} {'fl':>2} "
           f"{'steps':>5} {'st/s':>5} {'rn/s':>5} {'wall':>5} {'loss':>7} {'success':>8} {'95% CI':>11}")
    print(hdr)
    print("-" * len(hdr))
    for i, r in enumerate(rows):
        ev = r["eval"]
        lo, hi = ev["wilson"]
        cams = "+".join(c[0] for c in r["cameras"])  # a / w / a+w
        preset = r["preset"] + (f"@{r['backbone_image_size']}" if r.get("backbone_image_size") else "")
        rn = f"{r['bench']['runner_steps_per_s']:.1f}" if r.get("bench") else "-"
        print(f"{i:2d} {r['tag'][:24]:24s} {preset:9s} {r['head'][:8]:8s} {cams:5s} {r['image_size']:3d} "
              f"{r['episodes']:4d} {r['horizon']:>2}/{r['exec']:<2} {r['feature_layers']:2d} {r['steps']:5d} "
              f"{r['train_steps_per_s']:5.1f} {rn:>5} {r['wall_s']:5.0f} {r['final_loss']:7.4f} "
              f"{ev['success']:3d}/{ev['episodes']:<3d} {lo:5.0%}-{hi:4.0%}")
        if len(ev["per_task"]) > 1:
            print("     " + ", ".join(f"{t}: {v['success']}/{v['episodes']}" for t, v in ev["per_task"].items()))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen")
    g.add_argument("--task", action="append", required=True)
    g.add_argument("--episodes", type=int, default=200)
    g.add_argument("--image-size", type=int, default=32)
    g.add_argument("--cameras", default="agentview,wrist")
    g.add_argument("--out", required=True)
    g.add_argument("--overwrite", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("--data", required=True)
    r.add_argument("--tag", default="")
    r.add_argument("--cameras", default="agentview,wrist", help="which of the dataset's cameras the head sees")
    r.add_argument("--max-episodes", type=int, default=0)
    r.add_argument("--preset", default="tiny")
    r.add_argument("--backbone-image-size", type=int, default=0, help="override the preset's input size")
    r.add_argument("--backbone-seed", type=int, default=0)
    r.add_argument("--weights", default=None, help="a pretrained backbone file (python -m vlamux.pretrain)")
    r.add_argument("--head", default="l1_chunk")
    r.add_argument("--horizon", type=int, default=8)
    r.add_argument("--exec", default="4", help="actions executed per chunk; a comma list evaluates each")
    r.add_argument("--width", type=int, default=128)
    r.add_argument("--depth", type=int, default=2)
    r.add_argument("--feature-layers", action="store_true", help="layer-wise cross-attention (feature_layers=depth)")
    r.add_argument("--no-state", action="store_true")
    r.add_argument("--instruction-cond", default="adaln", choices=("none", "add", "adaln"))
    r.add_argument("--init-log-std", type=float, default=-0.5)
    r.add_argument("--batch", type=int, default=64)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--wd", type=float, default=0.01)
    r.add_argument("--cosine", action="store_true")
    r.add_argument("--steps", type=int, default=2000)
    r.add_argument("--path", choices=("cached", "runner"), default="cached")
    r.add_argument("--bench-runner-steps", type=int, default=20)
    r.add_argument("--eval-episodes", type=int, default=50, help="per task")
    r.add_argument("--eval-tasks", default="", help="comma-separated task ids (default: the dataset's tasks)")
    r.add_argument("--max-steps", type=int, default=120)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--results", default="")
    t = sub.add_parser("table")
    t.add_argument("--results", default="")
    args = ap.parse_args(argv)
    return {"gen": cmd_gen, "run": cmd_run, "table": cmd_table}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
