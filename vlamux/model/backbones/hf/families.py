"""What differs between the VLM families vlamux hosts: which transformers classes load them, how a
prompt with a tenant's cameras and instruction is laid out, and how the processor's per-row output
is batched into one model call. The preprocessing and the forward are the family's own (its image
processor, its processor's prompt expansion, its tokenizer, its model): nothing here re-implements
them.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlamux.model.backbones.hf.directory import ModelDirError


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings and progress bars off for a block (loads and writes vlamux makes on purpose)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def _import(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def build_processor(cls, image_processor, tokenizer, chat_template, options: dict | None = None):
    """The family's processor (`options`: its processor_config.json, e.g. SmolVLM's image_seq_len). Its
    video processor needs torchvision, which vlamux neither needs nor can install beside a CPU torch
    (and never sends video): the processor is built without one; its image and text paths are
    unchanged."""
    options = dict(options or {})
    wants_video = "video_processor" in cls.__init__.__code__.co_varnames
    if not wants_video:
        return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **options)

    class WithoutVideo(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    WithoutVideo.__name__ = cls.__name__
    return WithoutVideo(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                        chat_template=chat_template, **options)


@dataclass
class Row:
    """One observation row as the processor made it: its tokens and its images' tensors."""

    input_ids: Tensor  # [L] int64
    mm_types: Tensor  # [L] the processor's modality ids (0 text, 1 image)
    extra: dict = field(default_factory=dict)  # per-row model inputs (family-specific), e.g. pixel values


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    model_class: str  # the base model (no LM head): features, not logits
    image_processor: str  # the PIL backend: it needs no torchvision
    processor: str
    padding_side: str = "right"
    instruction_suffix: str = ""  # what the processor appends after the prompt's text
    image_kwargs: dict = field(default_factory=dict)  # image-processor options vlamux fixes (e.g. no tiling)
    nested_images: bool = False  # the processor takes each row's images as a list of its own

    # ---- loading --------------------------------------------------------------------------------
    def model(self, path, dtype: torch.dtype, attn: str):
        cls = _import(self.model_class)
        try:
            with quiet_transformers():  # the load report lists the LM head this base model leaves out
                return cls.from_pretrained(str(path), dtype=dtype, attn_implementation=attn, local_files_only=True)
        except OSError as e:
            raise ModelDirError(f"{path}: could not load {cls.__name__} ({e})") from None

    def text_model(self, model):
        """The language model inside (its decoder layers carry the features)."""
        return model.language_model

    # ---- prompts ----------------------------------------------------------------------------------
    def prompt(self, processor, template: str | None, instruction: str, n_images: int) -> str:
        """The text for one row: the chat template's user turn with one image per camera, then the
        instruction, and the assistant's turn opened (its first token is where an answer starts)."""
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": instruction}]
        messages = [{"role": "user", "content": content}]
        if template is None:
            raise ModelDirError(f"{self.name}: the model directory has no chat template")
        return processor.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                       add_generation_prompt=True)

    # ---- batching ---------------------------------------------------------------------------------
    def split(self, enc: dict, images_per_row: list[int]) -> list[dict]:
        """The processor's image tensors for each row (`enc` holds a whole request's)."""
        raise NotImplementedError

    def image_tokens(self, processor, extra: dict) -> list[int]:
        """How many image tokens each of a row's images became, in order."""
        raise NotImplementedError

    def collate(self, rows: list[Row], pad_id: int) -> dict:
        """The model's keyword arguments for `rows`, padded on `padding_side`."""
        length = max(len(r.input_ids) for r in rows)
        ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        types = torch.zeros(len(rows), length, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r.input_ids)
            at = slice(0, n) if self.padding_side == "right" else slice(length - n, length)
            ids[i, at], mask[i, at], types[i, at] = r.input_ids, 1, r.mm_types
        return {"input_ids": ids, "attention_mask": mask, **self.collate_images(rows, types)}

    def collate_images(self, rows: list[Row], mm_types: Tensor) -> dict:
        raise NotImplementedError


