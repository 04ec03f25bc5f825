"""vlamux.utils.io's one atomic write: old file or new, never half; nothing left behind on an error."""

import os

import pytest

from vlamux.utils.io import atomic_path, atomic_write_text


def test_the_new_text_replaces_the_old_with_the_usual_permissions(tmp_path):
    path = tmp_path / "sub" / "state.json"
    atomic_write_text(path, "old")
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert (path.stat().st_mode & 0o777) == (plain.stat().st_mode & 0o777)  # not mkstemp's 0600
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_an_error_while_writing_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("the writer died")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]
