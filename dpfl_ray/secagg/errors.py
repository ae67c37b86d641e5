"""Exceptions of the secure-aggregation core.

All of them are :class:`~dpfl_ray.errors.DPFLError`, so the CLI reports them as one line. Structured
details (phase, counts, client ids) are passed as keyword arguments and become attributes.
"""
from __future__ import annotations

from typing import Any

from dpfl_ray.errors import DPFLError


class SecAggError(DPFLError):
    """Base class; ``details`` are also set as attributes (``err.phase``, ``err.needed``...)."""

    def __init__(self, message: str, field: str | None = None, **details: Any):
        super().__init__(message, field)
        self.message = message
        self.details = dict(details)
        for key, value in details.items():
            setattr(self, key, value)

    def __reduce__(self):
        # Ray ships exceptions between processes; the default reduce would call cls(formatted_text)
        # and drop ``field`` and the details.
        return (_rebuild, (type(self), self.message, self.field, self.details))


def _rebuild(cls, message, field, details):
    return cls(message, field, **details)


class SecAggAbort(SecAggError):
    """The round cannot finish: fewer clients or shares remain than a threshold requires."""


class SecAggProtocolError(SecAggError):
    """A message is malformed, out of order, or inconsistent with what was sent earlier."""


class ShareAuthenticationError(SecAggProtocolError):
    """An encrypted share failed AEAD authentication (tampered, truncated or misaddressed)."""


class UnmaskRefused(SecAggProtocolError):
    """A client refuses an unmask request that could reveal both secrets of one peer."""


class ShamirError(SecAggError):
    """Secret sharing was used outside its domain (too few shares, duplicate points, bad secret)."""


class EncodingError(SecAggError):
    """A float vector cannot be encoded (NaN/inf, bad scale or modulus)."""


class EncodingOverflow(EncodingError):
    """``n_summands * max|value| * scale`` does not fit in the signed range of Z_(2^bits)."""
