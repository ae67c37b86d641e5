"""Checkpoints: the coordinator's committed state in one file of the run directory, written
atomically (a temporary file, then a rename), so a run stopped at any moment -- Ctrl-C, SIGTERM,
a killed driver or coordinator -- resumes from its last checkpoint with ``dpfl run --resume``.

Every random stream derives from (seed, round, client, purpose), so the round index *is* the RNG
state: a resumed run reproduces the uninterrupted one bit for bit (except with
``privacy.randomness: os``, whose noise is fresh by design).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..errors import DPFLError

CHECKPOINT = "checkpoint.npz"


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


def read_checkpoint(run_dir: Path) -> dict:
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise DPFLError(f"{run_dir} has no {CHECKPOINT}: it was not written by a run with "
                        "output.checkpoint_every > 0, or it stopped before its first round", field="--resume")
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(bytes(data["_meta"]).decode())
            meta["arrays"] = {k: data[k] for k in data.files if k != "_meta"}
    except (OSError, ValueError, KeyError) as err:
        raise DPFLError(f"{path} is not a readable checkpoint ({err})", field="--resume") from None
    return meta
