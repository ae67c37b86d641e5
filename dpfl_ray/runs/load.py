"""Reading run directories: one run's files (summary.json, rounds.jsonl, the ledger and the audit), and
the run directories of a sweep (its sweep.json manifest). ``report`` and ``sweep`` both read runs
through here."""
from __future__ import annotations

import csv
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import DPFLError

MANIFEST = "sweep.json"
# Linux file names hold 255 bytes; a run's directory name also gets ".log" and ".N" (.incomplete/)
MAX_NAME_BYTES = 240
# The most runs one sweep (or search) plans: each is a whole federated run, and planning checks
# every combination's scenario (a few ms each), so a larger grid is a typo, not an experiment.
MAX_RUNS = 10_000


def check_run_count(count: int, field: str) -> None:
    if count > MAX_RUNS:
        raise DPFLError(f"{count:,} runs; a sweep plans at most {MAX_RUNS:,} (split it into several sweeps)",
                        field=field)


def _load_summary(text: str):
    """summary.json, where an infinite epsilon is a figure ("no guarantee"), not a missing one:
    a bare Infinity, or null with ``non_finite`` saying "inf" (record.sanitise), reads as inf.
    A NaN stays None. Rounds keep :func:`_loads`: the plots draw only finite points."""
    summary = json.loads(text, parse_constant=lambda c: {"Infinity": math.inf, "-Infinity": -math.inf}.get(c))
    marks = summary.get("non_finite") if isinstance(summary, dict) else None
    if isinstance(marks, dict):
        for key, mark in marks.items():
            if summary.get(key) is None and mark in ("inf", "-inf"):
                summary[key] = math.inf if mark == "inf" else -math.inf
    return summary


@dataclass(frozen=True)
class SweepRun:
    """One combination: its grid values (as typed), its seed (None: the scenario's own), the
    ``--set`` overrides that make it, and its run directory's name. ``scenario``: the run's own
    scenario file, where runs of one directory differ in it (a paper's reproduction); None: the
    sweep's one scenario."""

    name: str
    values: tuple[tuple[str, str], ...]
    seed: int | None
    overrides: tuple[str, ...]
    scenario: Path | None = None


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text)


def expand(grid: dict[str, list[str]], seeds: list[int] | None, base_sets: Sequence[str] = (),
           points: Sequence[Sequence[str]] | None = None) -> list[SweepRun]:
    """Every combination, seeds outermost (one pass over the grid per seed), grid in order.
    ``points``: the combinations instead, each its values in the grid's key order (a random
    search's draws, runtime/search.py)."""
    set_keys = {s.partition("=")[0].strip() for s in base_sets}
    for key in grid:
        if key in set_keys:
            raise DPFLError(f"{key} is also given with --set", field="--grid")
    if "seed" in set_keys and seeds is not None:
        raise DPFLError("seed is given with both --set and --seeds", field="--seeds")
    combos = len(points) if points is not None else math.prod(len(v) for v in grid.values())
    check_run_count(combos * len(seeds if seeds is not None else [None]), "--grid" if points is None else "--num-samples")
    runs, names = [], {}
    for seed in (seeds if seeds is not None else [None]):
        for combo in (points if points is not None else itertools.product(*grid.values())):
            values = tuple(zip(grid, combo))
            parts = [f"{k}={v}" for k, v in values] + ([f"seed={seed}"] if seed is not None else [])
            name = _safe("__".join(parts)) or "run"
            if len(name.encode()) > MAX_NAME_BYTES:
                raise DPFLError(f"the run directory of {'__'.join(parts)[:60]}... would be named with "
                                f"{len(name.encode())} bytes; file names hold {MAX_NAME_BYTES} here: shorten the "
                                "values (or sweep fewer keys at once)", field="--grid")
            if name in names:
                raise DPFLError(f"{'__'.join(parts)} and {names[name]} share a directory name", field="--grid")
            names[name] = "__".join(parts)
            runs.append(SweepRun(name, values, seed, tuple(base_sets) + tuple(parts)))
    return runs


