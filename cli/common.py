"""Shared CLI plumbing: user mistakes become one line on stderr and exit code 2."""
from __future__ import annotations

import functools
import sys

import typer
from rich.console import Console

from dpfl_ray.errors import DPFLError

console = Console()
err_console = Console(stderr=True)

EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def user_errors(fn):
    """Turn DPFLError (bad scenario, bad parameter, bad file) into ``error: ...`` and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DPFLError as err:
            fail(str(err))
        except OSError as err:
            fail(f"{getattr(err, 'filename', '') or ''} {err.strerror or err}".strip())

    return wrapper


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()
