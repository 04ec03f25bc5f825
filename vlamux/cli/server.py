"""`vlamux serve`: the services and the HTTP API in this process (or on a Ray cluster)."""

from __future__ import annotations

from pathlib import Path

import click


class SlotMemory(click.ParamType):
    """--slot-memory-mb: a positive number of MiB, auto or none."""
    name = "MIB|auto|none"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, float):
            return value
        text = str(value).strip().lower()
        if text in ("auto", "none"):
            return None if text == "none" else "auto"
        try:
            mib = float(text)
        except ValueError:
            self.fail(f"{value!r}: expected a number of MiB, auto or none", param, ctx)
        if not mib > 0:
            self.fail(f"{value!r}: must be > 0", param, ctx)
        return mib


@click.command()
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
@click.option("--group-cap", type=click.Choice(["learned", "none"]), default="learned", show_default=True,
              envvar="VLAMUX_GROUP_CAP",
              help="Cap on a group's rows: learned by timing each backbone at start (a second or two "
                   "a service), or none beyond the queues' batch rows (env VLAMUX_GROUP_CAP).")
@click.option("--max-adapters-per-group", type=click.IntRange(1, None), default=None,
              help="At most this many tenants' LoRA adapters in one backbone call (each is one more segment of "
                   "every adapted Linear); the others join the next group. Default: no cap.")
@click.option("--slot-memory-mb", type=SlotMemory(), default="auto", show_default=True,
              help="Serving slots each inference replica keeps resident, in MiB: the least recently used "
                   "beyond it are parked in host memory and come back when asked. auto: a quarter of a GPU's "
                   "free memory when the replica starts (on a CPU all stay resident); none: all resident.")
@click.option("--slot-host-mb", type=click.FloatRange(0, None, min_open=True), default=None,
              help="Parked serving slots kept in host memory, in MiB (with --slot-memory-mb): the least "
                   "recently used beyond it are stored on disk. Default: all in memory.")
@click.option("--max-running-jobs", type=click.IntRange(1, None), default=None,
              help="Jobs running at once, all tenants together; past it jobs are accepted and queued (fair "
                   "across tenants; GET /v1/jobs/ID says their place and when they should start). "
                   "Default: no limit.")
@click.option("--job-history", type=click.IntRange(0, None), default=100, show_default=True,
              help="Finished jobs kept per tenant, with their checkpoints and files; older ones go as jobs "
                   "end (their usage stays in the tenant's totals; a policy being served is kept).")
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
          inference_replicas, group_cap, max_adapters_per_group, slot_memory_mb, slot_host_mb, max_running_jobs,
          job_history, ray_address, store_url, admin_key, max_body_mb, gym_envs, log_level) -> None:
    """Run the services and the HTTP API until interrupted (embedded runtime unless --ray)."""
    config = serve_config(data_dir, backbone, device, dtype, training_device, inference_devices, inference_replicas,
                          ray_address, store_url, max_body_mb, extra_backbones, gym_envs, vlm,
                          group_cap=None if group_cap == "none" else group_cap,
                          max_adapters_per_group=max_adapters_per_group, slot_memory_mb=slot_memory_mb,
                          slot_host_mb=slot_host_mb, max_running_jobs=max_running_jobs, job_history=job_history)
    from vlamux.api.server import serve as run

    data_dir.mkdir(parents=True, exist_ok=True)
    run(host, port, config, admin_key=admin_key, log_level=log_level)


def serve_config(data_dir, backbone, device, dtype, training_device, inference_devices, inference_replicas,
                 ray_address, store_url, max_body_mb, extra_backbones=(), gym_envs=(), vlm=None, group_cap="learned",
                 max_adapters_per_group=None, slot_memory_mb="auto", slot_host_mb=None, max_running_jobs=None,
                 job_history=100):
    """`vlamux serve`'s options as a ServiceConfig; a device or dtype this machine cannot run is a usage
    error now, not a failure after start-up (on Ray, devices are the actors' and checked there)."""
    from vlamux.api.host import ServiceConfig
    from vlamux.model.device import resolve_device, resolve_dtype

    from vlamux.model.backbones import named_backbones, spec_from_arg

    for opt, check in (("--backbone", lambda: spec_from_arg(backbone, vlm=vlm)),
                       ("--add-backbone", lambda: named_backbones(extra_backbones, vlm))):
        try:  # as the host will read them
            check()
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
                         inference_replicas=inference_replicas, group_cap=group_cap,
                         max_adapters_per_group=max_adapters_per_group, slot_memory_mb=slot_memory_mb,
                         slot_host_mb=slot_host_mb, max_running_jobs=max_running_jobs, job_history=job_history,
                         ray_address=ray_address, max_body_mb=max_body_mb, gym_envs=allowed)
