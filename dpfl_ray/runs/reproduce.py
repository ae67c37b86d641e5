"""Reproducing a paper: the logic behind ``dpfl reproduce``.

A paper's folder (``scenarios/papers/<paper>/``, schema in :mod:`.papers`) names its runs; each
becomes a :class:`~.load.SweepRun` with its own scenario file and runs through the sweep's engine
(a Ray Tune trial per run, runtime/trials.py: the run directory ``dpfl run`` would write, a timeout, a
finished run never run again, the directory locked by ``sweep.SweepLock``). Then the run
directories are read back into one row per run (here against the paper), the claims are checked,
and ``reproduction.csv``, ``reproduction.md`` and ``reproduction.png`` are written. Nothing here
imports Ray or prints.
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import DPFLError
from .load import SweepRun, load_run
from .papers import PAPER_FILE, ClaimResult, MetricMissing, PaperSpec, evaluate_claims, metric, run_metrics
from .sweep import is_finished

PAPERS_DIR = Path(__file__).resolve().parents[2] / "scenarios" / "papers"
MANIFEST = "reproduction.json"
EPSILONS = (("epsilon_accounted", "epsilon"), ("epsilon_claimed", "epsilon_claimed"),
            ("epsilon_empirical", "epsilon_empirical"))
"""(column, metric): the privacy every row shows, beside the paper's metrics."""
WITHIN_BUDGET = ("accuracy_within_budget", "accuracy_within_budget")
"""(column, metric): shown where a run has a per-client budget (papers.within_budget)."""
OWN_FILES = ("reproduction.csv", "reproduction.md", "reproduction.png", "tune", ".running", ".incomplete",
             ".incoming", ".stop")
"""What a reproduction writes in its directory beside the manifest and the run directories."""
TAIL = ("rounds", "stop_reason", "wall_seconds", "status")
TEXT_COLUMNS = ("run", "scenario", "stop_reason", "status")


def paper_folders(root: Path = PAPERS_DIR) -> list[Path]:
    """Every folder under ``root`` that holds a paper.yaml, by name."""
    return sorted(p for p in root.iterdir() if (p / PAPER_FILE).is_file()) if root.is_dir() else []


def find_paper(name: str, root: Path = PAPERS_DIR) -> Path:
    """A paper's folder: a name under ``root`` (scenarios/papers), or a path to a folder with a paper.yaml."""
    if "/" not in name and (root / name / PAPER_FILE).is_file():
        return root / name
    path = Path(name).expanduser()
    if (path / PAPER_FILE).is_file():
        return path
    known = ", ".join(p.name for p in paper_folders(root)) or "none"
    raise DPFLError(f"no paper {name!r}: not a folder under {root} (papers: {known}) nor a folder holding "
                    f"{PAPER_FILE}; `dpfl reproduce --list` shows them", field="paper")


def plan(folder: Path, spec: PaperSpec, quick: bool = False, sets: Sequence[str] = (), data: str | None = None,
         only: Sequence[str] = ()) -> list[SweepRun]:
    """The runs to run, in the paper's order: each run's own ``set``, then (``quick``) the quick
    ``set``, then ``data.path=DATA``, then ``sets`` (later overrides win)."""
    names = [r.name for r in spec.runs]
    chosen = list(spec.quick.runs) if quick and spec.quick.runs is not None else names
    for name in only:
        if name not in names:
            raise DPFLError(f"{name!r} is not a run of {spec.paper} (runs: {', '.join(names)})", field="--only")
        if name not in chosen:
            raise DPFLError(f"{name!r} is not one of {spec.paper}'s quick runs ({', '.join(chosen)})", field="--only")
    extra = [f"data.path={Path(data).expanduser().resolve()}"] if data is not None else []
    runs = []
    for name in (n for n in chosen if not only or n in only):
        r = spec.run(name)
        overrides = [*r.set, *(spec.quick.set if quick else ()), *extra, *sets]
        runs.append(SweepRun(r.name, (), None, tuple(overrides), (Path(folder) / r.scenario).resolve()))
    return runs


def data_of(runs: Sequence[SweepRun]) -> str | None:
    """The data the runs read, as their resolved scenarios name it ('idx at /data/fmnist')."""
    from ..scenario import load_scenario

    seen: list[str] = []
    for run in runs:
        d = load_scenario(run.scenario, list(run.overrides)).data
        text = d.source + (f" at {d.path}" if d.path else "")
        seen += [text] if text not in seen else []
    return ", ".join(seen) or None


