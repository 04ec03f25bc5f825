"""`vlamux demos`, `bench`: work on this machine, no server needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@click.command()
@click.argument("tasks", nargs=-1, required=True)
@click.option("--episodes", type=int, default=50, show_default=True, help="Episodes per task.")
@click.option("--image-size", type=int, default=32, show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("data/service"),
              show_default=True, help="The service's data directory.")
@click.option("--name", default=None, help="Dataset name (default: from the tasks).")
@click.option("--workers", type=int, default=2, show_default=True, help="Simulator processes.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace a dataset of that name.")
def demos(tasks, episodes, image_size, data_dir, name, workers, seed, overwrite) -> None:
    """Scripted demonstrations of TASKS (e.g. goal/touch-red-cube) as a dataset of the service at
    --data-dir (written locally; no server needed). Prints the name for a spec's sft.dataset.
    Meta-World tasks (metaworld/reach-v3, ...) are recorded through the environment service from
    the suite's own experts, one dataset per task (metaworld-<task>)."""
    from tqdm.auto import tqdm

    from vlamux.data.demos import generate

    if episodes < 1 or image_size < 8 or workers < 1:
        raise click.BadParameter("--episodes and --workers must be >= 1, --image-size >= 8")
    metaworld = [t for t in tasks if t.startswith("metaworld/")]
    if metaworld:
        if len(metaworld) != len(tasks):
            raise click.BadParameter("Meta-World tasks (metaworld/...) are recorded one dataset per task; "
                                     "give them apart from the built-in suite's")
        if name and len(tasks) > 1:
            raise click.BadParameter("--name names one dataset; Meta-World tasks make one each", param_hint="--name")
        for task in tasks:
            _metaworld_demos(task, episodes, image_size, data_dir, name, workers, seed, overwrite)
        return
    name = name or dataset_name(tasks)
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise click.BadParameter(f"{name!r}: a dataset name has no '/' and does not start with '.'",
                                 param_hint="--name")
    out = data_dir / "datasets" / name
    if out.exists() and not overwrite:
        raise click.ClickException(f"{out} exists; pass --overwrite to replace it, or --name")
    with tqdm(total=len(tasks), desc=f"demos {name}", unit="task", file=sys.stderr) as bar:
        def progress(msg: str) -> None:
            bar.update(1)
            bar.write(msg, file=sys.stderr)

        r = generate(list(tasks), episodes, out, image_size=image_size, seed=seed, workers=workers,
                     overwrite=overwrite, progress=progress)
    click.echo(f"{r['episodes']} episodes in {out} ({r['seconds']:.0f}s); use  sft: {{dataset: {name}}}",
               err=True)
    click.echo(name)


def _metaworld_demos(task, episodes, image_size, data_dir, name, workers, seed, overwrite) -> None:
    from tqdm.auto import tqdm

    from vlamux.workflows.metaworld_demos import record
    from vlamux.envs.metaworld import parse_task

    try:
        short = parse_task(task.removeprefix("metaworld/"))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="TASKS") from None
    name = name or f"metaworld-{short}"
    out = data_dir / "datasets" / name
    if out.exists() and not overwrite:
        raise click.ClickException(f"{out} exists; pass --overwrite to replace it, or --name")
    with tqdm(total=episodes, desc=f"demos {name}", unit="episode", file=sys.stderr) as bar:
        def progress(done: int, of: int) -> None:
            bar.update(done - bar.n)

        r = record(short, episodes, out, image_size=image_size, seed=seed, n_envs=workers, n_workers=workers,
                   overwrite=overwrite, progress=progress)
    click.echo(f"{r['episodes']} episodes ({r['frames']} frames; {len(r['failed_seeds'])} failed expert episodes "
               f"skipped) in {out} ({r['seconds']:.0f}s); use  sft: {{dataset: {name}}}", err=True)
    click.echo(name)


def dataset_name(tasks) -> str:
    name = "-".join(t.replace("/", "-") for t in tasks)
    if len(name) > 60:
        import hashlib

        name = f"{name[:48]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("name", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(name: str | None, args) -> None:
    """Run the benchmark bench/NAME.py with ARGS (no NAME: list them)."""
    available = sorted(p.stem for p in BENCH_DIR.glob("*.py") if p.stem not in ("common", "__init__")) \
        if BENCH_DIR.is_dir() else []
    if not available:
        raise click.ClickException(f"no benchmarks: {BENCH_DIR} is missing (run from a source checkout)")
    if name is None or name not in available:
        if name is not None:
            click.echo(f"error: no benchmark {name!r}", err=True)
        click.echo("available: " + " ".join(available), err=name is not None)
        sys.exit(0 if name is None else 2)
    rc = subprocess.call([sys.executable, str(BENCH_DIR / f"{name}.py"), *args], env=os.environ.copy())
    sys.exit(rc)
