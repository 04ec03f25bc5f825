"""The paths a dataset's own files name, kept inside the dataset.

Every file a reader opens is named by the dataset itself (fixed names, meta/info.json's path
templates filled from the episode metadata, image cells' paths): each is checked to lie inside the
dataset's directory, symbolic links resolved, before anything is read. The refusal depends only on
the path's text and where it resolves to, never on whether a file exists there, and names no path of
the machine: a dataset cannot read, nor probe for, another dataset's (another tenant's) files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from vlamux.data.errors import DatasetFormatError

V3_TEMPLATE_FIELDS = {"chunk_index": int, "file_index": int, "video_key": str}
LEGACY_TEMPLATE_FIELDS = {"episode_chunk": int, "episode_index": int, "video_key": str}
MAX_INDEX = 2 ** 31  # chunk, file and episode indices (and lengths) are below it
_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_TEMPLATE_FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::((?:0?[1-9][0-9]?)?d?))?")


def short(value: Any, n: int = 120) -> str:
    s = repr(value)
    return s if len(s) <= n else s[: n - 4] + "...'"


def outside_message(what: str) -> str:
    """The one refusal of a path leading outside the dataset (`what` names the field and the path)."""
    return f"{what} must name a file inside the dataset (a relative path, no '..', no link leading out of it)"


class PathTemplate:
    """One of meta/info.json's path templates (data_path, video_path), parsed without `str.format`:
    only the documented fields, each plain or with an integer format (`{chunk_index:03d}`); no
    attribute access, indexing, conversions or positional fields. `fill` builds a path from them."""

    def __init__(self, template: Any, fields: Mapping[str, type], where: str):
        self.where = where  # e.g. "meta/info.json: data_path"
        allowed = ", ".join("{" + f + "}" for f in fields)
        if not isinstance(template, str) or not template:
            raise DatasetFormatError(f"{where}: expected a path template (a string with {allowed}), "
                                     f"got {short(template)}")
        self.template = template
        self.fields = fields
        self.parts: list[str | tuple[str, str]] = []
        pos = 0
        for m in _TEMPLATE_TOKEN.finditer(template):
            self.parts.append(template[pos:m.start()])
            pos = m.end()
            tok = m.group(0)
            if tok in ("{{", "}}"):
                self.parts.append(tok[0])
                continue
            f = _TEMPLATE_FIELD.fullmatch(m.group(1) or "") if m.group(1) is not None else None
            if f is None or f.group(1) not in fields or (f.group(2) and fields[f.group(1)] is not int):
                bad = tok if m.group(1) is None else "{" + m.group(1) + "}"
                raise DatasetFormatError(
                    f"{where} {short(template)}: {short(bad, 60)} is not allowed; a template takes only "
                    f"{allowed}, an integer one with a format such as {{{next(iter(fields))}:03d}}")
            self.parts.append((f.group(1), f.group(2) or ""))
        self.parts.append(template[pos:])
        self.parts = [p for p in self.parts if p != ""]
        # the text alone must not leave the dataset (the values are checked once filled in)
        probe = "".join(p if isinstance(p, str) else "x" for p in self.parts)
        if not _relative_inside(probe):
            raise DatasetFormatError(outside_message(f"{where} {short(template)}"))

    def fill(self, **values: Any) -> str:
        """The path for these values; a ValueError names a value of the wrong type."""
        out = []
        for p in self.parts:
            if isinstance(p, str):
                out.append(p)
                continue
            name, spec = p
            v = values[name]
            if self.fields[name] is int:
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not 0 <= v < MAX_INDEX:
                    raise ValueError(f"{name} must be an integer in [0, {MAX_INDEX}), got {short(v, 40)}")
                out.append(format(int(v), spec))
            else:
                out.append(str(v))
        return "".join(out)


def _relative_inside(rel: str) -> bool:
    """Whether the text `rel` is a relative path that stays below its root ('a/b', not '/a', '../a',
    'a/../b' or '')."""
    if not isinstance(rel, str) or not rel or "\0" in rel or rel.startswith("/"):
        return False
    parts = PurePosixPath(rel).parts
    return bool(parts) and ".." not in parts and not PurePosixPath(rel).is_absolute()


def resolve_inside(root_real: Path, rel: str, what: str) -> Path:
    """`rel` (a path a dataset's file names, relative to its root) as a real path inside `root_real`
    (the dataset's resolved directory), symbolic links followed; refused with the same message
    whether or not anything exists where it leads. Reads nothing but links."""
    if _relative_inside(rel):
        try:
            real = Path(os.path.realpath(root_real.joinpath(*PurePosixPath(rel).parts)))
        except (OSError, ValueError):
            real = None
        if real is not None and real != root_real and real.is_relative_to(root_real):
            return real
    raise DatasetFormatError(outside_message(what))


def is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long, a loop of links, no permission: nothing to read there
        return False


def is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def listdir(path: Path, name: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        raise DatasetFormatError(f"{name}: cannot list ({e.strerror or type(e).__name__})") from None


def scrub(text: str, *roots: Path) -> str:
    """A library's error text with the dataset's absolute directory cut out (paths relative to it)."""
    for r in roots:
        text = text.replace(str(r) + "/", "").replace(str(r), ".")
    return text
