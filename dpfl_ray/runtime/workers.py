"""ClientWorker: a long-lived actor that hosts many logical clients.

It keeps the training data and one model copy for its whole life; per round it receives one
message (the model's object-store reference and its list of clients) and returns one reply
carrying the updates of all its clients. No task, no model pickling per client.
"""
from __future__ import annotations

import os
import time

import numpy as np
import ray
import torch

from .. import rng as rngmod
from ..local import local_update
from ..models import build_model
from ..scenario import Scenario


class ClientWorker:
    def __init__(self, scenario: dict, x_train: np.ndarray, y_train: np.ndarray, indices: np.ndarray,
                 offsets: np.ndarray, input_shape: tuple, num_classes: int):
        self.sc = Scenario.model_validate(scenario)
        torch.set_num_threads(self.sc.resources.torch_threads)
        use_cuda = self.sc.resources.num_gpus_per_worker > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda" if use_cuda else "cpu")
        # Arrays from the object store are read-only shared memory: read them, never copy whole.
        self.x, self.y, self.indices, self.offsets = x_train, y_train, indices, offsets
        self.model = build_model(self.sc.model, tuple(input_shape), num_classes, self.sc.seed).to(self.device)

    def info(self) -> dict:
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "device": str(self.device)}

    def run_clients(self, round_idx: int, theta: np.ndarray, client_ids: list[int],
                    upload_drops: list[int]) -> dict:
        """Local updates of ``client_ids`` from ``theta``. Clients in ``upload_drops`` train but
        their upload is lost (the fault plan's 'upload' phase), so nothing of theirs returns."""
        t0 = time.perf_counter()
        tr, seed = self.sc.training, self.sc.seed
        lost = set(upload_drops)
        ids, updates = [], []
        for cid in client_ids:
            idx = self.indices[self.offsets[cid]:self.offsets[cid + 1]]
            delta = local_update(
                self.model, theta, self.x[idx], self.y[idx], epochs=tr.local_epochs,
                batch_size=tr.batch_size, lr=tr.lr, clip_norm=tr.clip_norm,
                rng=rngmod.generator(seed, "batches", round_idx, cid),
                torch_seed=rngmod.int_seed(seed, "torch", round_idx, cid))
            if cid not in lost:
                ids.append(cid)
                updates.append(delta)
        stacked = np.stack(updates) if updates else np.zeros((0, len(theta)), np.float32)
        return {"client_ids": ids, "updates": stacked, "seconds": time.perf_counter() - t0}


def make_worker_class(num_cpus: float, num_gpus: float):
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)(ClientWorker)
