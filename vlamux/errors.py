"""Exceptions that cross module boundaries.

Every error names what was wrong so a tenant can fix its request without
reading our code (DESIGN invariant 5).
"""

import re

# an absolute path of two or more parts (not an API route such as /v1/jobs), its directories captured
_PATH = re.compile(r"(?<![\w:/.])(?:/(?!v1/)[^\s/:;,'\"()\[\]]+)+/([^\s/:;,'\"()\[\]]+)")


def public_message(message: str) -> str:
    """An error message for a tenant to read: the service's file paths cut to their last part, so
    that an error never tells one tenant where the service keeps anything (another tenant's files)."""
    return _PATH.sub(r"\1", message)


def public_error(e: BaseException) -> str:
    """An exception as a tenant reads it: its type and message, no service path."""
    return public_message(f"{type(e).__name__}: {e}")


class VlamuxError(Exception):
    """Base class of all vlamux errors."""


class InvalidInputError(VlamuxError, ValueError):
    """A request's input is malformed; the message names the field."""


class NonFiniteError(VlamuxError, FloatingPointError):
    """A loss or gradient is NaN or infinite; the tenant's state is left unchanged."""


class UnknownTenantError(VlamuxError, KeyError):
    """No slot exists for the tenant named in a request."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown tenant"


class IncompatibleError(VlamuxError):
    """A checkpoint or request does not fit the slot or backbone it was given to."""


class CorruptCheckpointError(IncompatibleError):
    """A checkpoint file is damaged: unreadable, truncated, altered since it was written, or holding
    non-finite values. It is never loaded."""


class UnknownBackboneError(VlamuxError, ValueError):
    """A request names a backbone the service does not hold; the message lists those it does."""
