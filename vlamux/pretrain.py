"""Pretrain the built-in backbone on the built-in suite, so frozen features carry what tenants need.

A frozen, randomly initialised backbone gives a head enough to learn one task from demonstrations
(touch-red-cube: 82-90% success), but not to follow instructions across a suite's tasks (measured:
goal suite touch tasks 15-18%, object 6%; see docs/RESULTS.md). This script trains the backbone
end to end together with a behaviour-cloning head on scripted demonstrations of every built-in
suite, then keeps the backbone only: tenants train their own heads on it, frozen, as always.
It is deterministic given its arguments (seeded data, init and batches), so the shipped weights
can be reproduced:

    python -m vlamux.pretrain --out vlamux/assets/tiny-tabletop.safetensors

It pretrains on recorded LeRobot datasets instead with --datasets (a glob; every dataset with the same
cameras, state and action features), e.g. the Meta-World experts' demonstrations of every MT50 task:

    python -m vlamux.pretrain --datasets 'data/metaworld/64px-50ep/*' \
        --camera-map '{"observation.images.corner2": "corner2"}' --out runs/metaworld-backbone.safetensors

Nothing here runs at service time; the services load the result through
`BackboneSpec(preset="tiny", weights=...)`.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vlamux.model import BackboneSpec, HeadSpec, build_backbone, canonicalize, save_backbone
from vlamux.model.normalize import NormStats
from vlamux.model.backbones.builtin import PRESETS, BuiltinBackbone
from vlamux.model.heads import build_head
from vlamux.utils.seeding import seeded

CAMERAS = {"observation.images.agentview": "agentview", "observation.images.wrist": "wrist"}


def suite_tasks(suites: list[str]) -> list[str]:
    from vlamux.envs.tabletop.tasks import SUITES

    return [t for s in suites for t in SUITES[s]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", default="goal,spatial,object")
    ap.add_argument("--episodes", type=int, default=100, help="expert episodes per task")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--aux-weight", type=float, default=1.0,
                    help="weight of the grounding loss: the query tokens predict where the episode ends")
    ap.add_argument("--horizon", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default="data/demos/pretrain")
    ap.add_argument("--out", default="vlamux/assets/tiny-tabletop.safetensors")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--datasets", default=None,
                    help="LeRobot dataset directories to pretrain on, comma-separated globs (default: the built-in "
                         "suites' demos)")
    ap.add_argument("--camera-map", default=None,
                    help="with --datasets: JSON mapping the datasets' camera keys to the backbone's camera names")
    args = ap.parse_args(argv)
    if bool(args.datasets) != bool(args.camera_map):
        ap.error("--datasets and --camera-map go together")
    if args.threads:
        torch.set_num_threads(args.threads)
    from vlamux.data import ChunkSampler, LeRobotDataset
    from vlamux.data.demos import generate

    if args.datasets:
        roots = sorted({Path(p) for pattern in args.datasets.split(",") for p in glob.glob(pattern.strip())
                        if (Path(p) / "meta" / "info.json").exists()})
        if not roots:
            ap.error(f"--datasets: no LeRobot dataset matches {args.datasets!r}")
        camera_map = json.loads(args.camera_map)
        tasks = [r.name for r in roots]
    else:
        tasks = suite_tasks(args.suites.split(","))
        root = Path(args.data) / f"{args.suites.replace(',', '-')}-{args.episodes}-{args.image_size}px"
        if not (root / "meta" / "info.json").exists():
            print(f"generating {args.episodes} expert episodes for each of {len(tasks)} tasks -> {root}", flush=True)
            generate(tasks, args.episodes, root, image_size=args.image_size, workers=2, progress=None)
        roots, camera_map = [root], CAMERAS
    datasets = [LeRobotDataset(r) for r in roots]
    samplers = [ChunkSampler(d, args.horizon, args.batch, camera_map, seed=args.seed) for d in datasets]
    # Where each episode's gripper ends (normalised): for touch, lift and push alike, a point the
    # instruction picks out in the image. Predicting it from the query tokens is what makes the
    # backbone bind words to objects; behaviour cloning alone did not (docs/RESULTS.md).
    state_key = "observation.state"
    ends = torch.tensor(np.stack([np.asarray(d.episode_array(e, state_key), np.float32)[-1, :3]
                                  for d in datasets for e in range(d.num_episodes)]))
    ends = (ends - ends.mean(0)) / ends.std(0).clamp_min(1e-6)
    action_dim, state_dim = (int(datasets[0].feature(k)["shape"][0]) for k in ("action", state_key))

    with seeded(args.seed):
        backbone = BuiltinBackbone(PRESETS[args.preset], f"builtin-{args.preset}-pretrained")
        head = build_head(HeadSpec("l1_chunk", action_dim, args.horizon, state_dim, width=128, depth=2),
                          backbone.meta.hidden_dim)
        aux = torch.nn.Linear(backbone.meta.hidden_dim, 3)
    params = list(backbone.parameters()) + list(head.parameters()) + list(aux.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    t0, epoch, it = time.time(), 0, None
    gen = torch.Generator().manual_seed(args.seed)
    n_query = backbone.meta.n_query
    data = _concat([_preload(s) for s in samplers])
    n = len(data["episode"])
    # one dataset: its own statistics (what the shipped weights were made with); several: over them all
    stats = samplers[0].norm_stats("mean_std") if len(samplers) == 1 else \
        {"action": NormStats.from_data(data["actions"][data["mask"]], "mean_std"),
         "state": NormStats.from_data(data["state"], "mean_std")}
    print(f"pretraining {args.preset} ({sum(p.numel() for p in backbone.parameters()) / 1e6:.2f}M) with an "
          f"l1_chunk head on {len(tasks)} tasks, {n} samples (preloaded in {time.time() - t0:.0f}s), "
          f"{args.steps} steps", flush=True)
    for step in range(1, args.steps + 1):
        if it is None or len(it) < args.batch:  # a new epoch: a fresh permutation, seeded
            it, epoch = np.random.default_rng([args.seed, epoch]).permutation(n).tolist(), epoch + 1
        idx, it = it[:args.batch], it[args.batch:]
        batch = _batch(data, idx)
        obs, actions, mask = batch
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / max(1, args.warmup)) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        cb = canonicalize(obs, backbone.schema, backbone.tokenizer, "cpu", torch.float32)
        feature = backbone.forward_group([cb])[0]
        state = stats["state"].normalize(obs.state)
        bc, _ = head.loss(feature, state, stats["action"].normalize(actions), mask, gen)
        target = ends[data["episode"][idx]]
        grounding = torch.nn.functional.mse_loss(aux(feature.hidden[:, :n_query].mean(1)), target)
        loss = bc + args.aux_weight * grounding
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 200 == 0 or step == args.steps:
            print(f"  step {step:5d}  {time.time() - t0:6.0f}s  bc {bc.item():.4f}  grounding {grounding.item():.4f}",
                  flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_backbone(backbone, out)
    check = build_backbone(BackboneSpec(preset=args.preset, weights=str(out)))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB); loads as {check.backbone_id}")
    return 0


def _preload(sampler, chunk: int = 512) -> dict:
    """Every frame of the dataset in memory, decoded once (a video decode per sample is the
    bottleneck otherwise): images uint8 per camera, state, action chunks, instructions, episodes."""
    out: dict = {"images": {}, "instruction": [], "state": [], "actions": [], "mask": [], "episode": []}
    for s in range(0, sampler.num_samples, chunk):
        ids = list(range(s, min(sampler.num_samples, s + chunk)))
        obs, actions, mask = sampler.batch(ids)
        for k, v in obs.images.items():
            out["images"].setdefault(k, []).append(v)
        out["instruction"] += list(obs.instruction)
        out["state"].append(obs.state)
        out["actions"].append(actions)
        out["mask"].append(mask)
        out["episode"] += [sampler.locate(i)[0] for i in ids]
    out["images"] = {k: torch.cat(v) for k, v in out["images"].items()}
    for k in ("state", "actions", "mask"):
        out[k] = torch.cat(out[k])
    out["episode"] = torch.tensor(out["episode"])
    return out


def _concat(parts: list[dict]) -> dict:
    """Several datasets' preloaded frames as one, each episode numbered after the previous datasets'."""
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [int(p["episode"].max()) + 1 for p in parts[:-1]])
    return {"images": {k: torch.cat([p["images"][k] for p in parts]) for k in parts[0]["images"]},
            "instruction": [x for p in parts for x in p["instruction"]],
            **{k: torch.cat([p[k] for p in parts]) for k in ("state", "actions", "mask")},
            "episode": torch.cat([p["episode"] + int(o) for p, o in zip(parts, offsets)])}


def _batch(data: dict, idx: list[int]):
    from vlamux.model import Observation

    i = torch.tensor(idx)
    obs = Observation({k: v[i] for k, v in data["images"].items()}, [data["instruction"][j] for j in idx],
                      data["state"][i])
    return obs, data["actions"][i], data["mask"][i]


if __name__ == "__main__":
    sys.exit(main())
