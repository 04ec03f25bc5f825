"""The `vlamux` command: run the service, and use it from a shell.

    vlamux serve                                  # embedded runtime on 127.0.0.1:8321
    export VLAMUX_API_KEY=vmx_...                 # a tenant's key (`vlamux tenants create NAME`)
    vlamux demos goal/touch-red-cube              # a dataset of scripted demonstrations, on this machine
    vlamux submit spec.yaml                       # progress bar until the job ends
    vlamux jobs; vlamux logs JOB --follow; vlamux usage

`--url` / ``$VLAMUX_URL`` (default http://127.0.0.1:8321) and `--key` / ``$VLAMUX_API_KEY`` select
the service and the key. A failed call prints one line (the server's message and field) and exits
with status 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click

DEFAULT_URL = "http://127.0.0.1:8321"
BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


class _Group(click.Group):
    """Turns the SDK's errors into one line on stderr and exit status 1, without a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:  # noqa: BLE001 - everything else is reported, not dumped
            _fail(e)


def _fail(e: Exception) -> None:
    from vlamux.sdk.errors import AuthenticationError, ServiceUnavailableError, VlamuxAPIError

    if isinstance(e, AuthenticationError) and "missing" in e.message:
        msg = f"error: no API key: pass --key or set VLAMUX_API_KEY [{e.status} {e.type}]"
    elif isinstance(e, ServiceUnavailableError):
        msg = f"error: cannot reach the service: {e.message}"
    elif isinstance(e, VlamuxAPIError):
        msg = f"error: {e.message}"
        if e.field and not e.message.startswith(f"{e.field}:"):
            msg += f" (field: {e.field})"
        if e.status:
            msg += f" [{e.status} {e.type}]"
    elif isinstance(e, (FileNotFoundError, ValueError, KeyError, RuntimeError, OSError)):
        msg = f"error: {e}"
    else:
        msg = f"error: {type(e).__name__}: {e}"
    click.echo(msg, err=True)
    sys.exit(1)


def _client(ctx: click.Context, key: str | None = None):
    from vlamux.sdk import Client

    obj = ctx.find_root().obj
    return Client(obj["url"], api_key=key or obj["key"] or "", timeout_s=obj["timeout"],
                  max_retries=obj["max_retries"])


def _table(rows: list[dict], columns: list[str]) -> None:
    if not rows:
        click.echo("(none)")
        return
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    click.echo("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def _when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "-"


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
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


# ---- the service -------------------------------------------------------------------------------
@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8321, show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("data/service"),
              show_default=True, help="Store, datasets, checkpoints.")
@click.option("--backbone", default="tiny", show_default=True,
              help="The default backbone: a built-in preset, or a model directory (a transformers VLM).")
@click.option("--add-backbone", "extra_backbones", multiple=True, metavar="NAME=PRESET_OR_DIR",
              help="Another backbone the services hold at once (repeatable); job specs and slots name it. "
                   "lerobot:CKPT_DIR holds a LeRobot checkpoint's VLM (SmolVLA, π0, π0.5; with --vlm).")
@click.option("--vlm", default=None, metavar="DIR",
              help="For a lerobot:CKPT_DIR backbone: the local copy of the VLM/tokenizer repository the "
                   "checkpoint names by hub id (its weights come from the checkpoint).")
@click.option("--device", default="auto", show_default=True,
              help="Where the model services run: auto (CUDA when present), cpu, cuda, cuda:N.")
@click.option("--dtype", default="auto", show_default=True,
              help="Backbone precision: auto (bfloat16 on CUDA, float32 on a CPU), float32, bfloat16.")
@click.option("--training-device", default=None, help="The Training Model Service's device (default: --device).")
@click.option("--inference-devices", default=None, metavar="DEV[,DEV...]",
              help="Inference replicas' devices, replica i on the i-th (cycled; default: --device).")
