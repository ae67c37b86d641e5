"""``dpfl submit``: run a scenario as a Ray Job on a cluster (docs/cluster.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import ADDRESS_HELP, err_console, follow_job, user_errors



@user_errors
def submit(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    set_: list[str] = typer.Option([], "--set", help="override a field: --set training.rounds=5 (repeatable)"),
    address: Optional[str] = typer.Option(None, "--address", help=ADDRESS_HELP),
    follow: bool = typer.Option(False, "--follow", help="stream the job's log; exit 0 if it SUCCEEDED, 1 otherwise"),
    name: Optional[str] = typer.Option(None, "--name", help="the job's id (default: SCENARIO-TIMESTAMP-xxxx)"),
    install: bool = typer.Option(False, "--install",
                                 help="pip-install dpfl's dependencies (torch pinned) on nodes that lack them"),
) -> None:
    """Submit SCENARIO as a Ray Job; prints its id. The job ships this project and the resolved
    scenario, runs `dpfl run` on the cluster, and packs the run directory into its log for
    `dpfl jobs fetch`."""
    from dpfl_ray.runtime.jobs import (Jobs, dashboard_address, entrypoint_command, job_runtime_env, project_root,
                                       submission_id)
    from dpfl_ray.scenario import load_scenario


    sc = load_scenario(scenario, set_)  # a bad scenario is one line here, not a failed job
    url = dashboard_address(address)
    jobs = Jobs(url)
    job_id = submission_id(name, sc.name)
    out = f"runs/{sc.name}/{job_id}"
    jobs.submit(entrypoint_command(out), job_runtime_env(sc.to_yaml(), project_root(), install), job_id,
                {"dpfl_scenario": sc.name, "dpfl_run_dir": out})
    typer.echo(job_id)  # alone on stdout, so `JOB=$(dpfl submit ...)` works
    err_console.print(f"submitted to {url}: `dpfl jobs logs {job_id} --follow`, then `dpfl jobs fetch {job_id}` "
                      f"(with --address {url})", highlight=False, soft_wrap=True)
    if follow:
        raise typer.Exit(follow_job(jobs, job_id))
