"""``dpfl sweep``: run a scenario over a grid of overrides (x seeds) and compare the runs."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .common import console, folder_option, user_errors


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


@user_errors
def sweep(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    grid: list[str] = typer.Option([], "--grid", help="an axis: --grid faults.dropout.rate=0,0.1,0.3 (repeatable); "
                                   "with --search random or optuna also a distribution: loguniform(1e-3,1e-1), uniform(a,b), "
                                   "randint(a,b)"),
    search: str = typer.Option("grid", "--search", help="grid: every combination; random: --num-samples points "
                               "drawn from the axes; optuna: --num-samples points asked of Optuna's TPE, "
                               "--max-concurrent (default 2) at a time, each batch from the results before it"),
    num_samples: Optional[int] = typer.Option(None, "--num-samples", help="how many points a search draws"),
    search_seed: Optional[int] = typer.Option(None, "--search-seed", min=0, help="the seed a search draws its points "
                                              "with (default 0)"),
    metric: Optional[str] = typer.Option(None, "--metric", help="optuna: what it optimises, final_accuracy "
                                         "(the default, maximised) or final_loss (minimised)"),
    scheduler: str = typer.Option("none", "--scheduler", help="none, or asha: stop runs whose test accuracy trails "
                                  "at a milestone round (Ray Tune's ASHA); they end with stop_reason stopped_early"),
    grace_rounds: Optional[int] = typer.Option(None, "--grace-rounds", min=1, help="asha: rounds every run gets "
                                               "before it can be stopped (default 1)"),
    reduction_factor: Optional[int] = typer.Option(None, "--reduction-factor", min=2, help="asha: 1 in this many "
                                                   "runs goes on at each milestone (default 4)"),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="seeds to repeat every combination with: 0,1,2"),
    set_: list[str] = typer.Option([], "--set", help="override a field in every run (repeatable)"),
    out: Optional[Path] = typer.Option(None, "--out", parser=folder_option, help="sweep directory (default: OUTPUT.DIR/NAME-sweep/TIMESTAMP); "
                                                            "an existing one is resumed"),
    timeout: float = typer.Option(3600.0, "--timeout", min=1, help="seconds one run may take"),
    address: Optional[str] = typer.Option(None, "--address", help="the Ray cluster every run joins: HOST:PORT, "
                                          "ray://HOST:10001 or auto (default: RAY_ADDRESS, else a private local Ray)"),
    max_concurrent: Optional[int] = typer.Option(None, "--max-concurrent", min=1,
                                                 help="runs at once (default: as many as the cluster's resources fit; "
                                                      "an optuna search's batch, default 2)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate and list the combinations, run nothing"),
) -> None:
    """Run every combination of the grid (x seeds) as Ray Tune trials in one Ray session, side by
    side; write sweep.csv and plots of final accuracy and epsilon against each axis. Finished runs
    are skipped and unfinished ones go on from their checkpoints: the same command resumes."""
    from dpfl_ray.runtime.shutdown import Shutdown
    from dpfl_ray.runs import sweep as sw
    from dpfl_ray.runs.record import default_run_dir
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.runtime.search import OptunaSearch
    from dpfl_ray.scenario import load_scenario

    # Until the sweep directory is touched a signal ends the command at once (planning a large grid
    # takes seconds); from there on it is only recorded, and the trials are told to stop (runtime/trials.py).
    try:
        base = load_scenario(scenario, set_)  # a bad scenario or --set is reported as itself
    except DPFLError:
        if not grid:
            raise
        base = None  # --set alone may be invalid where every grid value completes it (noise + bits)
    drawn = make_search(grid, search, num_samples, search_seed, metric, max_concurrent)
    early_stop = asha_options(scheduler, grace_rounds, reduction_factor)
    if isinstance(drawn, OptunaSearch):  # the points an earlier run of this command asked, else the first batch
        drawn.adopt(sw.read_manifest(out).get("search") if out is not None else None)
        if not drawn.asked:
            drawn.ask([])
    axes, seed_list, runs = sw.plan(scenario, grid, seeds, set_, drawn)  # every combination, before anything runs
    base = base or load_scenario(scenario, list(runs[0].overrides))
    if dry_run:
        if out is not None:  # what the real sweep would refuse there: a live sweep, another scenario or grid
            sw.SweepLock(out).check_free()
            sw.prepare(out, scenario, axes, seed_list, set_, drawn, write=False)
        for run in runs:
            console.print(run.name, highlight=False, soft_wrap=True)
        later = (f"; optuna asks the other {drawn.samples - len(drawn.points())} points from these runs' results"
                 if isinstance(drawn, OptunaSearch) and len(drawn.points()) < drawn.samples else "")
        console.print(f"ok: {len(runs)} combinations{later}")
        return
    sweep_dir = out or default_run_dir(base.output.dir, f"{base.name}-sweep")
    shutdown = Shutdown().install()
    with sw.SweepLock(sweep_dir):  # a second sweep on this directory is refused
        sw.prepare(sweep_dir, scenario, axes, seed_list, set_, drawn)
        todo, statuses = sw.set_aside(sweep_dir, runs, resumable)
        asking = (f" (optuna: {len(drawn.points())} of {drawn.samples} points asked)"
                  if isinstance(drawn, OptunaSearch) else "")
        console.print(f"[bold]sweep[/] {escape(base.name)}: {len(runs)} runs{asking}, {len(runs) - len(todo)} finished "
                      f"before{resuming(sweep_dir, todo)} -> {escape(str(sweep_dir))}", highlight=False)
        plan = {"axes": axes, "runs": runs}
        more = None
        if isinstance(drawn, OptunaSearch):
            more = _next_batches(drawn, plan, sweep_dir, scenario, (grid, seeds, set_), seed_list, shutdown)
            if not todo:
                todo = more(statuses)
        if todo:
            try:
                statuses.update(run_on_tune(sweep_dir, todo, scenario, timeout, address, max_concurrent, shutdown,
                                            early_stop, more=more))
            except DPFLError as err:  # e.g. an optuna batch the cluster cannot hold: said after the files
                plan["error"] = err
        axes, runs = plan["axes"], plan["runs"]
        rows, written = sw.write_outputs(sweep_dir, axes, runs, statuses, drawn=drawn is not None)
    _table(rows, list(axes))
    if isinstance(drawn, OptunaSearch):
        _best_line(drawn, sweep_dir, runs)
    for path in written:
        console.print(f"wrote {path}", highlight=False, soft_wrap=True, markup=False)
    _selection_line(sweep_dir)
    if plan.get("error") is not None:
        raise plan["error"]
    if shutdown.requested:
        again = ["dpfl", *sys.argv[1:]] + ([] if out else ["--out", str(sweep_dir)])
        console.print(f"interrupted; resume with: {shlex.join(again)}", highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(shutdown.exit_code)
    failed = [r for r in rows if r["run"] in statuses and r["status"] not in ("ok",)]
    if failed:
        console.print(f"{len(failed)} of {len(runs)} runs did not finish; run the same command to retry them")
        raise typer.Exit(1)


def _next_batches(search, plan: dict, sweep_dir: Path, scenario: Path, options: tuple, seed_list, shutdown):
    """``more`` for :func:`run_on_tune`: an optuna search's next batch of runs, asked from the results
    of every run so far once all of them finished (none if one did not: the command then ends, and
    the same command retries it). ``plan`` ({"axes", "runs"}) is updated to the search's points;
    ``options``: --grid, --seeds and --set as typed."""
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.runs import sweep as sw

    grid, seeds, set_ = options

    def more(done: dict[str, str]) -> list:
        while len(search.points()) < search.samples and not shutdown.requested:
            if any(done.get(run.name, "ok") not in ("ok", "skipped") for run in plan["runs"]):
                return []
            try:
                search.ask(search.results(sweep_dir, sw.runs_by_point(plan["runs"])))
            except DPFLError as err:  # said after the finished runs' files are written
                plan["error"] = err
                return []
            plan["axes"], _, plan["runs"] = sw.plan(scenario, grid, seeds, set_, search)
            sw.prepare(sweep_dir, scenario, plan["axes"], seed_list, set_, search)
            batch, skipped = sw.set_aside(sweep_dir, plan["runs"], resumable)
            done.update(skipped)
            if batch:
                console.print(f"optuna: {len(search.points())} of {search.samples} points asked", highlight=False)
                return batch
        return []

    return more


def resumable(run_dir: Path) -> bool:
    """runtime/checkpoint.resumable, imported when a sweep sets its runs aside."""
    from dpfl_ray.runtime.checkpoint import resumable as can_resume

    return can_resume(run_dir)


def resuming(sweep_dir: Path, todo: list) -> str:
    """``, N go on from their checkpoints`` for the header line, or nothing."""
    from dpfl_ray.runs.sweep import resumed

    n = resumed(sweep_dir, todo)
    return f", {n} go{'es' if n == 1 else ''} on from {'its' if n == 1 else 'their'} checkpoint{'' if n == 1 else 's'}" \
        if n else ""


def refuse_given(given: dict[str, bool], why: str) -> None:
    """One error line naming the first option in ``given`` ({option: given?}) that was given where it
    would be ignored."""
    from dpfl_ray.errors import DPFLError

    for option, present in given.items():
        if present:
            raise DPFLError(why, field=option)


def asha_options(scheduler: str, grace_rounds: int | None, reduction_factor: int | None) -> dict | None:
    """None without ``--scheduler asha``, else the ASHA options given (runtime/trials.early_stopping
    holds the defaults of those left out); an option of ASHA's without ``--scheduler asha`` is
    refused rather than ignored."""
    from dpfl_ray.errors import DPFLError

    if scheduler not in ("none", "asha"):
        raise DPFLError(f"{scheduler!r} is not one of none, asha", field="--scheduler")
    if scheduler == "none":
        refuse_given({"--grace-rounds": grace_rounds is not None, "--reduction-factor": reduction_factor is not None},
                     "is an option of --scheduler asha")
        return None
    given = {"grace_rounds": grace_rounds, "reduction_factor": reduction_factor}
    return {key: value for key, value in given.items() if value is not None}


def make_search(grid: list[str], search: str, num_samples: int | None, search_seed: int | None,
                metric: str | None = None, max_concurrent: int | None = None):
    """The search ``--search``/``--num-samples``/``--search-seed``/``--metric`` ask for (its space is
    ``--grid``): a RandomSearch, an OptunaSearch (its batch ``--max-concurrent``, default 2), or None
    for a grid."""
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.runtime.search import SEARCHES, OptunaSearch, RandomSearch, parse_space

    if search not in SEARCHES:
        raise DPFLError(f"{search!r} is not one of {', '.join(SEARCHES)}", field="--search")
    if search != "optuna":
        refuse_given({"--metric": metric is not None}, "is for --search optuna")
    if search == "grid":
        refuse_given({"--num-samples": num_samples is not None, "--search-seed": search_seed is not None},
                     "is for --search random or optuna; a grid runs every combination")
        return None
    if num_samples is None:
        raise DPFLError(f"--search {search} needs --num-samples N", field="--num-samples")
    if not grid:
        raise DPFLError(f"--search {search} draws from the --grid axes: give at least one", field="--grid")
    if search == "random":
        return RandomSearch(parse_space(grid), num_samples, search_seed or 0)
    import importlib.util

    if importlib.util.find_spec("optuna") is None:
        raise DPFLError("needs Optuna: pip install optuna (or dpfl-ray[search])", field="--search") from None
    return OptunaSearch(parse_space(grid), num_samples, search_seed or 0, metric or "final_accuracy",
                        max_concurrent or OPTUNA_BATCH)


# Points Optuna asks at a time when --max-concurrent is not given: a batch is recorded before it runs,
# so the same command asks the same points on any cluster.
OPTUNA_BATCH = 2


def _best_line(search, sweep_dir: Path, runs: list) -> None:
    """The best point an optuna search found so far, by its metric (mean over seeds), in one line."""
    from dpfl_ray.runs.sweep import runs_by_point
    from dpfl_ray.runtime.search import METRICS

    points, runs_of = search.points(), runs_by_point(runs)
    results = search.results(sweep_dir, runs_of)[:len(points)]
    scored = [(value, point) for value, point in zip(results, points) if isinstance(value, float)]
    if not scored:
        return
    pick = max if METRICS[search.metric] == "maximize" else min
    value, point = pick(scored, key=lambda vp: vp[0])
    seeds = len(runs_of[point])
    where = " ".join(f"{key}={text}" for key, text in zip(search.space, point))
    console.print(f"best of {len(scored)} points by {search.metric}: {where}: {value:.4f}"
                  + (f" (mean of {seeds} seeds)" if seeds > 1 else ""), highlight=False, soft_wrap=True, markup=False)


def _selection_line(sweep_dir: Path) -> None:
    """What choosing among the runs costs (runs/sweep.selection_privacy), in one line."""
    from dpfl_ray.runs.sweep import selection_line

    line = selection_line(sweep_dir)
    if line is not None:
        console.print(line, highlight=False, soft_wrap=True, markup=False)


def run_on_tune(sweep_dir: Path, todo: list, scenario: Path | None, timeout: float, address: str | None,
                max_concurrent: int | None, shutdown, early_stop: dict | None = None, more=None) -> dict[str, str]:
    """The runs ``todo`` as Tune trials on the cluster ``address`` names (else a private Ray), with
    rich progress; returns {run name: status}. Shared by ``dpfl sweep`` and ``dpfl reproduce``.
    ``early_stop``: ASHA's settings (runtime/trials.early_stopping). ``more(statuses)``: the runs to
    run next once these ended (an adaptive search's next batch), trials of the same Tune experiment,
    or an empty list."""
    from dpfl_ray.runtime import trials
    from dpfl_ray.runtime.driver import cluster_resources, ensure_ray, stop_ray
    from dpfl_ray.runtime.shutdown import keep_handlers

    try:
        with keep_handlers():
            ensure_ray(address, pending_signal=lambda: shutdown.first)
        shutdown.install()  # ray.init's C++ core installs signal handlers of its own
        configs = trials.run_configs(sweep_dir, todo, scenario, timeout, cluster_resources(), max_concurrent)
        with _progress() as progress:
            total = len(configs)
            task = progress.add_task("runs", total=total, status="starting")
            live: dict[str, str] = {}
            evaluated: dict[str, float] = {}  # each run's last evaluated accuracy (output.eval_every)

            def on_result(config: dict, m: dict) -> None:
                if m.get("test_accuracy") is not None:
                    evaluated[config["name"]] = m["test_accuracy"]
                acc, eps = evaluated.get(config["name"]), m.get("epsilon")
                live[config["name"]] = (f"r{m['round']}" + (f" acc {acc:.3f}" if acc is not None else "")
                                        + (f" eps {eps:.2f}" if eps is not None else ""))
                progress.update(task, status=_running(live))

            def on_done(config: dict, status: str) -> None:
                live.pop(config["name"], None)
                progress.console.print(f"{config['name']}: {status}", highlight=False, soft_wrap=True, markup=False)
                progress.update(task, advance=1, status=_running(live))

            def on_retry(config: dict) -> None:
                live[config["name"]] = "restarting"
                progress.console.print(f"{config['name']}: its trial's process ended (a lost node?); Tune starts it "
                                       "again, and the run goes on from its last checkpoint", highlight=False,
                                       soft_wrap=True, markup=False)
                progress.update(task, status=_running(live))

            def next_batch(done: dict[str, str]) -> list[dict]:
                nonlocal total
                todo = more(done)
                if shutdown.requested or not todo:
                    return []
                batch = trials.run_configs(sweep_dir, todo, scenario, timeout, cluster_resources(), max_concurrent)
                total += len(batch)
                progress.update(task, total=total)
                return batch

            return trials.run_trials(sweep_dir, configs, max_concurrent, shutdown, on_result, on_done, on_retry,
                                     early_stop, more=next_batch if more is not None else None)
    except KeyboardInterrupt:  # a signal while Ray started: no trial ran
        return {run.name: "interrupted" for run in todo}
    finally:
        stop_ray()


def _running(live: dict[str, str]) -> str:
    return "; ".join(f"{name} {what}" for name, what in list(live.items())[:3]) + (" ..." if len(live) > 3 else "")


def _progress() -> Progress:
    return Progress(TextColumn("[bold]runs"), MofNCompleteColumn(), BarColumn(), TextColumn("ETA"),
                    TimeRemainingColumn(), TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console,
                    transient=False)


def _table(rows: list[dict], axes: list[str]) -> None:
    table = Table(title="dpfl sweep", header_style="bold")
    for header in [*axes, "seed", "final acc", "epsilon", "eps claimed", "rounds", "stop", "status"]:
        table.add_column(header)
    for r in rows:
        table.add_row(*[escape(str(r.get(a))) for a in axes], _num(r["seed"], "d"), _num(r["final_accuracy"], ".4f"),
                      _num(r["epsilon"], ".3f"), _num(r["epsilon_claimed"], ".3f"), _num(r["rounds"], "d"),
                      escape(str(r["stop_reason"] or "-")), escape(str(r["status"])))
    console.print(table)