def plan_names(spec: PaperSpec, quick: bool) -> list[str]:
    """Every run a reproduction of ``spec`` (full or quick) may show, in the paper's order."""
    return list(spec.quick.runs) if quick and spec.quick.runs is not None else [r.name for r in spec.runs]


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def prepare(out: Path, spec: PaperSpec, quick: bool, runs: Sequence[SweepRun], write: bool = True) -> None:
    """Create or reopen a reproduction directory; ``reproduction.json`` records each run's scenario
    (file and hash) and overrides. Reopening needs the same paper and mode; a finished run made from
    another scenario or other overrides is refused by name (it would never be run again).
    ``write=False``: only what reopening would refuse (a dry run)."""
    path = Path(out) / MANIFEST
    manifest = {"paper": spec.paper, "quick": quick, "runs": {}}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            manifest["runs"] = dict(old["runs"])
        except (ValueError, KeyError, TypeError):
            raise DPFLError(f"{path} is not a reproduction manifest; choose another --out", field="--out") from None
        if (old.get("paper"), old.get("quick")) != (spec.paper, quick):
            mode = "quick" if old.get("quick") else "full"
            raise DPFLError(f"{out} holds the {mode} reproduction of {old.get('paper')}; choose another --out",
                            field="--out")
    for run in runs:
        entry = {"scenario": str(run.scenario), "scenario_sha256": _sha(run.scenario), "overrides": list(run.overrides)}
        before = manifest["runs"].get(run.name)
        same = before is not None and all(before.get(k) == entry[k] for k in ("scenario_sha256", "overrides"))
        if before is not None and not same and is_finished(Path(out) / run.name):
            raise DPFLError(f"run {run.name} in {out} was made from another scenario file or other overrides "
                            f"({' '.join(before.get('overrides', [])) or 'none'}); choose another --out, or delete "
                            f"{Path(out) / run.name} to run it again", field="--out")
        manifest["runs"][run.name] = entry
    if not write:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    tmp = Path(out) / f"{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)


def adopt(out: Path, runs: Sequence[SweepRun]) -> list[str]:
    """Check the run directories already in ``out`` before a reproduction takes them as its own
    (``dpfl reproduce --adopt``: runs made by hand with ``dpfl run`` or ``dpfl sweep``): every entry
    but the reproduction's own files must be the directory of one of ``runs``, and its
    ``scenario.yaml`` what that run's scenario file and overrides resolve to, or the first field that
    differs is named. Returns the adopted runs' names; nothing is written."""
    from ..scenario import first_difference, load_scenario

    by_name = {run.name: run for run in runs}
    adopted = []
    for entry in sorted(Path(out).iterdir()) if Path(out).is_dir() else []:
        if entry.name.startswith(MANIFEST) or entry.name in OWN_FILES:
            continue
        run = by_name.get(entry.name)
        if run is None or not entry.is_dir():
            raise DPFLError(f"{entry} is not the directory of a run of this reproduction "
                            f"({', '.join(by_name)}); move it away or choose another --out", field="--adopt")
        try:
            have = load_scenario(entry / "scenario.yaml").model_dump(mode="json")
        except DPFLError as err:
            raise DPFLError(f"{entry} cannot be adopted: {err}", field="--adopt") from None
        want = load_scenario(run.scenario, list(run.overrides)).model_dump(mode="json")
        found = first_difference(have, want)
        if found is not None:
            field, here, there = found
            raise DPFLError(f"{entry} was not made by run {run.name}: its {field} is {here!r}, the run's is "
                            f"{there!r}; move it away or choose another --out", field="--adopt")
        adopted.append(run.name)
    return adopted


# --- rows -------------------------------------------------------------------------------------------

@dataclass
class Reproduction:
    """What a reproduction directory says: one row per run, the claims' verdicts, the columns."""

    rows: list[dict]
    claims: list[ClaimResult]
    metrics: list[str]
    epsilons: list[tuple[str, str]]
    quick: bool = False

    def columns(self) -> list[str]:
        cols = ["run", "scenario"]
        for m in self.metrics:
            cols += [m, f"paper_{m}", f"diff_{m}"]
        return cols + [c for c, _ in self.epsilons] + list(TAIL)