class QwenVL(Family):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: native-resolution patches (14 px; Qwen3-VL's 16, 2x2 merged), one flat tensor of every
    image's patches with a (t, h, w) grid per image, and M-RoPE positions the model computes from the
    modality ids and the attention mask (so padding does not move them)."""

    def split(self, enc, images_per_row):
        grids = enc["image_grid_thw"]
        patches = grids.prod(-1).tolist()
        out, img, start = [], 0, 0
        for n in images_per_row:
            count = sum(patches[img:img + n])
            out.append({"pixel_values": enc["pixel_values"][start:start + count], "image_grid_thw": grids[img:img + n]})
            img, start = img + n, start + count
        return out

    def image_tokens(self, processor, extra):
        merge = processor.image_processor.merge_size ** 2
        return [int(n) // merge for n in extra["image_grid_thw"].prod(-1).tolist()]

    def collate_images(self, rows, mm_types):
        with_images = [r for r in rows if len(r.extra["image_grid_thw"])]
        if not with_images:
            return {"mm_token_type_ids": mm_types}
        return {"pixel_values": torch.cat([r.extra["pixel_values"] for r in with_images]),
                "image_grid_thw": torch.cat([r.extra["image_grid_thw"] for r in with_images]),
                "mm_token_type_ids": mm_types}


class SmolVLM(Family):
    """SmolVLM / SmolVLM2 (Idefics3's layout), as SmolVLA uses it: each camera one image, not tiled
    (do_image_splitting off), so a camera costs image_seq_len tokens; pixel values per row
    [images, 3, H, W] with a pixel mask, rows with fewer images padded with empty ones (which the
    model drops)."""

    def text_model(self, model):
        return model.text_model

    def image_tokens(self, processor, extra):
        return [processor.image_seq_len] * len(extra["pixel_values"])

    def split(self, enc, images_per_row):
        return [{"pixel_values": enc["pixel_values"][b, :n], "pixel_attention_mask": enc["pixel_attention_mask"][b, :n]}
                for b, n in enumerate(images_per_row)]

    def collate_images(self, rows, mm_types):
        n = max(len(r.extra["pixel_values"]) for r in rows)
        return {k: torch.stack([_pad_first(r.extra[k], n) for r in rows])
                for k in ("pixel_values", "pixel_attention_mask")}


class PaliGemma(Family):
    """PaliGemma (pi0's backbone): the processor puts each image's tokens first, then <bos>, the prompt
    and a newline, and marks the whole prefix (token_type_ids 0) for bidirectional attention; the
    model numbers positions 1..L itself, so rows are padded on the right."""

    def prompt(self, processor, template, instruction, n_images):
        # an <image> per camera first; the processor expands each and puts <bos> before the prompt
        return processor.image_token * n_images + instruction

    def image_tokens(self, processor, extra):
        return [processor.image_seq_length] * len(extra["pixel_values"])

    def split(self, enc, images_per_row):
        out, start = [], 0
        for n in images_per_row:
            out.append({"pixel_values": enc["pixel_values"][start:start + n]})
            start += n
        return out

    def collate_images(self, rows, mm_types):
        # the prefix is everything here (no suffix): token type 0, bidirectional, on every row
        return {"pixel_values": torch.cat([r.extra["pixel_values"] for r in rows]),
                "token_type_ids": torch.zeros_like(mm_types)}


def _pad_first(t: Tensor, n: int) -> Tensor:
    missing = n - t.shape[0]
    return t if missing == 0 else torch.cat([t, t.new_zeros(missing, *t.shape[1:])])


FAMILIES: dict[str, Family] = {f.name: f for f in (
    QwenVL("qwen2_5_vl", ("qwen2_5_vl",), "transformers.Qwen2_5_VLModel",
           "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil",
           "transformers.Qwen2_5_VLProcessor"),
    QwenVL("qwen3_vl", ("qwen3_vl",), "transformers.Qwen3VLModel",
           "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil",
           "transformers.Qwen3VLProcessor"),
    QwenVL("qwen2_vl", ("qwen2_vl",), "transformers.Qwen2VLModel",
           "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil",
           "transformers.Qwen2VLProcessor"),
    SmolVLM("smolvlm", ("smolvlm",), "transformers.SmolVLMModel",
            "transformers.models.smolvlm.image_processing_pil_smolvlm.SmolVLMImageProcessorPil",
            "transformers.SmolVLMProcessor", image_kwargs={"do_image_splitting": False}, nested_images=True),
    PaliGemma("paligemma", ("paligemma",), "transformers.PaliGemmaModel",
              "transformers.models.siglip.image_processing_pil_siglip.SiglipImageProcessorPil",
              "transformers.PaliGemmaProcessor", instruction_suffix="\n", nested_images=True),
)}


def family_of(model_type: str) -> Family:
    for f in FAMILIES.values():
        if model_type in f.model_types:
            return f
    known = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise ModelDirError(f"model_type {model_type!r} is not a family vlamux hosts; it hosts {known}")
