"""OFT-style parallel decoding: one learned query per step attends to the features; L1 loss."""

from __future__ import annotations

from torch import nn

from vlamux.model.heads.base import ActionHead, masked_mean


class L1ChunkHead(ActionHead):
    kind = "l1_chunk"

    def __init__(self, spec, feature_dim):
        super().__init__(spec, feature_dim)
        self.out = nn.Linear(spec.width, spec.action_dim)

    def predict(self, feature, state):
        b = feature.batch_size
        steps, _ = self.decode(self.step_pos.new_zeros(b, self.spec.horizon, self.spec.width), feature, state)
        return self.out(steps)

    def loss(self, feature, state, actions, action_mask, generator):
        l1 = masked_mean((self.predict(feature, state) - actions).abs(), action_mask)
        return l1, {"l1": l1.item()}

    def sample(self, feature, state, generator, deterministic=False):
        return {"actions": self.predict(feature, state)}
