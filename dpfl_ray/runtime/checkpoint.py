"""Checkpoints: the coordinator's committed state in one file of the run directory, written
atomically (a temporary file, then a rename), so a run stopped at any moment -- Ctrl-C, SIGTERM,
a killed driver or coordinator -- resumes from its last checkpoint with ``dpfl run --resume``.

Every random stream derives from (seed, round, client, purpose), so the round index *is* the RNG
state: a resumed run reproduces the uninterrupted one bit for bit. With ``privacy.randomness: os``
the streams derive from the run's secret root instead, kept in the run directory while the run can
be resumed (:func:`run_secret`): a resumed run redraws the noise and the client sample of every
round it runs again. The rounds after the last checkpoint were committed, so the server may have
seen them; fresh noise on a second run of them would be a release the ledger never booked.
"""
from __future__ import annotations

import hashlib
import json
import os
import reprlib
import zipfile
from pathlib import Path

import numpy as np

from ..errors import DPFLError
from ..runs.record import DP_SECRET
from ..scenario import first_difference

CHECKPOINT = "checkpoint.npz"


def run_secret(run_dir: Path, mode: str) -> bytes | None:
    """The run's root secret of DP randomness in mode 'os' (None in mode 'reproducible'): the one
    its directory holds, which a resumed run (or a sweep trial's next attempt) must use again;
    else a fresh one from ``os.urandom``, written there readable by its owner alone."""
    if mode != "os":
        return None
    path = Path(run_dir) / DP_SECRET
    if path.exists():
        return read_secret(path)
    return write_secret(run_dir, os.urandom(32))


