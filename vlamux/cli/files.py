"""`vlamux datasets`, `policies`: a tenant's files on the service."""

from __future__ import annotations

from pathlib import Path

import click

from vlamux.cli.common import Group, client, table


@click.group(cls=Group, invoke_without_command=True)
@click.pass_context
def datasets(ctx) -> None:
    """The datasets a job may name in sft.dataset: the service's (public) and yours; `upload` adds one."""
    if ctx.invoked_subcommand is None:
        for d in client(ctx).datasets():
            click.echo(f"{d['name']}  {'public' if d.get('public', True) else 'yours'}  {d.get('format', 'lerobot')}")


@datasets.command("upload")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--name", default=None, help="Its name in job specs (default: the directory's name).")
@click.pass_context
def datasets_upload(ctx, path: Path, name: str | None) -> None:
    """Upload dataset PATH as your private dataset: a LeRobot directory (or a .tar/.tar.gz of one), or a
    robomimic / LIBERO .hdf5 file. Large files go in resumable chunks."""
    d = client(ctx).upload_dataset(str(path), name)
    click.echo(f"dataset {d['name']}: {d['episodes']} episodes, {d['frames']} frames, {d['bytes']} bytes")


@datasets.command("delete")
@click.argument("name")
@click.pass_context
def datasets_delete(ctx, name: str) -> None:
    """Delete your dataset NAME."""
    client(ctx).delete_dataset(name)
    click.echo(f"dataset {name} deleted")


@click.group(cls=Group, invoke_without_command=True)
@click.pass_context
def policies(ctx) -> None:
    """The tenant's policies (one per job, one per training slot); `download` saves one as a file."""
    if ctx.invoked_subcommand is None:
        table(client(ctx).policies(), ["id", "source", "name", "policy_version"])


@policies.command("download")
@click.argument("policy_id")
@click.option("--version", type=int, default=None, help="A checkpoint's policy version (default: the live one).")
@click.option("--out", "-o", default=None, help="The file to write (default: the server's name for it, here).")
@click.option("--format", "fmt", type=click.Choice(["vlamux", "lerobot"]), default="vlamux", show_default=True,
              help="lerobot: a policy imported from a LeRobot checkpoint, as a tar of its checkpoint directory.")
@click.pass_context
def policies_download(ctx, policy_id: str, version: int | None, out: str | None, fmt: str) -> None:
    """Save policy POLICY_ID as one file: run it with vlamux.policy.load(FILE, backbone=...) (with
    --format lerobot: unpack the tar; lerobot's from_pretrained or vlamux.policy.load(DIR, vlm=...))."""
    path = client(ctx).policy(policy_id).download(out, version, fmt)
    click.echo(f"wrote {path}")


@policies.command("delete")
@click.argument("policy_id")
@click.pass_context
def policies_delete(ctx, policy_id: str) -> None:
    """Delete training slot POLICY_ID: it frees its place in your max_training_slots; its saved
    checkpoints stay downloadable (download --version)."""
    client(ctx).training_client(policy_id=policy_id).delete()
    click.echo(f"training slot {policy_id} deleted")


@policies.command("upload")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--name", default=None, help="Its name for a job's init_from (default: from the file's name).")
@click.pass_context
def policies_upload(ctx, path: Path, name: str | None) -> None:
    """Upload policy file PATH (a download's), or a LeRobot checkpoint directory (SmolVLA, π0, π0.5);
    a job spec's `init_from: NAME` starts from it."""
    f = client(ctx).upload_policy_file(str(path), name)
    kind = f"{f['family']} checkpoint" if f.get("format") == "lerobot" else f"version {f['policy_version']}"
    click.echo(f"policy file {f['name']}: {kind} on backbone {f['backbone']}, {f['bytes']} bytes")


@policies.command("files")
@click.pass_context
def policies_files(ctx) -> None:
    """The policy files you uploaded."""
    table(client(ctx).policy_files(), ["name", "bytes"])
