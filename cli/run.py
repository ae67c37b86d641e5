"""``dpfl run``: one scenario, locally or on a cluster, with live progress and a run directory."""
from __future__ import annotations

import importlib
import os
import threading
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .common import console, folder_option, preflight, user_errors


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console, transient=False)


@user_errors
def run(
    scenario: Optional[Path] = typer.Argument(None, help="scenario YAML file (not with --resume)"),
    set_: list[str] = typer.Option([], "--set", help="override a field: --set training.rounds=5 (repeatable)"),
    out: Optional[Path] = typer.Option(None, "--out", parser=folder_option, help="run directory (default: OUTPUT.DIR/NAME/TIMESTAMP)"),
    address: Optional[str] = typer.Option(
        None, "--address", help="join a Ray cluster: HOST:PORT (its GCS), ray://HOST:10001 or auto (default: the "
        "cluster RAY_ADDRESS names, as inside a Ray Job; else a private local Ray)"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="continue the run in this directory from its "
                                                                 "last checkpoint"),
) -> None:
    """Train a federation as the scenario says and write its run directory."""
    from dpfl_ray.runtime.shutdown import Shutdown

    # From here on a signal is only recorded (runtime/shutdown.py): the command stops at its next
    # check, never in the middle of an import or of a library's own code.
    shutdown = Shutdown().install()
    held: list[int] = []  # the run directory's lock, from _prepare until this command returns
    try:
        _run(*_prepare(scenario, set_, out, address, resume, held), address, shutdown)
    finally:
        for fd in held:
            os.close(fd)


def _run(sc, fed, run_dir, checkpoint, startup, address, shutdown) -> None:
    """Start Ray, run the scenario with live progress, and write and print what it ends with."""
    from dpfl_ray.runtime.shutdown import keep_handlers

    plotting = _Plotting()  # matplotlib loads while Ray starts
    from dpfl_ray.runs.record import RunRecord
    from dpfl_ray.runtime.checkpoint import rows_covered
    from dpfl_ray.runtime.driver import (cluster_resources, ensure_ray, ray_stopped, ray_to_watch, run_scenario,
                                         stop_ray, write_unstarted)
    from dpfl_ray.runtime.rescue import Watcher
    from dpfl_ray.runtime.resources import plan_pool
    if shutdown.requested:
        plotting.wait()
        console.print("interrupted before the run started: nothing was written", highlight=False)
        raise typer.Exit(shutdown.exit_code)

    record, watcher, t0 = None, None, time.time()
    try:
        t_ray = time.time()
        with keep_handlers():
            ensure_ray(address, pending_signal=lambda: shutdown.first)
        startup["ray_init"] = time.time() - t_ray
        if shutdown.requested:  # a signal while Ray started (signals are only recorded: runtime/shutdown.py)
            raise KeyboardInterrupt("signal received while Ray started")
        shutdown.install()  # ray.init's C++ core installs signal handlers of its own
        plan = plan_pool(sc.resources, cluster_resources(), fed.num_clients)
        record = RunRecord(run_dir) if checkpoint is None else RunRecord.reopen(run_dir, rows_covered(checkpoint))
        # Ray's core ends this process on the spot when its node stops: the watcher then writes the files
        watcher = Watcher(record.path, t0, *ray_to_watch())
        console.print(f"[bold]{sc.name}[/]: {fed.num_clients} clients, {sc.training.rounds} rounds, "
                      f"{plan.workers} workers -> {escape(str(record.path))}")
        with _progress() as progress:
            task = progress.add_task("rounds", total=sc.training.rounds, status="starting workers",
                                     completed=len(record.rounds))
            summary = run_scenario(sc, fed, record, on_event=_on_event(progress, task), shutdown=shutdown,
                                   resume=checkpoint, startup=startup, started_at=t0,
                                   keep_workers=False)  # one run per process: nothing would take them
    except KeyboardInterrupt:
        if checkpoint is not None and record is None:  # the directory is as the last stop left it
            stop_ray()
            raise typer.Exit(shutdown.exit_code)
        # interrupted while Ray or the run was starting: leave a consistent run of 0 rounds
        record = record or RunRecord(run_dir)
        summary = write_unstarted(sc, fed, record, time.time() - t0)
    finally:
        if watcher is not None:
            watcher.done()
        stop_ray()
        if not ray_stopped():  # else the process leaves by os._exit (cli/main.py): no import to finish
            plotting.wait()
        shutdown.done()
    _print_summary(summary, record)
    if summary["stop_reason"] == "interrupted":
        from dpfl_ray.runtime.checkpoint import CHECKPOINT

        if (record.path / CHECKPOINT).exists():  # not before the first round's checkpoint: nothing to resume
            console.print(f"resume with: dpfl run --resume {record.path}", highlight=False, soft_wrap=True,
                          markup=False)
        raise typer.Exit(shutdown.exit_code)


