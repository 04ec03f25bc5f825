"""The HTTP API (FastAPI): routes translate HTTP into `ServiceHost` calls and errors into answers.

Every route under /v1 resolves the caller's key first; every id it takes is looked up for that
caller's tenant by the host, so another tenant's id answers 404 exactly like a missing one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlamux import wire
from vlamux.api.admission import ADMITTED, Admission
from vlamux.api.errors import ApiError, BodyLimit, error_response, translate
from vlamux.api.access import Principal
from vlamux.api.file_routes import add_file_routes
from vlamux.api.faults import NotFound
from vlamux.api.host import ServiceHost
from vlamux.api.jobs import json_safe
from vlamux.api.keycache import TTLCache
from vlamux.api.responses import ResponseCounts
from vlamux.api.session_routes import add_session_routes
from vlamux.api.validate import (MSGPACK, MSGPACK_OUT, KeyIn, LoadStateIn, OptimStepIn, QuotasIn, SlotIn, TenantIn,
                                 fits_head, floats, head_error, invalid, observation)
from vlamux.errors import VlamuxError

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
STREAM_POLL_S = 0.5  # how often an event stream looks for news
STREAM_IDLE_S = 120.0  # an event stream with no news this long ends (the client reconnects)


def create_app(host: ServiceHost) -> FastAPI:
    app = FastAPI(title="vlamux", version="0.1.0",
                  description="Multi-tenant post-training service for VLA robot policies. See docs/API.md.")
    limit = int(host.config.max_body_mb * 1024 * 1024)

    # Handlers per class: an exception reaching Starlette's catch-all is re-raised after the 500.
    for cls in (ApiError, VlamuxError, wire.WireError, TimeoutError, Exception):
        app.add_exception_handler(cls, lambda request, e: translate(e))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        if err.get("type") == "json_invalid":  # loc is ("body", <offset>): the body as a whole
            return error_response(422, "invalid_input", f"body: not valid JSON ({err.get('msg')})", "body")
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path")]
        field = ".".join(loc) or "body"
        return error_response(422, "invalid_input", f"{field}: {err.get('msg')}", field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        """Starlette's own answers (no such route, method not allowed, body too large) in our format."""
        kinds = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "payload_too_large"}
        kind = kinds.get(e.status_code, "invalid_input" if e.status_code < 500 else "server_error")
        if e.status_code == 400:  # FastAPI's "There was an error parsing the body" (an optional body)
            return error_response(400, kind, f"body: {e.detail}", "body")
        return error_response(e.status_code, kind, str(e.detail), headers=getattr(e, "headers", None))

    app.add_middleware(BodyLimit, limit=limit, json_limit=int(host.config.max_json_kb * 1024),
                       read_timeout_s=host.config.body_timeout_s, upload_limit=int(host.config.max_upload_mb * (1 << 20)))
    app.add_middleware(Admission, host=host)  # it runs first, before the body is read
    app.add_middleware(ResponseCounts, counts=host.responses, lock=host.responses_lock)  # outermost: every answer

    async def principal(request: Request) -> Principal:
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer "):
            raise ApiError(401, "unauthenticated", "missing 'Authorization: Bearer <api key>'",
                           headers={"WWW-Authenticate": "Bearer"})
        secret = auth[7:].strip()
        p = host.access.cached_principal(secret)
        if TTLCache.missing(p):  # the store is read on a worker thread, never on the event loop
            p = await run_in_threadpool(host.access.authenticate, secret)
        if p is None:
            raise ApiError(401, "unauthenticated", "unknown, revoked or disabled API key",
                           headers={"WWW-Authenticate": "Bearer"})
        if request.scope.get("state", {}).get(ADMITTED) == p:  # counted at the front door already
            return p
        if not p.is_admin and not host.access.quotas_cached(p.tenant_id):
            await run_in_threadpool(host.access.quotas, p.tenant_id)
        host.access.admit(p)
        return p

    async def tenant(p: Principal = Depends(principal)) -> str:
        if p.is_admin:
            raise ApiError(403, "forbidden", "this route acts as a tenant; use a tenant's key")
        return p.tenant_id

    async def admin(p: Principal = Depends(principal)) -> Principal:
        if not p.is_admin:
            raise ApiError(403, "forbidden", "admin only")
        return p

    async def msgpack_body(request: Request) -> bytes:
        """The raw body, size-checked (bytes and msgpack objects, by its headers alone) but not decoded:
        routes decode it with `wire.loads` on their worker thread, after their own cheap lookups, so a
        hostile body costs neither the event loop nor a decode for an id that does not exist."""
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype not in (wire.CONTENT_TYPE, "application/x-msgpack"):
            raise ApiError(415, "invalid_input", f"content-type: expected {wire.CONTENT_TYPE}", "content-type")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, "payload_too_large", f"body over the limit of {limit} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        wire.check_size(raw)
        return raw

    def packed(obj, status: int = 200) -> Response:
        return Response(wire.dumps(obj), status_code=status, media_type=wire.CONTENT_TYPE)

    # ---- service ---------------------------------------------------------------------------
    @app.get("/healthz")
    def healthz():
        return {"ok": True, "uptime_s": round(time.time() - host.started_at, 1)}

    @app.get("/dashboard", include_in_schema=False)
    def dashboard():
        return FileResponse(STATIC / "dashboard.html", media_type="text/html")

    from fastapi.staticfiles import StaticFiles

    app.mount("/static", StaticFiles(directory=STATIC), name="static")  # the dashboard's script and styles

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics(p: Principal = Depends(admin)):
        from vlamux.api.prometheus import render

        return PlainTextResponse(render(host), media_type="text/plain; version=0.0.4")

    # ---- tenants and keys ------------------------------------------------------------------
    @app.post("/v1/tenants", status_code=201)
    def create_tenant(body: TenantIn, p: Principal = Depends(admin)):
        try:
            t = host.store.create_tenant(body.name, body.quotas.model_dump(exclude_none=True) if body.quotas else None)
        except ValueError as e:
            if "exists" in str(e):
                raise ApiError(409, "conflict", str(e), "name") from None
            raise
        _, secret = host.store.create_key(t.id, "default")
        return {"tenant": _tenant_view(host, t), "api_key": secret}

    @app.get("/v1/tenants")
    def list_tenants(p: Principal = Depends(admin)):
        return {"tenants": [_tenant_view(host, t) for t in host.store.list_tenants()]}

    def _admin_tenant(tenant_id: str):
        t = host.store.get_tenant(tenant_id)
        if t is None:
            raise NotFound(f"no tenant {tenant_id!r}")
        return t

    @app.post("/v1/tenants/{tenant_id}/disable")
    def disable_tenant(tenant_id: str, p: Principal = Depends(admin)):
        _admin_tenant(tenant_id)
        return {"tenant": _tenant_view(host, host.set_disabled(tenant_id, True))}

    @app.post("/v1/tenants/{tenant_id}/enable")
    def enable_tenant(tenant_id: str, p: Principal = Depends(admin)):
        _admin_tenant(tenant_id)
        return {"tenant": _tenant_view(host, host.set_disabled(tenant_id, False))}

    @app.put("/v1/tenants/{tenant_id}/quotas")
    def set_quotas(tenant_id: str, body: QuotasIn, p: Principal = Depends(admin)):
        t = _admin_tenant(tenant_id)
        quotas = {**(t.quotas or {}), **body.model_dump(exclude_none=True)}
        host.store.set_quotas(tenant_id, quotas)
        host.access.forget(tenant_id=tenant_id)
        return {"tenant": _tenant_view(host, host.store.get_tenant(tenant_id))}

    @app.post("/v1/keys", status_code=201)
    def create_key(body: KeyIn, t: str = Depends(tenant)):
        key, secret = host.store.create_key(t, body.name)
        return {"key": _key_view(key), "api_key": secret}

    @app.get("/v1/me")
    def me(p: Principal = Depends(principal)):
        """Who the key belongs to: the admin, or a tenant with its name and quotas."""
        if p.is_admin:
            return {"admin": True, "tenant": None}
        return {"admin": False, "tenant": _tenant_view(host, host.store.get_tenant(p.tenant_id))}

    @app.get("/v1/keys")
    def list_keys(t: str = Depends(tenant)):
        return {"keys": [_key_view(k) for k in host.store.list_keys(t)]}

    @app.delete("/v1/keys/{key_id}", status_code=204)
    def revoke_key(key_id: str, t: str = Depends(tenant)):
        if not host.store.revoke_key(key_id, t):
            raise NotFound(f"no key {key_id!r}")
        host.access.forget(key_id=key_id)
        return Response(status_code=204)

    # ---- datasets and jobs -----------------------------------------------------------------
    @app.get("/v1/backbones")
    def backbones(p: Principal = Depends(principal)):
        return {"backbones": host.backbones()}

    @app.post("/v1/backbones/calibrate")
    def calibrate(p: Principal = Depends(admin)):
        """Every model service measures its backbones' forward time by rows again, between its groups,
        and caps its groups where a bigger one stops paying (admin: it costs the services a few seconds)."""
        return {"group_caps": host.runtime.calibrate(), "backbones": host.backbones()}

    add_file_routes(app, host, tenant)

    @app.post("/v1/jobs", status_code=202)
    def submit(spec: dict[str, Any], t: str = Depends(tenant)):
        # The Master Service checks the backbone only after the job's record is made (which would
        # then stay "queued" for ever, counting against the tenant's job quota): check it first.
        held = host.runtime.backbone_names()
        if spec.get("backbone") is not None and spec["backbone"] not in held:
            raise invalid("backbone", f"this service holds {held}, the spec asks for {spec['backbone']!r}")
        return {"job": host.jobs.submit(t, spec)}

    @app.get("/v1/jobs")
    def jobs(state: str | None = None, t: str = Depends(tenant)):
        if state is not None and state not in ("queued", "running", "succeeded", "failed", "cancelled"):
            raise ApiError(422, "invalid_input", f"state: unknown state {state!r}", "state")
        return {"jobs": host.jobs.list(t, state)}

    @app.get("/v1/jobs/{job_id}")
    def job(job_id: str, t: str = Depends(tenant)):
        return {"job": host.jobs.view(t, job_id)}

    @app.post("/v1/jobs/{job_id}/cancel")
    def cancel(job_id: str, t: str = Depends(tenant)):
        return {"job": host.jobs.cancel(t, job_id)}

    @app.get("/v1/jobs/{job_id}/logs")
    def logs(job_id: str, since: int = Query(default=0, ge=0, le=10**9), t: str = Depends(tenant)):
        lines, nxt = host.jobs.logs(t, job_id, since)
        return {"lines": lines, "next": nxt}

    @app.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str, request: Request, since: int = Query(default=0, ge=0, le=10**9),
                         t: str = Depends(tenant)):
        """Server-Sent Events: the job's state transitions, progress (one per metrics row) and error,
        each with an id; a client that reconnects with `Last-Event-ID` (or `?since=`) gets every entry
        after that one, once. The stream ends with an `end` event when the job has ended, or an `idle`
        one after STREAM_IDLE_S without news (reconnect to go on); a comment line keeps it alive."""
        await run_in_threadpool(host.jobs.entries, t, job_id, 10**9)  # 404 before a stream begins
        last = request.headers.get("last-event-id", "").strip()
        if last:
            if not last.isdigit() or len(last) > 12:
                raise invalid("last-event-id", f"expected an event id this stream sent, got {last[:40]!r}")
            since = int(last)
        hold = contextlib.ExitStack()
        hold.enter_context(host.futures.long_poll(t))  # counted with the tenant's long polls: 429 past the cap

        async def stream():
            try:
                pos, news, alive = since, time.monotonic(), time.monotonic()
                yield "retry: 2000\n\n"
                while True:
                    entries, nxt, state = await run_in_threadpool(host.jobs.entries, t, job_id, pos)
                    for i, e in enumerate(entries):
                        data = json.dumps({"data": json_safe(e["data"]), "line": e["line"]}, default=str)
                        yield f"id: {pos + i + 1}\nevent: {e['kind']}\ndata: {data}\n\n"
                    pos, now = nxt, time.monotonic()
                    if entries:
                        news = alive = now
                    elif state in ("succeeded", "failed", "cancelled"):
                        yield f"event: end\ndata: {json.dumps({'state': state})}\n\n"
                        return
                    elif now - news > STREAM_IDLE_S:
                        yield f"event: idle\ndata: {json.dumps({'after_s': STREAM_IDLE_S})}\n\n"
                        return
                    elif now - alive > 10.0:
                        yield ": keepalive\n\n"
                        alive = now
                    await asyncio.sleep(STREAM_POLL_S)
            finally:
                hold.close()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/v1/jobs/{job_id}/metrics")
    def job_metrics(job_id: str, since: int = Query(default=0, ge=0, le=10**9), t: str = Depends(tenant)):
        rows, nxt = host.jobs.metrics(t, job_id, since)
        return {"rows": rows, "next": nxt}

    @app.get("/v1/jobs/{job_id}/checkpoints")
    def job_checkpoints(job_id: str, t: str = Depends(tenant)):
        return {"checkpoints": host.jobs.checkpoints(t, job_id)}

    # ---- policies, inference and low-level training ----------------------------------------
    @app.get("/v1/policies")
    def policies(t: str = Depends(tenant)):
        return {"policies": host.policies.list(t)}

    @app.get("/v1/policies/{policy_id}")
    def policy(policy_id: str, t: str = Depends(tenant)):
        return {"policy": host.policies.view(t, policy_id)}

    @app.get("/v1/policies/{policy_id}/versions")
    def versions(policy_id: str, t: str = Depends(tenant)):
        return host.policies.versions(t, policy_id)

    @app.get("/v1/policies/{policy_id}/download")
    def download_policy(policy_id: str, version: int | None = Query(default=None, ge=0, le=10**12),
                        format: str = Query(default="vlamux", pattern="^(vlamux|lerobot)$"),
                        t: str = Depends(tenant)):
        """The policy as one safetensors file (vlamux.policy.load runs it without a server): the
        tenant's module, spec and statistics and the backbone's id and content hash, never the
        backbone's weights. `version`: a checkpoint's policy version (default: the live one).
        format=lerobot: a policy imported from a LeRobot checkpoint, as a tar of the checkpoint
        directory lerobot's `from_pretrained` reads (the shared VLM's weights included)."""
        path, served = host.policies.file(t, policy_id, version, format)
        name = host.policies.view(t, policy_id)["name"]
        suffix = "lerobot.tar" if format == "lerobot" else "policy.safetensors"
        return FileResponse(path, media_type="application/octet-stream", filename=f"{name}-v{served}.{suffix}",
                            background=BackgroundTask(path.unlink, missing_ok=True))

    @app.post("/v1/policies/{policy_id}/predict", openapi_extra=MSGPACK, responses=MSGPACK_OUT)
    def predict(policy_id: str, t: str = Depends(tenant), raw: bytes = Depends(msgpack_body)):
        head = host.policies.view(t, policy_id)["head"]  # an unknown id answers 404 before the body is decoded
        body = wire.loads(raw)
        if not isinstance(body, dict):
            raise ApiError(422, "invalid_input", "body: expected a map with 'observation'", "body")
        obs = observation(body.get("observation"))
        deterministic = body.get("deterministic", False)
        if not isinstance(deterministic, bool):
            raise invalid("deterministic", f"expected true or false, got {deterministic!r}")
        pinned = body.get("policy_version")
        if pinned is not None and (not isinstance(pinned, int) or isinstance(pinned, bool) or pinned < 0):
            raise invalid("policy_version", f"expected a non-negative integer, got {pinned!r}")
        fits_head(head, obs)
        out = host.policies.predict(t, policy_id, obs, deterministic).result(60)
        served = int(out["policy_version"])
        if pinned is not None and served != pinned:  # the replicas serve one version per policy: the live one
            raise ApiError(409, "conflict", f"policy_version: asked for version {pinned}, the replicas serve "
                           f"{served}; an older version is served after load_state of its checkpoint",
                           "policy_version")
        return packed({"actions": out["actions"], "policy_version": served})

    @app.post("/v1/training/slots", status_code=201)
    def create_slot(body: SlotIn, t: str = Depends(tenant)):
        try:
            return {"policy": host.policies.view(t, host.slots.create(t, body.model_dump(exclude_none=True)).id)}
        except ValueError as e:  # raised while the training service builds the head
            if (err := head_error(e)) is None:
                raise
            raise err from None

    @app.post("/v1/training/slots/{policy_id}/forward_backward", status_code=202, openapi_extra=MSGPACK)
    def forward_backward(policy_id: str, t: str = Depends(tenant), raw: bytes = Depends(msgpack_body)):
        head = host.policies.view(t, policy_id)["head"]
        body = wire.loads(raw)
        if not isinstance(body, dict):
            raise ApiError(422, "invalid_input", "body: expected a map with observation, actions", "body")
        obs = observation(body.get("observation"))
        actions = floats(body.get("actions"), "actions", ndim=3)
        mask = body.get("action_mask")
        if mask is not None:
            import torch

            if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.shape != tuple(actions.shape[:2]):
                raise ApiError(422, "invalid_input", f"action_mask: expected bool {list(actions.shape[:2])}",
                               "action_mask")
            mask = torch.from_numpy(mask)
        if actions.shape[0] != obs.batch_size:
            raise ApiError(422, "invalid_input", f"actions: batch {actions.shape[0]} != {obs.batch_size} observations",
                           "actions")
        fits_head(head, obs, actions)
        return {"future": host.slots.forward_backward(t, policy_id, obs, actions, mask)}

    @app.post("/v1/training/slots/{policy_id}/optim_step", status_code=202)
    def optim_step(policy_id: str, body: OptimStepIn | None = None, t: str = Depends(tenant)):
        return {"future": host.slots.optim_step(t, policy_id, body.lr if body else None)}

    @app.post("/v1/training/slots/{policy_id}/save_state", status_code=202)
    def save_state(policy_id: str, t: str = Depends(tenant)):
        return {"future": host.slots.save_state(t, policy_id)}

    @app.post("/v1/training/slots/{policy_id}/load_state", status_code=202)
    def load_state(policy_id: str, body: LoadStateIn, t: str = Depends(tenant)):
        return {"future": host.slots.load_state(t, policy_id, body.checkpoint_id)}

    @app.delete("/v1/training/slots/{policy_id}", status_code=204)
    def delete_slot(policy_id: str, t: str = Depends(tenant)):
        """Free the training slot (its module and optimizer, in training and on every replica) and its
        place in max_training_slots; its saved checkpoints stay downloadable (`?version=`)."""
        host.slots.delete(t, policy_id)
        return Response(status_code=204)

    @app.get("/v1/futures/{future_id}")
    async def future(future_id: str, wait: float = Query(default=0.0, ge=0.0, le=30.0), t: str = Depends(tenant)):
        # A long poll waits on the event loop for the future's callback: it holds no worker thread, so
        # many waiters cannot starve other requests of threads (they are capped per tenant as well).
        tracked = host.futures.get(t, future_id)
        if wait > 0 and not tracked.future.done():
            with host.futures.long_poll(t):
                await _until_done(tracked.future, wait)
        return {"future": tracked.view()}

    add_session_routes(app, host, tenant, msgpack_body, packed)

    # ---- usage -----------------------------------------------------------------------------
    @app.get("/v1/usage")
    def usage(tenant: str | None = Query(default=None, max_length=64, description="admin: one tenant's id"),
              p: Principal = Depends(principal)):
        tenant_id = tenant
        if not p.is_admin:
            if tenant_id not in (None, p.tenant_id):
                raise NotFound(f"no tenant {tenant_id!r}")
            tenant_id = p.tenant_id
        return {"usage": _usage(host, tenant_id)}

    return app


