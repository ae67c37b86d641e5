"""``dpfl reproduce``: run a paper's runs (scenarios/papers/<paper>/) and set them beside its numbers."""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from .common import console, folder_option, user_errors
from .sweep import resumable, resuming, run_on_tune


def _say(text: str) -> None:
    console.print(text, highlight=False, soft_wrap=True, markup=False)


def _list_papers() -> None:
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.runs import papers as pp
    from dpfl_ray.runs import reproduce as rp

    folders = rp.paper_folders()
    if not folders:
        _say(f"no papers under {rp.PAPERS_DIR}")
        return
    broken = 0
    for folder in folders:
        try:
            spec = pp.load_paper(folder)
        except DPFLError as err:
            broken += 1
            _say(f"{folder.name}: invalid: {err}")
            continue
        quick = spec.quick.runs if spec.quick.runs is not None else [r.name for r in spec.runs]
        _say(f"{spec.paper}  {spec.title}  (data: {spec.data}; {len(spec.runs)} runs, {len(spec.claims)} claims)")
        width = max(len(r.name) for r in spec.runs)
        for r in spec.runs:
            _say(f"  {r.name:<{width}}  {r.scenario}{'' if r.name in quick else '  (not in --quick)'}")
    if broken:
        raise typer.Exit(2)


def _dry_run(folder: Path, spec, sets: list[str], data: Optional[Path], only: list[str], quick_only: bool,
             out: Optional[Path], adopt: bool = False) -> None:
    """Every run's scenario checked, full and quick (``--quick``: the quick ones alone, each --only
    among them, as the run itself would ask), --data a folder, and what the real command would refuse
    in an --out that exists: a live reproduction there, files that are not one, another paper or mode,
    a finished run of other overrides."""
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.runs import reproduce as rp
    from dpfl_ray.runs import sweep as sw

    if out is not None and out.exists() and not out.is_dir():
        raise DPFLError(f"{out} is not a folder", field="--out")
    if data is not None and not data.is_dir():
        raise DPFLError(f"{data} is not a folder", field="--data")
    if out is not None and out.is_dir():
        lock = sw.SweepLock(out, manifest=rp.MANIFEST, command="reproduce", what="reproduction",
                            foreign="" if adopt else ", or add --adopt if it holds this paper's run directories")
        lock.check_free()
    for quick in (True,) if quick_only else (False, True):  # the full runs first: a name of no run is one line there
        chosen = [n for n in only if n in rp.plan_names(spec, quick)] if quick and not quick_only else only
        if only and not chosen:  # none of them is a quick run
            continue
        runs = rp.plan(folder, spec, quick, sets, str(data) if data else None, chosen)
        sw.validate(None, runs, build_data=False)  # the data may live elsewhere: its files are not read here
        if out is not None and out.is_dir() and quick == quick_only:  # the mode the real command would run
            rp.prepare(out, spec, quick, runs, write=False)
        for run in runs:
            _say(f"{'quick' if quick else 'full '} {run.name}: {run.scenario.name} {' '.join(run.overrides)}".rstrip())
    _say(f"ok: {spec.paper}: every {'quick ' if quick_only else ''}run's scenario is valid"
         f"{'' if quick_only else ', full and quick'} (data not read)")


