"""Compare finished runs side by side: the logic behind ``dpfl report``.

The report answers "what did privacy cost?" for a handful of run directories, in the style of the
paper's Figure 2: test accuracy per round next to epsilon per round, plus accuracy against epsilon.
Where a run records both the effective epsilon (what the accountant can prove for the rounds that
actually ran) and a claimed one (``epsilon_claimed``), the two are drawn together so the gap shows;
so is ``epsilon_assumed``, the same rounds under a sensitivity the paper assumes and the code does
not enforce (NbAFL's 2C/m).

This module reads run directories, builds table rows and draws PNGs; it prints nothing.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from .load import Run, load_run, load_runs, sweep_members  # noqa: F401 - run loading, as report offers it
from .record import plotting_library

COLUMNS = ["run", "scenario", "rounds", "stop_reason", "final_accuracy", "best_accuracy", "epsilon",
           "epsilon_claimed", "epsilon_assumed", "epsilon_vs_server", "epsilon_empirical", "calibration", "delta",
           "mean_survivors", "wall_seconds"]
"""Table and CSV columns, in order."""


def _last(run: Run, key: str):
    """``key`` from the summary, else from the last round that has it."""
    if run.summary.get(key) is not None:
        return run.summary[key]
    for r in reversed(run.rounds):
        if r.get(key) is not None:
            return r[key]
    return None


def row(run: Run) -> dict:
    """The raw values of one table row (None where the run does not say)."""
    s = run.summary
    accs = [r["test_accuracy"] for r in run.rounds if r.get("test_accuracy") is not None]
    survivors = [r["survived"] for r in run.rounds if r.get("survived") is not None]
    final = s.get("final_accuracy")
    if final is None and accs:
        final = accs[-1]
    private = "epsilon" in s or "delta" in s or "dp_covered" in s
    return {
        "run": run.label,
        "scenario": s.get("name"),
        "rounds_completed": s.get("rounds_completed", len(run.rounds)),
        "rounds_planned": s.get("rounds_planned"),
        "stop_reason": s.get("stop_reason"),
        "final_accuracy": final,
        "best_accuracy": max(accs) if accs else None,
        "epsilon": s.get("epsilon") if private else _last(run, "epsilon"),
        "epsilon_nominal": _last(run, "epsilon_nominal"),
        "epsilon_claimed": _last(run, "epsilon_claimed"),
        "epsilon_assumed": _last(run, "epsilon_assumed"),
        "epsilon_vs_server": s.get("epsilon_vs_server"),
        **_empirical(s.get("epsilon_empirical")),
        "calibration": run.calibration,
        "delta": _last(run, "delta"),
        "mean_survivors": sum(survivors) / len(survivors) if survivors else None,
        "wall_seconds": s.get("wall_seconds"),
    }


def _empirical(audit) -> dict:
    """The canary audit's estimate and interval (docs/audit.md), or Nones."""
    keys = (("", "epsilon"), ("_low", "low"), ("_high", "high"))
    values = [audit.get(key) for _, key in keys] if isinstance(audit, dict) else []
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) or not values:
        values = [None] * len(keys)
    return {f"epsilon_empirical{suffix}": v for (suffix, _), v in zip(keys, values)}


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def cells(r: dict) -> list[str]:
    """One table row as text, in :data:`COLUMNS` order."""
    eps = _num(r["epsilon"], ".3f")
    if r["epsilon"] is None and r["epsilon_nominal"] is not None:
        eps = f"- (nominal {r['epsilon_nominal']:.3f})"
    planned = "?" if r["rounds_planned"] is None else r["rounds_planned"]
    return [r["run"], str(r["scenario"] or "-"), f"{r['rounds_completed']}/{planned}", str(r["stop_reason"] or "-"),
            _num(r["final_accuracy"], ".4f"), _num(r["best_accuracy"], ".4f"), eps,
            _num(r["epsilon_claimed"], ".3f"), _num(r["epsilon_assumed"], ".3f"), _num(r["epsilon_vs_server"], ".3f"),
            _interval(r), r["calibration"] or "-", _num(r["delta"], "g"),
            _num(r["mean_survivors"], ".1f"), _num(r["wall_seconds"], ".1f")]


