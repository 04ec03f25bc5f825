"""A local Hugging Face model directory, checked before anything loads: the files a family needs,
laid out as the hub ships them, each readable; the family it holds; an identity for its content.

Nothing here (or anywhere in vlamux) downloads: a missing file is an error that names it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from vlamux.errors import VlamuxError


class ModelDirError(VlamuxError, ValueError):
    """A model directory is missing a file, holds a corrupt one, or is of another family than asked."""


WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # one of them (tokenizers' JSON, or sentencepiece)


@dataclass(frozen=True)
class ModelDir:
    path: Path
    config: dict
    weight_files: tuple[Path, ...]

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    @property
    def random_weights(self) -> bool:
        """Made by `vlamux backbone init`: random weights, for tests and demos."""
        return bool(self.config.get("vlamux_random_weights"))

    def identity(self, full: bool = False) -> str:
        """A content hash (short, or all 64 hex digits): the config, and each weight file's size, first
        and last MiB. Cheap (no pass over gigabytes) yet different for any two directories a user would
        confuse."""
        h = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode())
        for f in self.weight_files:
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
                if size > 2 << 20:
                    fh.seek(-(1 << 20), 2)
                    h.update(fh.read(1 << 20))
        return h.hexdigest() if full else h.hexdigest()[:12]


def _json(path: Path) -> dict:
    if not path.is_file():
        raise ModelDirError(f"{path}: missing (a model directory laid out as the hub ships it needs it)")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{path}: not readable JSON ({e})") from None


def _check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    if not path.is_file():
        raise ModelDirError(f"{path}: missing weights file")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    except Exception as e:  # noqa: BLE001 - safetensors raises several kinds for a broken header
        raise ModelDirError(f"{path}: not a readable safetensors file ({e})") from None
    if not keys:
        raise ModelDirError(f"{path}: holds no tensors")


def open_model_dir(path: str | Path, model_types: tuple[str, ...] | None = None, family: str = "") -> ModelDir:
    """Check a model directory and return what it holds. `model_types`: the config model_type values
    the asked-for family accepts (else any)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelDirError(f"{path}: no such model directory")
    config = _json(path / "config.json")
    if model_types and config.get("model_type") not in model_types:
        raise ModelDirError(f"{path / 'config.json'}: model_type {config.get('model_type')!r} is not "
                            f"{family or 'the family asked for'} (expected one of {list(model_types)})")
    if (path / INDEX).is_file():
        index = _json(path / INDEX)
        shards = sorted(set((index.get("weight_map") or {}).values()))
        if not shards:
            raise ModelDirError(f"{path / INDEX}: its weight_map names no shard")
        files = tuple(path / s for s in shards)
    else:
        files = (path / WEIGHTS,)
        if not files[0].is_file():
            raise ModelDirError(f"{path}: no weights ({WEIGHTS}, or {INDEX} with its shards)")
    for f in files:
        _check_safetensors(f)
    if not any((path / t).is_file() for t in TOKENIZER_FILES):
        raise ModelDirError(f"{path}: no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if (path / "tokenizer.json").is_file():
        _json(path / "tokenizer.json")
    _json(path / "tokenizer_config.json")
    _json(path / "preprocessor_config.json")
    return ModelDir(path, config, files)


def chat_template(path: Path) -> str | None:
    """The directory's chat template, where the hub keeps one: chat_template.jinja, chat_template.json,
    or tokenizer_config.json's "chat_template"."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return _json(path / "chat_template.json").get("chat_template")
    return _json(path / "tokenizer_config.json").get("chat_template")


def processor_options(path: Path) -> dict:
    """The processor's own settings from processor_config.json (e.g. SmolVLM's image_seq_len), if any."""
    if not (path / "processor_config.json").is_file():
        return {}
    return {k: v for k, v in _json(path / "processor_config.json").items() if k != "processor_class"}