@user_errors
def reproduce(
    paper: Optional[str] = typer.Argument(None, help="a paper under scenarios/papers (see --list), or a folder "
                                                     "holding a paper.yaml"),
    list_: bool = typer.Option(False, "--list", help="list the papers and their runs"),
    quick: bool = typer.Option(False, "--quick", help="the CI-sized version of the runs (the paper's quick: section)"),
    out: Optional[Path] = typer.Option(None, "--out", parser=folder_option, help="directory (default runs/reproduce/PAPER[-quick]); an "
                                                           "existing one is resumed"),
    data: Optional[Path] = typer.Option(None, "--data", help="set data.path=DATA on every run (a folder of IDX files)"),
    set_: list[str] = typer.Option([], "--set", help="override a field in every run (repeatable)"),
    only: list[str] = typer.Option([], "--only", help="run only this run (repeatable)"),
    timeout: float = typer.Option(12 * 3600.0, "--timeout", min=1, help="seconds one run may take"),
    address: Optional[str] = typer.Option(None, "--address", help="the Ray cluster every run joins (default: "
                                          "RAY_ADDRESS, else a private local Ray)"),
    max_concurrent: Optional[int] = typer.Option(None, "--max-concurrent", min=1,
                                                 help="runs at once (default: as many as the cluster's resources fit)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate every run's scenario, full and quick (with "
                                 "--quick, the quick ones); run nothing"),
    adopt: bool = typer.Option(False, "--adopt", help="take the run directories already in --out (made by `dpfl "
                               "run` or `dpfl sweep`) as this reproduction's, each checked against its run's "
                               "scenario and overrides; finished ones are not run again"),
) -> None:
    """Run a paper's runs as Ray Tune trials (as `dpfl sweep` does), and write reproduction.csv, .md and
    .png: each run here beside the paper's value, its claimed, accounted and empirical epsilon, and
    the paper's claims checked. Finished runs are never run again."""
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.runs import papers as pp
    from dpfl_ray.runs import reproduce as rp
    from dpfl_ray.runs import sweep as sw
    from dpfl_ray.runtime.shutdown import Shutdown

    # Until the reproduction's directory is touched a signal ends the command at once (checking every
    # run's scenario and partition takes seconds); from there on it is only recorded, and the runs
    # are told to stop (runtime/trials.py).
    if list_:
        return _list_papers()
    if paper is None:
        raise DPFLError("name a paper (`dpfl reproduce --list` shows them)", field="paper")
    folder = rp.find_paper(paper)
    spec = pp.load_paper(folder)
    if dry_run:
        return _dry_run(folder, spec, set_, data, only, quick, out, adopt)
    t0 = time.monotonic()
    runs = rp.plan(folder, spec, quick, set_, str(data) if data else None, only)
    sw.validate(None, runs)  # every run's scenario and partition, before anything runs
    data_here = rp.data_of(runs)
    out_dir = out or Path("runs") / "reproduce" / (spec.paper + ("-quick" if quick else ""))
    command = shlex.join(["dpfl", *sys.argv[1:]])
    shutdown = Shutdown().install()
    if adopt:  # refused before the lock file is made in a folder the reproduction does not take (it writes nothing)
        rp.adopt(out_dir, runs)
    with sw.SweepLock(out_dir, manifest=rp.MANIFEST, command="reproduce", what="reproduction",
                      foreign="" if adopt else ", or add --adopt if it holds this paper's run directories"):
        adopted = rp.adopt(out_dir, runs) if adopt else []
        rp.prepare(out_dir, spec, quick, runs)
        if adopted:
            _say(f"adopted {len(adopted)} run director{'y' if len(adopted) == 1 else 'ies'}: {', '.join(adopted)}")
        todo, statuses = sw.set_aside(out_dir, runs, resumable)
        plural = "" if len(runs) == 1 else "s"
        _say(f"reproduce {spec.paper}{' (quick)' if quick else ''}: {len(runs)} run{plural}, "
             f"{len(runs) - len(todo)} finished before{resuming(out_dir, todo)} -> {out_dir}")
        if todo:
            statuses.update(run_on_tune(out_dir, todo, None, timeout, address, max_concurrent, shutdown))
        rep, written = rp.write_outputs(out_dir, spec, quick, statuses, command=command,
                                        elapsed_s=time.monotonic() - t0, data_here=data_here)
    _print(spec, rep)
    for path in written:
        _say(f"wrote {path}")
    if shutdown.requested:
        again = ["dpfl", *sys.argv[1:]] + ([] if out else ["--out", str(out_dir)])
        _say(f"interrupted; resume with: {shlex.join(again)}")
        raise typer.Exit(shutdown.exit_code)
    failed = [r for r in rep.rows if r["run"] in statuses and r["status"] not in ("ok", "skipped")]
    damaged = [r["run"] for r in failed if str(r["status"]).startswith("unreadable")]
    if damaged:  # finished by its summary, so a rerun would skip it: the user decides what to do with its files
        _say(f"{', '.join(damaged)}: the run directory under {out_dir} is damaged; move it away and run the same "
             "command to run it again")
    if len(failed) > len(damaged):
        _say(f"{len(failed) - len(damaged)} of {len(runs)} runs did not finish "
             f"({', '.join(r['run'] for r in failed if r['run'] not in damaged)}); run the same command to retry them")
    if failed:
        raise typer.Exit(1)


def _print(spec, rep) -> None:
    """The table if the console is wide enough, else one block per run; then the claims."""
    from rich.measure import Measurement

    from dpfl_ray.runs import reproduce as rp

    heads = rp.headers(rep)
    keep = [i for i, h in enumerate(heads) if h != "scenario"]  # in the csv and the md; here, width
    texts = [[rp.cells(rep, row)[i] for i in keep] for row in rep.rows]
    heads = [heads[i] for i in keep]
    title = f"{spec.title}: here vs paper{' (quick)' if rep.quick else ''}"
    table = Table(title=escape(title), header_style="bold")
    for i, header in enumerate(heads):
        table.add_column(escape(header), justify="left" if i == 0 or header in ("stop", "status") else "right",
                         no_wrap=True)
    for cells in texts:
        table.add_row(*(escape(c) for c in cells))
    if Measurement.get(console, console.options.update(max_width=10_000), table).maximum <= console.width:
        console.print(table)
    else:
        console.print(f"[bold]{escape(title)}[/]", highlight=False, soft_wrap=True)
        for cells in texts:
            card = Table(title=escape(cells[0]), title_justify="left", title_style="bold", show_header=False,
                         box=None, padding=(0, 1, 0, 2))
            card.add_column("field", style="dim", no_wrap=True)
            card.add_column("value", overflow="fold")
            for header, value, col in zip(heads[1:], cells[1:], [c for c in rep.columns() if c != "scenario"][1:]):
                label = f"{col.removeprefix('paper_').removeprefix('diff_')} {header}" if header in ("paper", "diff") \
                    else header
                card.add_row(escape(label), escape(value))
            console.print(card)
    style = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}
    for c in rep.claims:
        console.print(f"[bold {style[c.status]}]{c.status}[/] {escape(c.id)}: {escape(c.text)}", highlight=False,
                      soft_wrap=True)
        console.print(f"     {escape(c.compared)}", highlight=False, soft_wrap=True)
