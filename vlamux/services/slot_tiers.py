"""A model service's slots in tiers: the mover under a `Pager`.

The runner holds the resident slots (its `slots` are those, and only those); this holds the parked
ones (`ParkedSlot`s in host memory) and the stored ones (slot files in a spool directory of its own,
scratch: never read after a restart, when jobs resume from their checkpoints). Its mover, a thread of
its own, applies the pager's plan while the engine runs groups: the slots requests wait for come in,
the least recently used go down. A group's slots are pinned (`claim`) and never move while it runs;
every other slot may, so a request for a slot below resident waits for its copy, not for the group
running meanwhile. A stored slot is read back (and verified) on a loader thread, then loaded.

Locking: `lock` guards which tier holds each slot (the runner's `slots`, `parked`, the pager's
tiers); the copies run outside it. The mover takes no other lock while it holds this one, and a look
at whether a slot is resident takes none (the queue asks under its own).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from vlamux.errors import InvalidInputError
from vlamux.model import ModelRunner, Slot
from vlamux.model.parking import ParkedSlot, park, shell_key, spool, unpark, unspool
from vlamux.model.slot_file import MODULE_PREFIXES
from vlamux.model.snapshot import PolicySnapshot
from vlamux.services.pager import PagePlan, Pager, SlotBudget
from vlamux.utils.stats import quantile

log = logging.getLogger(__name__)


SHELLS = 16
STORES_IN_FLIGHT = 8  # stores handed to the writer at once
IO_THREADS = {"reader": 2, "writer": 1}


def slot_nbytes(slot) -> int:
    return sum(slot.memory_bytes().values())


class SlotTiers:
    """name: the service's, for errors. Set by the service once its queue exists:
    waiting() -> {tenant: when its oldest request came, time.monotonic()}, the oldest first (what the
    mover brings in); on_resident(): slots were made resident (the queue looks again);
    on_refused(tenant, error): that tenant's requests cannot be served (its stored slot is unreadable,
    or larger than the whole budget)."""

    def __init__(self, runner: ModelRunner, budget: SlotBudget, name: str = "slots"):
        self.runner, self.name = runner, name
        self.pager = Pager(budget)
        self.waiting: Callable[[], dict[str, float]] = dict
        self.on_resident: Callable[[], None] = lambda: None
        self.on_refused: Callable[[str, Exception], None] = lambda tenant, error: None
        self.lock = threading.RLock()
        # a wanted slot's wait for paging: from its oldest request (or, if later, the slot's leaving the
        # resident tier while that request waited its turn in the queue) to resident again
        self.load_s: deque[float] = deque(maxlen=4096)
        self._left: dict[str, float] = {}  # when a slot left the resident tier (monotonic)
        self.page_s: deque[float] = deque(maxlen=4096)  # each paging round's time (the mover's)
        self.loads_by_tier = {"parked": 0, "stored": 0}  # where the slots made resident came from
        self.parked: dict[str, ParkedSlot] = {}
        self.versions: dict[str, int] = {}  # of the slots below resident (and on their way up)
        self._spool: Path | None = None
        self.moves = {"park": 0, "store": 0, "load": 0, "read": 0}
        self._reading: dict[str, Future] = {}  # stored slots being read back
        self._reading_lock = threading.Lock()  # `want` starts reads from request threads
        self._from_disk: set[str] = set()  # parked slots that were read back, not loaded yet
        # a load from disk in two parts: its read (queued and read on a reader thread), then from the
        # read's end to resident (the mover's turn and copy)
        self.read_s: deque[float] = deque(maxlen=4096)
        self.pickup_s: deque[float] = deque(maxlen=4096)
        self._read_times: dict[str, list[float]] = {}  # tenant -> [read started, read done]
        self._digests: dict[str, str] = {}  # stored tenant -> its spool file's sha256 (`unspool` checks it)
        # slot objects of serving slots just parked, by kind: a load of the same kind copies into one
        # instead of building a head's modules anew (SHELLS at most of each kind; their bytes are
        # counted in `metrics`, outside the budget). The mover's alone.
        self._shells: dict[tuple, list[Slot]] = {}
        # `admit_parked`'s host slot of each kind (the engine thread's alone): building a slot costs
        # milliseconds, which ten thousand tenants registered at once would wait for
        self._registrars: dict[tuple, Slot] = {}
        self._pools: dict[str, ThreadPoolExecutor] = {}  # `_io`'s
        self._loader_lock = threading.Lock()
        self._storing: set[str] = set()  # stores submitted to the writer, not done
        self._kick = threading.Event()
        self._mover: threading.Thread | None = None
        self._closed = False

    # ---- membership (any thread; a look takes no lock) ----------------------------------------------
    def knows(self, tenant: str) -> bool:
        return tenant in self.pager.entries

    def resident(self, tenant: str) -> bool:
        return tenant in self.runner.slots

    def added(self, tenant: str) -> None:
        """A slot the runner made resident (a new tenant's)."""
        with self.lock:
            self.pager.add(tenant, slot_nbytes(self.runner.slots[tenant]))
        self._kick.set()  # over the budget now: the least recently used go down

    def room_for(self, snap: PolicySnapshot) -> bool:
        """Whether a new tenant's slot fits the resident budget beside the slots already there."""
        limit = self.pager.budget.resident_bytes
        module = sum(t.numel() * t.element_size() for k, t in snap.tensors.items() if k.startswith(MODULE_PREFIXES))
        return limit is None or self.pager.used["resident"] + module <= limit

    def admit_parked(self, snap: PolicySnapshot) -> None:
        """A new tenant, straight to host memory (the resident tier is full: it comes up when asked)."""
        key = shell_key(snap.head_spec.to_json(), snap.backbone_id, False)
        slot = self._registrars.get(key)
        if slot is None:  # one host slot a kind, each new tenant's policy copied through it and parked
            backbone = self.runner.backbones[snap.backbone_id]
            slot = self._registrars[key] = Slot(snap.tenant, snap.head_spec, backbone.meta, device="cpu", init=False,
                                                trainable=False, **self.runner.adapter_targets(snap.backbone_id))
        # as a new slot would be: the policy's module, statistics and version, its seed's generator
        slot.tenant, slot._host_copies = snap.tenant, {}
        slot.generator.manual_seed(slot.seed + 1)
        slot.apply_policy(snap.ready())
        with self.lock:  # its parked bytes are the resident slot's: what the pager plans with in every tier
            self.parked[snap.tenant], self.versions[snap.tenant] = park(slot), snap.version
            self.pager.add(snap.tenant, slot_nbytes(slot), tier="parked")

    def retire(self, tenant: str) -> None:
        """The tenant is no longer served: its slot goes from whichever tier holds it (a move of it
        under way finds it gone, and drops its copy)."""
        with self.lock:
            if tenant in self.runner.slots:
                self.runner.remove_slot(tenant)
            self.parked.pop(tenant, None)
            self.versions.pop(tenant, None)
            self._left.pop(tenant, None)
            self._digests.pop(tenant, None)
            self._from_disk.discard(tenant)
            with self._reading_lock:
                reading = self._reading.pop(tenant, None)
                self._read_times.pop(tenant, None)
            if reading is not None:
                reading.cancel()
            if self._spool is not None:
                self._path(tenant).unlink(missing_ok=True)
            self.pager.remove(tenant)

    def claim(self, tenants: list[str]) -> set[str]:
        """Pin the slots of a group's tenants, those still resident (the mover may have moved one since
        the queue looked): they stay resident until `release`. Returns the tenants pinned."""
        with self.lock:
            pinned = {t for t in tenants if t in self.runner.slots}
            self.pager.pin(pinned)
            return pinned

    def release(self, tenants) -> None:
        """A group has run: its slots may move again, and room may be made for what waits."""
        self.pager.unpin(tenants)
        self._kick.set()

    def want(self, tenant: str) -> None:
        """A request for `tenant` came (any thread): a slot below resident starts coming up now (one on
        disk is read at once, while the current group runs)."""
        e = self.pager.entries.get(tenant)
        if e is None or e.tier == "resident":
            return
        if e.tier == "stored":
            self._start_read(tenant)
        self._kick.set()

    # ---- the mover ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the mover (the service's start)."""
        with self._loader_lock:
            if self._mover is None and not self._closed:
                self._mover = threading.Thread(target=self._move, name=f"vlamux-{self.name}-mover", daemon=True)
                self._mover.start()

    def _move(self) -> None:
        while not self._closed:
            self._kick.wait(0.1)  # kicked by a request, a group's end or a read; else a look each 0.1 s
            self._kick.clear()
            if self._closed:
                return
            try:
                self.page(self.waiting())
            except Exception:  # noqa: BLE001 - tried again next round; the groups go on
                log.exception("%s: paging slots failed", self.name)

    def page(self, waiting: dict[str, float] | None = None) -> PagePlan:
        """One paging round now, on the calling thread (the mover's, or a test's): start reading what is
        on disk, load what is in host memory, copy out what it took down, then hand stores to the writer
        (`waiting`: tenants with requests queued -> when the oldest came, the oldest first). Tenants that cannot be served are refused
        (`on_refused`). Returns the plan."""
        t0 = time.monotonic()
        waiting = waiting or {}
        try:
            failed = self._read_back()
            with self.lock:
                plan = self.pager.plan(list(waiting))
                # what leaves the runner leaves it now (no group can take it from here on), what comes
                # up has its room now; the copies follow, outside the lock
                out = [(t, self._leave(t)) for t in plan.park]
                up = [(t, self.parked.pop(t)) for t in plan.load if t in self.parked]
                for t, _ in up:
                    self.pager.moved(t, "resident")
                reads = [t for t in plan.load if not self._here(t, "resident")]  # on disk
            for t in reads:  # on disk: read on a reader thread; loaded on a later round
                self._start_read(t)
            with self.runner.lane.paging():  # what requests wait for first, then the copies out
                loaded = [(t, self._unpark(t, parked)) for t, parked in up]
            with self.lock:
                for t, slot in loaded:
                    self._arrive(t, slot, waiting)
            if loaded:
                self.on_resident()
            for t, slot in out:
                self._park(t, slot)
            # stores on a writer thread, a few at a time: a round (what requests wait for) is not held
            # up by writes, nor a backlog of them (ten thousand tenants registered at once)
            for t in plan.store:
                if len(self._storing) >= STORES_IN_FLIGHT:
                    break
                parked = self.parked.get(t)
                if parked is not None and t not in self._storing:
                    self._storing.add(t)
                    self._io("writer").submit(self._store, t, parked)
            for t, error in failed.items():
                self.on_refused(t, error)
            for t in plan.never:
                e = self.pager.entries.get(t)
                self.on_refused(t, InvalidInputError(
                    f"{self.name}: the slot of tenant {t!r} ({e.nbytes if e else '?'} bytes) is larger than "
                    f"this replica's whole slot budget ({self.pager.budget.resident_bytes} bytes)"))
            return plan
        finally:
            self.page_s.append(time.monotonic() - t0)

    # Each move copies first and lets go of the old copy only once the new one exists: a move that
    # fails (no memory, a full disk) leaves the slot where it was, and a next round tries again.
    def _leave(self, t: str) -> Slot:
        self._left[t] = time.monotonic()
        slot = self.runner.remove_slot(t)
        self.versions[t] = slot.version
        self.pager.moved(t, "parked", holds_gradients=slot.accumulated > 0)
        return slot

    def _park(self, t: str, slot: Slot) -> None:
        try:
            with self.runner.lane.paging(after_lane=True):  # after the last group that used it
                parked = park(slot)
        except Exception:  # noqa: BLE001
            log.exception("%s: parking tenant %r's slot failed; it stays resident", self.name, t)
            with self.lock:
                if self._here(t, "parked") and t not in self.runner.slots:
                    self.runner.add_slot(slot)
                    self.versions.pop(t, None)
                    self.pager.moved(t, "resident")
            return
        with self.lock:
            if self._here(t, "parked") and t not in self.parked:  # not retired meanwhile
                self.parked[t] = parked
                self.moves["park"] += 1
        self._keep_shell(slot)

    def _store(self, t: str, parked: ParkedSlot) -> None:
        """On the writer thread: `parked` to disk; it leaves host memory if it is still what is parked."""
        try:
            digest = spool(parked, self._path(t))  # scratch: a restart never reads it
        except OSError:  # a full disk: it stays parked, over the host budget; the loads go on
            log.exception("%s: storing tenant %r's slot failed; it stays in host memory", self.name, t)
        else:
            with self.lock:
                if self.parked.get(t) is parked and self._here(t, "parked"):
                    del self.parked[t]
                    self._digests[t] = digest
                    self.pager.moved(t, "stored")
                    self.moves["store"] += 1
                else:  # loaded, retired or served afresh while it was written
                    self._path(t).unlink(missing_ok=True)
            self._kick.set()  # the next stores, if any wait (after a failure: the next look's round)
        finally:
            with self.lock:
                self._storing.discard(t)

    def _unpark(self, t: str, parked: ParkedSlot) -> Slot | ParkedSlot:
        """The resident slot, or `parked` back where the copy failed."""
        backbone = self.runner.backbones[parked.backbone_id]
        try:
            return unpark(parked, backbone.meta, backbone.device, shell=self._shell(parked),
                          **self.runner.adapter_targets(parked.backbone_id))
        except Exception:  # noqa: BLE001
            log.exception("%s: loading tenant %r's slot failed; it stays in host memory", self.name, t)
            return parked

    def _arrive(self, t: str, slot: Slot | ParkedSlot, waiting: dict[str, float]) -> None:
        if not self._here(t, "resident") or t in self.runner.slots:
            return  # retired (or served afresh) while it was copied
        if isinstance(slot, ParkedSlot):
            self.parked[t] = slot
            self.pager.moved(t, "parked")
            return
        self.runner.add_slot(slot)
        self.versions.pop(t, None)
        self.pager.moved(t, "resident", nbytes=slot_nbytes(slot))
        self.loads_by_tier["stored" if t in self._from_disk else "parked"] += 1
        self._from_disk.discard(t)
        with self._reading_lock:
            times = self._read_times.pop(t, None)
        if times is not None and len(times) == 2:
            self.read_s.append(times[1] - times[0])
            self.pickup_s.append(time.monotonic() - times[1])
        left = self._left.pop(t, 0.0)
        if t in waiting:
            self.load_s.append(time.monotonic() - max(waiting[t], left))
        self.moves["load"] += 1

    def _here(self, t: str, tier: str) -> bool:
        e = self.pager.entries.get(t)
        return e is not None and e.tier == tier

    def _keep_shell(self, slot: Slot) -> None:
        if slot.optimizer is not None:  # a training slot's optimizer is the tenant's: not reused
            return
        shells = self._shells.setdefault(shell_key(slot.head_spec.to_json(), slot.backbone_id, False), [])
        if len(shells) < SHELLS:
            shells.append(slot)

    def _shell(self, parked: ParkedSlot) -> Slot | None:
        if parked.meta.get("optimizer") != "none":
            return None
        shells = self._shells.get(shell_key(parked.meta["head_spec"], parked.backbone_id, False))
        return shells.pop() if shells else None

    def _read_back(self) -> dict[str, Exception]:
        """Stored slots read since the last round become parked."""
        failed = {}
        with self._reading_lock:
            done = {t: r for t, r in self._reading.items() if r.done()}
            for t in done:
                del self._reading[t]
        for t, reading in done.items():
            with self.lock:
                if not self._here(t, "stored"):
                    continue  # retired meanwhile
                try:
                    self.parked[t] = reading.result()
                except Exception as e:  # noqa: BLE001 - that tenant's requests are answered with it
                    # its only copy is unreadable: the slot is lost here (a new policy version brings it back)
                    log.exception("%s: reading tenant %r's stored slot back failed", self.name, t)
                    failed[t] = e
                    self.retire(t)
                    continue
                self._path(t).unlink(missing_ok=True)  # parked now: the file was its only use
                self._digests.pop(t, None)
                self._from_disk.add(t)
                self.pager.moved(t, "parked")
                self.moves["read"] += 1
        return failed

    def _start_read(self, tenant: str) -> None:
        with self._reading_lock:
            if tenant not in self._reading:
                self._read_times[tenant] = [time.monotonic()]
                self._reading[tenant] = self._io("reader").submit(self._read, tenant)

    def _read(self, tenant: str) -> ParkedSlot:
        try:
            with self.lock:
                digest = self._digests.get(tenant)
            if digest is None:
                raise FileNotFoundError(f"{self.name}: tenant {tenant!r} has no stored slot here")
            return unspool(self._path(tenant), digest)
        finally:
            with self._reading_lock:
                self._read_times.get(tenant, []).append(time.monotonic())
            self._kick.set()  # the mover makes it resident at once, not at its next look

    def _io(self, kind: str) -> ThreadPoolExecutor:
        """The reader (stored slots a request waits for) or the writer (stores): apart, so that a read
        never queues behind writes."""
        with self._loader_lock:
            if kind not in self._pools:
                self._pools[kind] = ThreadPoolExecutor(IO_THREADS[kind], thread_name_prefix=f"vlamux-slot-{kind}")
            return self._pools[kind]

    def version(self, tenant: str) -> int | None:
        slot = self.runner.slots.get(tenant)
        return slot.version if slot is not None else self.versions.get(tenant)

    def metrics(self) -> dict:
        budget = self.pager.budget
        shells = [s for kind in list(self._shells.values()) for s in list(kind)]  # the mover changes them
        return {**self.pager.usage(), "moves": dict(self.moves), "loads_from": dict(self.loads_by_tier),
                "shells": {"count": len(shells), "bytes": sum(slot_nbytes(s) for s in shells)},
                **{name: {"p50": quantile(xs, 0.5), "p99": quantile(xs, 0.99), "n": len(xs)}
                   for name, xs in (("load_wait_s", self.load_s), ("read_s", self.read_s),
                                    ("pickup_s", self.pickup_s))},
                "budget": {"resident_bytes": budget.resident_bytes, "parked_bytes": budget.parked_bytes}}

    def close(self) -> None:
        self._closed = True
        self._kick.set()
        if self._mover is not None and self._mover is not threading.current_thread():
            self._mover.join(timeout=10)
        with self._loader_lock:
            pools = list(self._pools.values())
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)

    def _path(self, tenant: str) -> Path:
        with self._loader_lock:  # made once, whichever thread asks first
            if self._spool is None:
                self._spool = Path(tempfile.mkdtemp(prefix="vlamux-spool-"))
        # by a digest: a tenant's name is not a file name
        return self._spool / f"{hashlib.sha256(tenant.encode()).hexdigest()[:32]}.safetensors"
