"""A tenant's environment sessions over the API: opened against its quotas (a session, its envs and
worker processes held in the ledger until it closes), and every call scoped to the tenant, through
the runtime's Environment Service."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from vlamux.api.quotas import Ledger, Need, session_processes
from vlamux.envs import EnvSpec
from vlamux.errors import InvalidInputError
from vlamux.services.contract import Environments
from vlamux.specs import build


class Sessions:
    def __init__(self, environment: Callable[[], Environments], ledger: Ledger,
                 reserve: Callable[..., None], gym_envs: dict, env_workers: int | None):
        # the runtime is built when the host starts: its environment is looked up at each call
        self._env, self.ledger, self._reserve = environment, ledger, reserve
        self.gym_envs, self.env_workers = gym_envs, env_workers

    def open(self, tenant_id: str, env: dict, n_envs: int, seed: int | None = None) -> dict:
        envs = self._env()
        spec = build(EnvSpec, env, "env")  # checked once, here, its errors naming the API's fields
        check_allowed(spec.backend, spec.task, spec.options, "env", self.gym_envs)
        # sessions the Environment Service closed on its own (idle, lost workers) hold nothing any more
        self.ledger.keep_only(tenant_id, "session:", {s["session_id"] for s in envs.list_sessions(tenant_id)})
        pending = f"opening:{uuid.uuid4().hex}"
        need = Need(sessions=1, envs=n_envs, processes=session_processes(n_envs, self.env_workers))
        self._reserve(tenant_id, pending, need, retry_after_s=5.0)
        try:
            sid = envs.open_session(tenant_id, spec, n_envs, seed=seed, n_workers=self.env_workers)
        except BaseException:
            self.ledger.release(tenant_id, pending)
            raise
        self.ledger.rename(tenant_id, pending, f"session:{sid}")
        return envs.session_info(tenant_id, sid)

    def close(self, tenant_id: str, session_id: str) -> None:
        self._env().close_session(tenant_id, session_id)
        self.ledger.release(tenant_id, f"session:{session_id}")

    def list(self, tenant_id: str) -> list[dict]:
        return self._env().list_sessions(tenant_id)

    def info(self, tenant_id: str, session_id: str) -> dict:
        return self._env().session_info(tenant_id, session_id)

    def reset(self, tenant_id: str, session_id: str, seed: int | None = None):
        return self._env().reset(tenant_id, session_id, seed=seed)

    def step(self, tenant_id: str, session_id: str, actions):
        return self._env().step(tenant_id, session_id, actions)


def check_allowed(backend: str, task, options: dict, where: str, gym_envs: dict) -> None:
    """A tenant's env may use backend 'gym' only with an id and env_kwargs the operator allowed."""
    if backend != "gym":
        return
    if not gym_envs:
        raise InvalidInputError(f"{where}.backend: 'gym' is not enabled on this service (its operator allows "
                                f"gymnasium ids with vlamux serve --gym-env)")
    if task not in gym_envs:
        raise InvalidInputError(f"{where}.task: gymnasium id {task!r} is not allowed here; allowed: {sorted(gym_envs)}")
    kwargs = options.get("env_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidInputError(f"{where}.options.env_kwargs: expected a map")
    extra = sorted(set(kwargs) - set(gym_envs[task]))
    if extra:
        raise InvalidInputError(f"{where}.options.env_kwargs.{extra[0]}: not allowed for {task!r}; allowed: "
                                f"{list(gym_envs[task]) or 'none'}")
