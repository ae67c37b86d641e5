"""The committed state of a run rebuilt without its coordinator: from a checkpoint, and whether
a joined cluster's head still answers. The driver uses these when the coordinator is lost, and the
run's watcher (runtime/rescue.py) when the driver itself is gone."""
from __future__ import annotations

import socket

import numpy as np


def row_of(event: dict) -> dict:
    """The row rounds.jsonl holds for a coordinator's round event: the event without its kind."""
    return {k: v for k, v in event.items() if k != "event"}


def add_pending_row(scenario, fed, record, state: dict) -> None:
    """The row of a checkpoint's last round when it still awaited its evaluation (``pending``):
    evaluated here, on the checkpoint's model, in the test ranges the pool uses (one thread), so
    its figures are the ones the run would have written."""
    if not state.get("pending") or len(record.rounds) >= int(state["round"]):
        return
    from ..training.models import build_model, evaluate, one_thread, set_flat

    ds = fed.dataset
    model = build_model(scenario.model, ds.input_shape, ds.num_classes, scenario.seed)
    set_flat(model, np.asarray(state["arrays"]["theta"], dtype=np.float32))
    with one_thread():
        acc, loss = evaluate(model, ds.x_test, ds.y_test)
    record.add_round({**row_of(state["pending"]), "test_accuracy": acc, "test_loss": loss})


def committed_from_checkpoint(scenario, fed, state: dict) -> dict:
    """What ``Coordinator.committed`` returns, rebuilt from a checkpoint (runtime/checkpoint.py)
    as the coordinator builds and restores its bookkeeping: the model, the ledger and the
    algorithm's summary fields after ``state["round"]`` rounds. An audit's statistics are not
    rebuilt (audit.json keeps what the last finished run wrote)."""
    from ..algorithms import algorithm_class, make_algorithm

    weights, sizes = np.asarray(fed.weights), np.asarray(fed.sizes)
    alg_sizes = sizes
    audit = scenario.privacy.audit
    if audit is not None:  # the canary clients, as runtime/driver.put_federation and the coordinator add them
        weights = np.concatenate([weights, np.ones(audit.canaries)])
        alg_sizes = np.concatenate([sizes, np.full(audit.canaries, sizes.max())])
    cls = algorithm_class(scenario)
    privacy = None
    if cls.private:
        from .privacy import ClientPrivacy, RunPrivacy

        privacy = (ClientPrivacy if cls.record_level else RunPrivacy)(scenario, weights, alg_sizes)
    algorithm = make_algorithm(scenario, weights, privacy.noise_multiplier if privacy else None, sizes=alg_sizes)
    arrays = state["arrays"]
    algorithm.load_state_dict(state["algorithm"])
    out = {"rounds": int(state["round"]), "theta": np.asarray(arrays["theta"], dtype=np.float32),
           "summary": algorithm.summary_fields(), "checkpoint": state}
    if privacy:
        privacy.bind(algorithm)
        privacy.load_state_dict({**state["privacy"], "arrays": {
            k.removeprefix("privacy."): v for k, v in arrays.items() if k.startswith("privacy.")}})
        out["ledger"] = privacy.to_dict()
    return out


def head_unreachable(gcs_address: str | None, timeout_s: float = 1.0) -> bool:
    """Does nothing listen at the cluster's GCS address any more (None: not known)?"""
    if not gcs_address:
        return False
    host, _, port = gcs_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return False
    except (OSError, ValueError):
        return True
