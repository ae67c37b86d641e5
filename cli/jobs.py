"""``dpfl jobs list | status | logs | stop | fetch``: the Ray Jobs of a cluster (docs/cluster.md).

``entrypoint`` (hidden) is what a job submitted by ``dpfl submit`` runs on the cluster.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .common import ADDRESS_HELP, console, fail, folder_option, follow_job, interrupt, user_errors, write_job_log

app = typer.Typer(help="Ray Jobs on a cluster: list, status, logs, stop, fetch.", no_args_is_help=True)

Address = typer.Option(None, "--address", help=ADDRESS_HELP)


def _jobs(address: Optional[str]):
    from dpfl_ray.runtime.jobs import Jobs, dashboard_address

    return Jobs(dashboard_address(address))


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


@app.command("list")
@user_errors
def list_(address: Optional[str] = Address) -> None:
    """Every job the cluster knows, oldest first."""
    views = _jobs(address).list()
    table = Table(box=None)
    for column in ("job id", "status", "scenario", "started", "took"):
        table.add_column(column, no_wrap=True)
    table.add_column("message", overflow="ellipsis", no_wrap=True)
    for v in views:
        took = f"{(v.end_time or time.time()) - v.start_time:.0f}s" if v.start_time else "-"
        table.add_row(v.job_id, v.status, v.metadata.get("dpfl_scenario", "-"), _when(v.start_time), took,
                      v.message[:60])
    console.print(table if views else "no jobs")


@app.command("status")
@user_errors
def status(job_id: str = typer.Argument(...), address: Optional[str] = Address) -> None:
    """One job's status, times and Ray's message."""
    v = _jobs(address).info(job_id)
    console.print(f"{v.job_id} {v.status}: {v.message}", highlight=False, soft_wrap=True)
    console.print(f"started {_when(v.start_time)}, ended {_when(v.end_time)}; entrypoint: {v.entrypoint}",
                  highlight=False, soft_wrap=True)


@app.command("logs")
@user_errors
def logs(job_id: str = typer.Argument(...), follow: bool = typer.Option(False, "--follow", help="until the job ends"),
         address: Optional[str] = Address) -> None:
    """A job's log (a packed run directory shows as one line)."""
    jobs = _jobs(address)
    if follow:
        raise typer.Exit(follow_job(jobs, job_id))
    write_job_log(jobs.logs(job_id))


@app.command("stop")
@user_errors
def stop(job_id: str = typer.Argument(...), address: Optional[str] = Address) -> None:
    """Ask a job to stop (SIGTERM to its entrypoint; it writes its files and packs them, as on Ctrl-C)."""
    jobs = _jobs(address)
    if jobs.stop(job_id):
        console.print(f"stop requested for {job_id}", highlight=False)
    else:
        console.print(f"{job_id} was not running ({jobs.status(job_id)})", highlight=False)


@app.command("fetch")
@user_errors
def fetch(job_id: str = typer.Argument(...),
          to: Optional[Path] = typer.Option(None, "--to", help="where to put it (default: runs/SCENARIO/JOB_ID)"),
          address: Optional[str] = Address) -> None:
    """Bring a finished job's run directory back (summary, rounds, ledger, model, plots), or a sweep
    job's sweep directory (sweep.csv, plots, every run's directory)."""
    from dpfl_ray.runs.bundle import find_bundle, unpack
    from dpfl_ray.runtime.jobs import TERMINAL

    jobs = _jobs(address)
    view = jobs.info(job_id)
    if view.status not in TERMINAL:
        fail(f"job {job_id} is {view.status}; its run directory is packed into its log when it ends "
             f"(wait with `dpfl jobs logs {job_id} --follow`)")
    bundle = find_bundle(jobs.logs(job_id))
    dest = to or Path("runs") / bundle.name / job_id
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        fail(f"{dest} already holds files; choose another --to")
    files = unpack(bundle, dest)
    line = f"{len(files)} files of job {job_id} ({view.status}) in {dest}"
    summary = dest / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        line += f": {s.get('stop_reason')}, {s.get('rounds_completed')} rounds"
    elif (dest / "sweep.csv").is_file():  # a sweep job
        import csv

        with open(dest / "sweep.csv", newline="") as fh:
            statuses = [row.get("status") for row in csv.DictReader(fh)]
        line += f": a sweep of {len(statuses)} runs, {statuses.count('ok')} ok"
    console.print(line, highlight=False, soft_wrap=True)


@app.command("entrypoint", hidden=True)
def entrypoint(out: Path = typer.Option(..., "--out", parser=folder_option)) -> None:
    """Inside a Ray Job: `dpfl run` the scenario `dpfl submit` shipped (or, for a sweep job, `dpfl
    sweep` it with the shipped options), then pack the run (or sweep) directory into the log
    (dpfl_ray/runs/bundle.py) -- also after a failure or a stop, whatever was written."""
    from dpfl_ray.runs.bundle import bundle_lines
    from dpfl_ray.runtime.jobs import SCENARIO_ENV, SWEEP_ENV

    try:  # recent Typer vendors its own copy of click
        from typer._click.exceptions import Abort
    except ImportError:  # pragma: no cover - older Typer on real click
        from click.exceptions import Abort

    from .run import run as run_command
    from .sweep import sweep as sweep_command

    # `dpfl run` / `dpfl sweep` exactly as the command line parses them, without importing cli.main
    # (which assembles this module): an app with a callback keeps them subcommands.
    dpfl = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)
    dpfl.callback()(lambda: None)
    dpfl.command("run")(run_command)
    dpfl.command("sweep")(sweep_command)
    sweep_args = json.loads(os.environ[SWEEP_ENV]) if os.environ.get(SWEEP_ENV) else None

    text = os.environ.get(SCENARIO_ENV)
    if not text:
        fail(f"{SCENARIO_ENV} is not set: this command runs inside jobs submitted by `dpfl submit`")
    path = Path(".dpfl_job") / f"{out.name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        # `ray job stop` sends SIGTERM: stop the run between rounds, like Ctrl-C, and still pack it
        signal.signal(signal.SIGTERM, interrupt)
    code = 0
    command = ["run", str(path), "--out", str(out)]
    if sweep_args is not None:
        command = ["sweep", str(path), "--out", str(out), *sweep_args]
    try:  # exactly `dpfl run` (or `dpfl sweep`), parsed as the command line would be
        rv = dpfl(command, standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except (KeyboardInterrupt, Abort):
        code = 130
    except Exception:  # a bug: keep its traceback in the job's log, still ship what was written
        traceback.print_exc()
        code = 1
    finally:
        if out.is_dir() and any(out.iterdir()):
            name = _scenario_name(path) + ("-sweep" if sweep_args is not None else "")
            sys.stdout.flush()
            print("\n".join(bundle_lines(out, name)), flush=True)
    raise typer.Exit(code)


def _scenario_name(path: Path) -> str:
    from dpfl_ray.scenario import load_yaml

    try:
        return str(load_yaml(path.read_text()).get("name") or "run")
    except Exception:
        return "run"
