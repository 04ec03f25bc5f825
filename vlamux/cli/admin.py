"""`vlamux tenants`, `keys`, `usage`, `backbones`: who may use the service, and what it holds."""

from __future__ import annotations

import json
from pathlib import Path

import click

from vlamux.cli.common import Group, client, table, when


@click.group(cls=Group)
@click.option("--admin-key", envvar="VLAMUX_ADMIN_KEY", default=None,
              help="The admin key (env VLAMUX_ADMIN_KEY; else --admin-key-file, else --key).")
@click.option("--admin-key-file", envvar="VLAMUX_ADMIN_KEY_FILE", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A file holding the admin key, e.g. <data-dir>/admin.key (env VLAMUX_ADMIN_KEY_FILE): "
                   "keeps the key off command lines and out of shell history.")
@click.pass_context
def tenants(ctx, admin_key: str | None, admin_key_file: Path | None) -> None:
    """Manage tenants (admin key)."""
    if admin_key is None and admin_key_file is not None:
        admin_key = admin_key_file.read_text().strip() or None
    ctx.obj = {"admin_key": admin_key}


def _admin(ctx):
    return client(ctx, key=ctx.find_object(dict).get("admin_key") if ctx.obj else None).admin


def _quota_options(f):
    for name, typ in (("--requests-per-s", float), ("--max-env-sessions", int), ("--max-concurrent-jobs", int),
                      ("--max-envs", int), ("--max-env-processes", int), ("--max-training-slots", int)):
        f = click.option(name, type=typ, default=None)(f)
    return f


def _quotas(**kw) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


@tenants.command("list")
@click.pass_context
def tenants_list(ctx) -> None:
    rows = [dict(t, created=when(t.get("created_at")), **{k: v for k, v in (t.get("quotas") or {}).items()})
            for t in _admin(ctx).list_tenants()]
    table(rows, ["id", "name", "disabled", "created", "max_concurrent_jobs", "max_training_slots", "max_env_sessions",
                  "max_envs", "max_env_processes", "requests_per_s"])


@tenants.command("create")
@click.argument("name")
@_quota_options
@click.pass_context
def tenants_create(ctx, name: str, **quotas) -> None:
    """Create tenant NAME; prints its id and first API key (shown only now)."""
    tenant, secret = _admin(ctx).create_tenant(name, _quotas(**quotas) or None)
    click.echo(f"tenant {tenant['name']} id {tenant['id']}")
    click.echo(f"api key (shown once): {secret}")


@tenants.command("disable")
@click.argument("tenant_id")
@click.pass_context
def tenants_disable(ctx, tenant_id: str) -> None:
    t = _admin(ctx).disable_tenant(tenant_id)
    click.echo(f"tenant {t['id']} ({t['name']}) disabled")


@tenants.command("enable")
@click.argument("tenant_id")
@click.pass_context
def tenants_enable(ctx, tenant_id: str) -> None:
    t = _admin(ctx).enable_tenant(tenant_id)
    click.echo(f"tenant {t['id']} ({t['name']}) enabled")


@tenants.command("quotas")
@click.argument("tenant_id")
@_quota_options
@click.pass_context
def tenants_quotas(ctx, tenant_id: str, **quotas) -> None:
    """Change a tenant's quotas; prints them all."""
    t = _admin(ctx).set_quotas(tenant_id, **_quotas(**quotas))
    click.echo(json.dumps(t["quotas"]))


@click.command()
@click.pass_context
def backbones(ctx) -> None:
    """The backbones the service holds (the first is the default)."""
    rows = client(ctx).backbones()
    for r in rows:
        r["family"] = r.get("family") or r["kind"]
        r["resident_mb"] = r["resident_bytes"] / 2 ** 20
        r["params_m"] = r["parameters"] / 1e6
        caps = {c.get("rows") for c in (r.get("group_caps") or {}).values()}
        r["group_cap"] = "/".join(str(c) for c in sorted(caps, key=str)) if caps else "-"  # rows, learned
        tiers = list((r.get("slot_tiers") or {}).values())  # replicas paging their serving slots
        r["slots_r/p/s"] = "/".join(str(sum(t[k]["count"] for t in tiers)) for k in ("resident", "parked", "stored")) \
            if tiers else "-"
    table(rows, ["name", "family", "id", "params_m", "dtype", "resident_mb", "tokens_per_camera", "group_cap",
                  "slots_r/p/s", "default"])


@click.group(cls=Group)
def keys() -> None:
    """The API keys of the caller's tenant."""


@keys.command("list")
@click.pass_context
def keys_list(ctx) -> None:
    rows = [dict(k, created=when(k.get("created_at")), last_used=when(k.get("last_used_at")))
            for k in client(ctx).list_keys()]
    table(rows, ["id", "name", "revoked", "created", "last_used"])


@keys.command("create")
@click.argument("name", default="")
@click.pass_context
def keys_create(ctx, name: str) -> None:
    key, secret = client(ctx).create_key(name)
    click.echo(f"key {key['id']}")
    click.echo(f"api key (shown once): {secret}")


@keys.command("revoke")
@click.argument("key_id")
@click.pass_context
def keys_revoke(ctx, key_id: str) -> None:
    client(ctx).revoke_key(key_id)
    click.echo(f"key {key_id} revoked")


@click.command()
@click.option("--tenant", "tenant_id", default=None, help="A tenant's id (admin key; default: every tenant).")
@click.pass_context
def usage(ctx, tenant_id: str | None) -> None:
    """Usage totals: backbone and head seconds, env steps, requests, stored bytes."""
    u = client(ctx).usage(tenant_id)
    table([dict(v, tenant=k) for k, v in u.items()],
           ["tenant", "backbone_s", "head_s", "env_steps", "requests", "stored_bytes"])
