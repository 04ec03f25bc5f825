"""What the offline-dataset readers and writer raise."""

from __future__ import annotations

from vlamux.errors import VlamuxError


class DatasetError(VlamuxError):
    """Base class of offline-dataset errors."""


class DatasetFormatError(DatasetError, ValueError):
    """A dataset on disk does not follow its format; the message names the file and the field."""


class MissingKeyError(DatasetError, KeyError):
    """A feature or statistic a caller needs is not in the dataset; the message names it."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "missing key"
