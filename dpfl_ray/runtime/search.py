"""Random search for ``dpfl sweep --search random``: each ``--grid`` axis is a list to choose from
(``training.lr=0.01,0.1``) or a Ray Tune distribution (``training.lr=loguniform(1e-4,1e-1)``, ``uniform(a,b)``,
``randint(a,b)`` with b excluded, as in Tune), and the sweep runs ``--num-samples`` points drawn
from them.

The points are drawn here, before anything runs, with Tune's own samplers, each from a generator
seeded by (``--search-seed``, the point's index): the same command draws the same points, a larger
``--num-samples`` keeps the earlier ones, and so a sweep directory resumes as a grid's does (finished
runs are never run again). Tune then runs the planned points as it runs a grid's combinations
(runtime/trials.py). A drawn number is kept to 4 significant digits: that text is both the
``--set`` the run gets and its directory's name.

Choosing the best of the runs is a release of its own: ``selection.json`` (runs/sweep.py) books it.
It lives with the runtime because it imports Ray (Tune's samplers); runs/sweep.py takes its points.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Sequence

from ..errors import DPFLError
from ..runs.sweep import DISTRIBUTION_SPEC, is_distribution, parse_grid

SEARCHES = ("grid", "random")
DIGITS = 4
# A space with fewer distinct points than asked for is refused after this many draws per point.
DRAWS_PER_POINT = 50


def _bounds(key: str, spec: str) -> tuple[str, float, float]:
    kind, args = DISTRIBUTION_SPEC.match(spec).groups()
    parts = [a.strip() for a in args.split(",")]
    try:
        low, high = (float(p) for p in parts)
    except ValueError:
        raise DPFLError(f"{key}: {spec.strip()} needs two numbers, as {kind}(low,high)", field="--grid") from None
    if not (math.isfinite(low) and math.isfinite(high)):
        raise DPFLError(f"{key}: {spec.strip()} needs finite bounds", field="--grid")
    if not low < high:
        raise DPFLError(f"{key}: {spec.strip()} needs low < high", field="--grid")
    if kind == "loguniform" and low <= 0:
        raise DPFLError(f"{key}: {spec.strip()} needs low > 0", field="--grid")
    if kind == "randint" and not (low.is_integer() and high.is_integer() and high - low >= 1):
        raise DPFLError(f"{key}: {spec.strip()} needs integers low < high (high is excluded)", field="--grid")
    return kind, low, high


def parse_space(items: Sequence[str]) -> dict[str, str | list[str]]:
    """``--grid`` options -> {key: a distribution's text, or the list of values to choose from}, in
    the order given; lists are checked as a grid's are (runs/sweep.parse_grid)."""
    space: dict[str, str | list[str]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if eq and key and is_distribution(value):
            if key in space:
                raise DPFLError(f"{key} is given twice", field="--grid")
            _bounds(key, value)
            space[key] = value.strip().replace(" ", "")
        else:
            (key, values), = parse_grid([item]).items()
            if key in space:
                raise DPFLError(f"{key} is given twice", field="--grid")
            space[key] = values
    if "seed" in space:
        raise DPFLError("sweep seeds with --seeds 0,1,2, not a search axis", field="--grid")
    return space


def _domain(key: str, axis: str | list[str]):
    from ray import tune

    if isinstance(axis, list):
        return tune.choice(axis)
    kind, low, high = _bounds(key, axis)
    if kind == "randint":
        return tune.randint(int(low), int(high))
    return {"uniform": tune.uniform, "loguniform": tune.loguniform}[kind](low, high)


def _text(value) -> str:
    if isinstance(value, str):
        return value
    if float(value).is_integer() and abs(value) < 10 ** DIGITS:
        return str(int(value))
    return format(float(value), f".{DIGITS}g")


@dataclass(frozen=True)
class RandomSearch:
    """``samples`` distinct points of ``space`` (:func:`parse_space`), drawn with ``seed``."""

    space: dict
    samples: int
    seed: int = 0

    def points(self) -> list[tuple[str, ...]]:
        """The points in draw order, each a tuple of values (as ``--set`` reads them) in the space's
        key order. A point drawn twice is drawn again (a choice-only space may hold fewer points
        than asked for: refused with one line)."""
        import numpy as np

        if self.samples < 1:
            raise DPFLError(f"must be at least 1 (got {self.samples})", field="--num-samples")
        domains = [(key, _domain(key, axis)) for key, axis in self.space.items()]
        points: list[tuple[str, ...]] = []
        seen: set[tuple[str, ...]] = set()
        draw = 0
        while len(points) < self.samples:
            if draw >= DRAWS_PER_POINT * self.samples:
                raise DPFLError(f"{len(points)} distinct points in {draw} draws: the search space holds fewer than "
                                f"{self.samples} (widen it or ask for fewer)", field="--num-samples")
            rng = np.random.default_rng([self.seed, draw])
            point = tuple(_text(domain.sample(random_state=rng)) for _, domain in domains)
            draw += 1
            if point not in seen:
                seen.add(point)
                points.append(point)
        return points

    def axes(self, points: Sequence[tuple[str, ...]]) -> dict[str, list[str]]:
        """{key: the values drawn, in draw order}: the sweep's columns and its plots' x values."""
        axes: dict[str, list[str]] = {key: [] for key in self.space}
        for point in points:
            for key, value in zip(axes, point):
                if value not in axes[key]:
                    axes[key].append(value)
        return axes

    def manifest(self, points: Sequence[tuple[str, ...]]) -> dict:
        """What ``sweep.json`` keeps: the space, the seed, and the points (read back by ``dpfl report``
        without drawing again)."""
        return {"kind": "random", "space": self.space, "seed": self.seed, "samples": self.samples,
                "points": [list(p) for p in points]}

    def same_space(self, old: dict | None) -> bool:
        """Does an earlier manifest's search draw the same points (its first ones, if it asked for fewer)?"""
        if not old:
            return False
        return (old.get("kind") == "random" and old.get("seed") == self.seed
                and json.dumps(old.get("space"), sort_keys=True) == json.dumps(self.space, sort_keys=True))
