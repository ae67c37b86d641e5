"""Shared CLI plumbing: every error is one ``error: ...`` line on stderr and exit code 2.

A DPFLError is a user mistake and says what to change. Anything else that reaches the CLI (a
MemoryError, a bug) is still one line, naming the exception; ``DPFL_DEBUG=1`` re-raises it with its
traceback for a bug report.
"""
from __future__ import annotations

import functools
import os
import signal
import sys

import typer
from rich.console import Console
from rich.markup import escape

from dpfl_ray.errors import DPFLError

# emoji=False: user text such as `--address foo::bar:x` must not turn `:x:` into an emoji (markup in
# user text is escaped where it is printed)
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)

EXIT_USAGE = 2
_MAX_MESSAGE = 400


def one_line(message: str) -> str:
    """``message`` on a single line, cut to a readable length."""
    text = " ".join(str(message).split())
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE - 3] + "..."


def fail(message: str, code: int = EXIT_USAGE) -> None:
    err_console.print(f"[bold red]error:[/] {escape(one_line(message))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def describe_exception(err: BaseException) -> str:
    """The one line for an exception (a DPFLError: its message)."""
    if isinstance(err, DPFLError):
        return str(err)
    if isinstance(err, MemoryError):
        return "out of memory: this command needs more memory than the machine (or its limit) allows"
    if isinstance(err, OSError):
        return f"{getattr(err, 'filename', '') or ''} {err.strerror or err}".strip()
    if isinstance(err, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({err.reason} at byte {err.start})"
    detail = one_line(str(err)) or "(no message)"
    return f"internal error: {type(err).__name__}: {detail} (set DPFL_DEBUG=1 for the traceback)"


def debugging() -> bool:
    return os.environ.get("DPFL_DEBUG", "") not in ("", "0")


def _is_cli_control(err: BaseException) -> bool:
    # typer.Exit / click's Abort derive from RuntimeError, click's usage errors from Exception:
    # they are how the CLI exits on purpose and pass through untouched.
    return type(err).__module__.split(".")[0] in ("click", "typer") or isinstance(err, typer.Exit)


def user_errors(fn):
    """Turn every exception of a command into ``error: ...`` and exit 2 (DPFLError: the message)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DPFLError as err:
            fail(str(err))
        except Exception as err:  # noqa: BLE001 - the CLI's promise: one line, whatever went wrong
            if _is_cli_control(err) or debugging():
                raise
            fail(describe_exception(err))

    return wrapper


def folder_option(text: str):
    """The parser of every option that names an output folder: an empty value (an unset shell
    variable, ``--out ""``) is refused; as a Path it would silently mean the current folder."""
    from pathlib import Path

    if isinstance(text, str) and not text.strip():  # a default arrives as a Path
        raise typer.BadParameter("is empty: give a folder")
    return Path(text)


def interrupt(signum, _frame) -> None:
    """A signal handler that stops a command as Ctrl-C does (SIGTERM from `ray job stop`, a bench
    stopped by its caller), so its ``finally`` clauses run."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()


def preflight(sc, run_dir) -> None:
    """What can be checked of a run before Ray starts: ``run_dir`` can be written, and the
    scenario's accountant can account its planned rounds within bounds (a note says when 'pld'
    will use a coarse grid or fall back to 'rdp'). Raises a DPFLError otherwise."""
    from dpfl_ray.runs.record import check_writable

    check_writable(run_dir)
    plan = accounting_plan(sc)
    if plan is not None and plan.note:
        console.print(f"[bold yellow]note:[/] {escape(plan.note)}", highlight=False, soft_wrap=True)


def accounting_plan(sc):
    """The :class:`~dpfl_ray.privacy.calibration.AccountingPlan` of a private scenario's planned
    rounds, from the algorithm's own planned mechanism (None without a run-wide ledger)."""
    from dpfl_ray.algorithms import algorithm_class

    if not algorithm_class(sc).client_level():
        # planned_mechanism's answer, known without importing dp_accounting and scipy: 0.8 s of every
        # non-private `dpfl run` before Ray starts
        return None
    from dpfl_ray.privacy.calibration import check_accounting_feasible
    from dpfl_ray.runtime.privacy import planned_mechanism

    mech = planned_mechanism(sc)
    if mech is None:
        return None
    _check_planned_multipliers(sc, mech)
    plan = check_accounting_feasible(sc.privacy.accountant, mech.noise_multipliers, mech.sampling,
                                     sc.training.rounds, sc.privacy.delta)
    _check_one_round_fits(sc, mech)
    return plan


def _check_planned_multipliers(sc, mech) -> None:
    """A multiplier the scenario derives (NbAFL's from its epsilon, a target epsilon's calibration)
    within the bounds a given one must keep (dpfl_ray.defaults): outside them dp_accounting
    overflows or divides by zero, an internal error."""
    from dpfl_ray.defaults import MAX_NOISE_MULTIPLIER, MIN_NOISE_MULTIPLIER
    from dpfl_ray.errors import DPFLError

    p = sc.privacy
    for z in mech.noise_multipliers:
        if not MIN_NOISE_MULTIPLIER <= z <= MAX_NOISE_MULTIPLIER:
            field = ("privacy.nbafl.epsilon" if p.nbafl is not None else
                     "privacy.noise_multiplier" if p.noise_multiplier is not None else "privacy.target_epsilon")
            raise DPFLError(f"gives a noise multiplier of {z:.3g}, outside [{MIN_NOISE_MULTIPLIER:g}, "
                            f"{MAX_NOISE_MULTIPLIER:g}]: no epsilon of it means anything", field=field)


def _check_one_round_fits(sc, mech) -> None:
    """A target epsilon that the first round already passes would end the run after 0 rounds with
    no epsilon and no reason (the budget rule stops a run before a round that would break it).
    Asked as the run asks it: one planned round on a ledger of the scenario's accountant; the
    accountant named is the one that answered ('pld' may hand a round to 'rdp')."""
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.privacy import PrivacyLedger

    p = sc.privacy
    if p.target_epsilon is None or p.noise_multiplier is None:  # a calibrated z meets the target by construction
        return
    ledger = PrivacyLedger(accountant=p.accountant, delta=p.delta)
    ledger.record_round(mech.noise_multipliers, mech.sampling, reason="the first round, as planned")
    booked = ledger.to_dict()
    eps = booked["epsilon"]
    if eps is None or eps > p.target_epsilon:
        cost = "is not bounded" if eps is None else f"costs epsilon {eps:.4g}"
        raise DPFLError(f"{p.target_epsilon:g} is below what one round costs: with noise_multiplier "
                        f"{p.noise_multiplier:g} one round {cost} at delta {p.delta:g} ({booked['accountant_used']} "
                        "accountant); raise the target or the noise multiplier, or leave noise_multiplier unset to "
                        "calibrate it", field="privacy.target_epsilon")


ADDRESS_HELP = "the cluster's dashboard, http://HEAD:8265 (default: RAY_API_SERVER_ADDRESS, or RAY_ADDRESS if http)"


def write_job_log(text: str) -> None:
    from dpfl_ray.runs.bundle import without_bundle

    sys.stdout.write(without_bundle(text))
    sys.stdout.flush()


def follow_job(jobs, job_id: str) -> int:
    """Stream a job's log until it ends: 0 if it SUCCEEDED, 1 if not, 130 if the user stops watching."""
    try:
        status = jobs.follow(job_id, write_job_log)
    except KeyboardInterrupt:
        err_console.print(f"stopped following; job {job_id} keeps running (`dpfl jobs stop {job_id}` stops it)",
                          highlight=False)
        return 130
    err_console.print(f"job {job_id} {status}", highlight=False)
    return 0 if status == "SUCCEEDED" else 1
