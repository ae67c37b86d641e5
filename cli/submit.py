"""``dpfl submit``: run a scenario as a Ray Job on a cluster (docs/cluster.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import ADDRESS_HELP, err_console, follow_job, user_errors
from .sweep import refuse_given


@user_errors
def submit(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    set_: list[str] = typer.Option([], "--set", help="override a field: --set training.rounds=5 (repeatable)"),
    grid: list[str] = typer.Option([], "--grid", help="a sweep job: an axis, as `dpfl sweep --grid` (repeatable)"),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="a sweep job: seeds, as `dpfl sweep --seeds`"),
    search: str = typer.Option("grid", "--search", help="a sweep job: grid, random or optuna, as `dpfl sweep "
                               "--search`"),
    num_samples: Optional[int] = typer.Option(None, "--num-samples", help="a search job: points to draw"),
    search_seed: Optional[int] = typer.Option(None, "--search-seed", min=0, help="a search job: the seed it draws "
                                              "with"),
    metric: Optional[str] = typer.Option(None, "--metric", help="an optuna search job: as `dpfl sweep --metric`"),
    scheduler: str = typer.Option("none", "--scheduler", help="a sweep job: none or asha, as `dpfl sweep --scheduler`"),
    grace_rounds: Optional[int] = typer.Option(None, "--grace-rounds", min=1, help="a sweep job under asha: as "
                                               "`dpfl sweep --grace-rounds`"),
    reduction_factor: Optional[int] = typer.Option(None, "--reduction-factor", min=2, help="a sweep job under asha: "
                                                   "as `dpfl sweep --reduction-factor`"),
    max_concurrent: Optional[int] = typer.Option(None, "--max-concurrent", min=1,
                                                 help="a sweep job: runs at once (default: as many as fit)"),
    timeout: Optional[float] = typer.Option(None, "--timeout", min=1, help="a sweep job: seconds one run may take"),
    address: Optional[str] = typer.Option(None, "--address", help=ADDRESS_HELP),
    follow: bool = typer.Option(False, "--follow", help="stream the job's log; exit 0 if it SUCCEEDED, 1 otherwise"),
    name: Optional[str] = typer.Option(None, "--name", help="the job's id (default: SCENARIO-TIMESTAMP-xxxx)"),
    install: bool = typer.Option(False, "--install",
                                 help="pip-install dpfl's dependencies (torch pinned) on nodes that lack them"),
) -> None:
    """Submit SCENARIO as a Ray Job; prints its id. The job ships this project and the resolved
    scenario, runs `dpfl run` on the cluster, and packs the run directory into its log for
    `dpfl jobs fetch`. With --grid or --seeds the job is a whole sweep: `dpfl sweep` on the
    cluster, its trials on every node, and the sweep directory comes back."""
    from dpfl_ray.runtime.jobs import (Jobs, dashboard_address, entrypoint_command, job_runtime_env, project_root,
                                       submission_id)
    from dpfl_ray.scenario import load_scenario

    sc = load_scenario(scenario, set_)  # a bad scenario is one line here, not a failed job
    sweep_args = None
    if grid or seeds:
        sweep_args = _sweep_args(scenario, set_, grid, seeds, max_concurrent, timeout,
                                 (search, num_samples, search_seed, metric),
                                 (scheduler, grace_rounds, reduction_factor))
    else:
        given = {"--search": search != "grid", "--num-samples": num_samples is not None,
                 "--search-seed": search_seed is not None, "--metric": metric is not None,
                 "--scheduler": scheduler != "none",
                 "--grace-rounds": grace_rounds is not None, "--reduction-factor": reduction_factor is not None,
                 "--max-concurrent": max_concurrent is not None, "--timeout": timeout is not None}
        refuse_given(given, "is for a sweep job: give --grid or --seeds")
    url = dashboard_address(address)
    jobs = Jobs(url)
    job_id = submission_id(name, sc.name)
    out = f"runs/{sc.name}{'-sweep' if sweep_args is not None else ''}/{job_id}"
    jobs.submit(entrypoint_command(out), job_runtime_env(sc.to_yaml(), project_root(), install, sweep_args), job_id,
                {"dpfl_scenario": sc.name, "dpfl_run_dir": out})
    typer.echo(job_id)  # alone on stdout, so `JOB=$(dpfl submit ...)` works
    err_console.print(f"submitted to {url}: `dpfl jobs logs {job_id} --follow`, then `dpfl jobs fetch {job_id}` "
                      f"(with --address {url})", highlight=False, soft_wrap=True)
    if follow:
        raise typer.Exit(follow_job(jobs, job_id))


def _sweep_args(scenario: Path, set_: list[str], grid: list[str], seeds: str | None, max_concurrent: int | None,
                timeout: float | None, search: tuple[str, int | None, int | None, str | None] = ("grid", None, None, None),
                scheduler: tuple[str, int | None, int | None] = ("none", None, None)) -> list[str]:
    """The `dpfl sweep` options the job runs with, every combination checked here first (a bad grid
    is one line before anything is submitted). The shipped scenario already holds the --set
    overrides. ``search``: --search, --num-samples, --search-seed and --metric (an optuna search's first
    batch is checked; the job asks the rest); ``scheduler``: --scheduler, --grace-rounds and
    --reduction-factor."""
    from dpfl_ray.runs import sweep as sw

    from dpfl_ray.runtime.search import OptunaSearch

    from .sweep import asha_options, make_search

    kind, num_samples, search_seed, metric = (*search, None)[:4]
    drawn = make_search(grid, kind, num_samples, search_seed, metric, max_concurrent)
    early_stop = asha_options(*scheduler)
    if isinstance(drawn, OptunaSearch):
        drawn.ask([])
    sw.plan(scenario, grid, seeds, set_, drawn)
    args = [a for axis in grid for a in ("--grid", axis)]
    if drawn is not None:
        args += ["--search", kind, "--num-samples", str(drawn.samples), "--search-seed", str(drawn.seed)]
    if isinstance(drawn, OptunaSearch):
        args += ["--metric", drawn.metric]
    if early_stop is not None:
        args += ["--scheduler", "asha"]
        args += [a for key, value in early_stop.items() for a in (f"--{key.replace('_', '-')}", str(value))]
    if seeds:
        args += ["--seeds", seeds]
    if max_concurrent is not None:
        args += ["--max-concurrent", str(max_concurrent)]
    if timeout is not None:
        args += ["--timeout", str(timeout)]
    return args
