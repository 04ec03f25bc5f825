"""A LeRobot policy checkpoint on disk, as lerobot's `save_pretrained` writes it: `config.json`,
`model.safetensors`, and the pre/post-processor files with their statistics. Families: SmolVLA
(`type: smolvla`), π0 (`pi0`) and π0.5 (`pi05`).

The state dict splits in two: the VLM (the shared backbone: its vision tower, connector and language
layers) and everything else (the tenant's module: the action expert and its projections).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from vlamux.errors import InvalidInputError
from vlamux.utils.io import tensors_sha256

# the state-dict prefix of each family's VLM; every other tensor is the tenant's module
VLM_PREFIX = {"smolvla": "model.vlm_with_expert.vlm.", "pi0": "model.paligemma_with_expert.paligemma.",
              "pi05": "model.paligemma_with_expert.paligemma."}
FAMILIES = tuple(VLM_PREFIX)
WEIGHTS, CONFIG = "model.safetensors", "config.json"
PRE, POST = "policy_preprocessor.json", "policy_postprocessor.json"
_HASHES: dict[tuple, str] = {}  # (weights file, size, mtime) -> its VLM's content hash
_HASHES_LOCK = threading.Lock()


@dataclass
class LeRobotCheckpoint:
    path: Path
    family: str
    config: dict
    tensors: dict[str, Tensor]  # the file's, by their names there
    metadata: dict  # the file's header metadata (π0's tied-embedding alias)
    pre: dict  # policy_preprocessor.json
    post: dict
    stats: dict[str, Tensor] = field(default_factory=dict)  # "<feature>.<stat>", the normalizer's

    @staticmethod
    def read(path, vlm: bool = True) -> LeRobotCheckpoint:
        """Read a checkpoint directory; errors name the file and what is wrong with it. vlm=False: the
        tenant's module only (importing a tenant onto a backbone that holds the VLM already; its hash
        is `vlm_sha256`'s, read once per file)."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_dir():
            raise InvalidInputError(f"{path.name}: not a LeRobot checkpoint directory")
        for name in (CONFIG, WEIGHTS, PRE, POST):
            if not (path / name).is_file():
                raise InvalidInputError(f"{path.name}/{name}: missing (a LeRobot checkpoint holds {CONFIG}, "
                                        f"{WEIGHTS}, {PRE} and {POST})")
        config = _json(path / CONFIG)
        family = config.get("type")
        if family not in FAMILIES:
            raise InvalidInputError(f"{path.name}/{CONFIG}: type {family!r} is not one vlamux imports "
                                    f"({', '.join(FAMILIES)})")
        try:
            with safe_open(str(path / WEIGHTS), framework="pt") as f:
                names = list(f.keys())
                tensors = {k: f.get_tensor(k) for k in names if vlm or not k.startswith(VLM_PREFIX[family])}
                metadata = f.metadata() or {}
        except Exception as e:  # noqa: BLE001 - a damaged header raises several kinds
            raise InvalidInputError(f"{path.name}/{WEIGHTS}: not a readable safetensors file ({e})") from None
        ckpt = LeRobotCheckpoint(path, family, config, tensors, metadata, _json(path / PRE), _json(path / POST))
        ckpt.stats = ckpt._normalizer_stats()
        if not any(k.startswith(VLM_PREFIX[family]) for k in names):
            raise InvalidInputError(f"{path.name}/{WEIGHTS}: no tensor under {VLM_PREFIX[family]!r}: not a "
                                    f"{family} checkpoint")
        return ckpt

    @staticmethod
    def read_config(path) -> dict:
        """Only the checkpoint's config.json (no tensors read), checked to be a family vlamux imports."""
        path = Path(path)
        if not (path / CONFIG).is_file():
            raise InvalidInputError(f"{path.name}: not a LeRobot checkpoint directory (no {CONFIG})")
        config = _json(path / CONFIG)
        if config.get("type") not in FAMILIES:
            raise InvalidInputError(f"{path.name}/{CONFIG}: type {config.get('type')!r} is not one vlamux imports "
                                    f"({', '.join(FAMILIES)})")
        return config

    # ---- the split ----------------------------------------------------------------------------------
    def vlm_tensors(self) -> dict[str, Tensor]:
        """The VLM's tensors, named without the family's VLM prefix."""
        p = VLM_PREFIX[self.family]
        return {k[len(p):]: v for k, v in self.tensors.items() if k.startswith(p)}

    def module_tensors(self) -> dict[str, Tensor]:
        """The tenant's module: every tensor that is not the VLM's, named as in the file without `model.`."""
        p = VLM_PREFIX[self.family]
        return {k.removeprefix("model."): v for k, v in self.tensors.items() if not k.startswith(p)}

    def vlm_sha256(self) -> str:
        """The content hash of the VLM's tensors (names without the prefix, dtypes, shapes, bytes); kept
        per file (its path, size and modification time): a VLM of gigabytes is hashed once, not once per
        tenant imported from checkpoints that share it."""
        f = (self.path / WEIGHTS).resolve()
        st = f.stat()
        key = (str(f), st.st_size, st.st_mtime_ns)
        with _HASHES_LOCK:
            if key in _HASHES:
                return _HASHES[key]
        tensors = self.vlm_tensors()
        if not tensors:  # read without its VLM: read that part now
            from safetensors import safe_open

            p = VLM_PREFIX[self.family]
            with safe_open(str(f), framework="pt") as h:
                tensors = {k[len(p):]: h.get_tensor(k) for k in h.keys() if k.startswith(p)}
        digest = tensors_sha256(tensors)
        with _HASHES_LOCK:
            _HASHES[key] = digest
            while len(_HASHES) > 256:
                _HASHES.pop(next(iter(_HASHES)))
        return digest

    # ---- what the processors say --------------------------------------------------------------------
    def vlm_hub_id(self) -> str:
        """What the checkpoint names its VLM (SmolVLA) or tokenizer (π0, π0.5) by: a hub id."""
        return _hub_id(self.config, self.pre)

    def pre_step(self, name: str) -> dict | None:
        return next((s for s in self.pre.get("steps", []) if s.get("registry_name") == name), None)

    def cameras(self) -> list[str]:
        """The camera features' names after `observation.images.`, in the config's order."""
        feats = self.config.get("input_features", {})
        return [k.removeprefix("observation.images.") for k, v in feats.items() if v.get("type") == "VISUAL"]

    def state_dim(self) -> int:
        f = self.config.get("input_features", {}).get("observation.state")
        return int(f["shape"][0]) if f else 0

    def action_dim(self) -> int:
        return int(self.config["output_features"]["action"]["shape"][0])

    def norm_modes(self) -> dict[str, str]:
        """STATE / ACTION -> MEAN_STD | QUANTILES | IDENTITY."""
        return dict(self.config.get("normalization_mapping", {}))

    def _normalizer_stats(self) -> dict[str, Tensor]:
        from safetensors.torch import load_file

        step = next((s for s in self.pre.get("steps", []) if s.get("state_file")), None)
        if step is None:
            raise InvalidInputError(f"{self.path.name}/{PRE}: no normalizer step with a state_file")
        f = self.path / step["state_file"]
        if not f.is_file():
            raise InvalidInputError(f"{self.path.name}/{step['state_file']}: missing (the normalizer's statistics)")
        return load_file(str(f))


def named_vlm(path) -> str:
    """The hub id a checkpoint directory names for its VLM / tokenizer (its JSON files only read)."""
    path = Path(path)
    return _hub_id(LeRobotCheckpoint.read_config(path), _json(path / PRE) if (path / PRE).is_file() else {})


def _hub_id(config: dict, pre: dict) -> str:
    if config.get("type") == "smolvla":
        return str(config.get("vlm_model_name"))
    step = next((s for s in pre.get("steps", []) if s.get("registry_name") == "tokenizer_processor"), None)
    return str(step["config"].get("tokenizer_name")) if step else "google/paligemma-3b-pt-224"


def is_lerobot_checkpoint(path) -> bool:
    """Whether `path` is a directory lerobot wrote for a policy vlamux imports (by its config's type)."""
    try:
        return isinstance(LeRobotCheckpoint.read_config(path), dict)
    except (InvalidInputError, OSError, TypeError):
        return False


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidInputError(f"{path.parent.name}/{path.name}: not readable JSON ({e})") from None