def _hold(run_dir: Path, held: list[int], option: str) -> None:
    """Take the run directory's lock (runs/sweep.hold_run: ``.running/NAME.lock`` beside it, the lock
    a sweep's trial takes for its run) into ``held``, or refuse in one line: another `dpfl run`, or a
    sweep's trial, is writing that directory. A parent this process cannot write in takes no lock
    (the checks of --out say what is wrong there)."""
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.runs.sweep import RUNNING, hold_run

    try:
        held.append(hold_run(run_dir.parent, run_dir.name))
    except OSError:
        pass
    except DPFLError:
        raise DPFLError(f"{run_dir} is being written by another dpfl process (a run, or a sweep's trial, holds "
                        f"{run_dir.parent / RUNNING / (run_dir.name + '.lock')}); wait for it to end",
                        field=option) from None


def _prepare(scenario, set_, out, address, resume, held: list[int]):
    """Everything that can be wrong with the scenario, found before a file is written or Ray
    starts: (scenario, federation, run directory, checkpoint or None, start-up seconds). The
    scenario is read before the data code loads: a mistake in it answers at once. Torch is not
    needed here: the model's fit to the data is checked without it (a worker builds it). The run
    directory's lock goes into ``held``: taken before a checkpoint is read, and after every check
    of a new run, which then checks again that the directory is still new."""
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.runs.record import RunRecord, default_run_dir, read_releases
    from dpfl_ray.runtime.checkpoint import finished, open_for_resume, scenario_fingerprint
    from dpfl_ray.runtime.cluster import recorded_address, resolve_target, stay_on_loopback
    from dpfl_ray.scenario import load_scenario

    checkpoint = None
    if resume is not None:
        if scenario is not None or set_ or out is not None:
            raise DPFLError("continues the run as its scenario.yaml says: give no SCENARIO, --set or --out",
                            field="--resume")
        if resume.is_dir():
            _hold(resume, held, "--resume")
        opened = open_for_resume(resume)
        if opened is None:  # resuming would only rewrite its files
            summary = finished(resume)
            console.print(f"{resume}: the run already finished ({summary['stop_reason']}, "
                          f"{summary.get('rounds_completed')} rounds); nothing to resume", markup=False, soft_wrap=True)
            raise typer.Exit(0)
        (checkpoint, sc), out = opened, resume
    elif scenario is None:
        raise DPFLError("give a scenario file, or --resume RUN_DIR", field="SCENARIO")
    else:
        sc = load_scenario(scenario, set_)
    from dpfl_ray.algorithms import make_algorithm
    from dpfl_ray.data import build_federation
    from dpfl_ray.training.model_inputs import check_model_input

    t_data = time.time()
    fed = build_federation(sc)
    startup = {"load_data": time.time() - t_data}
    check_model_input(sc.model, fed.dataset.input_shape)  # the model itself is built while Ray starts
    make_algorithm(sc, fed.weights, sc.privacy.noise_multiplier or 1.0, sizes=fed.sizes)  # impossible mechanisms
    run_dir = out or default_run_dir(sc.output.dir, sc.name)
    if checkpoint is None:
        RunRecord.check_new(run_dir)
        # what an earlier attempt released there must be this scenario's (privacy/reruns.py)
        read_releases(run_dir, scenario_fingerprint(sc)["scenario_sha256"], field="--out")
    preflight(sc, run_dir)  # --out writable, accounting within bounds: before Ray starts (issue #16)
    # A malformed address is one line before anything starts; loopback is read by Ray at import.
    stay_on_loopback(resolve_target(address, recorded=recorded_address))
    if checkpoint is None:
        _hold(run_dir, held, "--out")
        RunRecord.check_new(run_dir)  # a run that held it until now may have written it
    return sc, fed, run_dir, checkpoint, startup


# Modules the plotting thread loads (matplotlib imports both) that register an at-fork hook run in
# the parent, os.register_at_fork(before=..., after_in_parent=...): imported in the main thread
# before the thread starts. ray.init starts Ray's processes with a preexec_fn, so each fork runs the
# parent's "before" hooks, then the "after" ones; a hook the thread registered in between ran only
# its second half, and concurrent.futures' `lock.release` printed "Exception ignored ... RuntimeError:
# release unlocked lock" with a traceback on the user's stderr (seen in the signal tests, rarely).
# tests/e2e/test_cli.py reads the installed matplotlib's source for any others.
PARENT_FORK_HOOK_MODULES = ("logging", "concurrent.futures.thread")


class _Plotting:
    """matplotlib, loaded in a thread while ``ray.init`` runs, for the plots the run ends with
    (about 0.7 s of CPU; Ray's start-up spends most of its 3-5 s waiting for its own processes,
    which leaves a core idle on a 2-core machine). The driver loads no torch: the run's workers
    build the initial model and write model.pt (runtime/driver.run_scenario). Signals go to the
    main thread, as before."""

    DEADLINE_SECONDS = 120.0

    def __init__(self):
        for name in PARENT_FORK_HOOK_MODULES:
            importlib.import_module(name)
        self._thread = threading.Thread(target=self._load, name="dpfl-plotting", daemon=True)
        self._thread.start()

    @staticmethod
    def _load() -> None:
        try:
            from dpfl_ray.runs.record import plotting_library

            plotting_library()
        except Exception:  # noqa: BLE001 - only a head start: the plots load it again, and say what fails
            pass

    def wait(self) -> None:
        """Let the thread finish its import before the process exits (bounded)."""
        self._thread.join(self.DEADLINE_SECONDS)


