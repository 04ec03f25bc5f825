"""The slot book: what a runtime keeps so that a restarted training role gets its tenants back.

For each tenant with a training slot: how the slot was made (its recipe), the newest slot file it
was saved to or loaded from (its checkpoint), and the newest policy version published for it (also
what a restarted inference replica serves). Both runtimes keep one; only how they hear of a new
version differs (the embedded runtime subscribes to its publisher, the Ray driver fetches it after
each version-changing call).

The rules, in one place:
- a checkpoint is recorded only for the slot that wrote or read it: a save that completes after its
  slot was removed (or removed and made again under the same name) is not the new slot's checkpoint;
- a policy file loaded into a slot (a job's `init_from`) is no checkpoint: it supersedes the slot's
  last one, and the slot comes back from its newest published version instead;
- of two versions of a tenant's policy the newer one is kept; a trained tenant's only while its slot
  exists, one served without a slot (`serve`) until it is retired.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from vlamux.model import HeadSpec, OptimizerSpec
from vlamux.model.snapshot import PolicySnapshot
from vlamux.policy import is_policy_file


@dataclass(frozen=True)
class SlotRecipe:
    """How a tenant's slot was made: enough to make it again on a new training role."""

    head_spec: HeadSpec
    optim: OptimizerSpec | None
    seed: int
    backbone_id: str | None = None


@dataclass(frozen=True)
class Restore:
    """One tenant's way back after a training restart: its slot made again from `recipe`, then loaded
    from `checkpoint`, else given `snapshot`'s weights (its newest published version)."""

    tenant: str
    recipe: SlotRecipe
    checkpoint: Path | None
    snapshot: PolicySnapshot | None


class SlotBook:
    def __init__(self):
        self._lock = threading.Lock()
        self._recipes: dict[str, SlotRecipe] = {}
        self._made: dict[str, int] = {}  # tenant -> which making of its slot (a removed one's is gone)
        self._makings = 0
        self._checkpoints: dict[str, Path] = {}
        self._latest: dict[str, PolicySnapshot] = {}

    # ---- slots ------------------------------------------------------------------------------------
    def created(self, tenant: str, recipe: SlotRecipe) -> None:
        with self._lock:
            self._makings += 1
            self._recipes[tenant], self._made[tenant] = recipe, self._makings
            self._checkpoints.pop(tenant, None)  # a new slot: an old file of that name is not its checkpoint

    def removed(self, tenant: str) -> None:
        """The tenant's slot goes: a restart no longer brings it back."""
        with self._lock:
            self._recipes.pop(tenant, None)
            self._made.pop(tenant, None)
            self._checkpoints.pop(tenant, None)

    def making(self, tenant: str) -> int | None:
        """A token for the tenant's current slot, to pass to `file_used` once a call on it completes."""
        with self._lock:
            return self._made.get(tenant)

    def file_used(self, tenant: str, path: str | Path, making: int | None) -> None:
        """A call of slot `making` saved to or loaded from `path` (an absolute path on the driver)."""
        path = Path(path).absolute()
        policy = is_policy_file(path)
        with self._lock:
            if making is None or self._made.get(tenant) != making:
                return
            if policy:
                self._checkpoints.pop(tenant, None)
            else:
                self._checkpoints[tenant] = path

    def known(self, tenant: str) -> bool:
        with self._lock:
            return tenant in self._recipes

    def checkpoint(self, tenant: str) -> Path | None:
        with self._lock:
            return self._checkpoints.get(tenant)

    def plan(self) -> list[Restore]:
        """Every tenant's way back, as things stand now."""
        with self._lock:
            return [Restore(t, r, self._checkpoints.get(t), self._latest.get(t)) for t, r in self._recipes.items()]

    # ---- published versions -----------------------------------------------------------------------
    def keep(self, snap: PolicySnapshot, served: bool = False) -> bool:
        """Keep `snap` if it is the tenant's newest: a trained tenant's only while its slot exists,
        one `served` without a slot always. True if kept."""
        with self._lock:
            if not served and snap.tenant not in self._recipes:
                return False
            old = self._latest.get(snap.tenant)
            if old is not None and old.version > snap.version:
                return False
            self._latest[snap.tenant] = snap
            return True

    def dropped(self, tenant: str) -> None:
        """The tenant's policy is no longer served."""
        with self._lock:
            self._latest.pop(tenant, None)

    def latest(self, tenant: str) -> PolicySnapshot | None:
        with self._lock:
            return self._latest.get(tenant)

    def snapshots(self) -> list[PolicySnapshot]:
        """Every tenant's newest version: what a new or restarted replica stages."""
        with self._lock:
            return list(self._latest.values())

    def serves(self, tenant: str) -> bool:
        with self._lock:
            return tenant in self._latest
