"""The slot book's rules (vlamux/services/slot_book.py), which both runtimes restore from."""

import torch
from safetensors.torch import save_file

from vlamux.model import HeadSpec, OptimizerSpec
from vlamux.model.slot_file import FORMAT as SLOT_FORMAT
from vlamux.model.snapshot import PolicySnapshot
from vlamux.policy import FORMAT as POLICY_FORMAT
from vlamux.services.slot_book import SlotBook, SlotRecipe

HEAD = HeadSpec("gaussian", action_dim=4, horizon=4, state_dim=8)
RECIPE = SlotRecipe(HEAD, OptimizerSpec(lr=1e-3), 3, "bb")


def snap(tenant: str, version: int) -> PolicySnapshot:
    return PolicySnapshot(tenant, version, "bb", HEAD, {"head.w": torch.full((2,), float(version))}, {})


def safetensors_file(path, fmt: str):
    save_file({"x": torch.zeros(1)}, str(path), metadata={"format": fmt})
    return path


def test_a_checkpoint_is_the_slots_that_wrote_it_by_absolute_path(tmp_path, monkeypatch):
    book = SlotBook()
    book.created("a", RECIPE)
    making = book.making("a")
    monkeypatch.chdir(tmp_path)
    safetensors_file(tmp_path / "a.safetensors", SLOT_FORMAT)
    book.file_used("a", "a.safetensors", making)
    assert book.checkpoint("a") == tmp_path / "a.safetensors"
    [r] = book.plan()
    assert (r.tenant, r.recipe, r.checkpoint, r.snapshot) == ("a", RECIPE, tmp_path / "a.safetensors", None)


def test_a_save_that_completes_after_its_slot_was_removed_is_nobodys_checkpoint(tmp_path):
    book = SlotBook()
    book.created("a", RECIPE)
    old = book.making("a")  # a save of the first slot, still under way ...
    book.removed("a")
    book.created("a", RECIPE)  # ... while a new slot of that name is made
    book.file_used("a", safetensors_file(tmp_path / "old.safetensors", SLOT_FORMAT), old)
    assert book.checkpoint("a") is None
    book.removed("a")
    book.file_used("a", tmp_path / "old.safetensors", old)
    assert book.plan() == [] and book.checkpoint("a") is None


def test_a_loaded_policy_file_supersedes_the_checkpoint(tmp_path):
    book = SlotBook()
    book.created("a", RECIPE)
    book.file_used("a", safetensors_file(tmp_path / "ckpt.safetensors", SLOT_FORMAT), book.making("a"))
    book.file_used("a", safetensors_file(tmp_path / "policy.safetensors", POLICY_FORMAT), book.making("a"))
    assert book.checkpoint("a") is None  # back from its newest published version instead


def test_the_newest_version_is_kept_and_a_trained_one_only_while_its_slot_exists():
    book = SlotBook()
    assert not book.keep(snap("a", 1))  # no slot: a late fetch does not bring a removed tenant back
    book.created("a", RECIPE)
    assert book.keep(snap("a", 2)) and not book.keep(snap("a", 1)) and book.keep(snap("a", 2))
    assert book.latest("a").version == 2 and book.serves("a")
    book.removed("a")
    assert not book.keep(snap("a", 3)) and book.latest("a").version == 2  # dropped when retired
    book.dropped("a")
    assert not book.serves("a") and book.snapshots() == []


def test_a_policy_served_without_a_slot_is_kept_until_retired():
    book = SlotBook()
    assert book.keep(snap("job", 6), served=True)
    assert [s.version for s in book.snapshots()] == [6] and book.plan() == []
    book.dropped("job")
    assert book.snapshots() == []


def test_tenants_are_kept_apart():
    book = SlotBook()
    book.created("a", RECIPE)
    book.created("b", RECIPE)
    book.keep(snap("a", 5))
    book.removed("b")
    assert [r.tenant for r in book.plan()] == ["a"] and book.latest("a").version == 5 and book.latest("b") is None