def _on_event(progress, task):
    evaluated: dict = {}  # the last evaluated round's figures: a round between evaluations has none

    def on_event(ev: dict) -> None:
        if ev["event"] == "start":
            progress.update(task, status=f"{ev['workers']} workers")
        elif ev["event"] == "round":
            if ev.get("test_accuracy") is not None:
                evaluated.update(round=ev["round"], acc=ev["test_accuracy"], loss=ev["test_loss"])
            status = f"acc {evaluated['acc']:.4f} loss {evaluated['loss']:.4f}" if evaluated else ""
            status += f" (round {evaluated['round']})" if evaluated and evaluated["round"] != ev["round"] else ""
            status += f" survived {ev['survived']}/{ev['sampled']}"
            if ev.get("epsilon") is not None or "epsilon_nominal" in ev:
                eps = ev.get("epsilon")
                status += f" eps {eps:.3f}" if eps is not None else f" eps n/a (nominal {ev['epsilon_nominal']:.3f})"
                if ev.get("epsilon_claimed") is not None and eps is not None:
                    status += f" (claimed {ev['epsilon_claimed']:.3f})"
                if ev.get("epsilon_assumed") is not None and eps is not None:
                    status += f" (assumed {ev['epsilon_assumed']:.3f})"
            progress.update(task, completed=ev["round"], status=status)
    return on_event


def _print_summary(summary: dict, record) -> None:
    acc = summary["final_accuracy"]
    evaluated = summary.get("final_evaluated_round")
    of_round = f" (round {evaluated})" if evaluated is not None and evaluated != summary["rounds_completed"] else ""
    console.print(f"{summary['stop_reason']}: {summary['rounds_completed']} rounds in {summary['wall_seconds']:.1f}s, "
                  f"final test accuracy {acc if acc is None else f'{acc:.4f}'}{of_round}; files in {record.path}",
                  markup=False)
    for fault, rounds in (summary.get("faults_not_carried_out") or {}).items():
        console.print(f"note: faults.{fault} was planned in round{'s' if len(rounds) > 1 else ''} "
                      f"{', '.join(map(str, rounds))} and not carried out: this Ray has no node to remove but the head "
                      f"and the coordinator's (run it on a cluster of 2+ nodes)", markup=False)
    ca = summary.get("client_accuracy") or {}
    if ca.get("clients"):
        groups = "; ".join(f"{label} {g['mean']:.4f}" for label, g in (ca.get("by_group") or {}).items())
        console.print(f"each client's own model after the last round ({ca['clients']} clients): mean {ca['mean']:.4f}, "
                      f"min {ca['min']:.4f}, max {ca['max']:.4f}" + (f"; by group: {groups}" if groups else ""))
    if "epsilon" not in summary:
        return
    eps = summary["epsilon"]
    z = summary.get("noise_multiplier")
    booked = ", ".join(f"{b:.4f}" for b in summary.get("noise_multiplier_booked") or [])
    booked = f", booked multiplier {booked}" if booked else ""
    worst = " (the worst client's; per-client epsilons in ledger.json)" if summary.get("record_level") else ""
    # the accountant that gave the figure: 'pld' falls back to 'rdp' where its grid would not fit
    used = summary.get("accountant_used") or summary["accountant"]
    used = used if used == summary["accountant"] else f"{used}, in place of {summary['accountant']}"
    line = (f"privacy: epsilon {eps if eps is None else f'{eps:.4f}'}{worst} at delta {summary['delta']:g} "
            f"({used}{'' if z is None else f', z={z:.4f}'}{booked})")
    if not summary.get("dp_covered", True):
        line += f"; NOT covered by DP (see ledger.json), nominal {summary.get('epsilon_nominal', 0):.4f}"
    if summary.get("epsilon_claimed") is not None and eps is not None:
        line += f"; the paper claims {summary['epsilon_claimed']:.4f}, the epsilon above is what the server's view guarantees"
    console.print(line)
    if "epsilon_assumed" in summary:  # a sensitivity the paper assumes and the code does not enforce
        ea, zs = summary["epsilon_assumed"], summary.get("noise_multiplier_assumed") or []
        console.print(f"under the paper's assumption, which the code does not enforce: epsilon "
                      f"{'n/a' if ea is None else f'{ea:.4f}'} (booked multiplier "
                      f"{', '.join(f'{z:.4f}' for z in zs)}); {summary.get('assumption', '')}", markup=False)
    vs = summary.get("epsilon_vs_server")
    console.print(f"against the server itself (it knows the sample): epsilon "
                  f"{'n/a' if vs is None else f'{vs:.4f}'} ({summary.get('epsilon_vs_server_note', '')})")
    if summary.get("adjacency"):
        public = "; ".join(summary.get("adjacency_public") or []) or "nothing data-dependent"
        console.print(f"neighbouring relation: {summary['adjacency']} (taken as public: {public})", markup=False)