def write_secret(run_dir: Path, secret: bytes) -> bytes:
    """Put ``secret`` in the run directory as its DP_SECRET, readable by its owner alone and whole
    (written beside it, synced, then renamed)."""
    path = Path(run_dir) / DP_SECRET
    tmp = path.with_name(DP_SECRET + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return secret


def read_secret(path: Path) -> bytes:
    try:
        secret = Path(path).read_bytes()
    except OSError as err:
        raise DPFLError(f"cannot read {path} ({err.strerror or err})", field="--resume") from None
    if len(secret) != 32:
        raise DPFLError(f"{path} holds {len(secret)} bytes, not the run's 32-byte secret", field="--resume")
    return secret


def forget_run_secret(run_dir: Path) -> None:
    """A finished run is never resumed: its secret leaves the disk."""
    Path(run_dir, DP_SECRET).unlink(missing_ok=True)


def write_checkpoint(run_dir: Path, state: dict) -> Path:
    """``state``: JSON-able values plus numpy arrays under ``state["arrays"]``."""
    run_dir = Path(run_dir)
    arrays = dict(state.get("arrays", {}))
    meta = {k: v for k, v in state.items() if k != "arrays"}
    tmp = run_dir / (CHECKPOINT + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, _meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        f.flush()
        os.fsync(f.fileno())
    final = run_dir / CHECKPOINT
    os.replace(tmp, final)
    return final


def rows_covered(state: dict) -> int:
    """The rounds.jsonl rows a checkpoint covers: its rounds, less the last one if that round still
    awaited its evaluation (Coordinator._settle; ``pending`` holds its record without the figures)."""
    return int(state["round"]) - (1 if state.get("pending") else 0)


def read_checkpoint(run_dir: Path) -> dict:
    path = Path(run_dir) / CHECKPOINT
    if not Path(run_dir).is_dir():
        raise DPFLError(f"{run_dir}: no such run directory", field="--resume")
    if not path.is_file():
        raise DPFLError(f"{run_dir} has no {CHECKPOINT}: it was not written by a run with "
                        "output.checkpoint_every > 0, or it stopped before its first round", field="--resume")
    if not zipfile.is_zipfile(path):  # np.load would take a foreign file for a pickle or a bare .npy
        raise DPFLError(f"{path} is not a readable checkpoint (empty, cut short, or not an .npz archive)",
                        field="--resume")
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(bytes(data["_meta"]).decode())
            meta["arrays"] = {k: data[k] for k in data.files if k != "_meta"}
    # a truncated, empty or foreign file fails in zipfile (BadZipFile, EOFError) as often as in numpy
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as err:
        raise DPFLError(f"{path} is not a readable checkpoint ({type(err).__name__}: {err})",
                        field="--resume") from None
    rounds = meta.get("round") if isinstance(meta, dict) else None
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0 or "theta" not in meta["arrays"]:
        raise DPFLError(f"{path} is not a checkpoint of a dpfl run (no round count or model)", field="--resume")
    _check_parts(path, meta)
    return meta


def _check_parts(path: Path, meta: dict) -> None:
    """What a run's checkpoint holds, in the shapes the coordinator restores (Coordinator._restore):
    checked before a resume (or a rescue) touches the run's files. The model's values are the run's
    own, whatever they are (a diverged run's are kept as they are); its length is the scenario's
    model's, which the driver does not build: a foreign one is refused where it meets the model
    (training.models.model_file_bytes)."""
    theta = meta["arrays"]["theta"]
    if theta.ndim != 1 or theta.size == 0 or not np.issubdtype(theta.dtype, np.floating):
        raise DPFLError(f"{path}: its model is not a vector of floats (shape {theta.shape}, {theta.dtype.name})",
                        field="--resume")
    for key in ("pending", "algorithm", "privacy", "audit"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise DPFLError(f"{path}: its {key} is not a JSON object ({type(meta[key]).__name__})", field="--resume")


def scenario_fingerprint(scenario) -> dict:
    """What a checkpoint records of the run's resolved scenario: all of it (to name a field that
    changed) and its SHA-256 over canonical JSON (to compare at a glance)."""
    resolved = scenario.model_dump(mode="json")
    digest = hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()
    return {"scenario": resolved, "scenario_sha256": digest}


def check_same_scenario(checkpoint: dict, scenario, scenario_path: Path) -> None:
    """Refuse to resume ``checkpoint`` with a scenario other than the one it was written under:
    an edited scenario.yaml would continue another run under this run's name (another model, or
    a ledger booked at one noise multiplier and delta and printed at another)."""
    if "scenario_sha256" not in checkpoint:
        return  # written before checkpoints recorded their scenario: nothing to compare with
    mine = scenario_fingerprint(scenario)
    if mine["scenario_sha256"] == checkpoint["scenario_sha256"]:
        return
    found = first_difference(checkpoint.get("scenario") or {}, mine["scenario"])
    if found is None:
        return
    field, was, now = found
    raise DPFLError(f"{scenario_path} was edited after the checkpoint: {field} is {reprlib.repr(now)}, the run "
                    f"was checkpointed with {reprlib.repr(was)}; a resumed run continues the same run (start a new run for "
                    "another scenario)", field="--resume")


def finished(run_dir: Path) -> dict | None:
    """The summary of a run that ended on its own (completed, or stopped by its privacy budget):
    resuming it would only rewrite its files. None for a run that can go on."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and ended_on_its_own(summary) else None


def ended_on_its_own(summary: dict) -> bool:
    """Did the run of this summary end as planned or by its budget (not by a signal or an error)?"""
    return summary.get("stop_reason") not in ("interrupted", "error", None)


def resumable(run_dir: Path) -> bool:
    """Could ``dpfl run --resume`` continue this unfinished run directory (:func:`open_for_resume`
    finds its checkpoint, the rows it covers and scenario.yaml whole)? What a sweep's set_aside asks."""
    try:
        return open_for_resume(run_dir) is not None
    except DPFLError:
        return False


def _refuse_without_checkpoint(run_dir: Path) -> None:
    """The one line for a run directory with nothing to continue from (a run stopped before its first
    checkpoint, often while Ray started), saying what is safe instead. If it released nothing: a new
    run. If the server may have seen a round: a new run in this folder that keeps the release list
    and the secret (runs/record.py, KEPT_FOR_RESTART), as a sweep starts a trial again: it draws the
    same randomness and releases a listed round only as it was (privacy/reruns.py)."""
    from ..runs.record import KEPT_FOR_RESTART, RELEASES, lists_a_release

    if lists_a_release(run_dir):
        kept = " and ".join(sorted(KEPT_FOR_RESTART))
        advice = (f"the server may have seen a round ({RELEASES}): move all but {kept} away, then run its "
                  "scenario.yaml again into this folder (same randomness: a listed round is released only as it was)")
    else:
        advice = "it released nothing: run its scenario.yaml again with another --out"
    raise DPFLError(f"{run_dir} has no {CHECKPOINT} (stopped before its first checkpoint, or output.checkpoint_every: "
                    f"0); {advice}", field="--resume")


def open_for_resume(run_dir: Path):
    """(checkpoint, scenario) of a run directory to continue, every file it rests on checked before
    Ray starts: the checkpoint whole, the rows it covers whole, the list of the rounds it
    released (runs/record.py, read_releases) readable, scenario.yaml unedited. None when
    the run already finished (its summary: :func:`finished`)."""
    from ..runs.record import RunRecord, read_releases
    from ..scenario import load_scenario

    run_dir = Path(run_dir)
    if finished(run_dir) is not None:
        return None
    if (run_dir / "scenario.yaml").is_file() and not (run_dir / CHECKPOINT).exists():
        _refuse_without_checkpoint(run_dir)
    checkpoint = read_checkpoint(run_dir)
    RunRecord.committed_rows(run_dir, rows_covered(checkpoint))
    scenario = load_scenario(run_dir / "scenario.yaml")
    check_same_scenario(checkpoint, scenario, run_dir / "scenario.yaml")
    read_releases(run_dir)
    if scenario.privacy.randomness == "os":
        if not (run_dir / DP_SECRET).exists():
            raise DPFLError(f"{run_dir} has no {DP_SECRET}, the secret its DP noise came from (privacy.randomness: "
                            "os): a resumed run would draw fresh noise for rounds the server may already have "
                            "seen, which the ledger would not book; start the run afresh", field="--resume")
        read_secret(run_dir / DP_SECRET)
    return checkpoint, scenario
