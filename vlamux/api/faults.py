"""The host's own refusals, which the API answers with their status codes (vlamux.api.errors)."""

from __future__ import annotations

from vlamux.errors import VlamuxError


class NotFound(VlamuxError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "not found"


class Conflict(VlamuxError):
    pass


class QuotaExceeded(VlamuxError):
    """429. `numbers`: the resource, what is held, asked and allowed (the error body's "quota")."""

    def __init__(self, message: str, retry_after_s: float = 1.0, numbers: dict | None = None):
        super().__init__(message)
        self.retry_after_s, self.numbers = retry_after_s, numbers


class TooLarge(VlamuxError):
    """A body or an upload over a size limit (413)."""
