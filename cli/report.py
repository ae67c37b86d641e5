"""``dpfl report``: compare run directories in one table and Figure-2-style plots.

Accuracy per round beside epsilon per round (effective solid, claimed dashed), and accuracy against
epsilon, so the price of privacy across runs can be read at a glance.
"""
from __future__ import annotations

from pathlib import Path

import typer
from rich.measure import Measurement
from rich.table import Table

from .common import console, folder_option, user_errors

HEADERS = ["run", "scenario", "rounds", "stop", "final acc", "best acc", "epsilon", "eps claimed", "eps assumed",
           "eps vs server", "eps empirical [95%]", "calibration", "delta", "survivors/round", "wall s"]


def _wide_table(rows: list[list[str]]) -> Table:
    table = Table(title="dpfl report", header_style="bold")
    for i, header in enumerate(HEADERS):
        text = i < 4 or header == "calibration"
        table.add_column(header, justify="left" if text else "right", no_wrap=i != 0)
    for cells in rows:
        table.add_row(*cells)
    return table


def _run_cards(rows: list[list[str]]) -> list[Table]:
    """One two-column block per run: readable at any width (a pipe, an 80-column terminal)."""
    cards = []
    for cells in rows:
        card = Table(title=cells[0], title_justify="left", title_style="bold", show_header=False,
                     box=None, padding=(0, 1, 0, 2))
        card.add_column("field", style="dim", no_wrap=True)
        card.add_column("value", overflow="fold")
        for header, value in zip(HEADERS[1:], cells[1:]):
            card.add_row(header, value)
        cards.append(card)
    return cards


# what marks a directory as a run's (dpfl run) or a sweep's (dpfl sweep), never a report's
RUN_FILES = ("summary.json", "rounds.jsonl", "scenario.yaml", "ledger.json", "sweep.csv")


@user_errors
def report(
    run_dirs: list[Path] = typer.Argument(..., help="run directories written by `dpfl run`, or sweep directories "
                                                "written by `dpfl sweep` (each of their runs)"),
    out: Path = typer.Option(Path("report"), "--out", parser=folder_option, help="folder for the plots and report.csv"),
) -> None:
    """Compare runs: a table of accuracy and privacy, plus accuracy/epsilon plots and a CSV."""
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.runs.load import load_runs
    from dpfl_ray.runs.report import cells, write_report
    from dpfl_ray.runs.sweep import selection_line

    runs, notes = load_runs(run_dirs)  # every input is checked before anything is written
    if any(run.path.resolve() == out.resolve() for run in runs):  # its own accuracy.png would be replaced
        raise DPFLError(f"{out} is one of the run directories reported: choose another folder", field="--out")
    # any other run's or sweep's directory too: the report's accuracy.png and plots would replace that run's
    held = [name for name in RUN_FILES if (out / name).exists()]
    if held:
        raise DPFLError(f"{out} holds a run's or a sweep's files ({', '.join(held)}): the report's plots would "
                        "replace theirs; choose another folder", field="--out")
    rows, written = write_report(runs, out)
    texts = [cells(row) for row in rows]
    table = _wide_table(texts)
    # Squeezed into a narrow console the wide table would shrink the run column to nothing.
    if Measurement.get(console, console.options.update(max_width=10_000), table).maximum <= console.width:
        console.print(table)
    else:
        console.print("[bold]dpfl report[/]")
        for i, card in enumerate(_run_cards(texts)):
            if i:
                console.print()
            console.print(card)
    for note in notes:
        console.print(f"skipped {note}", highlight=False, soft_wrap=True)
    for path in run_dirs:  # a sweep's runs: no row's own epsilon covers choosing among them
        line = selection_line(path) if path.is_dir() else None
        if line is not None:
            console.print(f"{path}: {line}", highlight=False, soft_wrap=True, markup=False)
    for path in written:
        console.print(f"wrote {path}", highlight=False, soft_wrap=True)
