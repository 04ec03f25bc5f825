"""A tenant's intent as a job spec: YAML or JSON, validated, every error naming its field.

    name: acme-touch
    tenant: acme
    kind: rl                      # sft | rl | eval
    backbone: tiny                # one the service holds, by name (default: the service's first)
    head: {kind: gaussian, action_dim: 4, horizon: 4, state_dim: 8}
    optimizer: {lr: 1.0e-4}
    rl: {env: {task: goal/touch-red-cube, image_size: 32, n_action_steps: 2}, env_steps: 20000}
    eval: {tasks: [goal/touch-red-cube], episodes: 20}
    checkpoint_every: 10          # optimizer steps (SFT) or trained segments (RL)
    init_from: runs/sft/acme/checkpoint.safetensors   # optional: start from this slot file or policy file
                                                      # (over the API: the name of an uploaded policy file)
    init_adapter: DIR             # optional: start the head's adapter from a PEFT LoRA directory

A job whose head has an adapter also writes it in PEFT's layout to `<job dir>/adapter/`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from vlamux.envs import EnvSpec
from vlamux.errors import InvalidInputError, VlamuxError
from vlamux.model import HeadSpec, OptimizerSpec
from vlamux.workflows.rl import RLConfig
from vlamux.workflows.sft import SFTConfig


class JobSpecError(InvalidInputError):
    pass


_SEED = (0, 2**63 - 1)
_TIMEOUT = (1e-3, 3600.0)
_LR = (1e-12, 10.0)
# The range of every numeric field of a spec, [lo, hi]: a value outside (or NaN) is refused at
# submission, naming the field, before it can reserve resources or fail half-way through a job.
RANGES: dict[str, dict[str, tuple[float, float]]] = {
    "EnvSpec": {"image_size": (1, 1024), "max_steps": (1, 10**6), "n_action_steps": (1, 1024)},
    "RLConfig": {"env_steps": (1, 10**9), "n_envs": (1, 1024), "sub_batches": (1, 64), "env_workers": (1, 64),
                 "segment_steps": (1, 10**4), "group_size": (1, 1024), "gamma": (0.0, 1.0), "lam": (0.0, 1.0),
                 "clip_eps": (1e-6, 10.0), "max_is_weight": (1.0, 1e6), "value_coef": (0.0, 1e3),
                 "entropy_coef": (0.0, 10.0), "epochs": (1, 100), "critic_warmup": (0, 10**6),
                 "minibatch_rows": (1, 10**5), "max_staleness": (0, 10**3), "seed": _SEED, "timeout_s": _TIMEOUT,
                 "lr": _LR},
    "SFTConfig": {"steps": (1, 10**8), "batch_size": (1, 65536), "grad_accum": (1, 1024), "lr": _LR,
                  "warmup_steps": (0, 10**8), "seed": _SEED, "timeout_s": _TIMEOUT},
    "EvalSpec": {"episodes": (1, 10**5), "n_envs": (1, 1024), "seed": _SEED},
    "JobSpec": {"checkpoint_every": (1, 10**9), "seed": _SEED},
}


def check_range(cls_name: str, name: str, value, where: str) -> None:
    lo, hi = RANGES.get(cls_name, {}).get(name, (None, None))
    if lo is not None and value is not None and not lo <= value <= hi:  # NaN fails both comparisons
        raise JobSpecError(f"{where}: must be in [{lo:g}, {hi:g}], got {value!r}")


@dataclass
class EvalSpec:
    tasks: list = field(default_factory=list)  # default: the job's own env task
    episodes: int = 20
    n_envs: int = 4
    seed: int = 10_000
    before: bool = True  # evaluate before training too (the "before" of before/after)
    env: EnvSpec | None = None  # default: the job's RL env


@dataclass
class JobSpec:
    name: str
    tenant: str
    kind: str  # sft | rl | eval
    # None: init_from names a LeRobot checkpoint, whose expert is the head (heads.lerobot.import_spec)
    head: HeadSpec | None = None
    backbone: str | None = None  # a backbone's name in the service (None: its default)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    sft: SFTConfig | None = None
    rl: RLConfig | None = None
    eval: EvalSpec | None = None
    checkpoint_every: int = 10
    init_from: str | None = None
    init_adapter: str | None = None  # a PEFT LoRA directory (the head must carry an adapter)
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("sft", "rl", "eval"):
            raise JobSpecError(f"kind: expected 'sft', 'rl' or 'eval', got {self.kind!r}")
        if self.kind == "sft" and self.sft is None:
            raise JobSpecError("sft: an sft job needs an 'sft' section (dataset, steps, ...)")
        if self.kind == "rl" and self.rl is None:
            raise JobSpecError("rl: an rl job needs an 'rl' section (env, algorithm, env_steps, ...)")
        if self.kind == "eval" and self.eval is None:
            raise JobSpecError("eval: an eval job needs an 'eval' section (tasks, episodes)")
        if not self.name or len(self.name) > 128 or not all(c.isalnum() or c in "-_." for c in self.name):
            raise JobSpecError(f"name: 1 to 128 letters, digits, '-', '_' and '.', got {self.name[:80]!r}")
        self._lerobot_head()
        if self.checkpoint_every < 1:
            raise JobSpecError(f"checkpoint_every: expected >= 1, got {self.checkpoint_every}")
        if self.init_adapter is not None:
            if self.head.adapter is None:
                raise JobSpecError("init_adapter: the head has no adapter to start; give head.adapter too")
            if not (Path(self.init_adapter) / "adapter_config.json").is_file():
                raise JobSpecError(f"init_adapter: {self.init_adapter} is not a PEFT adapter directory "
                                   "(no adapter_config.json)")

    def _lerobot_head(self) -> None:
        from vlamux.model.heads.lerobot import import_spec
        from vlamux.model.vla.checkpoint import is_lerobot_checkpoint

        lerobot = self.init_from is not None and is_lerobot_checkpoint(self.init_from)
        if lerobot and self.head is not None and self.head.options.get("checkpoint") != str(self.init_from):
            raise JobSpecError("head: init_from names a LeRobot checkpoint, whose expert is the head: give no head")
        if lerobot and self.head is None:
            self.head = import_spec(self.init_from)
            default = SFTConfig.__dataclass_fields__["camera_map"].default_factory()
            if self.sft is not None and self.sft.camera_map == default:  # the checkpoint's cameras, by their names
                self.sft.camera_map = {f"observation.images.{c}": c for c in self.head.options["cameras"]}
        if self.head is None:
            raise JobSpecError("head: required (unless init_from names a LeRobot checkpoint)")

    @property
    def env(self) -> EnvSpec | None:
        return self.rl.env if self.rl is not None else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_spec(source: str | Path | dict) -> JobSpec:
    """A JobSpec from a dict, a YAML/JSON file path, or YAML/JSON text."""
    if isinstance(source, dict):
        data = source
    else:
        text = Path(source).read_text() if Path(str(source)).suffix in (".yaml", ".yml", ".json") else str(source)
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise JobSpecError(f"spec: neither JSON nor YAML ({e})") from None
    if not isinstance(data, dict):
        raise JobSpecError(f"spec: expected a mapping, got {type(data).__name__}")
    check_depth(data)
    return build(JobSpec, data, "")


MAX_DEPTH = 16  # a spec's deepest real field (an env's options) is a few levels down


def check_depth(data, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a spec nested deeper than `max_depth`, naming the field where it does (walked without
    recursion: the check itself cannot run out of stack)."""
    stack = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > max_depth:
            shown = where if len(where) <= 120 else where[:60] + "..." + where[-40:]
            raise JobSpecError(f"{shown}: nested deeper than {max_depth} levels")
        if isinstance(value, dict):
            stack.extend((v, _join(where, str(k)), depth + 1) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))


