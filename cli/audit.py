"""``dpfl audit RUN_DIR``: recompute a finished run's empirical epsilon from its ``audit.json``.

Mounted by the main CLI as ``app.command("audit")(audit.audit)``. The estimate (Andrew et al. 2024,
canary clients; docs/audit.md) needs only the per-canary statistics the run kept in ``audit.json``;
it is shown beside the ledger's ``epsilon`` and ``epsilon_claimed`` from ``summary.json``. A missing
or malformed file prints one line, ``error: ...``, and exits with status 2.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from dpfl_ray.errors import DPFLError
from dpfl_ray.runs.load import check_numbers

from .common import console, user_errors

AUDIT_FILE = "audit.json"


def _read(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise DPFLError(f"{path} not found: was the run audited (privacy.audit)?", field="run_dir")
        return {}
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise DPFLError(f"{path.name} is not UTF-8 text", field=str(path.parent)) from None
    except json.JSONDecodeError as err:
        raise DPFLError(f"{path.name} is not valid JSON ({err.msg}, line {err.lineno})", field=str(path.parent))
    if not isinstance(data, dict):
        raise DPFLError(f"{path.name} does not hold a JSON object", field=str(path.parent))
    return data


def _audited(run_dir: Path) -> bool:
    """Does the run's scenario.yaml set privacy.audit? (False where it cannot be read.)"""
    import yaml

    try:
        scenario = yaml.safe_load((run_dir / "scenario.yaml").read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 - unreadable, or YAML's own ValueErrors (a date of month 13): not known
        return False
    privacy = scenario.get("privacy") if isinstance(scenario, dict) else None
    return isinstance(privacy, dict) and bool(privacy.get("audit"))


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


@user_errors
def audit(
    run_dir: Annotated[Path, typer.Argument(help="a run directory written by `dpfl run` with privacy.audit on")],
    delta: Annotated[Optional[float], typer.Option(help="delta of the estimate; default: the run's delta")] = None,
    threat_model: Annotated[Optional[str], typer.Option(
        help="final_model, all_iterates or server_view; default: every one the run recorded")] = None,
    confidence: Annotated[float, typer.Option(help="level of the bootstrap interval")] = 0.95,
    bootstrap: Annotated[int, typer.Option(help="bootstrap resamples of the canaries (its time grows with "
                                                "resamples x canaries)", min=10, max=100_000)] = 1000,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
) -> None:
    """Empirical epsilon (a lower estimate) of a finished run, beside the ledger's epsilon."""
    from dpfl_ray.privacy.audit import THREAT_MODELS, estimate_epsilon, statistics_from_record

    if not run_dir.is_dir():
        raise DPFLError(f"{run_dir}: no such run directory", field="run_dir")
    if not (run_dir / AUDIT_FILE).is_file() and _audited(run_dir):
        raise DPFLError(f"{run_dir} was audited (privacy.audit) but released no round, so no canary statistics "
                        f"were kept ({AUDIT_FILE} is written once a round releases)", field="run_dir")
    record = _read(run_dir / AUDIT_FILE, required=True)
    summary = _read(run_dir / "summary.json", required=False)
    check_numbers(summary, ("epsilon", "epsilon_claimed", "delta"), "summary.json", run_dir)
    check_numbers(record, ("delta",), AUDIT_FILE, run_dir)
    stats = statistics_from_record(record)
    if threat_model is not None and threat_model not in THREAT_MODELS:
        raise DPFLError(f"unknown threat model {threat_model!r}; choose one of {', '.join(THREAT_MODELS)}",
                        field="threat_model")
    chosen = [tm for tm in THREAT_MODELS if tm in stats and threat_model in (None, tm)]
    if not chosen:
        raise DPFLError(f"{AUDIT_FILE} has no statistics for {threat_model}", field="threat_model")
    if delta is None:
        delta = record.get("delta", summary.get("delta"))
        if delta is None:
            ledger = _read(run_dir / "ledger.json", required=False)
            check_numbers(ledger, ("delta",), "ledger.json", run_dir)
            delta = ledger.get("delta")
        if delta is None:
            raise DPFLError("the run records no delta; give --delta", field="delta")
    seed = record.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise DPFLError(f"its seed must be an integer, got {seed!r}", field=AUDIT_FILE)
    results = {tm: estimate_epsilon(stats[tm], delta, confidence=confidence, bootstrap=bootstrap, seed=seed)
               for tm in chosen}
    if json_out:
        typer.echo(json.dumps({"run": str(run_dir), "delta": delta, "epsilon": summary.get("epsilon"),
                               "epsilon_claimed": summary.get("epsilon_claimed"),
                               "epsilon_empirical": {tm: r.to_dict() for tm, r in results.items()}}))
        return
    table = Table(title=f"dpfl audit (delta={delta:g})", header_style="bold")
    for header in ("threat model", "k", "rounds", "empirical", f"{confidence:.0%} interval", "epsilon", "claimed"):
        table.add_column(header, justify="left" if header == "threat model" else "right", no_wrap=True)
    for tm, r in results.items():
        table.add_row(tm, str(r.k), str(r.rounds), f"{r.epsilon:.3f}", f"[{r.low:.3f}, {r.high:.3f}]",
                      _fmt(summary.get("epsilon")), _fmt(summary.get("epsilon_claimed")))
    console.print(table)
    console.print("An estimate from below (Andrew et al. 2024), not a guarantee: see docs/audit.md.",
                  highlight=False, soft_wrap=True)
