"""Randomly initialised model directories of each family, in the hub's layout: config.json (marked
`"vlamux_random_weights": true`), model.safetensors, an offline tokenizer (a small byte-level BPE
trained here, with the family's special tokens), tokenizer_config.json, preprocessor_config.json and
the family's chat template. For tests, demos and benchmarks on machines without real weights: real
weights placed in a directory load through the same code.

    vlamux backbone init --family qwen2_5_vl --size tiny --out DIR
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from vlamux.model.backbones.hf.directory import ModelDirError

# The Qwen2-VL / Qwen2.5-VL chat template, as the hub ships it (chat_template.json).
QWEN_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]

# text: hidden, layers, heads, kv heads, mlp; vision: hidden, depth, heads, mlp. "3b" is Qwen2.5-VL-3B's
# shape (for accelerator benchmarks: about 7 GB of weights in bf16 written to disk).
QWEN_SIZES = {
    "tiny": dict(text=(64, 2, 4, 2, 128), vision=(32, 2, 2, 64)),
    "small": dict(text=(512, 6, 8, 2, 1536), vision=(256, 6, 4, 768)),  # ~22M, as the built-in small
    "base": dict(text=(896, 24, 14, 2, 4864), vision=(1280, 32, 16, 3420)),  # Qwen2.5-VL with a 0.5B LM
    "3b": dict(text=(2048, 36, 16, 2, 11008), vision=(1280, 32, 16, 3420)),
}
# Qwen3-VL (same fields); "2b" is Qwen3-VL-2B's shape.
QWEN3_SIZES = {
    "tiny": dict(text=(64, 2, 4, 2, 128), vision=(32, 2, 2, 64)),
    "small": dict(text=(512, 6, 8, 2, 1536), vision=(256, 6, 4, 768)),
    "base": dict(text=(1024, 28, 16, 8, 3072), vision=(768, 12, 12, 3072)),
    "2b": dict(text=(2048, 28, 16, 8, 6144), vision=(1024, 24, 16, 4096)),
}
# SmolVLM2: a Llama text model (hidden, layers, heads, kv, mlp), a SigLIP-like encoder (hidden, layers,
# heads, mlp), image px, patch px; pixel-shuffle 2 (a camera: (px / patch)^2 / 4 tokens). "2b" is
# SmolVLM2-2.2B's shape.
SMOLVLM_SIZES = {
    "tiny": dict(text=(64, 2, 4, 2, 128), vision=(32, 2, 2, 64), image=64, patch=16),
    "small": dict(text=(512, 6, 8, 2, 1536), vision=(256, 6, 4, 768), image=128, patch=16),
    "base": dict(text=(960, 12, 15, 5, 2560), vision=(768, 12, 12, 3072), image=512, patch=16),
    "2b": dict(text=(2048, 24, 32, 32, 8192), vision=(1152, 27, 16, 4304), image=384, patch=14),
}
# PaliGemma: a Gemma text model, a SigLIP encoder; image px, patch px (a camera: (px / patch)^2 tokens).
# "3b" is PaliGemma-3B's shape (pi0's backbone).
PALIGEMMA_SIZES = {
    "tiny": dict(text=(64, 2, 4, 1, 128), vision=(32, 2, 2, 64), image=28, patch=14),
    "small": dict(text=(512, 6, 8, 1, 1536), vision=(256, 6, 4, 768), image=112, patch=14),
    "base": dict(text=(1024, 12, 8, 1, 4096), vision=(768, 12, 12, 3072), image=224, patch=14),
    "3b": dict(text=(2048, 18, 8, 1, 16384), vision=(1152, 27, 16, 4304), image=224, patch=14),
}
FAMILY_SIZES = {"qwen2_5_vl": QWEN_SIZES, "qwen3_vl": QWEN3_SIZES, "smolvlm": SMOLVLM_SIZES, "paligemma": PALIGEMMA_SIZES}

# Words the tokenizer learns merges from: what the built-in suite's instructions and chat prompts say.
CORPUS = ("pick up the red green blue yellow purple orange cube ball block box and place push it into zone "
          "touch lift move left right front back top bottom near far slowly please then stop grab put on the "
          "table arm gripper open close you are a helpful assistant user system picture image robot task "
          "what should do next action go to reach over under between")


def _tokenizer(special: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = CORPUS.split()
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 8, trainer)
    return tok


def write_random_model(family: str, size: str, out: str | Path, seed: int = 0, overwrite: bool = False,
                       dtype: torch.dtype = torch.float32, device: str = "cpu") -> Path:
    """Write a random-weight model directory of `family` at `size` to `out`; returns it. `dtype` and
    `device`: where the weights are made and how they are stored (a 3B model is quicker made on a GPU,
    and half the size on disk in bfloat16)."""
    if family not in FAMILY_SIZES:
        raise ModelDirError(f"family {family!r}: random directories exist for {sorted(FAMILY_SIZES)}")
    sizes = FAMILY_SIZES[family]
    if size not in sizes:
        raise ModelDirError(f"size {size!r}: choose one of {sorted(sizes)} for {family}")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ModelDirError(f"{out}: exists and is not empty (overwrite=True replaces it)")
    out.mkdir(parents=True, exist_ok=True)
    from vlamux.model.backbones.hf.families import quiet_transformers

    with quiet_transformers():
        return _WRITERS[family](sizes[size], out, _Make(seed, dtype, torch.device(device)))


@dataclass(frozen=True)
class _Make:
    seed: int
    dtype: torch.dtype
    device: torch.device


def _qwen_files(out: Path, processor: str, patch: int, mean: list[float], std: list[float]) -> tuple:
    """The tokenizer, chat template and preprocessor config Qwen-VL directories share (Qwen3-VL's
    patches are 16 px and normalised to [-1, 1]; Qwen2/2.5-VL's 14 px, CLIP's statistics)."""
    tok = _tokenizer(QWEN_SPECIAL, 800)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIAL}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 32768, "padding_side": "right", "split_special_tokens": False,
        "extra_special_tokens": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                 "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
    }, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_TEMPLATE}, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor,
        "min_pixels": (4 * patch) ** 2, "max_pixels": (2 * patch) ** 2 * 1280, "patch_size": patch,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": mean, "image_std": std,
    }, indent=2))
    return tok, ids


def _mrope_section(head_dim: int) -> list[int]:
    half = head_dim // 2  # M-RoPE splits a head's rotary half into (t, h, w) sections
    return [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]


def _write_qwen2_5_vl(size: dict, out: Path, make: _Make) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok, ids = _qwen_files(out, "Qwen2_5_VLProcessor", 14, [0.48145466, 0.4578275, 0.40821073],
                           [0.26862954, 0.26130258, 0.27577711])
    hidden, layers, heads, kv, mlp = size["text"]
    v_hidden, v_depth, v_heads, v_mlp = size["vision"]
    section = _mrope_section(hidden // heads)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=mlp,
                         max_position_embeddings=32768, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section}),
        vision_config=dict(hidden_size=v_hidden, depth=v_depth, num_heads=v_heads, intermediate_size=v_mlp,
                           out_hidden_size=hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=112, fullatt_block_indexes=list(range(v_depth - 1, v_depth))),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True,
    )
    config.vlamux_random_weights = True
    _save(Qwen2_5_VLForConditionalGeneration, config, out, make)
    return out


def _write_qwen3_vl(size: dict, out: Path, make: _Make) -> Path:
    """Qwen3-VL: Qwen3 text layers (q/k norms, interleaved M-RoPE) and a vision tower whose middle
    layers also feed the first text layers (DeepStack)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok, ids = _qwen_files(out, "Qwen3VLProcessor", 16, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    hidden, layers, heads, kv, mlp = size["text"]
    v_hidden, v_depth, v_heads, v_mlp = size["vision"]
    head_dim = hidden // heads
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=mlp, head_dim=head_dim,
                         max_position_embeddings=32768, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": _mrope_section(head_dim), "mrope_interleaved": True}),
        vision_config=dict(hidden_size=v_hidden, depth=v_depth, num_heads=v_heads, intermediate_size=v_mlp,
                           out_hidden_size=hidden, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           num_position_embeddings=256, deepstack_visual_indexes=list(range(min(3, v_depth - 1)))),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    config.vlamux_random_weights = True
    _save(Qwen3VLForConditionalGeneration, config, out, make)
    return out


# SmolVLM's chat template, as SmolVLM2 ships it (text and images in a user turn; "Assistant:" opens the answer).
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] "
    "== 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == "
    "'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SMOLVLM_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>", "<image>",
                   "<fake_token_around_image>", "<global-img>"]
PALIGEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]


def _write_smolvlm(size: dict, out: Path, make: _Make) -> Path:
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    tok = _tokenizer(SMOLVLM_SPECIAL, 800)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SMOLVLM_SPECIAL}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>",
        "pad_token": "<|endoftext|>", "model_max_length": 8192, "padding_side": "right",
        "extra_special_tokens": {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                                 "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"},
    }, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": SMOLVLM_TEMPLATE}, indent=2))
    px, patch = size["image"], size["patch"]
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "SmolVLMImageProcessor", "processor_class": "SmolVLMProcessor",
        "do_image_splitting": True, "do_pad": True, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 1,
        "size": {"longest_edge": px * 4}, "max_image_size": {"longest_edge": px},
    }, indent=2))
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "SmolVLMProcessor", "image_seq_len": (px // patch) ** 2 // 4}, indent=2))
    hidden, layers, heads, kv, mlp = size["text"]
    v_hidden, v_layers, v_heads, v_mlp = size["vision"]
    config = SmolVLMConfig(
        text_config=dict(model_type="llama", vocab_size=tok.get_vocab_size(), hidden_size=hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                         intermediate_size=mlp, max_position_embeddings=8192, rope_theta=100000.0,
                         bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<end_of_utterance>"],
                         pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True),
        vision_config=dict(hidden_size=v_hidden, num_hidden_layers=v_layers, num_attention_heads=v_heads,
                           intermediate_size=v_mlp, image_size=px, patch_size=patch),
        scale_factor=2, image_token_id=ids["<image>"], pad_token_id=ids["<|endoftext|>"],
    )
    config.vlamux_random_weights = True
    _save(SmolVLMForConditionalGeneration, config, out, make)
    return out


def _write_paligemma(size: dict, out: Path, make: _Make) -> Path:
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    tok = _tokenizer(PALIGEMMA_SPECIAL, 800)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in PALIGEMMA_SPECIAL}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "model_max_length": 8192, "padding_side": "right",
        "extra_special_tokens": {"image_token": "<image>"},
    }, indent=2))
    px, patch = size["image"], size["patch"]
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "SiglipImageProcessor", "processor_class": "PaliGemmaProcessor",
        "image_seq_length": (px // patch) ** 2, "size": {"height": px, "width": px}, "resample": 3,
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    }, indent=2))
    hidden, layers, heads, kv, mlp = size["text"]
    v_hidden, v_layers, v_heads, v_mlp = size["vision"]
    vocab = tok.get_vocab_size()
    config = PaliGemmaConfig(
        text_config=dict(model_type="gemma", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=mlp,
                         head_dim=hidden // heads, max_position_embeddings=8192, bos_token_id=ids["<bos>"],
                         eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"]),
        vision_config=dict(hidden_size=v_hidden, num_hidden_layers=v_layers, num_attention_heads=v_heads,
                           intermediate_size=v_mlp, image_size=px, patch_size=patch, vision_use_head=False),
        image_token_index=ids["<image>"], vocab_size=vocab, projection_dim=hidden, hidden_size=hidden,
        pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
    )
    config.vlamux_random_weights = True
    _save(PaliGemmaForConditionalGeneration, config, out, make)
    return out


def _save(model_class, config, out: Path, make: _Make) -> None:
    from vlamux.utils.seeding import seeded

    with seeded(make.seed), torch.device(make.device):
        if make.device.type == "cuda":
            torch.cuda.manual_seed(make.seed)
        model = model_class._from_config(config, dtype=make.dtype)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)  # no generation: features only
    del model


_WRITERS = {"qwen2_5_vl": _write_qwen2_5_vl, "qwen3_vl": _write_qwen3_vl, "smolvlm": _write_smolvlm, "paligemma": _write_paligemma}
