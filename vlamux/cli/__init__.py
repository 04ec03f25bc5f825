"""The `vlamux` command: run the service, and use it from a shell.

    vlamux serve                                  # embedded runtime on 127.0.0.1:8321
    export VLAMUX_API_KEY=vmx_...                 # a tenant's key (`vlamux tenants create NAME`)
    vlamux demos goal/touch-red-cube              # a dataset of scripted demonstrations, on this machine
    vlamux submit spec.yaml                       # progress bar until the job ends
    vlamux jobs; vlamux logs JOB --follow; vlamux usage

`--url` / ``$VLAMUX_URL`` (default http://127.0.0.1:8321) and `--key` / ``$VLAMUX_API_KEY`` select
the service and the key. A failed call prints one line (the server's message and field) and exits
with status 1. The commands by group: `server` (serve), `jobs`, `admin` (tenants, keys, usage,
backbones), `files` (datasets, policies), `local` (demos, bench: no server needed), and
`vlamux.backbone_cli` (backbone init).
"""

from __future__ import annotations

import click

from vlamux.backbone_cli import backbone
from vlamux.cli import admin, files, jobs, local, server
from vlamux.cli.common import DEFAULT_URL, Group


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", envvar="VLAMUX_URL", default=DEFAULT_URL, show_default=True,
              help="The service (env VLAMUX_URL).")
@click.option("--key", envvar="VLAMUX_API_KEY", default=None, help="API key (env VLAMUX_API_KEY).")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds per HTTP attempt.")
@click.option("--max-retries", type=click.IntRange(0, 20), default=5, show_default=True,
              help="Retries of rate-limited or unavailable calls.")
@click.version_option(package_name="vlamux")
@click.pass_context
def main(ctx: click.Context, url: str, key: str | None, timeout: float, max_retries: int) -> None:
    """vlamux: multi-tenant post-training of robot policies on one shared VLA backbone."""
    ctx.obj = {"url": url, "key": key, "timeout": timeout, "max_retries": max_retries}


for _command in (server.serve, jobs.submit, jobs.jobs, jobs.job, jobs.logs, jobs.cancel, admin.tenants,
                 admin.backbones, admin.keys, admin.usage, files.datasets, files.policies, local.demos, local.bench,
                 backbone):
    main.add_command(_command)
