"""A tenant's imported policy written back out as a LeRobot checkpoint: the directory lerobot's
`from_pretrained` reads (config.json, model.safetensors, the pre/post-processor files with their
statistics), in the layout and key names the tenant's checkpoint came in.

model.safetensors holds the shared VLM's tensors (read again from the backbone's checkpoint, and
checked against the backbone's content hash) and the tenant's expert as it is now; the normaliser
files hold the tenant's statistics as it has them now; config.json and the processor JSON files are
the ones it was imported with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from vlamux.errors import IncompatibleError, InvalidInputError
from vlamux.model.normalize import NormStats
from vlamux.model.vla.checkpoint import CONFIG, POST, PRE, VLM_PREFIX, WEIGHTS, LeRobotCheckpoint

EXPERT_PREFIX = "head.expert."  # the expert's tensors in a slot's (and a policy snapshot's) module
LEROBOT_FEATURE = {"state": "observation.state", "action": "action"}


def write_lerobot(out, vlm_checkpoint, vlm_sha256: str, head_spec, tensors: dict[str, Tensor],
                  stats_modes: dict[str, str]) -> Path:
    """Write the policy (`tensors`: a slot's or snapshot's "head.*" and "stats.*"; `stats_modes` their
    modes) of an imported tenant to the directory `out`; the VLM's tensors from `vlm_checkpoint` (the
    checkpoint the tenant's backbone was built from, whose VLM must still hash to `vlm_sha256`)."""
    files = head_spec.options.get("lerobot") if head_spec.kind == "lerobot" else None
    if files is None:
        raise InvalidInputError(f"format lerobot: the policy's head is of kind {head_spec.kind!r}; only a policy "
                                f"imported from a LeRobot checkpoint is written as one")
    family = head_spec.options["family"]
    ckpt = LeRobotCheckpoint.read(vlm_checkpoint)
    if ckpt.vlm_sha256() != vlm_sha256:
        raise IncompatibleError(f"{Path(vlm_checkpoint).name}: its VLM tensors changed since the backbone was built "
                                f"from it (sha256 {vlm_sha256} then, {ckpt.vlm_sha256()} now)")
    dtype = getattr(torch, files.get("dtype", "float32"))
    weights = {VLM_PREFIX[family] + k: v.contiguous() for k, v in ckpt.vlm_tensors().items()}
    weights.update({"model." + k.removeprefix(EXPERT_PREFIX): v.detach().to("cpu", dtype).contiguous()
                    for k, v in tensors.items() if k.startswith(EXPERT_PREFIX)})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / WEIGHTS), metadata=_aliases(ckpt.metadata, weights))
    (out / CONFIG).write_text(json.dumps(files["config"], indent=4))
    stats = _lerobot_stats(tensors, stats_modes)
    for name, key in ((PRE, "preprocessor"), (POST, "postprocessor")):
        pipeline = files[key]
        (out / name).write_text(json.dumps(pipeline, indent=2))
        for step in pipeline.get("steps", []):
            if step.get("state_file"):
                save_file(stats, str(out / step["state_file"]))
    return out


def _aliases(metadata: dict, weights: dict) -> dict | None:
    """The file's tied-tensor aliases (π0's embedding is its lm_head) where both names still apply."""
    keep = {k: v for k, v in metadata.items() if v in weights and k not in weights}
    return {"format": "pt", **keep} if keep else {"format": "pt"}


def _lerobot_stats(tensors: dict[str, Tensor], modes: dict[str, str]) -> dict[str, Tensor]:
    """The slot's statistics under lerobot's names: mean/std (and min/max) for MEAN_STD, q01/q99 (the
    slot's min/max in that mode) for QUANTILES."""
    out = {}
    for name, feature in LEROBOT_FEATURE.items():
        mode = modes.get(name)
        if mode is None or mode == "identity":
            continue
        st = NormStats.from_tensors({k: v.detach().cpu().float() for k, v in tensors.items()}, f"stats.{name}", mode)
        out[f"{feature}.mean"], out[f"{feature}.std"] = st.mean, st.std
        lo, hi = ("q01", "q99") if mode == "min_max" else ("min", "max")
        out[f"{feature}.{lo}"], out[f"{feature}.{hi}"] = st.min, st.max
    return {k: v.contiguous() for k, v in out.items()}
