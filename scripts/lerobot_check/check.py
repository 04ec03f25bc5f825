"""Check exported LeRobot checkpoints against the real lerobot 0.4.4 package.

Usage: HF_HUB_OFFLINE=1 venv/bin/python check.py smolvla [pi0 pi05]

For every family it runs, for both the ORIGINAL checkpoint (/work/shared/lerobot-vla/<family>) and the EXPORT
(/tmp/lerobot_check/<family>):
    PreTrainedConfig.from_pretrained -> (hub ids pointed at local asset dirs) -> <Policy>.from_pretrained(config=...)
    make_pre_post_processors(pretrained_path=...) (= PolicyProcessorPipeline.from_pretrained on the checkpoint's
    policy_preprocessor.json / policy_postprocessor.json; only override: tokenizer_name -> local dir)
    preprocessor(batch1) -> policy.predict_action_chunk(noise=batch1.noise) -> postprocessor
and compares with references batch1.action (original, sanity) and <family>_vlamux_actions.safetensors (export).

Stub (only one): this torch (2.13.0+cpu) has no matching CPU torchvision on PyPI; the PyPI torchvision 0.28.0 wheel's
C extension is CUDA-linked and does not load, and `import torchvision` then fails registering fake kernels for the
ops torchvision::nms / torchvision::qnms. We DEFINE those two op schemas (no kernels) before importing torchvision,
so the pure-python parts (torchvision.transforms, imported by lerobot.datasets.utils) import. None of the code
paths used here call torchvision ops.
"""
import io
import json
import logging
import os
import sys
import contextlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

_tv_stub = torch.library.Library("torchvision", "DEF")
_tv_stub.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_tv_stub.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
import torchvision  # noqa: E402,F401

from safetensors.torch import load_file  # noqa: E402

import lerobot  # noqa: E402
import transformers  # noqa: E402
from lerobot.configs.policies import PreTrainedConfig  # noqa: E402
from lerobot.policies.factory import get_policy_class, make_pre_post_processors  # noqa: E402

SHARED = "/work/shared/lerobot-vla"
EXPORTS = "/tmp/lerobot_check"
ASSETS = {
    "HuggingFaceTB/SmolVLM2-500M-Video-Instruct": f"{SHARED}/assets/smolvlm2_tiny",
    "google/paligemma-3b-pt-224": f"{SHARED}/assets/paligemma_tokenizer",
}

torch.set_grad_enabled(False)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def state_dict_key_check(policy, ckpt_dir):
    """Independent strict key/shape comparison of model.safetensors against the instantiated policy."""
    sd = load_file(os.path.join(ckpt_dir, "model.safetensors"))
    model_sd = policy.state_dict()
    missing = sorted(set(model_sd) - set(sd))
    unexpected = sorted(set(sd) - set(model_sd))
    shape_mismatch = sorted(k for k in set(sd) & set(model_sd) if tuple(sd[k].shape) != tuple(model_sd[k].shape))
    # Do the loaded parameters equal the file's tensors? (catches silently skipped keys)
    value_mismatch = sorted(
        k for k in set(sd) & set(model_sd) if k not in shape_mismatch and not torch.equal(sd[k].float(), model_sd[k].float())
    )
    # safetensors drops tied (shared) tensors and records them in the header metadata {dropped_key: kept_key};
    # for such a missing key, check that the model's tensor equals the kept one (i.e. it is tied / was filled).
    from safetensors import safe_open

    with safe_open(os.path.join(ckpt_dir, "model.safetensors"), "pt") as f:
        meta = f.metadata() or {}
    for k in list(missing):
        if k in meta and meta[k] in sd:
            same = torch.equal(model_sd[k].float(), sd[meta[k]].float())
            print(f"  note: {k} absent from file, header metadata aliases it to {meta[k]}; model tensor equals it: {same}")
    return missing, unexpected, shape_mismatch, value_mismatch


_PATCHED = set()


def patch_tiny_pi(family):
    """pi0/pi05 only: config.json says paligemma_variant=gemma_2b / action_expert_variant=gemma_300m and lerobot hard-codes
    the stock PaliGemma sizes (vocab 257152, SigLIP So400m, projection 2048) in PaliGemmaWithExpertModel.__init__.
    The tiny test checkpoints have other sizes (README: "the tiny sizes come from the tensors' shapes"), so - exactly
    like the references' author had to - we patch, in lerobot's modeling module only: get_gemma_config (variant ->
    tiny dims) and the two HF model constructors it calls (vocab size and SigLIP dims set on the HF config before
    construction). The dims are the ones listed in references/<family>.json "dims"; everything else is lerobot's code.
    """
    if family in _PATCHED:
        return
    import importlib

    mod = importlib.import_module(f"lerobot.policies.{family}.modeling_{family}")
    dims = json.load(open(f"{SHARED}/references/{family}.json"))["dims"]
    variants = {"gemma_2b": dims["vlm_gemma"], "gemma_300m": dims["expert_gemma"]}
    vocab, sig = dims["vocab_size"], dims["siglip"]

    def get_gemma_config(variant):
        return mod.GemmaConfig(**variants[variant])

    orig_pg, orig_gemma = mod.PaliGemmaForConditionalGeneration, mod.GemmaForCausalLM

    def paligemma(config):
        config._vocab_size = vocab
        config.text_config.vocab_size = vocab
        vc = config.vision_config
        vc.hidden_size = sig["hidden_size"]
        vc.intermediate_size = sig["intermediate_size"]
        vc.num_hidden_layers = sig["num_hidden_layers"]
        vc.num_attention_heads = sig["num_attention_heads"]
        vc.patch_size = sig["patch_size"]
        vc.projection_dim = variants["gemma_2b"]["width"]
        return orig_pg(config=config)

    def gemma(config):
        config.vocab_size = vocab
        return orig_gemma(config=config)

    mod.get_gemma_config = get_gemma_config
    mod.PaliGemmaForConditionalGeneration = paligemma
    mod.GemmaForCausalLM = gemma
    _PATCHED.add(family)
    print(f"  [patch] {mod.__name__}: tiny dims {variants} vocab={vocab} siglip={sig}")


