"""Low-level, Tinker-style training: `TrainingClient` drives one training slot call by call.

Every call returns an `APIFuture` at once; the server runs the calls of one slot in the order they
arrive, and the client sends them in the order they are made (one lock per client), so

    fb = tc.forward_backward(obs, actions)
    step = tc.optim_step()
    fb2 = tc.forward_backward(obs, actions)   # sees the stepped weights
    fb.result()["loss"], fb2.result()["loss"]

is pipelined without waiting on each call.
"""

from __future__ import annotations

import threading
import time

from vlamux.sdk import _arrays
from vlamux.sdk.errors import WaitTimeoutError, error_from_future
from vlamux.sdk.http import HTTP
from vlamux.sdk.policy import PolicyClient

MAX_SERVER_WAIT_S = 30.0  # the server holds a GET /futures/{id}?wait=S for at most this long


class APIFuture:
    """The pending result of one training call; `result()` waits for it."""

    def __init__(self, http: HTTP, view: dict):
        self._http = http
        self.id: str = view["id"]
        self.op: str = view.get("op", "")
        self._view = view

    def __repr__(self) -> str:
        return f"APIFuture({self.op} {self.id}, {self._view.get('state')})"

    @property
    def state(self) -> str:
        """``pending``, ``done`` or ``failed`` (as of the last poll)."""
        return self._view.get("state", "pending")

    def _poll(self, wait_s: float) -> dict:
        if self.state == "pending":
            wait_s = max(0.0, min(wait_s, MAX_SERVER_WAIT_S))
            # The HTTP timeout must outlast the server's hold of the call.
            self._view = self._http.get(f"/v1/futures/{self.id}", params={"wait": round(wait_s, 3)},
                                        timeout_s=max(self._http.timeout_s, wait_s + 15.0))["future"]
        return self._view

    def done(self) -> bool:
        """Whether the call has finished (one quick poll)."""
        return self._poll(0.0)["state"] != "pending"

    def result(self, timeout: float | None = None) -> dict:
        """The call's result; raises the call's error (e.g. `InvalidInputError`), or `WaitTimeoutError`
        (a `TimeoutError`) after `timeout` seconds (None: until it finishes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = MAX_SERVER_WAIT_S if deadline is None else deadline - time.monotonic()
            view = self._poll(max(0.0, left))
            if view["state"] == "done":
                return view.get("result")
            if view["state"] == "failed":
                raise error_from_future(view.get("error"))
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(None, "timeout", f"future {self.id} ({self.op}) not done after {timeout}s")

    def exception(self, timeout: float | None = None) -> Exception | None:
        try:
            self.result(timeout)
        except WaitTimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - the call's error, returned as concurrent.futures does
            return e
        return None


class TrainingClient:
    """A training slot: the tenant's own action head + optimizer on the shared backbone.

    Made by `Client.training_client(head=...)` (a new slot) or `Client.training_client(policy_id=...)`
    (an existing one). `id` is the slot's policy id: `policy()` serves its live weights.
    """

    def __init__(self, http: HTTP, info: dict):
        self._http, self.info = http, info
        self.id: str = info["id"]
        self._lock = threading.Lock()  # calls leave in the order they were made

    def __repr__(self) -> str:
        return f"TrainingClient({self.id!r})"

    def _call(self, op: str, **kw) -> APIFuture:
        with self._lock:
            view = self._http.post(f"/v1/training/slots/{self.id}/{op}", **kw)["future"]
        return APIFuture(self._http, view)

    def forward_backward(self, observation: dict, actions, action_mask=None) -> APIFuture:
        """Loss and gradients (accumulated) on a batch; result: ``{"loss", ...}``.

        `observation` as for `PolicyClient.predict`; `actions` float ``[B, H, A]``; `action_mask`
        bool ``[B, H]`` (False: padding past an episode's end) or None.
        """
        body = {"observation": _arrays.observation(observation), "actions": _arrays.floats(actions)}
        if action_mask is not None:
            body["action_mask"] = _arrays.array(action_mask, bool)
        return self._call("forward_backward", packed=body)

    def optim_step(self, lr: float | None = None) -> APIFuture:
        """Apply the accumulated gradients (optionally at a new learning rate); a new policy version."""
        return self._call("optim_step", json={"lr": lr} if lr is not None else {})

    def save_state(self) -> APIFuture:
        """Checkpoint weights + optimizer; result: ``{"checkpoint": {"id", "policy_version", ...}}``."""
        return self._call("save_state")

    def load_state(self, checkpoint) -> APIFuture:
        """Restore a checkpoint of this slot (its id, or the dict `save_state` returned)."""
        if isinstance(checkpoint, dict):
            checkpoint = checkpoint.get("checkpoint", checkpoint)["id"]
        return self._call("load_state", json={"checkpoint_id": str(checkpoint)})

    def policy(self) -> PolicyClient:
        return PolicyClient(self._http, self.id)

    def delete(self) -> None:
        """Free the slot (its place in your max_training_slots too); its saved checkpoints stay
        downloadable by version. Calls on it afterwards answer 404."""
        with self._lock:
            self._http.delete(f"/v1/training/slots/{self.id}")
