"""``dpfl report``: compare run directories in one table and Figure-2-style plots.

Accuracy per round beside epsilon per round (effective solid, claimed dashed), and accuracy against
epsilon, so the price of privacy across runs can be read at a glance.
"""
from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from .common import console, user_errors

HEADERS = ["run", "scenario", "rounds", "stop", "final acc", "best acc", "epsilon", "eps claimed", "calibration",
           "delta", "survivors/round", "wall s"]


@user_errors
def report(
    run_dirs: list[Path] = typer.Argument(..., help="run directories written by `dpfl run`"),
    out: Path = typer.Option(Path("report"), "--out", help="folder for the plots and report.csv"),
) -> None:
    """Compare runs: a table of accuracy and privacy, plus accuracy/epsilon plots and a CSV."""
    from dpfl_ray.report import cells, load_run, write_report

    runs = [load_run(path) for path in run_dirs]  # every input is checked before anything is written
    rows, written = write_report(runs, out)
    table = Table(title="dpfl report", header_style="bold")
    for i, header in enumerate(HEADERS):
        text = i < 4 or header == "calibration"
        table.add_column(header, justify="left" if text else "right", no_wrap=i != 0)
    for row in rows:
        table.add_row(*cells(row))
    console.print(table)
    for path in written:
        console.print(f"wrote {path}", highlight=False, soft_wrap=True)
