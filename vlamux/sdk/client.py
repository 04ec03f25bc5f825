"""`Client`: the tenant's (and the admin's) entry point to a vlamux service.

    import vlamux

    c = vlamux.Client("http://127.0.0.1:8321", api_key="vmx_...")
    job = c.submit("specs/sft.yaml")          # or a dict
    job.wait()                                # a progress bar until the job ends
    print(job.state, job.result)
    out = c.policy(job.id).predict(obs)       # act with the trained policy

See docs/API.md for the HTTP API underneath.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlamux.sdk.env import EnvSession
from vlamux.sdk.errors import InvalidInputError, WaitTimeoutError
from vlamux.sdk.http import HTTP
from vlamux.sdk.policy import PolicyClient
from vlamux.sdk.training import TrainingClient

DEFAULT_URL = "http://127.0.0.1:8321"
TERMINAL = ("succeeded", "failed", "cancelled")


class Client:
    """A connection to the service with one API key (a tenant's, or the admin's for `admin`).

    `url` defaults to ``$VLAMUX_URL`` (else http://127.0.0.1:8321) and `api_key` to
    ``$VLAMUX_API_KEY``. Each HTTP attempt times out after `timeout_s`; rate-limited (429) and
    unavailable (502/503/504, connection refused) calls are retried up to `max_retries` times with
    exponential backoff, honouring the server's Retry-After; `http_options` tunes that
    (`backoff_s`=0.5, `max_backoff_s`=20, `max_wait_s`=120: the most one call sleeps between
    attempts). Errors raise the classes of `vlamux.sdk.errors` (`AuthenticationError`,
    `NotFoundError`, `InvalidInputError`, ...). Thread-safe; close it (or use ``with``) when done.
    """

    def __init__(self, url: str | None = None, api_key: str | None = None, timeout_s: float = 60.0,
                 max_retries: int = 5, **http_options: Any):
        self.url = (url or os.environ.get("VLAMUX_URL") or DEFAULT_URL).rstrip("/")
        api_key = api_key if api_key is not None else os.environ.get("VLAMUX_API_KEY")
        self._http = HTTP(self.url, api_key, timeout_s=timeout_s, max_retries=max_retries, **http_options)
        self.admin = AdminAPI(self._http)

    def __repr__(self) -> str:
        return f"vlamux.Client({self.url!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def health(self) -> dict:
        """``{"ok": True, "uptime_s"}``; needs no key."""
        return self._http.get("/healthz")

    # ---- API keys of the caller's tenant ------------------------------------------------------
    def create_key(self, name: str = "") -> tuple[dict, str]:
        """A new API key for the caller's tenant: ``(key info, secret)``; the secret is shown only now."""
        out = self._http.post("/v1/keys", json={"name": name})
        return out["key"], out["api_key"]

    def list_keys(self) -> list[dict]:
        return self._http.get("/v1/keys")["keys"]

    def revoke_key(self, key_id: str) -> None:
        self._http.delete(f"/v1/keys/{key_id}")

    # ---- jobs --------------------------------------------------------------------------------
    def submit(self, spec: dict | str | Path) -> JobHandle:
        """Submit a job spec (a dict, or the path of a YAML/JSON file); returns at once."""
        return JobHandle(self._http, self._http.post("/v1/jobs", json=load_spec_file(spec))["job"])

    def jobs(self, state: str | None = None) -> list[JobHandle]:
        """The tenant's jobs, newest first as the server lists them; `state` filters (e.g. ``running``)."""
        return [JobHandle(self._http, j) for j in self._http.get("/v1/jobs", params={"state": state})["jobs"]]

    def job(self, job_id: str) -> JobHandle:
        return JobHandle(self._http, self._http.get(f"/v1/jobs/{job_id}")["job"])

    # ---- data, policies, training, environments ------------------------------------------------
    def backbones(self) -> list[dict]:
        """The backbones the service holds: name (what a spec's ``backbone`` and a training client's
        ``backbone`` name), id, kind (builtin or hf, with its family), parameters, dtype, resident
        bytes, tokens per camera; the first is the default."""
        return self._http.get("/v1/backbones")["backbones"]

    def datasets(self) -> list[dict]:
        """The datasets a job of this tenant may name in ``sft.dataset``: the service's public ones
        and the tenant's own (``{"name", "public", "bytes"?}``)."""
        return self._http.get("/v1/datasets")["datasets"]

    def upload_dataset(self, path: str, name: str | None = None, timeout_s: float = 3600.0,
                       progress: Callable[[int, int], None] | None = None) -> dict:
        """Upload the LeRobot dataset directory `path` (or a .tar / .tar.gz of one), or a robomimic /
        LIBERO HDF5 file, as this tenant's private dataset `name` (default: the file's or directory's
        name). Large files go in resumable chunks (`progress(sent, total)` after each). The service reads
        it back before it accepts it; errors name the file and the key. Returns what it holds."""
        from vlamux.sdk.uploads import upload

        return upload(self._http, path, "dataset", name or _dataset_name(path), timeout_s=timeout_s, progress=progress)

    def delete_dataset(self, name: str) -> None:
        self._http.delete(f"/v1/datasets/{name}")

    def upload_policy_file(self, path: str, name: str | None = None, timeout_s: float = 600.0) -> dict:
        """Upload a policy file (`policy.download()`'s, perhaps from another service holding the same
        backbone), or a LeRobot policy checkpoint directory (SmolVLA, π0, π0.5, on a service holding its
        VLM), as `name`: a job spec's ``init_from: NAME`` starts from it."""
        from vlamux.sdk.uploads import upload

        base = os.path.basename(path)
        default = base[:-len(".policy.safetensors")] if base.endswith(".policy.safetensors") else base.rsplit(".", 1)[0]
        return upload(self._http, path, "policy_file", name or default, timeout_s=timeout_s)

    def policy_files(self) -> list[dict]:
        return self._http.get("/v1/policy-files")["policy_files"]

    def delete_policy_file(self, name: str) -> None:
        self._http.delete(f"/v1/policy-files/{name}")

    def policies(self) -> list[dict]:
        return self._http.get("/v1/policies")["policies"]

    def policy(self, policy_id: str) -> PolicyClient:
        """A handle on a policy (a job's id, or a training slot's); no call is made."""
        return PolicyClient(self._http, policy_id)

    def training_client(self, head: dict | None = None, optimizer: dict | None = None, seed: int = 0,
                        name: str | None = None, policy_id: str | None = None, backbone: str | None = None,
                        lora_rank: int | None = None) -> TrainingClient:
        """A new training slot with action head `head` (a HeadSpec dict) on `backbone` (a name from
        `backbones()`; default the service's first), or (`policy_id`) an existing one. lora_rank: give
        the tenant's module a LoRA adapter of that rank on the backbone (its default Linears; a head's
        own ``adapter`` dict says more)."""
        if policy_id is not None:
            info = self._http.get(f"/v1/policies/{policy_id}")["policy"]
            if info.get("source") != "training_slot":
                raise InvalidInputError(None, "invalid_input", f"policy_id: {policy_id!r} is a job's policy; "
                                        "only a training slot takes training calls", "policy_id")
            return TrainingClient(self._http, info)
        if head is None:
            raise InvalidInputError(None, "invalid_input", "head: required (or policy_id)", "head")
        if lora_rank is not None:
            head = {**head, "adapter": {**(head.get("adapter") or {}), "kind": "lora", "rank": lora_rank}}
        body: dict[str, Any] = {"head": head, "seed": seed}
        if backbone is not None:
            body["backbone"] = backbone
        if optimizer is not None:
            body["optimizer"] = optimizer
        if name is not None:
            body["name"] = name
        return TrainingClient(self._http, self._http.post("/v1/training/slots", json=body)["policy"])

    def env_session(self, env: dict, n_envs: int = 1, seed: int | None = None) -> EnvSession:
        """Open a simulator session (an EnvSpec dict, e.g. ``{"task": "goal/touch-red-cube"}``)."""
        body: dict[str, Any] = {"env": env, "n_envs": n_envs}
        if seed is not None:
            body["seed"] = seed
        return EnvSession(self._http, self._http.post("/v1/sessions", json=body)["session"])

    def usage(self, tenant_id: str | None = None) -> dict:
        """``{tenant id: {"backbone_s", "head_s", "env_steps", "requests", "stored_bytes"}}``: the caller's
        tenant, or (admin key) `tenant_id` or every tenant."""
        return self._http.get("/v1/usage", params={"tenant": tenant_id})["usage"]


class AdminAPI:
    """Tenant management; needs the admin key (`PermissionDeniedError` with a tenant's)."""

    def __init__(self, http: HTTP):
        self._http = http

    def create_tenant(self, name: str, quotas: dict | None = None) -> tuple[dict, str]:
        """A new tenant and its first API key: ``(tenant, secret)``; the secret is shown only now."""
        body: dict[str, Any] = {"name": name}
        if quotas:
            body["quotas"] = quotas
        out = self._http.post("/v1/tenants", json=body)
        return out["tenant"], out["api_key"]

    def list_tenants(self) -> list[dict]:
        return self._http.get("/v1/tenants")["tenants"]

    def disable_tenant(self, tenant_id: str) -> dict:
        """Disabled: the tenant's keys answer 401 until it is enabled again."""
        return self._http.post(f"/v1/tenants/{tenant_id}/disable")["tenant"]

    def enable_tenant(self, tenant_id: str) -> dict:
        return self._http.post(f"/v1/tenants/{tenant_id}/enable")["tenant"]

    def set_quotas(self, tenant_id: str, **quotas: float) -> dict:
        """Change some of ``max_concurrent_jobs``, ``max_training_slots``, ``max_env_sessions``, ``max_envs`` (sub-envs over the
        tenant's sessions and jobs), ``max_env_processes`` (simulator processes), ``requests_per_s``."""
        return self._http.put(f"/v1/tenants/{tenant_id}/quotas", json=quotas)["tenant"]


class JobHandle:
    """A job of the tenant; `data` is the last view the server gave (`refresh()` fetches a new one)."""

    def __init__(self, http: HTTP, view: dict):
        self._http, self.data = http, dict(view)
        self.id: str = view["id"]

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r}, {self.name!r}, {self.state})"

    name = property(lambda self: self.data.get("name"))
    kind = property(lambda self: self.data.get("kind"))
    state = property(lambda self: self.data.get("state"), doc="queued, running, succeeded, failed or cancelled")
    progress = property(lambda self: self.data.get("progress") or {},
                        doc='{"phase": "sft", "step", "of", "loss", ...} or {"phase": "rl", "env_steps", "of", ...}')
    result = property(lambda self: self.data.get("result"))
    error = property(lambda self: self.data.get("error"))
    queue = property(lambda self: self.data.get("queue"),
                     doc='A job waiting for the service\'s room: {"position", "of", "eta_s", "eta_at", "waiting_for"}; '
                         'else None')

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    def refresh(self) -> JobHandle:
        self.data = self._http.get(f"/v1/jobs/{self.id}")["job"]
        return self

    def events(self, since: int = 0, timeout_s: float | None = None):
        """The job's events as they happen (`vlamux.sdk.events.JobEvent`: state, progress, error),
        from position `since` on, ending with an `end` event once the job has ended (or when
        `timeout_s` has passed). Reconnects as needed; nothing is missed or repeated."""
        from vlamux.sdk.events import follow

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return follow(self._http.client, self.id, since, deadline)

    def wait(self, timeout_s: float | None = None, progress: bool = True, poll_s: float = 1.0) -> JobHandle:
        """Wait until the job ends (any end: check `state`); a tqdm bar on stderr when `progress`.
        Follows the job's event stream, and polls every `poll_s` where the server has none.

        Raises `WaitTimeoutError` (a `TimeoutError`) after `timeout_s`; the job goes on regardless.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        bar = _ProgressBar(self) if progress else None
        try:
            if self._wait_streaming(deadline, bar, poll_s):
                return self
            while True:
                self.refresh()
                if bar is not None:
                    bar.update(self.data)
                if self.done:
                    return self
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise WaitTimeoutError(None, "timeout", f"job {self.id} still {self.state} after {timeout_s}s")
                time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - now)))
        finally:
            if bar is not None:
                bar.close()

    def _wait_streaming(self, deadline: float | None, bar, poll_s: float) -> bool:
        """wait() over the event stream: True once the job has ended; False where the server has no
        stream to give (then wait() polls)."""
        from vlamux.sdk.errors import NotFoundError, RateLimitedError, ServiceUnavailableError

        refreshed = 0.0
        try:
            for event in self.events(timeout_s=None if deadline is None else max(0.0, deadline - time.monotonic())):
                now = time.monotonic()
                if event.kind in ("state", "end", "error") or now - refreshed >= poll_s:
                    self.refresh()  # the view (progress with its "of", state, result), at most every poll_s
                    refreshed = now
                    if bar is not None:
                        bar.update(self.data)
                if event.kind == "end":
                    return True
        except (NotFoundError, RateLimitedError, ServiceUnavailableError):
            if self.refresh().done:
                return True
            return False  # an older server, or a stream that keeps breaking: poll instead
        if self.refresh().done:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeoutError(None, "timeout", f"job {self.id} still {self.state} after the timeout")
        return False

    def logs(self, since: int = 0) -> list[str]:
        """Log lines from number `since` on: state changes, one line per metrics row, the error."""
        return self._http.get(f"/v1/jobs/{self.id}/logs", params={"since": since})["lines"]

    def follow_logs(self, poll_s: float = 1.0, since: int = 0):
        """Yield log lines as they come, until the job ends (from the event stream; by polling every
        `poll_s` where the server has none)."""
        from vlamux.sdk.errors import NotFoundError, RateLimitedError, ServiceUnavailableError

        try:
            for event in self.events(since):
                if event.id is not None:
                    since = event.id
                    yield event.line
            return
        except (NotFoundError, RateLimitedError, ServiceUnavailableError):
            pass  # an older server, or a stream that keeps breaking: poll from where it stopped
        while True:
            out = self._http.get(f"/v1/jobs/{self.id}/logs", params={"since": since})
            yield from out["lines"]
            since = max(since, int(out["next"]))
            if self.refresh().done:
                out = self._http.get(f"/v1/jobs/{self.id}/logs", params={"since": since})
                yield from out["lines"]
                return
            time.sleep(poll_s)

    def metrics(self, since: int = 0) -> list[dict]:
        """Per-step metrics rows (``time_s, phase, step, loss, ...``) from row `since` on."""
        return self._http.get(f"/v1/jobs/{self.id}/metrics", params={"since": since})["rows"]

    def checkpoints(self) -> list[dict]:
        return self._http.get(f"/v1/jobs/{self.id}/checkpoints")["checkpoints"]

    def cancel(self) -> JobHandle:
        """Cancel a queued or running job (`ConflictError` if it already ended)."""
        self.data = self._http.post(f"/v1/jobs/{self.id}/cancel")["job"]
        return self

    def policy(self) -> PolicyClient:
        """The job's policy (its id is the job's)."""
        return PolicyClient(self._http, self.id)


class _ProgressBar:
    """A tqdm bar driven by a job's progress: steps (sft), env steps (rl), or a phase alone (eval).

    Until the job reports a phase, a one-line status (queued, running) stands in, and is cleared
    when the first phase's bar replaces it; each finished phase keeps its line.
    """

    def __init__(self, job: JobHandle, file=None):
        self.job, self.file = job, file or sys.stderr
        self.bar, self.phase = None, None

    def update(self, view: dict) -> None:
        from tqdm.auto import tqdm

        p = view.get("progress") or {}
        phase, state = p.get("phase"), view.get("state")
        name = view.get("name") or self.job.id
        n = p.get("env_steps", p.get("step"))
        n = int(n) if isinstance(n, (int, float)) else None
        if phase is None and self.phase is None:  # no progress yet: the status line
            if self.bar is None:
                self.bar = tqdm(total=None, desc=f"{name} {state}", bar_format="{desc} [{elapsed}]",
                                file=self.file, dynamic_ncols=True, leave=False)
            place = view.get("queue")
            self.bar.set_description_str(f"{name} {state}" + (f" {queue_text(place)}" if place else ""),
                                         refresh=False)
            if state in TERMINAL:
                self.bar.leave = True
            self.bar.refresh()
            return
        if phase is not None and phase != self.phase:
            self.close()
            self.bar = tqdm(total=p.get("of"), initial=n or 0, desc=f"{name} {phase}",
                            unit="env step" if "env_steps" in p else "step", file=self.file, dynamic_ncols=True,
                            smoothing=0, leave=True)
            self.phase = phase
        if n is not None:
            self.bar.n = n
        post = {}
        for key, fmt in (("loss", "{:.4g}"), ("success_rate", "{:.2f}"), ("policy_version", "{}")):
            if isinstance(p.get(key), (int, float)):
                post["v" if key == "policy_version" else key] = fmt.format(p[key])
        if p.get("phase") == "eval" and p.get("tasks"):
            post["tasks"] = len(p["tasks"])
        if state in TERMINAL:
            post["state"] = state
        self.bar.set_postfix(post, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def queue_text(place: dict) -> str:
    """A waiting job's place in a few words: "#2 of 3, starts in ~4m" ("~?" when not known)."""
    eta = place.get("eta_s")
    if eta is None:
        starts = "start not known yet"
    elif eta < 1:
        starts = "starts next"
    else:
        starts = "starts in ~" + (f"{eta:.0f}s" if eta < 90 else f"{eta / 60:.0f}m" if eta < 5400 else f"{eta / 3600:.1f}h")
    return f"#{place.get('position')} of {place.get('of')}, {starts}"


def load_spec_file(spec: dict | str | Path) -> dict:
    """A spec dict as is, or read from a ``.json``/``.yaml``/``.yml`` file."""
    if isinstance(spec, dict):
        return spec
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"spec: no file {str(path)!r}")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else _yaml(text)
    except ValueError as e:
        raise InvalidInputError(None, "invalid_input", f"spec: {path} is not valid "
                                f"{'JSON' if path.suffix == '.json' else 'YAML'}: {e}", "spec") from None
    if not isinstance(data, dict):
        raise InvalidInputError(None, "invalid_input", f"spec: {path} holds a {type(data).__name__}, "
                                "expected a mapping", "spec")
    return data


def _yaml(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


def _dataset_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    for ext in (".tar.gz", ".tgz", ".tar", ".hdf5", ".h5"):
        if base.endswith(ext):
            return base[: -len(ext)]
    return base