@click.option("--inference-replicas", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Inference Model Service replicas.")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Place the services on this Ray cluster ('auto', 'ray://host:10001'; 'local' starts one in-process).")
@click.option("--store-url", default=None, help="SQLAlchemy URL of the store (default: sqlite in --data-dir).")
@click.option("--admin-key", envvar="VLAMUX_ADMIN_KEY", default=None,
              help="Admin key to use (env VLAMUX_ADMIN_KEY); else one is made on the first start.")
@click.option("--max-body-mb", type=float, default=64.0, show_default=True, help="Largest request body.")
@click.option("--gym-env", "gym_envs", multiple=True, metavar="ID[=KWARG,...]",
              help="Let tenants simulate gymnasium env ID (backend 'gym'), with only these env_kwargs "
                   "(repeatable). Without it the 'gym' backend is off for tenants.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False))
def serve(host, port, data_dir, backbone, extra_backbones, vlm, device, dtype, training_device, inference_devices,
          inference_replicas, ray_address, store_url, admin_key, max_body_mb, gym_envs, log_level) -> None:
    """Run the services and the HTTP API until interrupted (embedded runtime unless --ray)."""
    config = serve_config(data_dir, backbone, device, dtype, training_device, inference_devices, inference_replicas,
                          ray_address, store_url, max_body_mb, extra_backbones, gym_envs, vlm)
    from vlamux.api.server import serve as run

    data_dir.mkdir(parents=True, exist_ok=True)
    run(host, port, config, admin_key=admin_key, log_level=log_level)


def serve_config(data_dir, backbone, device, dtype, training_device, inference_devices, inference_replicas,
                 ray_address, store_url, max_body_mb, extra_backbones=(), gym_envs=(), vlm=None):
    """`vlamux serve`'s options as a ServiceConfig; a device or dtype this machine cannot run is a usage
    error now, not a failure after start-up (on Ray, devices are the actors' and checked there)."""
    from vlamux.api.host import ServiceConfig
    from vlamux.model.device import resolve_device, resolve_dtype

    from vlamux.model.backbones import spec_from_arg

    for opt, value in [("--backbone", backbone)] + [("--add-backbone", b) for b in extra_backbones]:
        name, sep, what = value.partition("=")
        if opt == "--add-backbone" and not (sep and name and what):
            raise click.BadParameter(f"{value!r}: expected NAME=PRESET_OR_DIR", param_hint=opt)
        try:
            spec_from_arg(what if opt == "--add-backbone" else value, vlm=vlm)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint=opt) from None
    allowed = {}
    for value in gym_envs:
        env_id, _, kwargs = value.partition("=")
        if not env_id:
            raise click.BadParameter(f"{value!r}: expected ID or ID=KWARG,...", param_hint="--gym-env")
        allowed[env_id] = tuple(k.strip() for k in kwargs.split(",") if k.strip())
    devices = tuple(d.strip() for d in inference_devices.split(",") if d.strip()) if inference_devices else ()
    if not ray_address:
        for opt, name in [("--device", device), ("--training-device", training_device)] + \
                [("--inference-devices", d) for d in devices]:
            if name is None:
                continue
            try:
                resolve_dtype(dtype, resolve_device(name))
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint=opt if "dtype" not in str(e) else "--dtype") from None
    return ServiceConfig(data_dir=data_dir, store_url=store_url, backbone=backbone,
                         extra_backbones=tuple(extra_backbones), vlm=vlm, device=device, dtype=dtype,
                         training_device=training_device, inference_devices=devices,
                         inference_replicas=inference_replicas, ray_address=ray_address, max_body_mb=max_body_mb,
                         gym_envs=allowed)


# ---- jobs --------------------------------------------------------------------------------------
@main.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--watch/--no-watch", default=True, show_default=True,
              help="Follow the job with a progress bar until it ends.")
