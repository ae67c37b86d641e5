"""The driver side of a run: start Ray, hand the data to a Coordinator, stream its events into
a RunRecord. Everything that decides what happens lives in the coordinator and the pure core."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import ray

import dpfl_ray

from ..data import Federation
from ..errors import DPFLError
from ..models import build_model, set_flat
from ..results import RunRecord, versions
from ..scenario import Scenario
from .coordinator import make_coordinator


def ensure_ray(address: str | None = None) -> bool:
    """Join the cluster ``address`` (or RAY_ADDRESS) names, or start a private local Ray bound to
    127.0.0.1 (runtime/connect.py). Returns True when this call connected (so the caller shuts it down)."""
    from .connect import connect

    return connect(address)


def put_federation(fed: Federation) -> dict:
    ds = fed.dataset
    return {"x_train": ray.put(ds.x_train), "y_train": ray.put(ds.y_train), "x_test": ray.put(ds.x_test),
            "y_test": ray.put(ds.y_test), "indices": ray.put(fed.indices), "offsets": ray.put(fed.offsets),
            "weights": ray.put(fed.weights), "input_shape": list(ds.input_shape), "num_classes": ds.num_classes}


def run_scenario(scenario: Scenario, fed: Federation, record: RunRecord,
                 on_event: Callable[[dict], None] | None = None, poll_seconds: float = 0.2) -> dict:
    """Run a scenario on the connected Ray; returns the summary (also written to summary.json).

    Every round reaches ``rounds.jsonl`` as soon as the coordinator reports it, and the summary
    is written even when the run is interrupted or fails, so no finished round is lost.
    """
    t0 = time.time()
    record.write_scenario(scenario.to_yaml())
    coord = make_coordinator(scenario, put_federation(fed))
    run_ref = coord.run.remote()
    seen, stop_reason, error = 0, "completed", None
    try:
        while True:
            done, _ = ray.wait([run_ref], timeout=poll_seconds)
            for ev in ray.get(coord.events.remote(seen)):
                seen += 1
                if ev.get("event") == "round":
                    record.add_round({k: v for k, v in ev.items() if k != "event"})
                if on_event:
                    on_event(ev)
            if done:
                stop_reason = ray.get(run_ref)["stop_reason"]
                break
    except KeyboardInterrupt:
        coord.stop.remote()
        stop_reason = "interrupted"
    except ray.exceptions.RayError as err:
        stop_reason, error = "error", _one_line(err)
    summary = _finish(scenario, fed, record, coord, stop_reason, error, time.time() - t0)
    if error:
        raise DPFLError(f"run failed after {summary['rounds_completed']} rounds ({record.path}): {error}")
    return summary


def _finish(scenario, fed, record, coord, stop_reason, error, wall) -> dict:
    rounds = record.rounds
    last_acc = next((r["test_accuracy"] for r in reversed(rounds) if r.get("test_accuracy") is not None), None)
    summary = {"name": scenario.name, "final_accuracy": last_acc,
               "final_loss": next((r["test_loss"] for r in reversed(rounds) if r.get("test_loss") is not None), None),
               "rounds_completed": len(rounds), "rounds_planned": scenario.training.rounds,
               "stop_reason": stop_reason, "wall_seconds": round(wall, 3), "seed": scenario.seed,
               "versions": versions()}
    if error:
        summary["error"] = error
    try:
        ledger = ray.get(coord.ledger.remote(), timeout=60)
    except ray.exceptions.RayError:
        ledger = None
    if ledger is not None:
        record.write_json("ledger.json", ledger)
        last = rounds[-1] if rounds else {}
        summary.update(epsilon=last.get("epsilon"), delta=scenario.privacy.delta,
                       accountant=scenario.privacy.accountant, dp_covered=ledger.get("fully_covered"),
                       noise_multiplier=ledger.get("noise_multiplier"))
        for key in ("epsilon_nominal", "epsilon_claimed"):
            if key in last:
                summary[key] = last[key]
        if scenario.training.algorithm == "baek":
            summary["calibration"] = scenario.privacy.calibration
        record.plot_privacy()
    try:
        theta = ray.get(coord.final_model.remote(), timeout=60)
        model = build_model(scenario.model, fed.dataset.input_shape, fed.dataset.num_classes, scenario.seed)
        set_flat(model, theta)
        record.write_model(model.state_dict())
    except ray.exceptions.RayError:
        summary["model"] = "unavailable: the coordinator died before handing it back"
    record.write_json("summary.json", summary)
    record.plot_accuracy()
    record.close()
    return summary


def _one_line(err: Exception) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(err).__name__
