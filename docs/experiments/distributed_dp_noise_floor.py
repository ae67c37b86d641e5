"""What one run's final accuracy is worth beside another's (docs/distributed_dp.md, issue #36's
acceptance run): python docs/experiments/distributed_dp_noise_floor.py RUN_DIR...

The run directories are runs of one scenario with ``privacy.randomness: os``: the data, the model's
initial weights and the local shuffles come from the scenario seed, every DP draw (the cohorts, the
noise shares) from the operating system, so two runs of one configuration differ by their DP
randomness alone. They are grouped by their noise (``privacy.distributed_noise``, and
``secagg.bits`` for the integer ones, as each scenario.yaml says); for each group the table gives
the final accuracies' mean and standard deviation, how many pairs of its runs end within 0.02 of
each other, and the difference of its mean from the Gaussian's with a 95% interval (Welch).
"""
from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path

import yaml
from scipy import stats

WITHIN = 0.02


def group_of(run: Path) -> str:
    scenario = yaml.safe_load((run / "scenario.yaml").read_text()) or {}
    privacy, secagg = scenario.get("privacy") or {}, scenario.get("secagg") or {}
    if privacy.get("randomness") != "os":
        raise SystemExit(f"{run}: not a run with privacy.randomness: os (its repeats would be one run)")
    noise = privacy.get("distributed_noise", "gaussian")
    return noise if noise == "gaussian" else f"{noise}, {secagg.get('bits')} bits"


def final_accuracy(run: Path) -> float:
    summary = json.loads((run / "summary.json").read_text())
    if summary.get("stop_reason") != "completed":
        raise SystemExit(f"{run}: did not complete ({summary.get('stop_reason')})")
    return float(summary["final_accuracy"])


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """mean(a) - mean(b) and the half-width of its 95% interval (Welch-Satterthwaite degrees of freedom)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return statistics.fmean(a) - statistics.fmean(b), float(stats.t.ppf(0.975, df)) * (va + vb) ** 0.5


def table(runs: list[Path]) -> list[str]:
    groups: dict[str, list[float]] = {}
    for run in runs:
        groups.setdefault(group_of(run), []).append(final_accuracy(run))
    base = groups.get("gaussian")
    lines = ["| noise | runs | final accuracy, mean | standard deviation | lowest - highest "
             f"| pairs of runs within {WITHIN} | minus the Gaussian's mean (95% interval) |",
             "|---|--:|--:|--:|---|--:|--:|"]
    for name in sorted(groups, key=lambda g: (g != "gaussian", g)):
        acc = groups[name]
        if len(acc) < 2:
            raise SystemExit(f"{name}: {len(acc)} run; a standard deviation needs two")
        pairs = list(itertools.combinations(acc, 2))
        close = sum(abs(x - y) <= WITHIN for x, y in pairs)
        if name == "gaussian" or base is None:
            versus = "-"
        else:
            diff, half = welch(acc, base)
            versus = f"{diff:+.3f} ({diff - half:+.3f} to {diff + half:+.3f})"
        lines.append(f"| {name} | {len(acc)} | {statistics.fmean(acc):.3f} | {statistics.stdev(acc):.3f} "
                     f"| {min(acc):.3f} - {max(acc):.3f} | {close} of {len(pairs)} | {versus} |")
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__.splitlines()[1].strip())
    print("\n".join(table([Path(p) for p in sys.argv[1:]])))
