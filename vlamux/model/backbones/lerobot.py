"""A LeRobot VLA checkpoint's VLM as the shared backbone (kind "lerobot"): SmolVLA's SmolVLM2 or π0's
and π0.5's PaliGemma, its weights the checkpoint's, its config and tokenizer from the model directory
the checkpoint names by hub id. Tenants of the family import their experts onto it
(`ModelRunner.import_lerobot`).

`prepare(obs, prefix=...)` turns one tenant's observation into its rows' prefix inputs, as that
tenant's checkpoint configures them (its cameras in order, resized with padding to the VLM's size;
its prompt, with π0.5's state bins); `forward_group` runs every request's prefix through the VLM in
one forward (rows padded at the end) and gives each request its own rows' per-layer keys and values
(`VLAFeature.kv`), trimmed to its own length: a request's are what it would get alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from vlamux.errors import InvalidInputError
from vlamux.model.backbones.base import Backbone
from vlamux.model.batch import InputSchema, Observation
from vlamux.model.device import to_device
from vlamux.model.feature import FeatureMeta, TokenType, VLAFeature
from vlamux.model.vla.checkpoint import LeRobotCheckpoint
from vlamux.model.vla.processor import PrefixSpec, prompts, vlm_image
from vlamux.model.vla.vlm import PrefixKV, build_vlm, prefix_inputs, prefix_kv

MAX_CAMERAS = 8


@dataclass
class VLABatch:
    """One request's prefix inputs: each camera's images [B, 3, S, S] in [-1, 1], the prompt's tokens
    [B, L] and their mask, and how many tokens of its own the tenant adds at the end."""

    images: list[Tensor]
    ids: Tensor
    lang_mask: Tensor
    own_tokens: int = 0

    @property
    def batch_size(self) -> int:
        return self.ids.shape[0]


class LeRobotBackbone(Backbone):
    kind = "lerobot"

    def __init__(self, ckpt_dir, vlm_dir, backbone_id: str | None = None):
        super().__init__()
        from transformers import AutoTokenizer

        ckpt = LeRobotCheckpoint.read(ckpt_dir)
        if vlm_dir is None or not Path(vlm_dir).is_dir():
            raise InvalidInputError(f"vlm: {ckpt.family} checkpoint {Path(ckpt_dir).name} names {ckpt.vlm_hub_id()!r}: "
                                    f"give the local directory of that hub repository (its config and tokenizer "
                                    f"files; the weights come from the checkpoint), e.g. `huggingface-cli download "
                                    f"{ckpt.vlm_hub_id()}` on a machine that reaches the hub")
        # the checkpoint stays where it is: a policy written back out takes the VLM's tensors from it
        self.family, self.vlm_dir, self.ckpt_dir = ckpt.family, Path(vlm_dir), Path(ckpt_dir)
        self.vlm = build_vlm(ckpt.family, ckpt.vlm_tensors(), self.vlm_dir)
        self.content_sha256 = ckpt.vlm_sha256()
        self.backbone_id = backbone_id or f"lerobot-{ckpt.family}@{self.content_sha256[:12]}"
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.vlm_dir), local_files_only=True)
        size = ckpt.config.get("resize_imgs_with_padding") or ckpt.config.get("image_resolution") or [224, 224]
        self.image_hw = (int(size[0]), int(size[1]))
        step = ckpt.pre_step("tokenizer_processor")
        tok = step["config"] if step else {}
        # a request without a tenant's prefix (a head reading hidden states, the calibration probe): every
        # camera it has, in its order, and the checkpoint's own prompt length
        self._plain = (int(tok.get("max_length", 48)), str(tok.get("padding", "max_length")),
                       int(ckpt.config.get("max_state_dim", 32)))
        self.schema = InputSchema(0, MAX_CAMERAS, self.tokenizer.model_max_length)
        with torch.no_grad():
            self._per_camera = self.vlm.embed_images(torch.zeros(1, 3, *self.image_hw)).shape[1]

    # ---- the Backbone contract ----------------------------------------------------------------------
    @property
    def meta(self) -> FeatureMeta:
        return FeatureMeta(self.backbone_id, self.vlm.text_dim, len(self.vlm.layers), 0, self._per_camera)

    def describe(self) -> dict:
        return {**super().describe(), "family": self.family, "vlm": str(self.vlm_dir), "checkpoint": str(self.ckpt_dir),
                "image_size": list(self.image_hw)}

    def prepare(self, obs: Observation, n_query: int = 0, prefix=None, state_stats=None) -> VLABatch:
        """One tenant's rows as its checkpoint's processor makes them (`prefix`: its `PrefixSpec`;
        `state_stats`: its state's statistics on the host, for π0.5's prompt)."""
        if prefix is None:
            prefix = PrefixSpec(self.family, tuple(obs.images), self._plain[0], self._plain[1], 0, self._plain[2])
        if n_query:
            raise InvalidInputError(f"backbone {self.backbone_id!r} takes no query tokens")
        if not isinstance(obs, Observation):
            raise InvalidInputError(f"obs: expected an Observation, got {type(obs).__name__}")
        obs.validate(self.schema)
        missing = [c for c in prefix.cameras if c not in obs.images]
        if missing:
            raise InvalidInputError(f"obs.images: the tenant's policy reads cameras {list(prefix.cameras)}; missing "
                                    f"{missing}")
        images = [to_device(vlm_image(obs.images[c].to(torch.float32) / 255.0, self.family, self.image_hw),
                            self.device, self.dtype) for c in prefix.cameras]
        state = None
        if prefix.family == "pi05" and obs.state is not None:  # on the host: it becomes text
            raw = obs.state.to(torch.float32)
            state = F.pad(raw if state_stats is None else state_stats.normalize(raw),
                          (0, max(0, prefix.max_state - obs.state.shape[-1])))
        enc = self.tokenizer(prompts(list(obs.instruction), prefix.family, state), max_length=prefix.max_length,
                             truncation=True, padding=prefix.padding, padding_side="right", return_tensors="pt")
        return VLABatch(images, to_device(enc["input_ids"], self.device), to_device(enc["attention_mask"].bool(),
                                                                                   self.device), prefix.own_tokens)

    def forward(self, batch: VLABatch, n_layers: int = 0) -> VLAFeature:
        return self.forward_group([batch], n_layers)[0]

    def forward_group(self, batches: list[VLABatch], n_layers: int = 0, queries: list | None = None
                      ) -> list[VLAFeature]:
        """One VLM forward for every request's rows. `queries`: per request, its tenant's own tokens for
        its rows' prefix end [B, n, D] (SmolVLA's state token), or None."""
        queries = queries or [None] * len(batches)
        given = [0 if q is None else q.shape[1] for q in queries]
        if given != [b.own_tokens for b in batches]:
            raise ValueError(f"tenant tokens: the batches were prepared for {[b.own_tokens for b in batches]}, "
                             f"the call gives {given}")
        # every camera image of every request in one vision call (all are the VLM's size)
        images = [img for b in batches for img in b.images]
        embedded = self.vlm.embed_images(torch.cat(images)).split([img.shape[0] for img in images])
        rows, pads, atts, at = [], [], [], 0
        for b, own in zip(batches, queries):
            cams = list(embedded[at:at + len(b.images)])
            at += len(b.images)
            tokens, pad_t, att = prefix_inputs(cams, self.vlm.embed_text(b.ids), b.lang_mask, own)
            rows.append(tokens)
            pads.append(pad_t)
            atts.append(att)
        length = max(r.shape[1] for r in rows)
        kv, hidden = prefix_kv(self.vlm, torch.cat([F.pad(r, (0, 0, 0, length - r.shape[1])) for r in rows]),
                               torch.cat([F.pad(p, (0, length - p.shape[1])) for p in pads]),
                               torch.cat([F.pad(a, (0, length - a.shape[1])) for a in atts]), hidden=True)
        out, start = [], 0
        for b, r in zip(batches, rows):
            n, own_len = b.batch_size, r.shape[1]
            sl = slice(start, start + n)
            start += n
            mine = PrefixKV([k[sl, :own_len] for k in kv.keys], [v[sl, :own_len] for v in kv.values], kv.pad[sl, :own_len])
            types = self._token_types(b, own_len)
            out.append(VLAFeature(hidden[sl, :own_len], mine.pad, types, self.meta, kv=mine))
        return out

    def _token_types(self, b: VLABatch, length: int) -> Tensor:
        types = torch.full((b.batch_size, length), int(TokenType.TEXT), dtype=torch.long)
        at = 0
        for k, img in enumerate(b.images):
            types[:, at:at + self._per_camera] = int(TokenType.CAMERA) + k
            at += self._per_camera
        if b.own_tokens:
            types[:, -b.own_tokens:] = int(TokenType.QUERY)
        return to_device(types, b.ids.device)
