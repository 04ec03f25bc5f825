"""`vlamux backbone ...`: model directories on this machine, no server needed.

    vlamux backbone init --family qwen2_5_vl --size tiny --out DIR   # random weights, the hub's layout
    vlamux backbone inspect DIR                                       # what a directory holds
"""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.group()
def backbone() -> None:
    """Model directories (transformers VLMs) on this machine."""


@backbone.command("init")
@click.option("--family", required=True, type=click.Choice(["qwen2_5_vl", "qwen3_vl", "smolvlm", "paligemma"]))
@click.option("--size", default="tiny", show_default=True,
              help="tiny | small | base, or the full size (qwen2_5_vl: 3b, qwen3_vl: 2b, smolvlm: 2b, paligemma: 3b).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace a directory that is not empty.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="How the weights are stored.")
@click.option("--device", default="cpu", show_default=True, help="Where they are made (cuda: quicker for 2-3B).")
def init(family: str, size: str, out: Path, seed: int, overwrite: bool, dtype: str, device: str) -> None:
    """Write a randomly initialised model directory of FAMILY (marked as random weights in its
    config): for tests, demos and benchmarks where no real weights are at hand."""
    from vlamux.model.backbones.hf.directory import ModelDirError
    from vlamux.model.backbones.hf.random_init import write_random_model

    try:
        import torch

        path = write_random_model(family, size, out, seed=seed, overwrite=overwrite,
                                  dtype=getattr(torch, dtype), device=device)
    except ModelDirError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {path}: {family} ({size}), random weights")
    _print(path)


@backbone.command("inspect")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--load", is_flag=True, help="Also load it and report parameters and tokens per camera.")
def inspect(path: Path, load: bool) -> None:
    """What a model directory holds: its family, its files, whether its weights are random."""
    from vlamux.model.backbones.hf.directory import ModelDirError

    try:
        _print(path, load)
    except (ModelDirError, ValueError) as e:
        raise click.ClickException(str(e)) from None


def _print(path: Path, load: bool = False) -> None:
    from vlamux.model.backbones.hf import family_of, open_model_dir

    found = open_model_dir(path)
    family = family_of(found.model_type)
    size = sum(f.stat().st_size for f in found.weight_files)
    click.echo(f"family: {family.name} (model_type {found.model_type})")
    click.echo(f"weights: {len(found.weight_files)} file(s), {size / 2 ** 20:.1f} MiB"
               + (" (random: made by `vlamux backbone init`)" if found.random_weights else ""))
    click.echo(f"files: {', '.join(sorted(p.name for p in found.path.iterdir()))}")
    click.echo(f"content id: {found.identity()}")
    if load:
        from vlamux.model import BackboneSpec, build_backbone

        bb = build_backbone(BackboneSpec(kind="hf", path=str(found.path)))
        d = bb.describe()
        click.echo(json.dumps({k: d[k] for k in ("id", "parameters", "hidden_dim", "layers", "tokens_per_camera")}))
