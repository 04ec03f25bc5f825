"""`PolicyClient`: actions from one of the tenant's policies (a job's, or a training slot's)."""

from __future__ import annotations

from vlamux.sdk import _arrays
from vlamux.sdk.http import HTTP


class PolicyClient:
    """A handle on policy `id`; making one costs no call.

    >>> out = client.policy(job.id).predict(obs)      # obs: the wire observation layout
    >>> out["actions"].shape, out["policy_version"]   # float32 [B, H, A], int
    """

    def __init__(self, http: HTTP, policy_id: str):
        self._http, self.id = http, policy_id

    def __repr__(self) -> str:
        return f"PolicyClient({self.id!r})"

    def info(self) -> dict:
        """``{"id", "source", "name", "head", "policy_version", "created_at"}``."""
        return self._http.get(f"/v1/policies/{self.id}")["policy"]

    def download(self, path: str | None = None, version: int | None = None, format: str = "vlamux") -> str:
        """Save the policy (`version`: a checkpoint's; default the live one) as a file that
        `vlamux.policy.load(path, backbone=...)` runs with no server; returns its path (default:
        the name the server gives it, in the current directory). format="lerobot" (a policy imported
        from a LeRobot checkpoint): a tar of the LeRobot checkpoint directory, which lerobot's
        `from_pretrained` and `vlamux.policy.load(DIR, vlm=...)` read once unpacked."""
        return self._http.download(f"/v1/policies/{self.id}/download", path,
                                   params={"version": version, "format": None if format == "vlamux" else format})

    def versions(self) -> dict:
        """``{"live": N or None, "checkpoints": [...]}``."""
        return self._http.get(f"/v1/policies/{self.id}/versions")

    def predict(self, observation: dict, deterministic: bool = False, timeout_s: float | None = None,
                policy_version: int | None = None) -> dict:
        """An action chunk per observation row: ``{"actions": float32 [B, H, A], "policy_version": int}``.

        `observation` is ``{"images": {camera: uint8 [B, 3, H, W]}, "state": float32 [B, S],
        "instructions": [str] * B}`` (what `EnvSession.reset`/`step` return can be passed as is).
        `policy_version`: refuse (`ConflictError`) unless the served version is this one.
        """
        body = {"observation": _arrays.observation(observation), "deterministic": bool(deterministic)}
        if policy_version is not None:
            body["policy_version"] = int(policy_version)
        return self._http.post(f"/v1/policies/{self.id}/predict", packed=body, timeout_s=timeout_s)
