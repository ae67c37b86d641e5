"""The ``dpfl`` command."""
from __future__ import annotations

import signal

import typer

from . import bench, jobs, privacy, scenarios, submit
from . import report
from . import run as run_cmd
from . import audit
from . import reproduce as reproduce_cmd
from . import sweep as sweep_cmd

app = typer.Typer(help="dpfl_ray: differentially private federated learning on Ray.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False, add_completion=False)
app.command("run")(run_cmd.run)
app.command("report")(report.report)
app.command("audit")(audit.audit)
app.command("sweep")(sweep_cmd.sweep)
app.command("reproduce")(reproduce_cmd.reproduce)
app.command("submit")(submit.submit)
app.add_typer(scenarios.app, name="scenarios")
app.add_typer(bench.app, name="bench")
app.add_typer(privacy.app, name="privacy")
app.add_typer(jobs.app, name="jobs")


def _one_line_listings(typer_app: typer.Typer) -> None:
    """A command list shows each command's first paragraph, and Typer keeps its line breaks: give
    each command the paragraph as one line (``--help`` on the command itself is unchanged)."""
    import inspect

    for info in typer_app.registered_commands:
        if info.short_help is None:
            doc = info.help or inspect.getdoc(info.callback) or ""
            info.short_help = " ".join(doc.split("\n\n")[0].split())
    for group in typer_app.registered_groups:
        _one_line_listings(group.typer_instance)


_one_line_listings(app)


def main() -> None:
    """Console entry point: like ``app()``, but a malformed command line (unknown option, a value
    of the wrong type) or any exception a command lets through is one ``error:`` line and exit 2
    instead of a usage box or a traceback (``DPFL_DEBUG=1`` keeps the traceback).

    A Ctrl-C is exit 130 wherever it lands, including the moments between giving the signals back
    (:func:`cli.release_early_signals`) and a command taking them, and while an error is printed."""
    try:
        _main()
    except KeyboardInterrupt:
        _leave(130)


def quiet_import_warnings() -> None:
    """Keep urllib3's notice that PySocks is missing off stderr (requests, which Ray imports, asks
    for SOCKS support and hides that warning itself).

    requests' own filter is not enough: `dpfl run` imports matplotlib in a thread while the main
    thread imports Ray, and a ``warnings.catch_warnings()`` block in that thread restores the filter
    list it saved on entry, dropping a filter the main thread added meanwhile (CI printed the
    warning above a one-line error once). A filter installed here, before any thread starts, is in
    every list such a block saves."""
    import warnings

    warnings.filterwarnings("ignore", message="SOCKS support in urllib3", module=r"urllib3\b")


def _main() -> None:
    import logging
    import sys

    from . import release_early_signals

    early = release_early_signals()
    if early is not None:  # interrupted while the command loaded: nothing has started
        sys.exit(early)

    try:  # recent Typer vendors its own copy of click, and keeps Abort and Exit in typer.exceptions
        from typer._click import exceptions as clickexc
        from typer.exceptions import Abort
    except ImportError:  # pragma: no cover - older Typer on real click
        from click import exceptions as clickexc
        from click.exceptions import Abort

    from rich.markup import escape

    from .common import debugging, describe_exception, err_console, one_line

    # dp_accounting logs RDP orders it skips as warnings: noise around the one line a user reads
    logging.getLogger("absl").setLevel(logging.ERROR)
    quiet_import_warnings()
    try:
        rv = app(standalone_mode=False)
    except SystemExit as exc:  # rich's answer to a closed pipe (`dpfl ... | head`), or a command's own exit
        _leave(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1))
    except clickexc.NoArgsIsHelpError:
        _leave(0)  # Typer has already printed the help
    except clickexc.UsageError as err:
        where = f"{err.ctx.command_path}: " if err.ctx else ""
        err_console.print(f"[bold red]error:[/] {escape(one_line(where + err.format_message()))}",
                          highlight=False, soft_wrap=True)
        _leave(2)
    except (KeyboardInterrupt, Abort) as err:
        _leave(_interrupted_code(err))
    except clickexc.ClickException as err:
        err_console.print(f"[bold red]error:[/] {escape(one_line(err.format_message()))}", highlight=False,
                          soft_wrap=True)
        _leave(2)
    except Exception as err:  # noqa: BLE001 - one line, whatever went wrong
        if debugging():
            raise
        err_console.print(f"[bold red]error:[/] {escape(describe_exception(err))}", highlight=False, soft_wrap=True)
        _leave(2)
    _leave(rv if isinstance(rv, int) else 0)


def _interrupted_code(err: BaseException) -> int:
    """128 + the signal that stopped the command: SIGTERM turned into a KeyboardInterrupt by
    cli.common.interrupt (named in its argument) is 143, as `dpfl run` exits on it; Ctrl-C is 130."""
    name = err.args[0] if isinstance(err, KeyboardInterrupt) and err.args else None
    try:
        return 128 + signal.Signals[name] if isinstance(name, str) else 130
    except KeyError:
        return 130


def _leave(code: int) -> None:
    """Exit with ``code``. A command that ran Ray here and stopped it (runtime.driver.stop_ray:
    every file written, Ray shut down, its processes gone) leaves without the interpreter's
    teardown, which spends about a second joining Ray's and torch's threads (measured: 1.15 s
    after ray.shutdown, 0.7 s without Ray). That second is part of how fast a signal stops a run."""
    import os
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (`dpfl ... | head`): say nothing more
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
            except (OSError, ValueError):
                pass
    driver = sys.modules.get("dpfl_ray.runtime.driver")
    if driver is not None and driver.ray_stopped():
        os._exit(code)
    # CPython remembers a KeyboardInterrupt that ended an exec() or eval() of a string (dataclasses,
    # typing and namedtuple run hundreds while modules import) and, under `python -m`, ends the
    # process by SIGINT at exit (status -2, no message) even though the interrupt was handled here.
    # A string exec that ends normally clears that memory.
    exec("pass")
    sys.exit(code)


if __name__ == "__main__":
    main()