@click.pass_context
def submit(ctx, spec: Path, watch: bool) -> None:
    """Submit the job spec SPEC (YAML or JSON)."""
    c = _client(ctx)
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


@main.command()
@click.option("--state", type=click.Choice(["queued", "running", "succeeded", "failed", "cancelled"]), default=None)
@click.pass_context
def jobs(ctx, state: str | None) -> None:
    """The tenant's jobs."""
    rows = [dict(j.data, created=_when(j.data.get("created_at"))) for j in _client(ctx).jobs(state)]
    _table(rows, ["id", "name", "kind", "state", "created"])


@main.command()
@click.argument("job_id")
@click.pass_context
def job(ctx, job_id: str) -> None:
    """One job, as JSON."""
    click.echo(json.dumps(_client(ctx).job(job_id).data, indent=2, default=str))


@main.command()
@click.argument("job_id")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--since", type=int, default=0, help="First line to print.")
@click.pass_context
def logs(ctx, job_id: str, follow: bool, since: int) -> None:
    """A job's log: state changes and one line per training step."""
    j = _client(ctx).job(job_id)
    lines = j.follow_logs(since=since) if follow else j.logs(since)
    for line in lines:
        click.echo(line)


@main.command()
@click.argument("job_id")
@click.pass_context
def cancel(ctx, job_id: str) -> None:
    """Cancel a queued or running job."""
    j = _client(ctx).job(job_id).cancel()
    click.echo(f"job {j.id} {j.state}")


