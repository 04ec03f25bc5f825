"""The Python SDK of the vlamux service (docs/API.md is the HTTP API underneath).

    import vlamux

    c = vlamux.Client("http://127.0.0.1:8321", api_key="vmx_...")
    job = c.submit({"name": "sft-1", "kind": "sft", "head": {...}, "sft": {"dataset": "demos", "steps": 500}})
    job.wait()                                  # progress bar; then job.state, job.result
    tc = c.training_client(head={"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8})
    loss = tc.forward_backward(obs, actions).result()["loss"]

Public names: `Client`, `AdminAPI`, `JobHandle`, `TrainingClient`, `APIFuture`, `PolicyClient`,
`EnvSession`, and the exceptions of `vlamux.sdk.errors`.
"""

from vlamux.sdk.client import AdminAPI, Client, JobHandle
from vlamux.sdk.env import EnvSession
from vlamux.sdk.errors import (AuthenticationError, ConflictError, InvalidInputError, NotFoundError,
                               PermissionDeniedError, QuotaExceededError, RateLimitedError, ServerError,
                               ServiceUnavailableError, VlamuxAPIError, WaitTimeoutError)
from vlamux.sdk.policy import PolicyClient
from vlamux.sdk.training import APIFuture, TrainingClient

__all__ = ["Client", "AdminAPI", "JobHandle", "TrainingClient", "APIFuture", "PolicyClient", "EnvSession",
           "VlamuxAPIError", "AuthenticationError", "PermissionDeniedError", "NotFoundError", "InvalidInputError",
           "ConflictError", "RateLimitedError", "QuotaExceededError", "ServerError", "ServiceUnavailableError",
           "WaitTimeoutError"]
