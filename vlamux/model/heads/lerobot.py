"""An imported LeRobot policy's action expert as a tenant's head (kind "lerobot"): SmolVLA's, π0's or
π0.5's expert (vlamux.model.vla.experts), reading the prefix's per-layer keys and values a LeRobot
backbone puts in the feature (`VLAFeature.kv`), sampling by lerobot's flow (noise at t = 1 to actions
at t = 0, ten Euler steps) and trained by its flow-matching loss; for RL it explores by Flow-SDE
(vlamux.model.heads.flow_sde, lerobot's times mapped onto its convention) and is scored on its chain.

The spec's options carry everything that shapes the expert (`expert_dims`) and what the tenant's rows
need before the shared forward (`prefix_spec`: its cameras, its prompt's length and padding); the slot
normalises state and actions with the checkpoint's statistics (mean/std, or π0.5's quantiles as a
min/max over q01..q99: the same arithmetic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlamux.errors import InvalidInputError
from vlamux.model.heads.base import HeadSpec
from vlamux.model.heads.flow_sde import chain_log_prob, draw_steps, drawn_log_prob, sample_chain
from vlamux.model.vla.experts import build_expert
from vlamux.model.vla.flow import loss as flow_loss
from vlamux.model.vla.flow import sample as flow_sample
from vlamux.model.vla.processor import PrefixSpec

# what a spec's options must hold, besides the expert's dims (vlamux.model.vla.experts.expert_dims)
PREFIX_OPTIONS = ("cameras", "max_length", "padding")
BETA_ALPHA, T_SCALE, T_OFFSET = 1.5, 0.999, 0.001  # lerobot's flow-time draw: Beta(1.5, 1) * 0.999 + 0.001


def import_spec(ckpt_dir) -> HeadSpec:
    """The head spec that stands for "this tenant's head is the expert of the LeRobot checkpoint at
    `ckpt_dir`" (a job's `init_from`): its shapes from the checkpoint's config, the checkpoint's path in
    the options. Creating a slot from it imports the checkpoint (`ModelRunner.create_slot`); the slot's
    own spec is then the full one (`vlamux.model.vla.tenant.head_spec`)."""
    from vlamux.model.vla.checkpoint import LeRobotCheckpoint

    cfg = LeRobotCheckpoint.read_config(ckpt_dir)
    feats = cfg.get("input_features", {})
    state = feats.get("observation.state", {}).get("shape", [0])[0]
    return HeadSpec("lerobot", action_dim=int(cfg["output_features"]["action"]["shape"][0]),
                    horizon=int(cfg.get("chunk_size", 50)), state_dim=int(state), instruction_cond="none",
                    options={"family": cfg["type"], "checkpoint": str(ckpt_dir),
                             "cameras": [k.removeprefix("observation.images.") for k, v in feats.items()
                                         if v.get("type") == "VISUAL"]})


def checkpoint_of(spec: HeadSpec) -> str | None:
    """The checkpoint an import spec (`import_spec`) names; None for any other spec."""
    return spec.options.get("checkpoint") if spec.kind == "lerobot" else None


class LeRobotHead(nn.Module):
    kind = "lerobot"
    # what shapes a tenant's rows, not its expert: experts that differ only there run as one fused call
    INIT_OPTIONS: tuple = ("lerobot", "cameras", "max_length", "padding", "max_state")
    DEFAULT_OPTIONS: dict = {}  # none a user sets: every option comes from the imported checkpoint
    HAS_VALUE = False
    EXPLORES = True  # RL by Flow-SDE (vlamux.model.heads.flow_sde), its times mapped from lerobot's
    # fused by torch.func.vmap: on a CPU its per-operation cost outweighs two tenants' own calls (measured
    # with bench/vla_groups.py's shapes: π0 tiny inference, 2 tenants 140 ms fused vs 104 one by one; from 4
    # tenants fusing wins, 201 vs 253 ms); elsewhere from two (on a GPU each tenant's own call is kernel
    # launches that fusing saves; not yet measured there)
    FUSE_FROM = {"cpu": 3}
    # training through the VLM (SmolVLA's state token) fused: each tenant's prefix keys and values are copied
    # into the stack and their gradient back; on a CPU that outweighs what fusing saves once the expert is
    # large (measured with bench/vla_groups.py's shapes, 8 tenants x 1 row, one thread, the forward_backward
    # call: SmolVLA tiny, 0.2M-parameter experts, 95 ms fused vs 115 one by one; small, 4.8M, 701 vs 528)
    JOINT_FUSE_MAX_PARAMS = {"cpu": 1_000_000}

    def __init__(self, spec: HeadSpec, feature_dim: int):
        super().__init__()
        o = spec.options
        missing = [k for k in ("family", "width", "layers", "action_in", "chunk", *PREFIX_OPTIONS) if k not in o]
        if missing:
            raise ValueError(f"head spec: a lerobot head's options need {missing} (made by importing a checkpoint)")
        self.spec, self.options = spec, dict(o)
        self.family = o["family"]
        self.ACTION_NORM = "min_max" if self.family == "pi05" else "mean_std"  # π0.5: quantiles q01..q99
        self.expert = build_expert(dict(o))
        self.state_in = int(o.get("state_in", o["action_in"]))
        self.steps = int(o.get("steps", 10))

    @property
    def step_pos(self) -> Tensor:  # what callers read the head's dtype and device from
        return self.expert.action_in_proj.weight

    @property
    def trains_through_prefix(self) -> bool:
        """Its own prefix token (SmolVLA's state) makes gradients pass through the shared VLM."""
        return self.family == "smolvla"

    def prefix_spec(self) -> PrefixSpec:
        o = self.options
        return PrefixSpec(self.family, tuple(o["cameras"]), int(o["max_length"]), str(o["padding"]),
                          1 if self.family == "smolvla" else 0, int(o.get("max_state", 32)))

    def prefix_tokens(self, state: Tensor | None) -> Tensor | None:
        """This tenant's tokens at its rows' prefix end [B, n, D] (SmolVLA: the projected state)."""
        if self.family != "smolvla":
            return None
        return self.expert.state_token(self._state(state))

    def _state(self, state: Tensor | None) -> Tensor | None:
        return None if state is None else F.pad(state, (0, self.state_in - state.shape[-1]))

    @staticmethod
    def _stacked(kv) -> bool:
        """The keys are [N, B, L, H, D]: N tenants' requests in one fused call (vlamux.model.fused), the
        expert's parameters stacked [N, ...] likewise."""
        return kv.keys[0].dim() == 5

    def _velocity(self, kv, x: Tensor, t: Tensor, state: Tensor | None) -> Tensor:
        """The velocity; for a stacked call, each tenant's expert on its own rows, as one mapped call."""
        if not self._stacked(kv):
            return self.expert.velocity(kv, x, t, state)
        from torch.func import functional_call, vmap

        params = dict(self.expert.named_parameters())

        def one(p, keys, values, pad, x, t, state):
            return functional_call(self.expert, p, (keys, values, pad, x, t, state))

        return vmap(one, in_dims=(0, 0, 0, 0, 0, 0, None if state is None else 0))(
            params, kv.keys, kv.values, kv.pad, x, t, state)

    def _kv(self, feature):
        if getattr(feature, "kv", None) is None:
            raise InvalidInputError("head kind 'lerobot' reads a LeRobot backbone's prefix keys and values; this "
                                    f"backbone ({feature.meta.backbone_id!r}) gives none")
        return feature.kv

    # ---- randomness ---------------------------------------------------------------------------------
    def draw(self, purpose: str, batch: int, generator: torch.Generator, deterministic: bool = False,
             explore=None) -> dict:
        shape = (batch, int(self.options["chunk"]), int(self.options["action_in"]))
        if purpose == "loss":  # the noise, then the flow time: Beta(1.5, 1) is u^(1/1.5) (its CDF is t^1.5)
            noise = torch.randn(shape, generator=generator)
            u = torch.rand(batch, generator=generator)
            return {"noise": noise, "t": u.pow(1.0 / BETA_ALPHA) * T_SCALE + T_OFFSET}
        if deterministic:
            return {"x0": torch.zeros(shape)}
        x0 = {"x0": torch.randn(shape, generator=generator)}
        if explore is None:
            return x0
        return {**x0, **draw_steps(explore, batch, self.steps, shape[1:], generator)}

    def chain_shape(self) -> tuple[int, int, int]:
        """A sampled chain's shape per row: (steps + 1, chunk, the expert's action width)."""
        return self.steps + 1, int(self.options["chunk"]), int(self.options["action_in"])

    def _forward_velocity(self, kv, state):
        """The velocity in flow_sde's convention (t from the noise at 0 to the actions at 1): lerobot's
        runs from the noise at t = 1, so t -> 1 - t and v -> -v (the same Euler steps)."""
        st = self._state(state)
        return lambda x, t: -self._velocity(kv, x, 1.0 - t, st)

    # ---- the head's maths -----------------------------------------------------------------------------
    def loss(self, feature, state, actions, action_mask, generator=None, noise=None):
        """lerobot's flow-matching loss on normalised `actions` [B, T, A] (padded to the expert's width;
        SmolVLA averages over every padded dim, π0 and π0.5 over the first A, as lerobot does; like
        lerobot it does not mask padded steps)."""
        if noise is None:
            noise = {k: v.to(actions.device) for k, v in self.draw("loss", actions.shape[0], generator).items()}
        a = F.pad(actions, (0, int(self.options["action_in"]) - actions.shape[-1]))
        dims = None if self.family == "smolvla" else actions.shape[-1]
        kv = self._kv(feature)
        if self._stacked(kv):
            value = self._stacked_loss(kv, a, noise["noise"].to(a.dtype), noise["t"].to(a.dtype), self._state(state),
                                       dims, action_mask)
        else:
            value = flow_loss(self.expert, kv, a, noise["noise"].to(a.dtype), noise["t"].to(a.dtype),
                              self._state(state), dims)
        return value, {"velocity_mse": value.detach()}

    def _stacked_loss(self, kv, a: Tensor, noise: Tensor, t: Tensor, state, dims, mask: Tensor) -> Tensor:
        """flow_loss for each of N tenants [N]: its rows' mean (a row padded into the stack, with no
        valid step, counts for nothing; each real row weighs the same, as in the plain mean)."""
        tt = t[..., None, None]
        x_t = tt * noise + (1.0 - tt) * a
        err = (noise - a - self._velocity(kv, x_t, t, state)) ** 2
        per_row = (err if dims is None else err[..., :dims]).mean(dim=(-2, -1))  # [N, B]
        real = mask.any(dim=-1).to(per_row.dtype)
        return (per_row * real).sum(-1) / real.sum(-1).clamp_min(1.0)

    def sample(self, feature, state, generator=None, deterministic=False, noise=None):
        """Normalised actions [B, T, A] from noise `x0` [B, T, expert width] (zeros when deterministic)."""
        kv = self._kv(feature)
        if noise is None:
            noise = self.draw("sample", kv.pad.shape[0], generator, deterministic)
        x = noise["x0"].to(self.step_pos.device, torch.float32)
        if "std" in noise:  # exploring (RL): the SDE's chain and what the update scores
            chain = sample_chain(self._forward_velocity(kv, state), x, self.steps, noise["std"], noise["z"])
            steps = noise["steps"].long()
            return {"actions": chain[..., -1, :, :self.spec.action_dim], "chain": chain, "chain_steps": steps,
                    "chain_std": noise["std"].gather(-1, steps),
                    "step_log_prob": drawn_log_prob(noise["z"], noise["std"], dims=self.spec.action_dim)}
        if self._stacked(kv):  # the flow's Euler steps as flow_sample takes them, each a mapped call
            dt = -1.0 / self.steps
            for k in range(self.steps):
                t = torch.full(x.shape[:2], 1.0 + k * dt, dtype=torch.float32, device=x.device)
                x = x + dt * self._velocity(kv, x, t, self._state(state))
        else:
            x = flow_sample(self.expert, kv, x, self._state(state), self.steps)
        return {"actions": x[..., :self.spec.action_dim]}

    def evaluate(self, feature, state, actions, action_mask, sampled=None):
        """RL (GRPO: an expert has no critic): the log-probability [..., B] of the chain a rollout
        sampled with exploration, under the current weights, over the masked steps and the policy's
        action dims (the expert's padded dims are noise no action reads)."""
        if not sampled or "chain" not in sampled:
            raise InvalidInputError("head kind 'lerobot': RL scores the denoising chain its rollout sampled; sample "
                                    "with exploration (an RL job's rl.flow) and train on that sample's chain")
        log_prob, entropy = chain_log_prob(self._forward_velocity(self._kv(feature), state), sampled["chain"],
                                           sampled["chain_steps"], sampled["chain_std"], dims=self.spec.action_dim)
        m = action_mask.to(log_prob.dtype)
        return (log_prob * m).sum(-1), (entropy * m).sum(-1), None