def run(family, ckpt_dir, ref):
    print(f"--- {family}: {ckpt_dir}")
    if family in ("pi0", "pi05"):
        patch_tiny_pi(family)
    cfg = PreTrainedConfig.from_pretrained(ckpt_dir)
    if hasattr(cfg, "vlm_model_name"):
        cfg.vlm_model_name = ASSETS.get(cfg.vlm_model_name, cfg.vlm_model_name)
    cap = _Capture()
    logging.getLogger().addHandler(cap)
    buf = io.StringIO()
    policy_cls = get_policy_class(cfg.type)
    with contextlib.redirect_stdout(buf):
        policy = policy_cls.from_pretrained(ckpt_dir, config=cfg)
    logging.getLogger().removeHandler(cap)
    policy.eval()
    print("  from_pretrained stdout:", repr(buf.getvalue().strip()) if buf.getvalue().strip() else "(none)")
    print("  from_pretrained warnings:", cap.records if cap.records else "(none)")
    missing, unexpected, shape_mm, value_mm = state_dict_key_check(policy, ckpt_dir)
    print(f"  own strict check: missing={missing} unexpected={unexpected} shape_mismatch={shape_mm} "
          f"loaded!=file={value_mm}")

    pre_json = json.load(open(os.path.join(ckpt_dir, "policy_preprocessor.json")))
    overrides = {}
    for step in pre_json["steps"]:
        tn = step.get("config", {}).get("tokenizer_name")
        if tn is not None:
            overrides[step["registry_name"]] = {"tokenizer_name": ASSETS.get(tn, tn)}
    pre, post = make_pre_post_processors(cfg, pretrained_path=ckpt_dir, preprocessor_overrides=overrides)

    batch = {
        "observation.images.front": ref["batch1.observation.images.front"].clone(),
        "observation.images.wrist": ref["batch1.observation.images.wrist"].clone(),
        "observation.state": ref["batch1.observation.state"].clone(),
        "task": list(TASKS[family]),
    }
    proc = pre(batch)
    info = {}
    if "batch1.lang_tokens" in ref:
        lt = proc["observation.language.tokens"]
        info["lang_tokens==ref"] = bool(lt.shape == ref["batch1.lang_tokens"].shape and torch.equal(lt, ref["batch1.lang_tokens"]))
    if "batch1.state_normalized" in ref:
        info["max|state_norm-ref|"] = float((proc["observation.state"] - ref["batch1.state_normalized"]).abs().max())
    policy.reset()
    act_norm = policy.predict_action_chunk(proc, noise=ref["batch1.noise"].clone())
    info["max|action_normalized-ref|"] = float((act_norm - ref["batch1.action_normalized"]).abs().max())
    actions = post(act_norm)
    print("  pipeline vs reference intermediates (meaningful for the original):", info)
    return actions


def main(families):
    print(f"lerobot {getattr(lerobot, '__version__', '?')} transformers {transformers.__version__} torch {torch.__version__}")
    results = {}
    for fam in families:
        ref = load_file(f"{SHARED}/references/{fam}.safetensors")
        TASKS[fam] = json.load(open(f"{SHARED}/references/{fam}.json"))["tasks"]["batch1"]
        expected = load_file(f"{EXPORTS}/{fam}_vlamux_actions.safetensors")["action"]
        a_orig = run(fam, f"{SHARED}/{fam}", ref)
        d_orig = float((a_orig - ref["batch1.action"]).abs().max())
        print(f"  SANITY original: max|lerobot - references batch1.action| = {d_orig:.3e}  shape {tuple(a_orig.shape)}")
        a_exp = run(fam, f"{EXPORTS}/{fam}", ref)
        d_exp = float((a_exp - expected).abs().max())
        d_exp_ref = float((a_exp - ref["batch1.action"]).abs().max())
        d_x = float((expected - ref["batch1.action"]).abs().max())
        print(f"  EXPORT: max|lerobot(export) - {fam}_vlamux_actions| = {d_exp:.3e}  shape {tuple(a_exp.shape)}")
        print(f"  (extra) max|lerobot(export) - references batch1.action| = {d_exp_ref:.3e}; "
              f"max|vlamux_actions - references batch1.action| = {d_x:.3e}; "
              f"max|lerobot(export) - lerobot(original)| = {float((a_exp - a_orig).abs().max()):.3e}")
        results[fam] = dict(orig_vs_ref=d_orig, export_vs_expected=d_exp)
    print("SUMMARY", json.dumps(results))


TASKS = {}

if __name__ == "__main__":
    main(sys.argv[1:] or ["smolvla"])
