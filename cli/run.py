"""``dpfl run``: one scenario, locally or on a cluster, with live progress and a run directory."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .common import console, user_errors


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console, transient=False)


@user_errors
def run(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    set_: list[str] = typer.Option([], "--set", help="override a field: --set training.rounds=5 (repeatable)"),
    out: Optional[Path] = typer.Option(None, "--out", help="run directory (default: OUTPUT.DIR/NAME/TIMESTAMP)"),
    address: Optional[str] = typer.Option(
        None, "--address", help="join a Ray cluster: HOST:PORT (its GCS), ray://HOST:10001 or auto (default: the "
        "cluster RAY_ADDRESS names, as inside a Ray Job; else a private local Ray)"),
) -> None:
    """Train a federation as the scenario says and write its run directory."""
    from dpfl_ray.algorithms import make_algorithm
    from dpfl_ray.data import build_federation
    from dpfl_ray.models import build_model
    from dpfl_ray.results import RunRecord, default_run_dir
    from dpfl_ray.scenario import load_scenario

    sc = load_scenario(scenario, set_)
    # Everything that can be wrong with the scenario is found before a file is written.
    fed = build_federation(sc)
    build_model(sc.model, fed.dataset.input_shape, fed.dataset.num_classes, sc.seed)
    if sc.privacy.noise_multiplier is not None:
        make_algorithm(sc, fed.weights)  # catches impossible mechanism parameters
    run_dir = out or default_run_dir(sc.output.dir, sc.name)
    RunRecord.check_new(run_dir)

    from dpfl_ray.runtime.cluster import recorded_address, resolve_target, stay_on_loopback

    # A malformed address is one line before anything starts; loopback is read by Ray at import.
    stay_on_loopback(resolve_target(address, recorded=recorded_address))
    import ray

    from dpfl_ray.runtime.driver import ensure_ray, run_scenario
    from dpfl_ray.runtime.resources import plan_pool

    started = ensure_ray(address)
    try:
        plan = plan_pool(sc.resources, ray.cluster_resources(), fed.num_clients)
        record = RunRecord(run_dir)
        console.print(f"[bold]{sc.name}[/]: {fed.num_clients} clients, {sc.training.rounds} rounds, "
                      f"{plan.workers} workers -> {record.path}")
        with _progress() as progress:
            task = progress.add_task("rounds", total=sc.training.rounds, status="starting workers")

            def on_event(ev: dict) -> None:
                if ev["event"] == "start":
                    progress.update(task, status=f"{ev['workers']} workers")
                elif ev["event"] == "round":
                    acc = ev.get("test_accuracy")
                    status = f"acc {acc:.4f} loss {ev['test_loss']:.4f}" if acc is not None else ""
                    status += f" survived {ev['survived']}/{ev['sampled']}"
                    if ev.get("epsilon") is not None or "epsilon_nominal" in ev:
                        eps = ev.get("epsilon")
                        status += f" eps {eps:.3f}" if eps is not None else f" eps n/a (nominal {ev['epsilon_nominal']:.3f})"
                        if ev.get("epsilon_claimed") is not None and eps is not None:
                            status += f" (claimed {ev['epsilon_claimed']:.3f})"
                    progress.update(task, completed=ev["round"], status=status)

            summary = run_scenario(sc, fed, record, on_event=on_event)
    finally:
        if started:
            ray.shutdown()
    acc = summary["final_accuracy"]
    console.print(f"{summary['stop_reason']}: {summary['rounds_completed']} rounds in {summary['wall_seconds']:.1f}s, "
                  f"final test accuracy {acc if acc is None else f'{acc:.4f}'}; files in {record.path}")
    if "epsilon" in summary:
        eps = summary["epsilon"]
        console.print(f"privacy: epsilon {eps if eps is None else f'{eps:.4f}'} at delta {summary['delta']:g} "
                      f"({summary['accountant']}, z={summary['noise_multiplier']:.4f})"
                      + ("" if summary.get("dp_covered", True) else
                         f"; NOT covered by DP (median clipping), nominal {summary.get('epsilon_nominal', 0):.4f}")
                      + (f"; claimed {summary['epsilon_claimed']:.4f} (calibration={summary['calibration']}), "
                         "the epsilon above is what the server's view guarantees"
                         if summary.get("epsilon_claimed") is not None and eps is not None else ""))
    if summary["stop_reason"] == "interrupted":
        raise typer.Exit(130)