# ---- tenants and keys --------------------------------------------------------------------------
@main.group(cls=_Group)
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
    return _client(ctx, key=ctx.find_object(dict).get("admin_key") if ctx.obj else None).admin


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
    rows = [dict(t, created=_when(t.get("created_at")), **{k: v for k, v in (t.get("quotas") or {}).items()})
            for t in _admin(ctx).list_tenants()]
    _table(rows, ["id", "name", "disabled", "created", "max_concurrent_jobs", "max_training_slots", "max_env_sessions",
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


@main.command()
@click.pass_context
def backbones(ctx) -> None:
    """The backbones the service holds (the first is the default)."""
    rows = _client(ctx).backbones()
    for r in rows:
        r["family"] = r.get("family") or r["kind"]
        r["resident_mb"] = r["resident_bytes"] / 2 ** 20
        r["params_m"] = r["parameters"] / 1e6
        caps = {c.get("rows") for c in (r.get("group_caps") or {}).values()}
        r["group_cap"] = "/".join(str(c) for c in sorted(caps, key=str)) if caps else "-"  # rows, learned
    _table(rows, ["name", "family", "id", "params_m", "dtype", "resident_mb", "tokens_per_camera", "group_cap",
                  "default"])


@main.group(cls=_Group)
def keys() -> None:
    """The API keys of the caller's tenant."""


@keys.command("list")
@click.pass_context
def keys_list(ctx) -> None:
    rows = [dict(k, created=_when(k.get("created_at")), last_used=_when(k.get("last_used_at")))
            for k in _client(ctx).list_keys()]
    _table(rows, ["id", "name", "revoked", "created", "last_used"])


@keys.command("create")
@click.argument("name", default="")
@click.pass_context
def keys_create(ctx, name: str) -> None:
    key, secret = _client(ctx).create_key(name)
    click.echo(f"key {key['id']}")
    click.echo(f"api key (shown once): {secret}")


@keys.command("revoke")
@click.argument("key_id")
@click.pass_context
def keys_revoke(ctx, key_id: str) -> None:
    _client(ctx).revoke_key(key_id)
    click.echo(f"key {key_id} revoked")


# ---- usage, data, policies ---------------------------------------------------------------------
@main.command()
@click.option("--tenant", "tenant_id", default=None, help="A tenant's id (admin key; default: every tenant).")
@click.pass_context
def usage(ctx, tenant_id: str | None) -> None:
    """Usage totals: backbone and head seconds, env steps, requests, stored bytes."""
    u = _client(ctx).usage(tenant_id)
    _table([dict(v, tenant=k) for k, v in u.items()],
           ["tenant", "backbone_s", "head_s", "env_steps", "requests", "stored_bytes"])


@main.group(cls=_Group, invoke_without_command=True)
@click.pass_context
def datasets(ctx) -> None:
    """The datasets a job may name in sft.dataset: the service's (public) and yours; `upload` adds one."""
    if ctx.invoked_subcommand is None:
        for d in _client(ctx).datasets():
            click.echo(f"{d['name']}  {'public' if d.get('public', True) else 'yours'}  {d.get('format', 'lerobot')}")


@datasets.command("upload")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--name", default=None, help="Its name in job specs (default: the directory's name).")
@click.pass_context
def datasets_upload(ctx, path: Path, name: str | None) -> None:
    """Upload dataset PATH as your private dataset: a LeRobot directory (or a .tar/.tar.gz of one), or a
    robomimic / LIBERO .hdf5 file. Large files go in resumable chunks."""
    d = _client(ctx).upload_dataset(str(path), name)
    click.echo(f"dataset {d['name']}: {d['episodes']} episodes, {d['frames']} frames, {d['bytes']} bytes")


@datasets.command("delete")
@click.argument("name")
@click.pass_context
def datasets_delete(ctx, name: str) -> None:
    """Delete your dataset NAME."""
    _client(ctx).delete_dataset(name)
    click.echo(f"dataset {name} deleted")


@main.group(cls=_Group, invoke_without_command=True)
@click.pass_context
def policies(ctx) -> None:
    """The tenant's policies (one per job, one per training slot); `download` saves one as a file."""
    if ctx.invoked_subcommand is None:
        _table(_client(ctx).policies(), ["id", "source", "name", "policy_version"])


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
    path = _client(ctx).policy(policy_id).download(out, version, fmt)
    click.echo(f"wrote {path}")


@policies.command("delete")
@click.argument("policy_id")
@click.pass_context
def policies_delete(ctx, policy_id: str) -> None:
    """Delete training slot POLICY_ID: it frees its place in your max_training_slots; its saved
    checkpoints stay downloadable (download --version)."""
    _client(ctx).training_client(policy_id=policy_id).delete()
    click.echo(f"training slot {policy_id} deleted")


@policies.command("upload")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--name", default=None, help="Its name for a job's init_from (default: from the file's name).")
@click.pass_context
def policies_upload(ctx, path: Path, name: str | None) -> None:
    """Upload policy file PATH (a download's), or a LeRobot checkpoint directory (SmolVLA, π0, π0.5);
    a job spec's `init_from: NAME` starts from it."""
    f = _client(ctx).upload_policy_file(str(path), name)
    kind = f"{f['family']} checkpoint" if f.get("format") == "lerobot" else f"version {f['policy_version']}"
    click.echo(f"policy file {f['name']}: {kind} on backbone {f['backbone']}, {f['bytes']} bytes")


@policies.command("files")
@click.pass_context
def policies_files(ctx) -> None:
    """The policy files you uploaded."""
    _table(_client(ctx).policy_files(), ["name", "bytes"])


@main.command()
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
    --data-dir (written locally; no server needed). Prints the name for a spec's sft.dataset."""
    from tqdm.auto import tqdm

    from vlamux.data.demos import generate

    if episodes < 1 or image_size < 8 or workers < 1:
        raise click.BadParameter("--episodes and --workers must be >= 1, --image-size >= 8")
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


def dataset_name(tasks) -> str:
    name = "-".join(t.replace("/", "-") for t in tasks)
    if len(name) > 60:
        import hashlib

        name = f"{name[:48]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
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


from vlamux.backbone_cli import backbone  # noqa: E402  (a group of its own: it needs no server)

main.add_command(backbone)

if __name__ == "__main__":
    main()
