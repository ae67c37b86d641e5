"""What Baek's calibration costs late in training at z = 1.5 and 10% dropout (docs/reproductions.md,
Baek et al. 2021, experiments 8 to 11): python docs/experiments/baek2021_late_gap.py [--level P] FIRST LAST RUN_DIR...

The run directories are runs of the same seeds, of three kinds told apart by their scenario.yaml: the
calibrated run at z = 1.5 with 10% tail dropout; the run without dropout at z / 0.9 = 1.6667, the noise
the calibration leaves on the survivors' average; and the run without dropout at z = 1.5, the paper's
baseline. Each is evaluated every round over FIRST..LAST. For each two kinds present the script prints
one table, the runs paired by seed: D = z / 0.9 minus calibrated (experiment 8), L = z = 1.5 minus
calibrated (the claim's loss, experiment 9) and C = z = 1.5 minus z / 0.9 (what z / 0.9 costs). For each
seed a table gives the mean over those rounds of one kind's accuracy minus the other's, and the gaps at
the window's first round, at round 100 and at its last round; below it, the mean over the seeds with
its standard error and t-based interval (95%, or P: experiment 10's second look uses 0.975, experiment
11's third 0.98333), and the mean gap at round 100 and at the last round alone.
A seed whose two runs do not both cover the window is listed and not counted.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import yaml
from scipy import stats

from dpfl_ray.errors import DPFLError
from dpfl_ray.runs.load import load_run

CALIBRATED, Z_OVER_09, NO_DROPOUT = "calibrated", "z/0.9", "z=1.5"
COMPARISONS = (("D", Z_OVER_09, CALIBRATED), ("L", NO_DROPOUT, CALIBRATED), ("C", NO_DROPOUT, Z_OVER_09))


def kind_and_seed(run: Path) -> tuple[str, int]:
    scenario = yaml.safe_load((run / "scenario.yaml").read_text())
    dropout, privacy = scenario["faults"]["dropout"], scenario["privacy"]
    rate = dropout["rate"] if dropout["model"] != "none" else 0.0
    z = privacy["noise_multiplier"]
    if rate == 0.1 and z == 1.5 and privacy["calibration"] == "baek":
        return CALIBRATED, scenario["seed"]
    if rate == 0.0 and abs(z - 1.5 / 0.9) < 1e-3:
        return Z_OVER_09, scenario["seed"]
    if rate == 0.0 and z == 1.5:
        return NO_DROPOUT, scenario["seed"]
    raise SystemExit(f"{run}: neither the calibrated z = 1.5, 10% run nor a run without dropout at z = 1.5 or z / 0.9")


def accuracy_by_round(run: Path) -> dict[int, float]:
    try:
        rows = load_run(run).rounds
    except DPFLError as err:
        raise SystemExit(str(err)) from None
    return {r["round"]: r["test_accuracy"] for r in rows if r.get("test_accuracy") is not None}


def read(dirs: list[Path]) -> dict[int, dict[str, dict[int, float]]]:
    runs: dict[int, dict[str, dict[int, float]]] = {}
    for d in dirs:
        kind, seed = kind_and_seed(d)
        if kind in runs.get(seed, {}):
            raise SystemExit(f"{d}: a second {kind} run of seed {seed}")
        runs.setdefault(seed, {})[kind] = accuracy_by_round(d)
    return runs


def table(first: int, last: int, dirs: list[Path], name: str = "D", ahead: str = Z_OVER_09,
          behind: str = CALIBRATED, runs: dict | None = None, level: float = 0.95) -> list[str]:
    runs = read(dirs) if runs is None else runs
    window = range(first, last + 1)
    lines = [f"| seed | mean gap, rounds {first}-{last} | round {first} | round 100 | round {last} |",
             "|---|--:|--:|--:|--:|"]
    means, at_100, at_last = [], [], []
    for seed in sorted(runs):
        pair = {kind: acc for kind, acc in runs[seed].items() if kind in (ahead, behind)}
        if not pair:
            continue
        if set(pair) != {ahead, behind} or not all(set(window) <= set(acc) for acc in pair.values()):
            lines.append(f"| {seed} | not counted: its two runs do not both cover rounds {first}-{last} | | | |")
            continue
        gap = {t: pair[ahead][t] - pair[behind][t] for t in window}
        means.append(statistics.fmean(gap.values()))
        at_last.append(gap[last])
        if 100 in gap:
            at_100.append(gap[100])
        lines.append(f"| {seed} | {means[-1]:+.4f} | {gap[first]:+.4f} | "
                     f"{f'{gap[100]:+.4f}' if 100 in gap else '-'} | {gap[last]:+.4f} |")
    if len(means) < 2:
        raise SystemExit(f"{name}: fewer than two seeds with both runs over rounds {first}-{last}")
    mean, se = statistics.fmean(means), stats.sem(means)
    low, high = stats.t.interval(level, len(means) - 1, loc=mean, scale=se)
    lines += ["", f"{name} = {mean:+.4f} over {len(means)} seeds (SE {se:.4f}, {level:.1%} {low:+.4f} to {high:+.4f})"
              .replace(".0%", "%")]
    for label, values in ((100, at_100), (last, at_last)):
        if len(values) >= 2:
            lines.append(f"round {label} alone: {statistics.fmean(values):+.4f} (SE {stats.sem(values):.4f})")
    return lines


def tables(first: int, last: int, dirs: list[Path], level: float = 0.95) -> list[str]:
    runs = read(dirs)
    kinds = {kind for pair in runs.values() for kind in pair}
    out: list[str] = []
    for name, ahead, behind in COMPARISONS:
        if {ahead, behind} <= kinds:
            out += ([""] if out else []) + [f"{name} = {ahead} minus {behind}:", ""]
            out += table(first, last, dirs, name, ahead, behind, runs, level)
    if not out:
        raise SystemExit("no two kinds of run to compare")
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    level = 0.95
    if args[:1] == ["--level"]:
        level, args = float(args[1]), args[2:]
        if not 0.5 < level < 1.0:
            raise SystemExit(f"--level: an interval's coverage in (0.5, 1), got {level:g}")
    print("\n".join(tables(int(args[0]), int(args[1]), [Path(d) for d in args[2:]], level)))
