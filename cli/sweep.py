"""``dpfl sweep``: run a scenario over a grid of overrides (x seeds) and compare the runs."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from .common import console, user_errors


def _shard(text: str | None) -> tuple[int, int]:
    from dpfl_ray.errors import DPFLError

    if text is None:
        return 0, 1
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit()) or not 0 <= int(i) < int(n):
        raise DPFLError(f"expected I/N with 0 <= I < N, like 0/4 (got {text!r})", field="--shard")
    return int(i), int(n)


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


@user_errors
def sweep(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    grid: list[str] = typer.Option([], "--grid", help="an axis: --grid faults.dropout.rate=0,0.1,0.3 (repeatable)"),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="seeds to repeat every combination with: 0,1,2"),
    set_: list[str] = typer.Option([], "--set", help="override a field in every run (repeatable)"),
    out: Optional[Path] = typer.Option(None, "--out", help="sweep directory (default: OUTPUT.DIR/NAME-sweep/TIMESTAMP); "
                                                            "an existing one is resumed"),
    timeout: float = typer.Option(3600.0, "--timeout", min=1, help="seconds one run may take"),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address every run connects to"),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: run only every N-th combination from the I-th "
                                                               "(split a sweep over several jobs)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate and list the combinations, run nothing"),
) -> None:
    """Run every combination of the grid (x seeds) with `dpfl run`, one after the other; write
    sweep.csv and plots of final accuracy and epsilon against each axis. Finished runs are skipped."""
    from dpfl_ray.runs import sweep as sw
    from dpfl_ray.runs.record import default_run_dir
    from dpfl_ray.scenario import load_scenario

    base = load_scenario(scenario, set_)  # a bad scenario or --set is reported as itself
    axes = sw.parse_grid(grid)
    runs = sw.expand(axes, sw.parse_seeds(seeds), set_)
    index, count = _shard(shard)
    sw.validate(scenario, runs)  # every combination, before anything runs
    mine = runs[index::count]
    if dry_run:
        for run in mine:
            console.print(run.name, highlight=False, soft_wrap=True)
        console.print(f"ok: {len(runs)} combinations" + (f", {len(mine)} in shard {shard}" if count > 1 else ""))
        return
    sweep_dir = out or default_run_dir(base.output.dir, f"{base.name}-sweep")
    # A second sweep on this directory is refused; the runs inherit the lock (dpfl_ray/runs/sweep.py)
    with sw.SweepLock(sweep_dir, index, count) as lock:
        sw.prepare(sweep_dir, scenario, axes, sw.parse_seeds(seeds), set_)
        console.print(f"[bold]sweep[/] {escape(base.name)}: {len(mine)} runs -> {escape(str(sweep_dir))}",
                      highlight=False)

        def on_run(i: int, run, status: str) -> None:
            console.print(f"[{i + 1}/{len(mine)}] {run.name}: {status}", highlight=False, soft_wrap=True,
                          markup=False)

        runner = sw.subprocess_runner(scenario.resolve(), timeout, address, keep_fds=(lock.fd,))
        try:
            statuses = sw.run_all(sweep_dir, mine, runner, on_run)
        except KeyboardInterrupt:
            again = ["dpfl", *sys.argv[1:]] + ([] if out else ["--out", str(sweep_dir)])
            console.print(f"interrupted; resume with: {shlex.join(again)}", highlight=False, soft_wrap=True,
                          markup=False)
            raise typer.Exit(130)
        if count > 1:  # shards finish at different times; one unsharded call writes the whole table
            console.print(f"shard {shard} done; run without --shard to write sweep.csv and the plots", markup=False)
            return
        rows, written = sw.write_outputs(sweep_dir, axes, runs, statuses)
    _table(rows, list(axes))
    for path in written:
        console.print(f"wrote {path}", highlight=False, soft_wrap=True, markup=False)
    failed = [r for r in rows if r["run"] in statuses and r["status"] not in ("ok",)]
    if failed:
        console.print(f"{len(failed)} of {len(mine)} runs did not finish; run the same command to retry them")
        raise typer.Exit(1)


def _table(rows: list[dict], axes: list[str]) -> None:
    table = Table(title="dpfl sweep", header_style="bold")
    for header in [*axes, "seed", "final acc", "epsilon", "eps claimed", "rounds", "stop", "status"]:
        table.add_column(header)
    for r in rows:
        table.add_row(*[escape(str(r.get(a))) for a in axes], _num(r["seed"], "d"), _num(r["final_accuracy"], ".4f"),
                      _num(r["epsilon"], ".3f"), _num(r["epsilon_claimed"], ".3f"), _num(r["rounds"], "d"),
                      escape(str(r["stop_reason"] or "-")), escape(str(r["status"])))
    console.print(table)