def collect(out: Path, spec: PaperSpec, quick: bool, statuses: dict[str, str] | None = None) -> Reproduction:
    """One row per run that ran now (``statuses``) or earlier into ``out``, in the paper's order, and
    the claims checked on the finished ones."""
    statuses = statuses or {}
    metrics = spec.metrics() or ["final_accuracy"]
    epsilons = [(c, m) for c, m in EPSILONS if m not in metrics]
    rows, results = [], {}
    for name in plan_names(spec, quick):
        run_dir, status = Path(out) / name, statuses.get(name)
        if status is None and not (run_dir / "summary.json").is_file():
            continue  # neither run now nor before: not part of this reproduction
        r = spec.run(name)
        row = {"run": name, "scenario": r.scenario, "rounds": None, "stop_reason": None, "wall_seconds": None}
        values = None
        run = None
        if (run_dir / "summary.json").is_file():
            try:
                run = load_run(run_dir)
            except DPFLError as err:  # a damaged run directory is a row that says so, not a crash
                status = f"unreadable: {err}"
        if run is not None:
            values = run_metrics(run.summary, run.rounds)
            row.update(rounds=values.get("rounds_completed", len(run.rounds)), stop_reason=values.get("stop_reason"),
                       wall_seconds=values.get("wall_seconds"))
            finished = is_finished(run_dir)
            if status in (None, "skipped"):
                status = "ok" if finished else "unfinished"
            if not finished:
                values = None
        for m in metrics:
            here, paper = _number(values, m), r.paper.get(m)
            row.update({m: here, f"paper_{m}": paper,
                        f"diff_{m}": None if here is None or paper is None else round(here - paper, 12)})
        for column, m in epsilons + [WITHIN_BUDGET]:
            row[column] = _number(values, m)
        row["status"] = status or "not run"
        rows.append(row)
        results[name] = values
    if WITHIN_BUDGET[1] not in metrics and any(row[WITHIN_BUDGET[0]] is not None for row in rows):
        epsilons = epsilons + [WITHIN_BUDGET]
    return Reproduction(rows, evaluate_claims(spec, results), metrics, epsilons, quick)


def _number(values: dict | None, name: str) -> float | None:
    if values is None:
        return None
    try:
        return metric(values, name, "")
    except MetricMissing:
        return None


def write_csv(rep: Reproduction, path: Path) -> Path:
    """``reproduction.csv``: full-precision numbers, empty cells where a run does not say."""
    cols = rep.columns()
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        for row in rep.rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in cols})
    return path


# --- text ---------------------------------------------------------------------------------------------

