"""`EnvSession`: a simulator session of the service's Environment Service (vectorised, `n_envs` wide)."""

from __future__ import annotations

from vlamux.sdk import _arrays
from vlamux.sdk.errors import NotFoundError
from vlamux.sdk.http import HTTP


class EnvSession:
    """Opened by `Client.env_session`; close it (or use ``with``) to free the tenant's session quota.

    >>> with client.env_session({"task": "goal/touch-red-cube", "image_size": 32}) as env:
    ...     obs = env.reset(seed=0)
    ...     out = env.step(policy.predict(obs)["actions"])
    """

    def __init__(self, http: HTTP, info: dict):
        self._http, self.info = http, info
        self.id: str = info["id"]
        self.n_envs: int = int(info.get("n_envs", 1))
        self.closed = False

    def __repr__(self) -> str:
        return f"EnvSession({self.id!r}, n_envs={self.n_envs}{', closed' if self.closed else ''})"

    def reset(self, seed: int | None = None) -> dict:
        """Reset every sub-env; the observation batch in the wire layout (images, state, instructions)."""
        body = {"seed": seed} if seed is not None else {}
        return self._http.post(f"/v1/sessions/{self.id}/reset", json=body)["observation"]

    def step(self, actions) -> dict:
        """One step of every sub-env with float actions ``[N, A]`` (or an action chunk ``[N, H, A]``).

        Returns ``{"observation", "reward": float32 [N], "terminated": bool [N], "truncated": bool [N],
        "success": [bool] * N}``.
        """
        return self._http.post(f"/v1/sessions/{self.id}/step", packed={"actions": _arrays.floats(actions)})

    def close(self) -> None:
        """Close the session on the server; closing twice (or a session the server dropped) is fine."""
        if self.closed:
            return
        try:
            self._http.delete(f"/v1/sessions/{self.id}")
        except NotFoundError:
            pass
        self.closed = True

    def __enter__(self) -> EnvSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
