"""A transformers VLM as the shared backbone: the family's processor turns each tenant's observation
into its prompt (one image per camera, then the instruction), the requests of a group are padded into
one forward of the transformers model, and each request gets its rows' hidden states back.

`encode(batches)` is exactly what the model is called with, so a feature can be checked against the
model itself; `prepare(obs)` runs the processor on the host, per request, before the group forms.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from vlamux.errors import InvalidInputError
from vlamux.model.backbones.base import Backbone
from vlamux.model.backbones.hf.directory import ModelDir, chat_template, processor_options
from vlamux.model.backbones.hf.families import Family, Row, _import, build_processor
from vlamux.model.batch import InputSchema, Observation
from vlamux.model.device import to_device
from vlamux.model.feature import FeatureMeta, TokenType, VLAFeature
from vlamux.model import queries as query_tokens

MAX_CAMERAS = 8


@dataclass
class HFBatch:
    """One request's rows, preprocessed on the host (`HFBackbone.prepare`)."""

    rows: list[Row]
    token_types: list[Tensor]  # per row [L]: TokenType values
    n_query: int = 0  # the tenant's query tokens, the last of each row's tokens (vlamux.model.queries)

    @property
    def batch_size(self) -> int:
        return len(self.rows)


class HFBackbone(Backbone):
    kind = "hf"
    prepares_on_device = False  # the processor runs on the host; `encode` copies in the forward

    def __init__(self, model_dir: ModelDir, family: Family, backbone_id: str, dtype: torch.dtype = torch.float32,
                 layer: int | None = None, max_layers: int | None = None, image_size: int | None = None):
        super().__init__()
        self.model_dir, self.family, self.backbone_id = model_dir, family, backbone_id
        # SDPA everywhere: it is what runs on a GPU, and the CPU runs it too (eager attention would
        # be another numerics path than the one served)
        self.model = family.model(model_dir.path, dtype, "sdpa")
        text = family.text_model(self.model)
        depth = len(text.layers)
        if max_layers is not None:
            if not 1 <= max_layers <= depth:
                raise ValueError(f"backbone spec: max_layers must be in [1, {depth}], got {max_layers}")
            text.layers = text.layers[:max_layers]  # SmolVLA-style truncation: the rest is never run
            text.config.num_hidden_layers = max_layers
            depth = max_layers
        if layer is not None and not 1 <= layer <= depth:
            raise ValueError(f"backbone spec: layer must be in [1, {depth}], got {layer}")
        self.depth, self.layer, self.image_size = depth, layer, image_size
        image_processor = _import(family.image_processor).from_pretrained(str(model_dir.path), local_files_only=True,
                                                                          **family.image_kwargs)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir.path), local_files_only=True)
        self.template = chat_template(model_dir.path)
        self.processor = build_processor(_import(family.processor), image_processor, tokenizer, self.template,
                                         processor_options(model_dir.path))
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.schema = InputSchema(image_size or 0, MAX_CAMERAS, tokenizer.model_max_length)
        self.hidden_dim = text.config.hidden_size

    # ---- the Backbone contract ----------------------------------------------------------------------
    @property
    def meta(self) -> FeatureMeta:
        return FeatureMeta(self.backbone_id, self.hidden_dim, self.depth, 0, self.tokens_per_camera())

    LORA_DEFAULT = ("q_proj", "k_proj", "v_proj", "o_proj")

    def adaptable(self) -> dict:
        """The language model's Linears, named as in the transformers model (so PEFT's keys match):
        their inputs are the group's rows [R, L, D]. The vision tower is not adapted."""
        from vlamux.model.adapters import Target

        text = self.family.text_model(self.model)
        prefix = next(n for n, m in self.named_modules() if m is text)
        out = {}
        for i, layer in enumerate(text.layers):
            for name, m in layer.named_modules():
                if isinstance(m, torch.nn.Linear):
                    full = f"{prefix}.layers.{i}.{name}"
                    out[full] = Target(full, m.in_features, m.out_features, i)
        return out

    def segments(self, batches: list[HFBatch]) -> list[int]:
        return [b.batch_size for b in batches]

    def describe(self) -> dict:
        return {**super().describe(), "family": self.family.name, "path": str(self.model_dir.path),
                "random_weights": self.model_dir.random_weights, "image_size": self.image_size}

    def tokens_per_camera(self, size: int | None = None) -> int:
        """Image tokens one camera costs at `size` px square (default: the spec's image_size, else 224)."""
        size = size or self.image_size or 224
        img = np.zeros((size, size, 3), dtype=np.uint8)
        enc = self.processor(images=[[img]] if self.family.nested_images else [img],
                             text=[self.family.prompt(self.processor, self.template, "", 1)],
                             return_mm_token_type_ids=True)
        return int(np.sum(np.asarray(enc["mm_token_type_ids"][0]) == 1))

    def forward(self, batch: HFBatch, n_layers: int = 0) -> VLAFeature:
        return self.forward_group([batch], n_layers)[0]

    def prepare(self, obs: Observation, n_query: int = 0) -> HFBatch:
        """A request's observation through the family's processor: each row's prompt (its present
        cameras' images in the tenant's camera order, then its instruction), tokens, pixel tensors and
        token types (camera k, instruction text, prompt), then `n_query` placeholders for the tenant's
        query tokens (their vectors are placed in the forward: `forward_group(queries=...)`)."""
        if not isinstance(obs, Observation):
            raise InvalidInputError(f"obs: expected an Observation, got {type(obs).__name__}")
        obs.validate(self.schema)
        names = list(obs.images)
        images, prompts, cams_of_row, suffixes = [], [], [], []
        for b in range(obs.batch_size):
            present = [k for k, n in enumerate(names) if n not in obs.camera_mask or bool(obs.camera_mask[n][b])]
            if not present:
                raise InvalidInputError(f"camera_mask: row {b} has no camera present (a VLM prompt needs an image)")
            row_images = [self._image(obs.images[names[k]][b]) for k in present]
            images.append([row_images] if self.family.nested_images else row_images)
            text = self.family.prompt(self.processor, self.template, obs.instruction[b], len(present))
            prompts.append(text)
            cams_of_row.append(present)
            # characters after the instruction: the template's, and what the processor appends
            suffixes.append(len(text) - text.rfind(obs.instruction[b]) - len(obs.instruction[b])
                            + len(self.family.instruction_suffix))
        rows, types = [], []
        for b, cams in enumerate(cams_of_row):  # a row at a time: rows differ in length (no padding here)
            enc = self.processor(images=images[b], text=[prompts[b]], return_mm_token_type_ids=True,
                                 return_offsets_mapping=True, return_tensors=None)
            extra = self.family.split(_tensors(enc), [len(cams)])[0]
            ids = torch.tensor(enc["input_ids"][0], dtype=torch.long)
            mm = torch.tensor(enc["mm_token_type_ids"][0], dtype=torch.long)
            counts = self.family.image_tokens(self.processor, extra)
            kinds = self._token_types(mm, enc["offset_mapping"][0], obs.instruction[b], cams, counts, suffixes[b])
            if n_query:  # text tokens to the family's code (masks, positions); their embedding is replaced
                ids = torch.cat([ids, ids.new_full((n_query,), self.pad_id)])
                mm = torch.cat([mm, mm.new_zeros(n_query)])
                kinds = torch.cat([kinds, kinds.new_full((n_query,), int(TokenType.QUERY))])
            rows.append(Row(ids, mm, extra))
            types.append(kinds)
        return HFBatch(rows, types, n_query)

    def encode(self, batches: list[HFBatch]) -> dict:
        """The keyword arguments the transformers model is called with for these requests' rows
        (padded together), on the backbone's device: what `forward_group` passes, exactly."""
        rows = [r for b in batches for r in b.rows]
        kwargs = self.family.collate(rows, self.pad_id)
        dev = self.device
        return {k: to_device(v, dev, self.dtype if v.is_floating_point() else None) for k, v in kwargs.items()}

    def forward_group(self, batches: list[HFBatch], n_layers: int = 0, queries: list | None = None
                      ) -> list[VLAFeature]:
        """`queries`: per request, its tenant's query vectors [Q, D] (`QueryTokens.weight`) for the Q
        placeholders its batch was prepared with, or None."""
        if not 0 <= n_layers <= self.depth:
            raise ValueError(f"n_layers must be in [0, {self.depth}], got {n_layers}")
        kwargs = self.encode(batches)
        want_states = bool(n_layers) or self.layer is not None
        with self._queries_placed(batches, queries, kwargs["input_ids"].shape[1]):
            out = self.model(**kwargs, output_hidden_states=want_states, use_cache=False, return_dict=True)
        states = out.hidden_states[1:] if want_states else ()  # the decoder layers' outputs, oldest first
        hidden = out.last_hidden_state if self.layer is None else states[self.layer - 1]
        kept = states[len(states) - n_layers:] if n_layers else ()
        length = hidden.shape[1]
        # split by request, not sliced: under autograd (adapters) a slice's backward fills the whole group
        sizes = [b.batch_size for b in batches]
        hidden_of, kept_of = hidden.split(sizes), [s.split(sizes) for s in kept]
        features, start = [], 0
        for g, b in enumerate(batches):
            rows = slice(start, start + b.batch_size)
            start += b.batch_size
            own = max(len(r.input_ids) for r in b.rows)
            at = slice(0, own) if self.family.padding_side == "right" else slice(length - own, length)
            mask = kwargs["attention_mask"][rows, at].bool()
            types = torch.full((b.batch_size, own), int(TokenType.PROMPT), dtype=torch.long)
            for i, t in enumerate(b.token_types):
                n = len(t)
                if self.family.padding_side == "right":
                    types[i, :n] = t
                else:
                    types[i, own - n:] = t
            features.append(VLAFeature(hidden_of[g][:, at], mask, to_device(types, hidden.device), self.meta,
                                       tuple(k[g][:, at] for k in kept_of)))
        return features

    # ---- query tokens -------------------------------------------------------------------------------
    def query_init(self) -> dict:
        """What a tenant's query tokens are made like: the hidden size and the spread of the model's own
        token embeddings as its embedding module gives them (Gemma's scales its table: the vectors are
        placed after it)."""
        embed = self.model.get_input_embeddings()
        with torch.no_grad():
            sample = embed(torch.arange(min(embed.num_embeddings, 4096), device=self.device))
        return {"dim": sample.shape[-1], "std": float(sample.float().std())}

    def install_tenant_hooks(self) -> None:
        super().install_tenant_hooks()
        query_tokens.install(self.model.get_input_embeddings())

    def _queries_placed(self, batches: list[HFBatch], queries: list | None, length: int):
        """The hook that puts each request's query vectors at its rows' placeholders (the last n_query
        tokens of each row, wherever the family's padding puts them)."""
        wanted = [b.n_query for b in batches]
        given = [0 if q is None else q.shape[0] for q in (queries or [None] * len(batches))]
        if wanted != given:
            raise ValueError(f"query tokens: the batches were prepared for {wanted}, the call gives {given}")
        if not any(wanted):
            return contextlib.nullcontext()
        rows = [(len(r.input_ids), b.n_query, q) for b, q in zip(batches, queries) for r in b.rows]
        positions = torch.zeros(len(rows), length, dtype=torch.bool)
        for i, (n, k, _) in enumerate(rows):
            if k:
                end = n if self.family.padding_side == "right" else length
                positions[i, end - k:end] = True
        values = torch.cat([q for _, k, q in rows if k])
        return query_tokens.placed(self.model.get_input_embeddings(), to_device(positions, self.device), values)

    # ---- helpers ------------------------------------------------------------------------------------
    def _image(self, chw: Tensor) -> np.ndarray:
        """A camera image [3, H, W] uint8 as the processors take it (HWC), resized to the spec's square
        size if one is set (it bounds a camera's tokens; the processor then does its own resize)."""
        img = chw
        if self.image_size and tuple(chw.shape[1:]) != (self.image_size, self.image_size):
            import torch.nn.functional as F

            img = F.interpolate(chw[None].float(), size=(self.image_size, self.image_size), mode="bilinear",
                                antialias=True, align_corners=False)[0].round().clamp(0, 255).to(torch.uint8)
        return img.permute(1, 2, 0).contiguous().numpy()

    @staticmethod
    def _token_types(mm: Tensor, offsets, instruction: str, cams: list[int], counts: list[int], suffix: int
                     ) -> Tensor:
        """Camera k for its image's tokens (the images' tokens come in camera order, `counts` each), TEXT
        for the instruction's (located from the end of the text, `suffix` characters after it: the images
        before it change the text's length), PROMPT for the rest."""
        types = torch.full(mm.shape, int(TokenType.PROMPT), dtype=torch.long)
        image = mm == 1
        if int(image.sum()) != sum(counts):
            raise RuntimeError(f"the processor made {int(image.sum())} image tokens for images of {counts}")
        owner = torch.repeat_interleave(torch.tensor(cams, dtype=torch.long), torch.tensor(counts, dtype=torch.long))
        types[image] = TokenType.CAMERA + owner
        if instruction:
            stop = max(e for _, e in offsets) - suffix
            first = stop - len(instruction)
            for i, (s, e) in enumerate(offsets):
                if not image[i] and e > s and s < stop and e > first:
                    types[i] = TokenType.TEXT
        return types


def _tensors(enc) -> dict:
    """The processor's image outputs as tensors (it returned python lists / arrays: return_tensors=None)."""
    out = {}
    for k, v in enc.items():
        if k in ("input_ids", "attention_mask", "mm_token_type_ids", "offset_mapping"):
            continue
        out[k] = torch.as_tensor(np.asarray(v)) if not isinstance(v, Tensor) else v
    return out