def fmt(value, column: str = "") -> str:
    """A cell as text: accuracies and losses to 4 decimals, epsilons to 3, seconds to 1, '-' for none."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if column == "wall_seconds":
        return f"{value:,.1f}"
    signed = "+" if column.startswith("diff_") else ""
    if abs(value) >= 1000:
        return f"{value:{signed},.0f}"
    digits = 3 if "epsilon" in column else 4
    return f"{value:{signed}.{digits}f}"


def headers(rep: Reproduction) -> list[str]:
    """Readable column titles, in :meth:`Reproduction.columns` order."""
    names = {"run": "run", "scenario": "scenario", "epsilon_accounted": "ε accounted", "epsilon_claimed": "ε claimed",
             "epsilon_empirical": "ε empirical", WITHIN_BUDGET[0]: "accuracy within ε budget", "rounds": "rounds", "stop_reason": "stop", "wall_seconds": "wall s",
             "status": "status"}
    out = []
    for c in rep.columns():
        if c in names:
            out.append(names[c])
        elif c.startswith("paper_"):
            out.append("paper")
        elif c.startswith("diff_"):
            out.append("diff")
        else:
            out.append(c)
    return out


def cells(rep: Reproduction, row: dict) -> list[str]:
    return [fmt(row.get(c), c) for c in rep.columns()]


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(spec: PaperSpec, rep: Reproduction, *, quick: bool, command: str, elapsed_s: float,
                    data_here: str | None = None) -> str:
    """``reproduction.md``: self-contained, to paste into docs/reproductions.md."""
    lines = [f"## {spec.title} (`{spec.paper}`)", ""]
    mode = ("**quick** (`--quick`: a CI-sized version of the runs; its numbers say the pipeline works, "
            "not what the paper measured)" if quick else "full, at the paper's data scale")
    lines += [f"Runs: {mode}. The paper's numbers were measured on `{spec.data}`"
              + (f"; these runs read `{data_here}`." if data_here and data_here != spec.data else "."), ""]
    if spec.notes:
        lines += [" ".join(spec.notes.split()), ""]
    heads = headers(rep)
    align = ["---" if c in TEXT_COLUMNS else "--:" for c in rep.columns()]
    lines += ["| " + " | ".join(heads) + " |", "|" + "|".join(align) + "|"]
    for row in rep.rows:
        lines.append("| " + " | ".join(_md_cell(c) for c in cells(rep, row)) + " |")
    metrics = ", ".join(f"`{m}`" for m in rep.metrics)
    lines += ["", f"`paper`: the value the paper reports for {metrics}; `diff`: here minus paper. ε accounted: the "
              "run's ledger (`epsilon`); ε claimed: the paper's own accounting (`epsilon_claimed`); ε empirical: "
              "a canary audit's lower estimate, where the run had one."
              + (" Accuracy within ε budget: the test accuracy at the run's last evaluation whose accounted ε is "
                 "within its per-client budget, what the same run stopped on the accounted ε reaches (its rows "
                 "are the same up to there)." if WITHIN_BUDGET[0] in rep.columns() else ""), ""]
    sources = [(r.name, r.source) for r in spec.runs if r.source and any(row["run"] == r.name for row in rep.rows)]
    if sources:
        lines += ["Where the paper states its values:", ""]
        lines += [f"- `{name}`: {' '.join(src.split())}" for name, src in sources] + [""]
    if rep.claims:
        lines += ["### Claims", "", "| claim | result | compared |", "|---|---|---|"]
        for c in rep.claims:
            text = _md_cell(" ".join(c.text.split()))
            lines.append(f"| `{c.id}`: {text} | **{c.status}** | {_md_cell(c.compared)} |")
        lines += ["", "PASS / FAIL: the check held or not on the numbers shown; SKIP: a run it needs did not "
                  "finish or was not run in this reproduction.", ""]
    total = sum(r["wall_seconds"] or 0 for r in rep.rows)
    lines += ["### Command", "", "```", command, "```", "",
              f"Wall time: {fmt(total, 'wall_seconds')} s over the {len(rep.rows)} runs (their `wall_seconds`); "
              f"this invocation took {fmt(elapsed_s, 'wall_seconds')} s.", ""]
    return "\n".join(lines)


# --- plot ---------------------------------------------------------------------------------------------

def plot(spec: PaperSpec, rep: Reproduction, path: Path) -> Path | None:
    """``reproduction.png``: per paper metric, here beside the paper for every run; then the
    accounted and claimed epsilon of every run that has one. None if no run has a number to draw."""
    from .record import plotting_library

    panels = []
    for m in rep.metrics:
        here = [row.get(m) for row in rep.rows]
        paper = [row.get(f"paper_{m}") for row in rep.rows]
        if any(v is not None for v in here + paper):
            panels.append((m, (("here", here), ("paper", paper))))
    eps = [(label, [row.get(c) for row in rep.rows]) for label, c in
           (("accounted", "epsilon_accounted"), ("claimed", "epsilon_claimed"), ("empirical", "epsilon_empirical"))
           if c in rep.columns()]
    eps = [(label, vals) for label, vals in eps if any(v is not None and math.isfinite(v) for v in vals)]
    if eps:
        panels.append(("epsilon", tuple(eps)))
    if not panels:
        return None
    plt = plotting_library()
    names = [row["run"] for row in rep.rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5.0, 0.9 * len(names) + 2) * len(panels), 4.6),
                             squeeze=False)
    for ax, (title, series) in zip(axes[0], panels):
        width = 0.8 / len(series)
        for i, (label, vals) in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j, v in enumerate(vals) if _drawable(v)]
            ys = [v for v in vals if _drawable(v)]
            bars = ax.bar(xs, ys, width, label=label, color=f"C{i}")
            ax.bar_label(bars, labels=[fmt(v, title) for v in ys], fontsize="x-small", rotation=90, padding=2)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize="small")
        ax.set_title(title)
        ax.margins(y=0.2)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{spec.title}{' (quick)' if rep.quick else ''}: here vs paper")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _drawable(value) -> bool:
    return value is not None and math.isfinite(value)


def write_outputs(out: Path, spec: PaperSpec, quick: bool, statuses: dict[str, str] | None, *, command: str,
                  elapsed_s: float, data_here: str | None = None) -> tuple[Reproduction, list[Path]]:
    """Collect the rows and write ``reproduction.csv``, ``.md`` and ``.png``; returns them and the files written."""
    rep = collect(out, spec, quick, statuses)
    written = [write_csv(rep, Path(out) / "reproduction.csv")]
    md = Path(out) / "reproduction.md"
    md.write_text(render_markdown(spec, rep, quick=quick, command=command, elapsed_s=elapsed_s, data_here=data_here))
    written.append(md)
    png = plot(spec, rep, Path(out) / "reproduction.png")
    return rep, written + ([png] if png else [])
