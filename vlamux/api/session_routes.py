"""The routes of a tenant's environment sessions (`ServiceHost.sessions`): open, list, reset, step,
close. Observations and actions travel as msgpack (vlamux.wire)."""

from __future__ import annotations

import dataclasses

import numpy as np
from fastapi import Depends, FastAPI
from fastapi.responses import Response

from vlamux import wire
from vlamux.api.errors import ApiError
from vlamux.api.validate import MSGPACK, MSGPACK_OUT, ResetIn, SessionIn, env_error, invalid, obs_out
from vlamux.envs.base import EnvError, EnvWorkerCrashed
from vlamux.errors import InvalidInputError


def add_session_routes(app: FastAPI, host, tenant, msgpack_body, packed) -> None:
    """tenant, msgpack_body: the app's dependencies (the caller's tenant id, the raw msgpack body);
    packed: a msgpack response."""
    @app.post("/v1/sessions", status_code=201)
    def open_session(body: SessionIn, t: str = Depends(tenant)):
        try:
            info = host.sessions.open(t, body.env, body.n_envs, body.seed)
        except (InvalidInputError, EnvError) as e:
            if isinstance(e, (TimeoutError, EnvWorkerCrashed)):  # the service's trouble, not the spec's
                raise
            raise env_error(e) from None
        return {"session": _session_view(info)}

    @app.get("/v1/sessions")
    def sessions(t: str = Depends(tenant)):
        return {"sessions": [_session_view(s) for s in host.sessions.list(t)]}

    @app.post("/v1/sessions/{session_id}/reset", responses=MSGPACK_OUT)
    def reset(session_id: str, body: ResetIn | None = None, t: str = Depends(tenant)):
        obs, _ = host.sessions.reset(t, session_id, seed=body.seed if body else None)
        return packed({"observation": obs_out(obs)})

    @app.post("/v1/sessions/{session_id}/step", openapi_extra=MSGPACK, responses=MSGPACK_OUT)
    def step(session_id: str, t: str = Depends(tenant), raw: bytes = Depends(msgpack_body)):
        host.sessions.info(t, session_id)  # an unknown session: 404 before decoding
        body = wire.loads(raw)
        if not isinstance(body, dict):
            raise ApiError(422, "invalid_input", "body: expected a map with 'actions'", "body")
        a = body.get("actions")
        if not isinstance(a, np.ndarray) or a.dtype.kind != "f" or a.ndim not in (2, 3):
            raise ApiError(422, "invalid_input", "actions: expected float [N, A] or [N, H, A]", "actions")
        with np.errstate(over="ignore"):
            a = a.astype(np.float32)  # before the check: a float64 1e300 is infinite as float32
        if not np.isfinite(a).all():
            raise invalid("actions", "contains NaN or infinity (as float32)")
        obs, reward, term, trunc, infos = host.sessions.step(t, session_id, a)
        success = [bool(i.get("success", False)) if isinstance(i, dict) else False for i in (infos or [])]
        return packed({"observation": obs_out(obs), "reward": np.asarray(reward, np.float32),
                       "terminated": np.asarray(term, bool), "truncated": np.asarray(trunc, bool),
                       "success": success})

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    def close_session(session_id: str, t: str = Depends(tenant)):
        host.sessions.close(t, session_id)
        return Response(status_code=204)


def _session_view(s: dict) -> dict:
    spec = s.get("spec")
    return {"id": s["session_id"], "n_envs": s["n_envs"], "n_workers": s["n_workers"],
            "env": dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) else spec,
            "env_steps": s.get("env_steps", 0), "idle_s": round(s.get("idle_s", 0.0), 3)}
