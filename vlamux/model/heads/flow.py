"""GR00T/pi0-style flow matching: a small DiT, conditioned on the flow time by adaLN,
cross-attends to the features and predicts the velocity from noise to actions.

Convention (rectified flow): x_t = (1 - t) * noise + t * actions, velocity
v = actions - noise; sampling integrates t from 0 to 1 in K Euler steps.
"""

from __future__ import annotations

import torch
from torch import nn

from vlamux.model.heads.base import ActionHead, masked_mean
from vlamux.model.heads.layers import timestep_embedding


class FlowHead(ActionHead):
    kind = "flow"
    DEFAULT_OPTIONS = {"steps": 10}

    def __init__(self, spec, feature_dim):
        super().__init__(spec, feature_dim, cond_dim=spec.width)
        self.steps = int(self.options["steps"])
        if self.steps < 1:
            raise ValueError(f"head spec: options.steps must be >= 1, got {self.steps}")
        w = spec.width
        self.action_in = nn.Linear(spec.action_dim, w)
        self.time_mlp = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.out = nn.Linear(w, spec.action_dim)

    def velocity(self, feature, state, x, t):
        cond = self.time_mlp(timestep_embedding(t, self.spec.width))
        steps, _ = self.decode(self.action_in(x), feature, state, cond)
        return self.out(steps)

    def loss(self, feature, state, actions, action_mask, generator):
        b = actions.shape[0]
        noise = torch.randn(actions.shape, generator=generator, device=actions.device, dtype=actions.dtype)
        t = torch.rand(b, generator=generator, device=actions.device, dtype=actions.dtype)
        x_t = (1 - t)[:, None, None] * noise + t[:, None, None] * actions
        mse = masked_mean((self.velocity(feature, state, x_t, t) - (actions - noise)).pow(2), action_mask)
        return mse, {"velocity_mse": mse.item()}

    def sample(self, feature, state, generator, deterministic=False):
        s, b = self.spec, feature.batch_size
        dtype, device = self.out.weight.dtype, self.out.weight.device
        shape = (b, s.horizon, s.action_dim)
        x = torch.zeros(shape, dtype=dtype, device=device) if deterministic else \
            torch.randn(shape, generator=generator, device=device, dtype=dtype)
        dt = 1.0 / self.steps
        for k in range(self.steps):
            t = torch.full((b,), k * dt, device=device, dtype=dtype)
            x = x + dt * self.velocity(feature, state, x, t)
        return {"actions": x}