def _tenant_view(host: ServiceHost, t) -> dict:
    return {"id": t.id, "name": t.name, "disabled": t.disabled, "created_at": t.created_at,
            "quotas": host.access.quotas(t.id)}


def _key_view(k) -> dict:
    return {"id": k.id, "name": k.name, "created_at": k.created_at, "revoked": k.revoked_at is not None,
            "last_used_at": k.last_used_at}


async def _until_done(fut, timeout_s: float) -> None:
    """Wait up to timeout_s for a concurrent Future without a thread, and without cancelling it."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake(_):
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    fut.add_done_callback(wake)
    try:
        await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except asyncio.TimeoutError:
        pass


def _usage(host: ServiceHost, tenant_id: str | None) -> dict:
    """tenant id -> usage; stored bytes are the tenant's checkpoints on disk now."""
    totals = host.store.usage_totals(tenant_id)
    ids = [tenant_id] if tenant_id is not None else [t.id for t in host.store.list_tenants()]
    zero = {"backbone_s": 0.0, "head_s": 0.0, "env_steps": 0.0, "requests": 0.0}
    return {tid: {**zero, **totals.get(tid, {}),
                  "stored_bytes": _stored_bytes(host, tid)} for tid in ids}


def _stored_bytes(host: ServiceHost, tenant_id: str) -> int:
    """The tenant's checkpoint files on disk now (a job rewrites one file, registered at every save)."""
    paths = {c.path for c in host.store.list_checkpoints(tenant_id)}
    return sum(Path(p).stat().st_size for p in paths if Path(p).exists())
