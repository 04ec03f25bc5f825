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
from dataclasses import dataclass, field
from pathlib import Path

from vlamux.envs import EnvSpec
from vlamux.model import HeadSpec, OptimizerSpec
from vlamux.specs import SEED_MAX, SpecError, bounded, build, check, join
from vlamux.workflows.rl import RLConfig
from vlamux.workflows.sft import SFTConfig


JobSpecError = SpecError  # the name this module's callers have caught since before vlamux.specs


@dataclass
class EvalSpec:
    tasks: list = field(default_factory=list)  # default: the job's own env task
    episodes: int = bounded(20, 1, 10**5)
    n_envs: int = bounded(4, 1, 1024)
    seed: int = bounded(10_000, 0, SEED_MAX)
    before: bool = True  # evaluate before training too (the "before" of before/after)
    env: EnvSpec | None = None  # default: the job's RL env
    # An RL job: episodes on seeds of their own (validation_seed + k, none of the evaluation's), run on
    # the policy RL starts from and on the one it ends with; the job keeps RL's only where it validates
    # higher (a tie keeps the start), so it never hands back a policy that did worse there. 0: off.
    validation_episodes: int = bounded(0, 0, 10**5)
    validation_seed: int = bounded(5_000_000, 0, SEED_MAX)

    def __post_init__(self):
        check(self)
        if self.validation_episodes and self.validation_seed < self.seed + self.episodes \
                and self.seed < self.validation_seed + self.validation_episodes:
            raise JobSpecError(f"eval.validation_seed: the validation episodes' seeds {self.validation_seed}.."
                               f"{self.validation_seed + self.validation_episodes - 1} overlap the evaluation's "
                               f"{self.seed}..{self.seed + self.episodes - 1}: selecting on the episodes that "
                               f"report the result would bias it")


@dataclass
class JobSpec:
    name: str
    tenant: str
    kind: str = bounded(choices=("sft", "rl", "eval"))
    # None: init_from names a LeRobot checkpoint, whose expert is the head (heads.lerobot.import_spec)
    head: HeadSpec | None = None
    backbone: str | None = None  # a backbone's name in the service (None: its default)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    sft: SFTConfig | None = None
    rl: RLConfig | None = None
    eval: EvalSpec | None = None
    checkpoint_every: int = bounded(10, 1, 10**9)
    init_from: str | None = None
    init_adapter: str | None = None  # a PEFT LoRA directory (the head must carry an adapter)
    seed: int = bounded(0, 0, SEED_MAX)

    def __post_init__(self):
        check(self)
        if self.kind == "sft" and self.sft is None:
            raise JobSpecError("sft: an sft job needs an 'sft' section (dataset, steps, ...)")
        if self.kind == "rl" and self.rl is None:
            raise JobSpecError("rl: an rl job needs an 'rl' section (env, algorithm, env_steps, ...)")
        if self.kind == "eval" and self.eval is None:
            raise JobSpecError("eval: an eval job needs an 'eval' section (tasks, episodes)")
        if self.kind != "rl" and self.eval is not None and self.eval.validation_episodes:
            raise JobSpecError(f"eval.validation_episodes: only an rl job validates (its start against its end); "
                               f"this is a {self.kind} job")
        if not self.name or len(self.name) > 128 or not all(c.isalnum() or c in "-_." for c in self.name):
            raise JobSpecError(f"name: 1 to 128 letters, digits, '-', '_' and '.', got {self.name[:80]!r}")
        self._lerobot_head()
        if self.kind == "rl":
            self._flow_rl()
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

    def _flow_rl(self) -> None:
        """RL on a flow head samples its chain with exploration (rl.flow, defaults when not given); PPO's
        critic must be on the head. Checked here, not at the first update."""
        from vlamux.model.heads.flow_sde import FlowExploration

        kind = self.head.kind if self.head is not None else None
        if kind not in ("flow", "lerobot"):
            if self.rl.flow is not None:
                raise JobSpecError(f"rl.flow: for a flow head or an imported expert; this head is {kind!r}")
            return
        if self.rl.flow is None:
            self.rl.flow = FlowExploration()
        if not self.rl.flow.noise_level > 0:
            raise JobSpecError("rl.flow.noise_level: RL scores a stochastic chain; it must be > 0")
        if self.rl.algorithm == "ppo" and kind == "lerobot":
            raise JobSpecError("rl.algorithm: PPO trains a critic, and an imported expert has none; use "
                               "algorithm grpo")
        if self.rl.algorithm == "ppo" and not self.head.options.get("critic"):
            raise JobSpecError("rl.algorithm: PPO trains a critic, and this flow head has none; set "
                               "head.options.critic: true, or use algorithm grpo")

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
    return build(JobSpec, data)


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
            stack.extend((v, join(where, str(k)), depth + 1) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
