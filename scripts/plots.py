"""Regenerate the PNG plots of docs/RESULTS.md from the committed result files.

    python scripts/plots.py            # or: make plots

Reads bench/results/async_rl.json, bench/results/multi_tenant.json and the main job's record
(bench/results/main_job/: summary.json and one metrics.csv per job, copied from a
`python -m vlamux.main_job` run's workdir by `--record`), writes docs/img/*.png; then checks that
every number in docs/RESULTS.md's tables is in a result file its section names
(scripts/check_results.py). A missing input file, or a number found in none, fails it (exit 1);
nothing is measured here.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the machines this runs on
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
IMG = ROOT / "docs" / "img"
MAIN_JOB = RESULTS / "main_job"


MISSING: list[str] = []  # input files not found: the run fails at the end


def _load(path: Path, optional: bool = False) -> dict | None:
    if not path.exists():
        print(f"{'skip' if optional else 'missing'}: {path.relative_to(ROOT)} not found")
        if not optional:
            MISSING.append(str(path.relative_to(ROOT)))
        return None
    return json.loads(path.read_text())


def _save(fig, name: str) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    out = IMG / name
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def async_rl() -> None:
    r = _load(RESULTS / "async_rl.json")
    if r is None:
        return
    warm = _load(RESULTS / "async_rl_warm.json", optional=True)
    fig, axes = plt.subplots(1, 3 if warm else 2, figsize=(15 if warm else 10, 3.8))
    ax1, ax2 = axes[0], axes[1]
    modes = ["sync", "async"]
    ax1.bar(modes, [r["sync_steps_per_s"], r["async_steps_per_s"]], color=["#888", "#2a7"])
    sync = r["sync_steps_per_s"]
    for label, factor, style in (("overlap limit", r["overlap_limit"], "--"), ("all cores busy", r.get("cpu_limit"), ":"),
                                 ("paper's 1.86x", r["target"], "-.")):
        if factor:
            ax1.axhline(sync * factor, ls=style, color="k", lw=1)
            ax1.text(-0.4, sync * factor, f" {label} ({factor:.2f}x)", va="bottom", fontsize=8)
    ax1.set_ylabel("env steps / s")
    ax1.set_title(f"throughput: speedup {r['speedup']:.2f}x")
    for mode, color in (("sync", "#888"), ("async", "#2a7")):
        pts = r["curves"].get(mode) or []
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], label=mode, color=color)
    ax2.set_xlabel("env steps")
    ax2.set_ylabel("success rate (episodes so far)")
    ax2.set_ylim(0, 1)
    ax2.legend()
    ax2.set_title("sample efficiency, random start")
    if warm:
        ax3 = axes[2]
        for mode, color in (("sync", "#888"), ("async", "#2a7")):
            pts = warm["curves"].get(mode) or []
            lo, hi = warm[mode]["success_ci95"]
            ax3.plot([p[0] for p in pts], [p[1] for p in pts], color=color,
                     label=f"{mode}: {warm[mode]['success_rate']:.0%} [{lo:.0%}, {hi:.0%}]")
        ax3.set_xlabel("env steps")
        ax3.set_ylim(0, 1)
        ax3.legend(fontsize=8)
        ax3.set_title(f"from one SFT start ({warm['config']['warm_start_steps']} steps); {warm['speedup']:.2f}x")
    _save(fig, "async_rl.png")


def multi_tenant() -> None:
    r = _load(RESULTS / "multi_tenant.json")
    if r is None:
        return
    settings = [("shared", r)] + ([("split", r["split"])] if "split" in r else [])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    w = 0.38
    x = range(len(settings))
    ax1.bar([i - w / 2 for i in x], [s["isolated_wall_s"] for _, s in settings], w, label="isolated", color="#888")
    ax1.bar([i + w / 2 for i in x], [s["multi_wall_s"] for _, s in settings], w, label="multi-tenant", color="#27a")
    ax1.set_xticks(list(x), [f"{name}: reduction {s['reduction']:.1%}" for name, s in settings])
    ax1.set_ylabel("wall time (s)")
    ax1.legend(loc="lower right")
    ax1.set_title("same 3 RL + 1 SFT jobs (paper: reduction 28.3%)")
    iso = [s["train_util_isolated"] for _, s in settings]
    mul = [s["train_util_multi"] for _, s in settings]
    ax2.bar([i - w / 2 for i in x], iso, w, label="isolated", color="#888")
    ax2.bar([i + w / 2 for i in x], mul, w, label="multi-tenant", color="#27a")
    ax2.set_xticks(list(x), [f"{name}: x{s['train_util_multi'] / s['train_util_isolated']:.2f}" for name, s in settings])
    ax2.set_ylabel("Training Model Service utilisation")
    ax2.set_ylim(0, 1)
    ax2.legend(loc="lower right")
    ax2.set_title("training utilisation (paper 1.99x)")
    _save(fig, "multi_tenant.png")


def _metrics(job: str) -> list[dict]:
    path = MAIN_JOB / job / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def main_job() -> None:
    summary = _load(MAIN_JOB / "summary.json")
    if summary is None:
        return
    jobs = summary["results"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    ax_loss, ax_rl, ax_bar = axes
    for name in jobs:
        rows = _metrics(name)
        sft = [(int(r["step"]), float(r["loss"])) for r in rows if r["phase"] == "sft" and r["loss"]]
        if sft:
            ax_loss.plot([s for s, _ in sft], [v for _, v in sft], label=name, lw=0.8)
        rl = [(int(r["env_steps"]), float(r["success_rate"])) for r in rows
              if r["phase"] == "rl" and r["success_rate"] and r["env_steps"]]
        if rl:
            ax_rl.plot([s for s, _ in rl], [v for _, v in rl], label=name)
    ax_loss.set_xlabel("SFT step")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title("SFT (incl. RL tenants' warm start)")
    ax_loss.legend(fontsize=8)
    ax_rl.set_xlabel("env steps")
    ax_rl.set_ylabel("success rate (recent episodes)")
    ax_rl.set_ylim(0, 1)
    ax_rl.set_title("RL, while training")
    ax_rl.legend(fontsize=8)
    names = list(jobs)
    stages = [("before", "#bbb"), ("after_sft", "#8ac"), ("after", "#27a")]
    w = 0.27
    for k, (stage, color) in enumerate(stages):
        xs, ys, err = [], [], [[], []]
        for i, name in enumerate(names):
            res = jobs[name].get(stage)
            if not res:
                continue
            lo, hi = res["ci95"]
            xs.append(i + (k - 1) * w)
            ys.append(res["success"])
            err[0].append(res["success"] - lo)
            err[1].append(hi - res["success"])
        ax_bar.bar(xs, ys, w, yerr=err, capsize=2, color=color, label=stage.replace("_", " "))
    ax_bar.set_xticks(range(len(names)), names, fontsize=8)
    ax_bar.set_ylabel("success (95% CI)")
    ax_bar.set_ylim(0, 1)
    ax_bar.legend(fontsize=8)
    ax_bar.set_title("evaluation on seeded episodes")
    _save(fig, "main_job.png")


def record(workdir: Path) -> None:
    """Copy a main job run's summary and metrics (its multi-tenant phase) into bench/results/main_job."""
    src = workdir / "summary.json"
    if not src.exists():
        raise SystemExit(f"{src} not found: run `python -m vlamux.main_job --workdir {workdir}` first")
    MAIN_JOB.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, MAIN_JOB / "summary.json")
    for metrics in (workdir / "multi").glob("*/metrics.csv"):
        (MAIN_JOB / metrics.parent.name).mkdir(exist_ok=True)
        shutil.copy(metrics, MAIN_JOB / metrics.parent.name / "metrics.csv")
    print(f"recorded {workdir} -> {MAIN_JOB.relative_to(ROOT)}")


def main(argv=None) -> int:
    global IMG
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", metavar="WORKDIR", help="first copy a main job run's results (e.g. runs/main)")
    ap.add_argument("--img-dir", default=None, help="where the PNGs go (default docs/img)")
    args = ap.parse_args(argv)
    if args.img_dir:
        IMG = Path(args.img_dir).resolve()
    if args.record:
        record(Path(args.record))
    async_rl()
    multi_tenant()
    main_job()
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_results import README, check

    problems = [f"docs/RESULTS.md {p}" for p in check()] + [f"README.md {p}" for p in check(README, require_source=False)]
    for line in problems:
        print(line)
    if MISSING or problems:
        print(f"plots: {len(MISSING)} input files missing, {len(problems)} table numbers without a source")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
