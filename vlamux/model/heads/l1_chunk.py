"""OFT-style parallel decoding: one learned query per step attends to the features; L1 loss."""

from __future__ import annotations

from vlamux.model.heads.base import ActionHead, masked_mean
from vlamux.model.heads.layers import Linear


class L1ChunkHead(ActionHead):
    kind = "l1_chunk"

    def __init__(self, spec, feature_dim):
        super().__init__(spec, feature_dim)
        self.out = Linear(spec.width, spec.action_dim)

    def predict(self, feature, state):
        steps, _ = self.decode(self.step_tokens(feature), feature, state)
        return self.out(steps).float()

    def loss(self, feature, state, actions, action_mask, generator=None, noise=None):
        l1 = masked_mean((self.predict(feature, state) - actions).abs(), action_mask)
        return l1, {"l1": l1.detach()}

    def sample(self, feature, state, generator=None, deterministic=False, noise=None):
        return {"actions": self.predict(feature, state)}