def _interval(r: dict) -> str:
    if r["epsilon_empirical"] is None:
        return "-"
    return f"{r['epsilon_empirical']:.2f} [{r['epsilon_empirical_low']:.2f}, {r['epsilon_empirical_high']:.2f}]"


def write_csv(rows: list[dict], path: Path) -> Path:
    """The table with full-precision numbers; empty cells where a run does not say."""
    fields = ["run", "scenario", "rounds_completed", "rounds_planned", "stop_reason", "final_accuracy",
              "best_accuracy", "epsilon", "epsilon_nominal", "epsilon_claimed", "epsilon_assumed",
              "epsilon_vs_server", "epsilon_empirical", "epsilon_empirical_low", "epsilon_empirical_high",
              "calibration", "delta", "mean_survivors", "wall_seconds"]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r[k] is None else r[k] for k in fields})
    return path


def _color(index: int) -> str:
    """The same run keeps the same colour in every plot."""
    return f"C{index % 10}"


def _save(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    ax.set_xlabel(xlabel)
    if xlabel == "round":
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plotting_library().close(fig)
    return path


def plot_accuracy(runs: list[Run], path: Path) -> Path | None:
    """Test accuracy against round, one line per run."""
    runs = [(i, r) for i, r in enumerate(runs) if r.series("test_accuracy")[0]]
    if not runs:
        return None
    fig, ax = plotting_library().subplots(figsize=(7, 4.5))
    for i, run in runs:
        ax.plot(*run.series("test_accuracy"), marker=".", markersize=3, color=_color(i), label=run.legend)
    return _save(fig, ax, path, "round", "test accuracy", "Test accuracy per round")


def plot_epsilon(runs: list[Run], path: Path) -> Path | None:
    """Epsilon against round: effective solid, claimed dashed, nominal (rounds not covered) dotted,
    assumed (a sensitivity the code does not enforce) dash-dotted; a log axis where they span decades."""
    runs = [(i, r) for i, r in enumerate(runs) if r.has_epsilon]
    if not runs:
        return None
    fig, ax = plotting_library().subplots(figsize=(7, 4.5))
    for i, run in runs:
        effective = " (effective)" if run.series("epsilon_claimed")[0] else ""
        for key, style, suffix in (("epsilon", "-", effective), ("epsilon_nominal", ":", " (nominal)"),
                                   ("epsilon_claimed", "--", " (claimed)"), ("epsilon_assumed", "-.", " (assumed)")):
            xs, ys = run.series(key)
            if xs:
                ax.plot(xs, ys, linestyle=style, color=_color(i), label=run.legend + suffix)
    values = [y for line in ax.get_lines() for y in line.get_ydata() if y > 0]
    if values and max(values) > 100 * min(values):  # NbAFL: 5e4 enforced beside 17.6 assumed
        ax.set_yscale("log")
    return _save(fig, ax, path, "round", "epsilon", "Privacy spent per round")


def plot_accuracy_vs_epsilon(runs: list[Run], path: Path) -> Path | None:
    """Test accuracy against the effective epsilon spent so far (nominal where rounds are not covered)."""
    lines = []
    for i, run in enumerate(runs):
        pts = [(r["epsilon"] if r.get("epsilon") is not None else r.get("epsilon_nominal"), r.get("test_accuracy"))
               for r in run.rounds]
        pts = [p for p in pts if p[0] is not None and p[1] is not None]
        if pts:
            nominal = any(r.get("epsilon") is None and r.get("epsilon_nominal") is not None for r in run.rounds)
            lines.append((i, run.legend + (" (nominal)" if nominal else ""), pts))
    if not lines:
        return None
    fig, ax = plotting_library().subplots(figsize=(7, 4.5))
    for i, label, pts in lines:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", markersize=3, color=_color(i), label=label)
    return _save(fig, ax, path, "epsilon", "test accuracy", "Accuracy against privacy spent")


def _finite_number(v) -> bool:
    """A real number JSON can hold as a figure (not a bool, NaN or infinite)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def client_epsilons(run: Run) -> list[float]:
    """Record-level runs (Huang et al. 2020, Fu et al. 2022): each client's epsilon from ledger.json's
    ``per_client_epsilon``; [] for other runs or an unreadable ledger (the table does not need it)."""
    if not run.summary.get("record_level"):
        return []
    try:
        ledger = json.loads((run.path / "ledger.json").read_text(encoding="utf-8"))
        values = ledger["per_client_epsilon"].values()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return [float(v) for v in values if _finite_number(v) and v >= 0]  # no epsilon is negative


def plot_client_epsilon(runs: list[Run], path: Path) -> Path | None:
    """A histogram of the clients' epsilons of each record-level run (one ledger per client)."""
    runs = [(i, r, client_epsilons(r)) for i, r in enumerate(runs)]
    runs = [(i, r, eps) for i, r, eps in runs if eps]
    if not runs:
        return None
    plt = plotting_library()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run, eps in runs:
        ax.hist(eps, bins=min(30, max(5, len(eps) // 3)), alpha=0.5, color=_color(i),
                label=f"{run.legend} ({len(eps)} clients, max {max(eps):.3g})")
    return _save(fig, ax, path, "epsilon of the client's records", "clients", "Per-client epsilon (record level)")


def client_accuracy_groups(run: Run) -> dict[str, dict]:
    """summary.json's ``client_accuracy`` (output.client_accuracy: each client's own model in the
    last round) as {group: {"mean", "min", "max"}}, one group "all clients" when the algorithm does
    not label clients; {} when the run has none or the figures are not accuracies in order
    (0 <= min <= mean <= max <= 1)."""
    ca = run.summary.get("client_accuracy")
    if not isinstance(ca, dict):
        return {}
    groups = ca.get("by_group") if isinstance(ca.get("by_group"), dict) else {"all clients": ca}
    out = {}
    for label, stats in groups.items():
        values = [stats.get(k) if isinstance(stats, dict) else None for k in ("mean", "min", "max")]
        if all(_finite_number(v) for v in values) and 0 <= values[1] <= values[0] <= values[2] <= 1:
            out[str(label)] = dict(zip(("mean", "min", "max"), map(float, values)))
    return out


def plot_client_accuracy(runs: list[Run], path: Path) -> Path | None:
    """Each run's per-client accuracy by group (Huang et al. 2020, Fig. 7): the mean, with a bar
    from the worst client to the best."""
    runs = [(i, r, client_accuracy_groups(r)) for i, r in enumerate(runs)]
    runs = [(i, r, g) for i, r, g in runs if g]
    if not runs:
        return None
    labels = list(dict.fromkeys(label for _, _, g in runs for label in g))
    fig, ax = plotting_library().subplots(figsize=(max(6, 1.2 * len(labels) + 3), 4.5))
    width = 0.8 / len(runs)
    for k, (i, run, groups) in enumerate(runs):
        xs = [j + (k - (len(runs) - 1) / 2) * width for j, label in enumerate(labels) if label in groups]
        st = [groups[label] for label in labels if label in groups]
        ax.errorbar(xs, [s["mean"] for s in st], yerr=[[s["mean"] - s["min"] for s in st],
                                                       [s["max"] - s["mean"] for s in st]],
                    fmt="o", capsize=4, color=_color(i), label=run.legend)
    ax.set_xticks(range(len(labels)), labels)
    return _save(fig, ax, path, "client group", "test accuracy of the client's own model",
                 "Per-client accuracy (mean, worst to best)")


def write_report(runs: list[Run], out: Path) -> tuple[list[dict], list[Path]]:
    """Build the rows, write ``report.csv`` and every non-empty plot into ``out``; return rows and paths."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [row(r) for r in runs]
    written = [write_csv(rows, out / "report.csv")]
    for plot, name in ((plot_accuracy, "accuracy.png"), (plot_epsilon, "epsilon.png"),
                       (plot_accuracy_vs_epsilon, "accuracy_vs_epsilon.png"),
                       (plot_client_epsilon, "client_epsilon.png"),
                       (plot_client_accuracy, "client_accuracy.png")):
        path = plot(runs, out / name)
        if path is not None:
            written.append(path)
    return rows, written
