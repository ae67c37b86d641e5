"""What one run's final accuracy is worth beside another's (docs/distributed_dp.md, issue #36's
acceptance run): python docs/experiments/distributed_dp_noise_floor.py RUN_DIR...

The run directories are runs of one scenario with ``privacy.randomness: os``: the data, the model's
initial weights and the local shuffles come from the scenario seed, every DP draw (the cohorts, the
noise shares) from the operating system, so two runs of one configuration differ by their DP
randomness alone. They are grouped by their noise (``privacy.distributed_noise``, and
``secagg.bits`` for the integer ones, as each scenario.yaml says); for each group the table gives
the final accuracies' mean and standard deviation, how many pairs of its runs end within 0.02 of
each other, and the difference of its mean from the Gaussian's with a 95% interval (Welch); then
the same difference for each run's mean accuracy over its last five rounds and over every round
(rounds.jsonl), which one evaluation's luck moves less. A difference is marked "within 0.02" where
its whole interval lies inside +-0.02.
"""
from __future__ import annotations

import itertools
import statistics
import sys
from pathlib import Path

import yaml
from scipy import stats

from dpfl_ray.errors import DPFLError
from dpfl_ray.runs.load import Run, load_run

WITHIN = 0.02
LAST = 5


def group_of(run: Path) -> str:
    scenario = yaml.safe_load((run / "scenario.yaml").read_text()) or {}
    privacy, secagg = scenario.get("privacy") or {}, scenario.get("secagg") or {}
    if privacy.get("randomness") != "os":
        raise SystemExit(f"{run}: not a run with privacy.randomness: os (its repeats would be one run)")
    noise = privacy.get("distributed_noise", "gaussian")
    return noise if noise == "gaussian" else f"{noise}, {secagg.get('bits')} bits"


def read(run: Path) -> Run:
    """The run's summary and rows (runs.load: a damaged file is one line naming it)."""
    try:
        return load_run(run)
    except DPFLError as err:
        raise SystemExit(str(err)) from None


def final_accuracy(run: Run) -> float:
    summary = run.summary
    if summary.get("stop_reason") != "completed" or summary.get("final_accuracy") is None:
        raise SystemExit(f"{run.path}: did not complete ({summary.get('stop_reason')})")
    return float(summary["final_accuracy"])


def last_rounds_accuracy(run: Run, rounds: int | None = LAST) -> float:
    """The run's mean test accuracy over its last ``rounds`` rounds (None: every round), each evaluated."""
    rows = run.rounds
    kept = rows if rounds is None else rows[-rounds:]
    accuracies = [r["test_accuracy"] for r in kept if r.get("test_accuracy") is not None]
    if not accuracies or len(accuracies) < len(kept) or len(kept) < (rounds or 1):
        raise SystemExit(f"{run.path}: " + ("not every round was evaluated" if rounds is None
                                       else f"fewer than {rounds} evaluated rounds"))
    return statistics.fmean(accuracies)


def _versus(acc: list[float], base: list[float] | None) -> str:
    """mean(acc) - mean(base) and its 95% interval, Welch's (scipy's t-test without equal variances)."""
    if base is None or acc is base:
        return "-"
    low, high = stats.ttest_ind(acc, base, equal_var=False).confidence_interval(0.95)
    inside = ", within 0.02" if -WITHIN < low and high < WITHIN else ""
    return f"{statistics.fmean(acc) - statistics.fmean(base):+.3f} ({low:+.3f} to {high:+.3f}{inside})"


def table(runs: list[Path]) -> list[str]:
    groups: dict[str, list[tuple[float, float, float]]] = {}
    for path in runs:
        run = read(path)
        groups.setdefault(group_of(path), []).append(
            (final_accuracy(run), last_rounds_accuracy(run), last_rounds_accuracy(run, None)))
    finals = {name: [f for f, _, _ in v] for name, v in groups.items()}
    lasts = {name: [m for _, m, _ in v] for name, v in groups.items()}
    every = {name: [m for _, _, m in v] for name, v in groups.items()}
    lines = ["| noise | runs | final accuracy, mean | standard deviation | lowest - highest "
             f"| pairs of runs within {WITHIN} | minus the Gaussian's mean (95% interval) "
             f"| last {LAST} rounds' accuracy, mean (sd) | minus the Gaussian's (95% interval) "
             "| every round's accuracy, mean (sd) | minus the Gaussian's (95% interval) |",
             "|---|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|"]
    for name in sorted(groups, key=lambda g: (g != "gaussian", g)):
        acc, last, all_rounds = finals[name], lasts[name], every[name]
        if len(acc) < 2:
            raise SystemExit(f"{name}: {len(acc)} run; a standard deviation needs two")
        pairs = list(itertools.combinations(acc, 2))
        close = sum(abs(x - y) <= WITHIN for x, y in pairs)
        lines.append(f"| {name} | {len(acc)} | {statistics.fmean(acc):.3f} | {statistics.stdev(acc):.3f} "
                     f"| {min(acc):.3f} - {max(acc):.3f} | {close} of {len(pairs)} "
                     f"| {_versus(acc, finals.get('gaussian'))} "
                     f"| {statistics.fmean(last):.3f} ({statistics.stdev(last):.3f}) "
                     f"| {_versus(last, lasts.get('gaussian'))} "
                     f"| {statistics.fmean(all_rounds):.3f} ({statistics.stdev(all_rounds):.3f}) "
                     f"| {_versus(all_rounds, every.get('gaussian'))} |")
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__.splitlines()[1].strip())
    print("\n".join(table([Path(p) for p in sys.argv[1:]])))
