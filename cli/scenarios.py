"""``dpfl scenarios``: list the shipped scenarios and validate a file."""
from __future__ import annotations

from pathlib import Path

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from .common import accounting_plan, console, user_errors

app = typer.Typer(help="List and validate scenario files.", no_args_is_help=True)


def scenarios_dir() -> Path:
    here = Path(__file__).resolve().parents[1] / "scenarios"
    return here if here.is_dir() else Path.cwd() / "scenarios"


@app.command("list")
@user_errors
def list_() -> None:
    """The scenarios shipped in scenarios/."""
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.scenario import load_yaml

    table = Table("file", "name", "description")
    for path in sorted(scenarios_dir().glob("*.yaml")):
        try:
            raw = load_yaml(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError, DPFLError):
            raw = {"description": "(not a valid scenario file)"}
        raw = raw if isinstance(raw, dict) else {}
        table.add_row(path.name, escape(str(raw.get("name", ""))), escape(str(raw.get("description", ""))))
    console.print(table)


@app.command()
@user_errors
def validate(path: Path = typer.Argument(..., help="scenario YAML file"),
             set_: list[str] = typer.Option([], "--set", help="override a field (repeatable)"),
             data: bool = typer.Option(True, help="also build the partition (catches impossible partitions)")) -> None:
    """Check a scenario: keys, types, and (by default) that its partition can be built."""
    from dpfl_ray.scenario import load_scenario

    sc = load_scenario(path, set_)
    plan = accounting_plan(sc)
    if plan is not None and plan.note:
        console.print(f"note: {plan.note}", highlight=False, soft_wrap=True, markup=False)
    if data:
        from dpfl_ray.data import build_federation
        from dpfl_ray.training.models import build_model

        fed = build_federation(sc)
        build_model(sc.model, fed.dataset.input_shape, fed.dataset.num_classes, sc.seed)
        console.print(f"ok: {path} ({sc.name}: {fed.num_clients} clients, sizes "
                      f"{int(fed.sizes.min())}-{int(fed.sizes.max())}, {sc.training.rounds} rounds)")
    else:
        console.print(f"ok: {path} ({sc.name})")
