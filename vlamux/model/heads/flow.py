"""GR00T/pi0-style flow matching: a small DiT, conditioned on the flow time by adaLN,
cross-attends to the features and predicts the velocity from noise to actions.

Convention (rectified flow): x_t = (1 - t) * noise + t * actions, velocity
v = actions - noise; sampling integrates t from 0 to 1 in K Euler steps.
"""

from __future__ import annotations

import torch
from torch import nn

from vlamux.model.heads.base import ActionHead, masked_mean
from vlamux.model.heads.layers import Linear, timestep_embedding
from vlamux.specs import Bound


class FlowHead(ActionHead):
    kind = "flow"
    DEFAULT_OPTIONS = {"steps": 10}
    OPTION_BOUNDS = {"steps": Bound(1, 4096)}  # Euler steps of the sampler

    def __init__(self, spec, feature_dim):
        super().__init__(spec, feature_dim, cond_dim=spec.width)
        self.steps = int(self.options["steps"])
        if self.steps < 1:
            raise ValueError(f"head spec: options.steps must be >= 1, got {self.steps}")
        w = spec.width
        self.action_in = Linear(spec.action_dim, w)
        self.time_mlp = nn.Sequential(Linear(w, w), nn.SiLU(), Linear(w, w))
        self.out = Linear(w, spec.action_dim)

    def velocity(self, feature, state, x, t):
        cond = self.time_mlp(timestep_embedding(t, self.spec.width))
        steps, _ = self.decode(self.action_in(x), feature, state, cond)
        return self.out(steps)

    def draw(self, purpose, batch, generator, deterministic=False):
        shape = (batch, self.spec.horizon, self.spec.action_dim)
        if purpose == "loss":  # the noise first, then the flow times (the order is part of the RNG stream)
            noise = torch.randn(shape, generator=generator)
            return {"noise": noise, "t": torch.rand(batch, generator=generator)}
        return {} if deterministic else {"x0": torch.randn(shape, generator=generator)}

    def loss(self, feature, state, actions, action_mask, generator=None, noise=None):
        draws = self._noise("loss", actions, generator, noise)
        eps, t = draws["noise"].to(actions.dtype), draws["t"].to(actions.dtype)
        x_t = (1 - t)[..., None, None] * eps + t[..., None, None] * actions
        mse = masked_mean((self.velocity(feature, state, x_t, t) - (actions - eps)).pow(2), action_mask)
        return mse, {"velocity_mse": mse.detach()}

    def sample(self, feature, state, generator=None, deterministic=False, noise=None):
        lead = feature.hidden.shape[:-2]
        s = self.spec
        if deterministic:
            x = torch.zeros(*lead, s.horizon, s.action_dim, device=feature.hidden.device)
        else:
            x = self._noise("sample", feature, generator, noise)["x0"].float()
        dt = 1.0 / self.steps
        for k in range(self.steps):
            t = torch.full(lead, k * dt, device=x.device)
            x = x + dt * self.velocity(feature, state, x, t).float()
        return {"actions": x}
