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

``--search optuna`` (:class:`OptunaSearch`) is adaptive: Optuna's TPE sampler asks for the next
points from the results of the runs before them. It asks in batches (``--max-concurrent`` points,
default 2): a batch is recorded in ``sweep.json`` before it runs, runs as Tune trials like a grid's
combinations, and its results are told back before the next batch is asked. Each batch's sampler
is seeded by (``--search-seed``, the batch's first index) and told every earlier point and result
afresh, so the same command asks the same points whenever the runs give the same results (they do:
a run's bits follow its seed), an interrupted search resumes from the runs on disk, and a finished
run is never run again.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..errors import DPFLError
from ..runs.sweep import DISTRIBUTION_SPEC, check_run_count, is_distribution, parse_grid

SEARCHES = ("grid", "random", "optuna")
# What --search optuna may optimise (a number in each run's summary.json) and in which direction.
METRICS = {"final_accuracy": "maximize", "final_loss": "minimize"}
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
    if kind == "randint" and max(abs(low), abs(high)) > 2 ** 53:
        raise DPFLError(f"{key}: {spec.strip()} needs bounds within +-2^53", field="--grid")
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


def drawn_axes(space: dict, points: Sequence[tuple[str, ...]]) -> dict[str, list[str]]:
    """{key: the values drawn, in draw order}: a search's columns in ``sweep.csv`` and its plots' x values."""
    axes: dict[str, list[str]] = {key: [] for key in space}
    for point in points:
        for key, value in zip(axes, point):
            if value not in axes[key]:
                axes[key].append(value)
    return axes


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
        check_run_count(self.samples, "--num-samples")
        check_run_count(self.samples, "--num-samples")
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
        return drawn_axes(self.space, points)

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


def _finite_size(key: str, axis: str) -> float:
    """How many values a distribution axis can give: randint's count, else unbounded."""
    kind, low, high = _bounds(key, axis)
    return int(high - low) if kind == "randint" else math.inf


def _tpe_seed(*entropy: int) -> int:
    """A 32-bit seed for an Optuna sampler from the search's seed and where it is."""
    import numpy as np

    return int(np.random.SeedSequence(list(entropy)).generate_state(1)[0])


@dataclass
class OptunaSearch:
    """``samples`` distinct points of ``space`` (:func:`parse_space`), asked of Optuna's TPE sampler
    ``batch`` at a time, each batch from the results of the points before it (``metric`` of
    :data:`METRICS`, averaged over a point's seeds). ``asked``: the points so far, in order."""

    space: dict
    samples: int
    seed: int = 0
    metric: str = "final_accuracy"
    batch: int = 2
    asked: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise DPFLError(f"must be at least 1 (got {self.samples})", field="--num-samples")
        check_run_count(self.samples, "--num-samples")
        if self.metric not in METRICS:
            raise DPFLError(f"{self.metric!r} is not one of {', '.join(METRICS)}", field="--metric")
        if self.batch < 1:
            raise DPFLError(f"must be at least 1 (got {self.batch})", field="--max-concurrent")
        size = math.prod(len(axis) if isinstance(axis, list) else _finite_size(key, axis)
                         for key, axis in self.space.items())
        if size < self.samples:
            raise DPFLError(f"the search space holds {size} points, fewer than {self.samples} (widen it or ask for "
                            "fewer)", field="--num-samples")

    def points(self) -> list[tuple[str, ...]]:
        """The points asked so far (at most ``samples``), in order."""
        return [tuple(p) for p in self.asked[:self.samples]]

    def startup(self) -> int:
        """How many points TPE draws at random before it models the results: half of them, at
        least one batch, at most Optuna's default of 10."""
        return max(self.batch, min(10, self.samples // 2))

    def _distributions(self) -> dict:
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        out = {}
        for key, axis in self.space.items():
            if isinstance(axis, list):
                out[key] = CategoricalDistribution(axis)
                continue
            kind, low, high = _bounds(key, axis)
            out[key] = (IntDistribution(int(low), int(high) - 1) if kind == "randint"
                        else FloatDistribution(low, high, log=kind == "loguniform"))
        return out

    def _params(self, point: Sequence[str], dists: dict) -> dict:
        """A point's text as the values Optuna is told: a drawn number kept to 4 digits may lie just
        outside its bounds, and is told at the bound."""
        from optuna.distributions import CategoricalDistribution, IntDistribution

        params = {}
        for (key, dist), text in zip(dists.items(), point):
            if isinstance(dist, CategoricalDistribution):
                params[key] = text
            else:
                value = min(max(float(text), dist.low), dist.high)
                params[key] = int(round(value)) if isinstance(dist, IntDistribution) else value
        return params

    def ask(self, results: Sequence[float | str | None]) -> list[tuple[str, ...]]:
        """The next batch (appended to ``asked``; none once ``samples`` are asked). ``results[i]``:
        the metric of ``asked[i]``, or "stopped_early" (told to TPE as pruned), or None (failed)."""
        import warnings

        import optuna
        from optuna.trial import TrialState, create_trial

        want = min(self.batch, self.samples - len(self.asked))
        if want <= 0:
            return []
        if len(results) != len(self.asked):
            raise ValueError(f"{len(results)} results for {len(self.asked)} points")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        dists = self._distributions()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna's ExperimentalWarning for options it still marks so
            sampler = optuna.samplers.TPESampler(seed=_tpe_seed(self.seed, len(self.asked)),
                                                 n_startup_trials=self.startup(), constant_liar=True)
            study = optuna.create_study(direction=METRICS[self.metric], sampler=sampler)
            for point, result in zip(self.asked, results):
                if isinstance(result, (int, float)) and math.isfinite(result):
                    state, value = TrialState.COMPLETE, float(result)
                else:
                    state, value = (TrialState.PRUNED if result == "stopped_early" else TrialState.FAIL), None
                study.add_trial(create_trial(params=self._params(point, dists), distributions=dists, value=value,
                                             state=state))
            seen = {tuple(p) for p in self.asked}
            new: list[tuple[str, ...]] = []
            draws, repeated = 0, False
            while len(new) < want:
                if draws >= DRAWS_PER_POINT * want:
                    raise DPFLError(f"{len(self.asked) + len(new)} distinct points in the space after {draws} draws: it "
                                    f"holds fewer than {self.samples} (widen it or ask for fewer)", field="--num-samples")
                # TPE may propose a point already run (often, in a small space of choices): the next
                # draw is then Optuna's random sampler's, seeded like the batch
                study.sampler = sampler if draws == 0 or not repeated else optuna.samplers.RandomSampler(
                    seed=_tpe_seed(self.seed, len(self.asked), draws))
                trial = study.ask(dists)
                draws += 1
                point = tuple(_text(trial.params[key]) for key in self.space)
                repeated = point in seen
                if repeated:
                    study.tell(trial, state=TrialState.FAIL)
                    continue
                seen.add(point)
                new.append(point)
        self.asked += new
        return new

    def results(self, sweep_dir: Path, runs_of: dict[tuple[str, ...], list[str]]) -> list[float | str | None]:
        """Each asked point's result for :meth:`ask`, read from its runs' ``summary.json`` in
        ``sweep_dir`` (``runs_of``: {point: its run directories' names, one per seed})."""
        out: list[float | str | None] = []
        for point in self.asked:
            values, early = [], False
            for name in runs_of.get(tuple(point), []):
                try:
                    summary = json.loads((Path(sweep_dir) / name / "summary.json").read_text())
                except (OSError, ValueError):
                    summary = {}
                early |= summary.get("stop_reason") == "stopped_early"
                value = summary.get(self.metric)
                values.append(float(value) if isinstance(value, (int, float)) else None)
            if early:
                out.append("stopped_early")
            elif values and all(v is not None and math.isfinite(v) for v in values):
                out.append(sum(values) / len(values))
            else:
                out.append(None)
        return out

    def axes(self, points: Sequence[tuple[str, ...]]) -> dict[str, list[str]]:
        return drawn_axes(self.space, points)

    def manifest(self, points: Sequence[tuple[str, ...]]) -> dict:
        """What ``sweep.json`` keeps: the space, the seed, the metric, the batch and the points asked."""
        return {"kind": "optuna", "space": self.space, "seed": self.seed, "samples": self.samples,
                "metric": self.metric, "batch": self.batch, "points": [list(p) for p in points]}

    def same_space(self, old: dict | None) -> bool:
        """Does an earlier manifest's search ask the same points from the same results?"""
        if not old:
            return False
        return (old.get("kind") == "optuna" and old.get("seed") == self.seed and old.get("metric") == self.metric
                and old.get("batch") == self.batch
                and json.dumps(old.get("space"), sort_keys=True) == json.dumps(self.space, sort_keys=True))

    def adopt(self, old: dict | None) -> None:
        """Take the points an earlier run of the same search asked (its ``sweep.json``'s); points that
        are not lists of one text value per axis are one line naming the file."""
        if self.same_space(old):
            points = old.get("points", [])
            if not (isinstance(points, list) and all(
                    isinstance(p, list) and len(p) == len(self.space) and all(isinstance(v, str) for v in p)
                    for p in points)):
                raise DPFLError(f"sweep.json's search points are not lists of {len(self.space)} value"
                                f"{'s' if len(self.space) > 1 else ''} (one text per axis); choose another --out",
                                field="--out")
            self.asked = [tuple(p) for p in points]
