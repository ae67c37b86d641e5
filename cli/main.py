"""The ``dpfl`` command."""
from __future__ import annotations

import typer

from . import bench, privacy, scenarios
from . import report
from . import run as run_cmd

app = typer.Typer(help="dpfl_ray: differentially private federated learning on Ray.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False, add_completion=False)
app.command("run")(run_cmd.run)
app.command("report")(report.report)
app.add_typer(scenarios.app, name="scenarios")
app.add_typer(bench.app, name="bench")
app.add_typer(privacy.app, name="privacy")

if __name__ == "__main__":
    app()