def build(cls, data, where: str):
    """Build dataclass `cls` from plain data, checking names and types; errors name the field path."""
    if not isinstance(data, dict):
        raise JobSpecError(f"{where or 'spec'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise JobSpecError(f"{_join(where, unknown[0])}: unknown field; allowed: {', '.join(sorted(fields))}")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise JobSpecError(f"{_join(where, missing[0])}: required")
    kwargs = {name: _value(hints[name], value, _join(where, name)) for name, value in data.items()}
    for name, value in kwargs.items():
        check_range(cls.__name__, name, value, _join(where, name))
    try:
        return cls(**kwargs)
    except JobSpecError:
        raise
    except (ValueError, TypeError, VlamuxError) as e:
        msg = str(e)
        head = msg.split(":", 1)[0]
        if where and head.replace("_", "").replace(".", "").isalnum():  # "field: why" -> "where.field: why"
            raise JobSpecError(f"{where}.{msg}") from None
        raise JobSpecError(f"{where or 'spec'}: {msg}") from None


def _value(hint, value, where: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _value(options[0], value, where)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise JobSpecError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise JobSpecError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise JobSpecError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise JobSpecError(f"{where}: expected a string, got {value!r}")
        return value
    if hint is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise JobSpecError(f"{where}: expected a list, got {value!r}")
        return tuple(value)
    if hint is list or origin is list:
        if not isinstance(value, list):
            raise JobSpecError(f"{where}: expected a list, got {value!r}")
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise JobSpecError(f"{where}: expected a mapping, got {value!r}")
        return value
    return value


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
