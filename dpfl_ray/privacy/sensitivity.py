"""The one rule that turns a mechanism's noise into the multiplier the accountant books.

dp_accounting's ``GaussianDpEvent(noise_multiplier)`` means *noise standard deviation divided by the
query's L2 sensitivity under the accountant's neighbouring relation*. A mechanism here knows two
things: the standard deviation of the noise it adds, and how far one client (or one record) can
move the query when it is *added or removed* -- its contribution bound. The sampling decides the
relation:

* Poisson sampling -> add/remove one: the sensitivity is the contribution bound;
* fixed-size cohorts (m of K without replacement) -> replace one: a replacement is a removal plus
  an addition, so the sensitivity is twice the contribution bound (two S-clipped updates can point
  in opposite directions: ||S u - (-S u)|| = 2S).

So the multiplier booked is ``noise_std / (contribution_bound * factor(relation))``. User-facing z
stays "noise std / clip norm" (Opacus, TF Privacy); under fixed-size cohorts the ledger books z/2.

A mechanism may state a sensitivity above the one the relation needs (Baek et al. 2021, Prop. 2,
analyse replace-one with the sampled weight n public and so state 2C for every round): booking with
the larger sensitivity gives a smaller multiplier and a larger epsilon, which stays an upper bound.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from dpfl_ray.privacy.validation import _check_noise, _check_real

if TYPE_CHECKING:
    from dp_accounting import NeighboringRelation

__all__ = ["relation_factor", "l2_sensitivity", "booked_noise_multiplier"]


def relation_factor(relation: NeighboringRelation) -> float:
    """How many add/remove steps one neighbouring step of ``relation`` is: 1, or 2 for replace-one."""
    from dp_accounting import NeighboringRelation  # here, not at the top: see privacy/sampling.py

    if relation is NeighboringRelation.ADD_OR_REMOVE_ONE:
        return 1.0
    if relation is NeighboringRelation.REPLACE_ONE:
        return 2.0
    raise ValueError(f"no sensitivity rule for {relation!r}")


def l2_sensitivity(contribution_bound: float, relation: NeighboringRelation) -> float:
    """L2 sensitivity of a query in which one unit moves the value by at most ``contribution_bound``
    when it is added or removed."""
    bound = _check_real(contribution_bound, "contribution_bound")
    if bound <= 0:
        raise ValueError(f"contribution_bound must be > 0, got {bound}")
    return bound * relation_factor(relation)


def booked_noise_multiplier(noise_std: float, sensitivity: float) -> float:
    """dp_accounting's noise multiplier: noise standard deviation over L2 sensitivity."""
    std = _check_noise(noise_std, "noise_std")
    sens = _check_real(sensitivity, "sensitivity")
    if sens <= 0:
        raise ValueError(f"sensitivity must be > 0, got {sens}")
    return std / sens
