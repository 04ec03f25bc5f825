"""`vlamux submit`, `jobs`, `job`, `logs`, `cancel`: a tenant's jobs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from vlamux.cli.common import client, table, when


@click.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--watch/--no-watch", default=True, show_default=True,
              help="Follow the job with a progress bar until it ends.")
@click.pass_context
def submit(ctx, spec: Path, watch: bool) -> None:
    """Submit the job spec SPEC (YAML or JSON)."""
    c = client(ctx)
    job = c.submit(spec)
    click.echo(f"submitted job {job.id} ({job.name}, {job.kind})")
    if not watch:
        return
    try:
        job.wait(progress=True)
    except KeyboardInterrupt:
        click.echo(f"\ndetached; the job goes on: vlamux logs {job.id} --follow", err=True)
        sys.exit(130)
    _report_end(job)


def _summary(result: dict) -> str:
    """Scalars of a job's result, one level of nesting flattened: "sft.steps 30, sft.final_loss 0.86"."""
    parts = []
    for k, v in result.items():
        items = v.items() if isinstance(v, dict) else [(None, v)]
        for sub, x in items:
            if isinstance(x, (str, int, float, bool)) or x is None:
                parts.append(f"{k}.{sub}" if sub else k)
                parts[-1] += " " + (f"{x:.4g}" if isinstance(x, float) else str(x))
    return ", ".join(parts)


def _report_end(job) -> None:
    click.echo(f"job {job.id} {job.state}")
    if job.result:
        click.echo("result: " + _summary(job.result))
    if job.error:
        click.echo(f"error: {job.error}", err=True)
    if job.state != "succeeded":
        sys.exit(1)


@click.command()
@click.option("--state", type=click.Choice(["queued", "running", "succeeded", "failed", "cancelled"]), default=None)
@click.pass_context
def jobs(ctx, state: str | None) -> None:
    """The tenant's jobs."""
    from vlamux.sdk.client import queue_text

    rows = [dict(j.data, created=when(j.data.get("created_at")),
                 queue=queue_text(j.queue) if j.queue else "-") for j in client(ctx).jobs(state)]
    table(rows, ["id", "name", "kind", "state", "queue", "created"])


@click.command()
@click.argument("job_id")
@click.pass_context
def job(ctx, job_id: str) -> None:
    """One job, as JSON."""
    click.echo(json.dumps(client(ctx).job(job_id).data, indent=2, default=str))


@click.command()
@click.argument("job_id")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--since", type=int, default=0, help="First line to print.")
@click.pass_context
def logs(ctx, job_id: str, follow: bool, since: int) -> None:
    """A job's log: state changes and one line per training step."""
    j = client(ctx).job(job_id)
    lines = j.follow_logs(since=since) if follow else j.logs(since)
    for line in lines:
        click.echo(line)


@click.command()
@click.argument("job_id")
@click.pass_context
def cancel(ctx, job_id: str) -> None:
    """Cancel a queued or running job."""
    j = client(ctx).job(job_id).cancel()
    click.echo(f"job {j.id} {j.state}")
