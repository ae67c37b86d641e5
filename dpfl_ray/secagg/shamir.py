"""t-out-of-n Shamir secret sharing over GF(2^521 - 1) (Shamir 1979; used by Bonawitz et al. 2017, Sec. 3).

The field must hold any 256-bit secret (a 32-byte self-mask seed ``b_i`` or an X25519 private key
``s_i^SK``), so the prime has to exceed 2^256; the Mersenne prime M521 does, and it is a well known
prime rather than one we would have to justify. Shares are the values of a random polynomial of
degree ``t - 1`` with constant term the secret; client ``i`` holds the point ``x = i + 1`` so that
no holder ever gets ``x = 0`` (which *is* the secret).
"""
from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Mapping, Sequence

from dpfl_ray.secagg.errors import ShamirError

PRIME = (1 << 521) - 1
SECRET_BYTES = 32
SHARE_BYTES = (PRIME.bit_length() + 7) // 8  # 66


def secret_to_int(secret: bytes) -> int:
    if len(secret) != SECRET_BYTES:
        raise ShamirError(f"a secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    return int.from_bytes(secret, "big")


def int_to_secret(value: int) -> bytes:
    if not 0 <= value < 1 << (8 * SECRET_BYTES):
        # A reconstruction from inconsistent shares lands anywhere in the field.
        raise ShamirError("reconstructed value is not a 256-bit secret; the shares are inconsistent")
    return value.to_bytes(SECRET_BYTES, "big")


def encode_share(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "big")


def decode_share(data: bytes) -> int:
    if not isinstance(data, (bytes, bytearray)):
        raise ShamirError(f"a share must be {SHARE_BYTES} bytes, got a {type(data).__name__}")
    if len(data) != SHARE_BYTES:
        raise ShamirError(f"a share must be {SHARE_BYTES} bytes, got {len(data)}")
    value = int.from_bytes(data, "big")
    if value >= PRIME:
        raise ShamirError("share value is outside the field")
    return value


def _check_points(xs: Sequence[int]) -> None:
    if len(set(xs)) != len(xs):
        raise ShamirError(f"share points must be distinct, got {sorted(xs)}")
    for x in xs:
        if not 0 < x < PRIME:
            raise ShamirError(f"share point {x} is outside 1..p-1")


def split(secret: int, threshold: int, xs: Sequence[int], *,
          randbelow: Callable[[int], int] = secrets.randbelow) -> dict[int, int]:
    """Shares of ``secret`` at the points ``xs``; any ``threshold`` of them reconstruct it.

    ``randbelow`` draws the polynomial coefficients; it defaults to the OS CSPRNG and must stay one.
    """
    xs = list(xs)
    if not 0 <= secret < PRIME:
        raise ShamirError("secret is outside the field")
    if threshold < 1:
        raise ShamirError(f"threshold must be >= 1, got {threshold}")
    if len(xs) < threshold:
        raise ShamirError(f"{len(xs)} holders cannot meet threshold {threshold}")
    _check_points(xs)
    coeffs = [secret] + [randbelow(PRIME) for _ in range(threshold - 1)]
    top = coeffs[::-1]
    shares = {}
    for x in xs:
        acc = 0
        for k, c in enumerate(top, 1):  # Horner
            acc = acc * x + c
            if k % 16 == 0:  # reducing at every step costs twice as much; never reducing grows acc without bound
                acc %= PRIME
        shares[x] = acc % PRIME
    return shares


@functools.lru_cache(maxsize=256)
def lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """Coefficients ``l_j`` with ``f(0) = sum_j l_j f(x_j)`` for any polynomial of degree < len(xs).

    Cached: in one round every survivor's ``b`` is usually rebuilt from the same responder set.
    """
    _check_points(xs)
    out = []
    for j, xj in enumerate(xs):
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * xm % PRIME
                den = den * (xm - xj) % PRIME
        out.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(out)


def reconstruct(shares: Mapping[int, int], threshold: int) -> int:
    """The secret from ``{x: f(x)}``; uses the ``threshold`` smallest points."""
    if threshold < 1:
        raise ShamirError(f"threshold must be >= 1, got {threshold}")
    if len(shares) < threshold:
        raise ShamirError(f"{len(shares)} shares cannot meet threshold {threshold}")
    xs = tuple(sorted(shares)[:threshold])
    coeffs = lagrange_at_zero(xs)
    return sum(c * shares[x] for c, x in zip(coeffs, xs)) % PRIME