@dataclass
class Run:
    """One run directory as written by ``dpfl run``."""

    path: Path
    summary: dict
    rounds: list[dict]

    @property
    def label(self) -> str:
        path = self.path.resolve()
        return f"{path.parent.name}/{path.name}" if path.parent.name else path.name

    def series(self, key: str) -> tuple[list, list]:
        """(rounds, values) for the rounds where ``key`` has a value."""
        pts = [(r["round"], r[key]) for r in self.rounds if r.get(key) is not None and r.get("round") is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    @property
    def calibration(self) -> str | None:
        """The noise calibration after dropouts (summary.json's optional ``calibration``), if recorded."""
        value = self.summary.get("calibration")
        return None if value in (None, "") else str(value)

    @property
    def legend(self) -> str:
        """The label in the plots: the run, plus its calibration when it records one."""
        return f"{self.label} (calibration={self.calibration})" if self.calibration else self.label

    @property
    def has_epsilon(self) -> bool:
        return any(r.get(k) is not None for r in self.rounds for k in ("epsilon", "epsilon_nominal",
                                                                        "epsilon_claimed"))


NUMERIC_SUMMARY = ("final_accuracy", "final_loss", "rounds_completed", "rounds_planned", "epsilon",
                   "epsilon_nominal", "epsilon_claimed", "epsilon_assumed", "epsilon_vs_server", "delta",
                   "wall_seconds")


NUMERIC_ROUND = ("round", "test_accuracy", "test_loss", "epsilon", "epsilon_nominal", "epsilon_claimed",
                 "epsilon_assumed", "delta", "survived", "sampled", "seconds")


def _loads(text: str):
    # Files written before strict JSON may hold bare NaN / Infinity: read them as "no value".
    return json.loads(text, parse_constant=lambda _: None)


# What a run writes: accuracies are fractions, rounds count from 1, counts and epsilons are not negative.
RANGES = {"final_accuracy": (0.0, 1.0), "test_accuracy": (0.0, 1.0), "round": (1, math.inf),
          "rounds_completed": (0, math.inf), "rounds_planned": (0, math.inf), "survived": (0, math.inf),
          "sampled": (0, math.inf), "epsilon": (0.0, math.inf), "epsilon_claimed": (0.0, math.inf),
          "delta": (0.0, 1.0)}


def check_numbers(obj: dict, keys: tuple[str, ...], where: str, run_dir: Path) -> None:
    """Each of ``keys`` in ``obj`` is a number in its RANGES (or null): one line naming the file and key."""
    for key in keys:
        value = obj.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise DPFLError(f"{where}: {key} must be a number or null, got {value!r:.40}", field=str(run_dir))
        low, high = RANGES.get(key, (-math.inf, math.inf))
        if value is not None and not low <= value <= high:
            raise DPFLError(f"{where}: {key} must be in [{low:g}, {high:g}], got {value!r:.40}", field=str(run_dir))


def _read_json(path: Path, run_dir: Path, loads=_loads) -> dict:
    try:
        data = loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DPFLError(f"{path.name} is not a text (UTF-8) file", field=str(run_dir)) from None
    except json.JSONDecodeError as err:
        raise DPFLError(f"{path.name} is not valid JSON ({err.msg}, line {err.lineno})", field=str(run_dir))
    if not isinstance(data, dict):
        raise DPFLError(f"{path.name} does not hold a JSON object", field=str(run_dir))
    return data


def load_run(path: str | Path) -> Run:
    """Read ``summary.json`` and ``rounds.jsonl``; any problem is a :class:`DPFLError` naming the path."""
    path = Path(path)
    if not path.is_dir():
        raise DPFLError("not a run directory (no such directory)", field=str(path))
    missing = [n for n in ("summary.json", "rounds.jsonl") if not (path / n).is_file()]
    if missing:
        raise DPFLError(f"not a run directory (no {' or '.join(missing)})", field=str(path))
    summary = _read_json(path / "summary.json", path, _load_summary)
    check_numbers(summary, NUMERIC_SUMMARY, "summary.json", path)
    try:
        lines = (path / "rounds.jsonl").read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DPFLError("rounds.jsonl is not a text (UTF-8) file", field=str(path)) from None
    rounds = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = _loads(line)
        except json.JSONDecodeError as err:
            raise DPFLError(f"rounds.jsonl line {lineno} is not valid JSON ({err.msg})", field=str(path))
        if not isinstance(row, dict):
            raise DPFLError(f"rounds.jsonl line {lineno} is not a JSON object", field=str(path))
        check_numbers(row, NUMERIC_ROUND, f"rounds.jsonl line {lineno}", path)
        rounds.append(row)
    return Run(path, summary, rounds)


def sweep_members(path: str | Path) -> tuple[list[Path], list[str]] | None:
    """The run directories of a sweep directory written by ``dpfl sweep``, in ``sweep.csv`` order
    then its manifest's (a live or killed sweep has runs the csv does not list yet, or no csv), and
    the names of its runs that left no ``summary.json`` (running, timed out, failed, not run yet);
    None if ``path`` is not a sweep directory."""
    path = Path(path)
    table, names = path / "sweep.csv", None
    if table.is_file():
        try:
            with open(table, newline="", encoding="utf-8") as fh:
                names = [r["run"] for r in csv.DictReader(fh)]
        except (UnicodeDecodeError, KeyError, TypeError, csv.Error):
            if not (path / MANIFEST).is_file():
                raise DPFLError("sweep.csv has no 'run' column: not a sweep directory", field=str(path)) from None
    if (path / MANIFEST).is_file():
        try:
            planned = [r.name for r in _manifest_runs(path)]
        except DPFLError:
            if names is None:
                raise
            planned = []  # the csv lists the runs
        listed = set(names or [])
        names = (names or []) + [n for n in planned if n not in listed]
    if names is None:
        return None
    # a name is a directory inside the sweep, never a path out of it
    names = [n for n in names if n and Path(n).name == n and n not in (".", "..")]
    done = [n for n in names if (path / n / "summary.json").is_file()]
    return [path / n for n in done], [n for n in names if n not in done]


def load_runs(paths) -> tuple[list[Run], list[str]]:
    """Every run the paths name: a run directory is one run, a sweep directory each of its runs that
    left a summary. Returns the runs and one note per sweep run that could not be reported."""
    runs, notes = [], []
    for path in map(Path, paths):
        members = sweep_members(path) if path.is_dir() else None
        if members is None:
            runs.append(load_run(path))
            continue
        found, missing = members
        if not found:
            raise DPFLError("a sweep directory with no finished run (no run directory holds a summary.json)",
                            field=str(path))
        runs += [load_run(d) for d in found]
        notes += [f"{path / name}: no summary.json (the run did not finish), not reported" for name in missing]
    return runs, notes


def sweep_run_dirs(path: Path) -> list[Path] | None:
    """The run directories of a sweep directory that hold a summary (for ``dpfl report``), or None
    if ``path`` is not one."""
    if not (Path(path) / MANIFEST).is_file():
        return None
    return [Path(path) / r.name for r in _manifest_runs(path) if (Path(path) / r.name / "summary.json").is_file()]


def _manifest_runs(path: Path) -> list[SweepRun]:
    """Every run a sweep directory's manifest plans, or one line saying it is not a manifest."""
    manifest = Path(path) / MANIFEST
    try:
        m = json.loads(manifest.read_text())
        return expand(m["grid"], m["seeds"], m["sets"], (m.get("search") or {}).get("points"))
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        raise DPFLError(f"{manifest} is not a sweep manifest", field=str(path)) from None
