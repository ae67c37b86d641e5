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
from ..algorithms.baek import calibration_term, client_layer_seeds, client_noise
from ..algorithms.base import client_vector
from ..local import local_update
from ..secagg import PHASES as PROTOCOL_PHASES
from ..secagg import SecAggClient, encode, presum_masked
from ..models import build_model
from ..scenario import Scenario

# The worker's phases: the protocol's, then Baek et al.'s calibration (Alg. 2 line 22).
WORKER_PHASES = PROTOCOL_PHASES + ("calibration",)


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

    def _local(self, round_idx: int, theta: np.ndarray, cid: int) -> np.ndarray:
        tr, seed = self.sc.training, self.sc.seed
        idx = self.indices[self.offsets[cid]:self.offsets[cid + 1]]
        return local_update(
            self.model, theta, self.x[idx], self.y[idx], epochs=tr.local_epochs,
            batch_size=tr.batch_size, lr=tr.lr, clip_norm=tr.clip_norm,
            rng=rngmod.generator(seed, "batches", round_idx, cid),
            torch_seed=rngmod.int_seed(seed, "torch", round_idx, cid))

    def run_clients(self, round_idx: int, theta: np.ndarray, client_ids: list[int],
                    undelivered: list[int]) -> dict:
        """Local updates of ``client_ids`` from ``theta``. Clients in ``undelivered`` train but
        their upload never arrives (the fault plan), so nothing of theirs returns."""
        t0 = time.perf_counter()
        lost = set(undelivered)
        ids, updates = [], []
        for cid in client_ids:
            delta = self._local(round_idx, theta, cid)
            if cid not in lost:
                ids.append(cid)
                updates.append(delta)
        stacked = np.stack(updates) if updates else np.zeros((0, len(theta)), np.float32)
        return {"client_ids": ids, "updates": stacked, "seconds": time.perf_counter() - t0}

    # -- secure aggregation: the client side of the four rounds, for all of this worker's clients --
    def secagg_start(self, round_idx: int, theta: np.ndarray, clients: dict, leave: dict,
                     config, weights: dict, encoding: dict, spec: dict) -> dict:
        """Train, encode w_i * Delta_i (+ e_i, Baek et al.) into Z_2^b, and advertise keys
        (Bonawitz et al. Round 0).

        ``clients`` maps client id -> protocol index; ``leave`` maps client id -> the worker phase
        (WORKER_PHASES) from which that client sends nothing (the fault plan)."""
        t0 = time.perf_counter()
        noise = spec.get("noise")
        self._sa = {"clients": {}, "inputs": {}, "clip_events": [], "cids": {}, "weights": {}, "noise": noise,
                    "leave": {clients[c]: WORKER_PHASES.index(p) for c, p in leave.items() if c in clients}}
        for cid, idx in clients.items():
            value = client_vector(self._local(round_idx, theta, cid), spec) * np.float32(weights[cid])
            if noise is not None:
                value = value.astype(np.float64) + client_noise(noise, cid, weights[cid], value.size)
            enc = encode(value, bits=config.bits, scale=encoding["scale"], n_summands=encoding["n_summands"],
                         rng=rngmod.generator(self.sc.seed, "encode", round_idx, cid),
                         overflow="clip" if encoding["overflow"] == "clip" else "raise")
            if enc.clip is not None:
                self._sa["clip_events"].append({"client": cid, "clipped": enc.clip.n_clipped})
            self._sa["inputs"][idx] = enc.data
            self._sa["clients"][idx] = SecAggClient(idx, config)
            self._sa["cids"][idx], self._sa["weights"][idx] = cid, float(weights[cid])
        msgs = self._phase("advertise", lambda c: c.advertise_keys())
        return {"messages": msgs, "clip_events": self._sa["clip_events"], "seconds": time.perf_counter() - t0}

    def _phase(self, phase: str, call, only=None) -> list:
        """Call ``call`` for each client still online in ``phase`` (and in ``only``, if given)."""
        order, leave = WORKER_PHASES.index(phase), self._sa["leave"]
        return [call(client) for idx, client in self._sa["clients"].items()
                if leave.get(idx, len(WORKER_PHASES)) > order and (only is None or idx in only)]

    def secagg_share(self, keys: dict) -> dict:
        noise = self._sa["noise"]
        if noise is None or noise.get("mode") != "layered":
            return {"messages": self._phase("share", lambda c: c.share_keys(keys))}
        # layered calibration: the seeds of noise layers 1..L are Shamir-shared with b_u and s_u^SK
        absent = noise["N"] - next(iter(self._sa["clients"].values())).config.n_clients
        return {"messages": self._phase("share", lambda c: c.share_keys(
            keys, layer_seeds=client_layer_seeds(noise, self._sa["cids"][c.id]), absent=absent))}

    def secagg_masked(self, forwarded: dict) -> dict:
        """Masked inputs of this worker's clients, pre-summed mod 2^b into one message."""
        msgs = self._phase("masked_input", lambda c: c.masked_input(forwarded[c.id], self._sa["inputs"][c.id]),
                           only=set(forwarded))
        bits = msgs[0]["masked"].dtype.itemsize * 8 if msgs else 0
        return {"messages": [presum_masked(msgs, bits)] if msgs else []}

    def secagg_unmask(self, request: dict, calibration: dict | None = None) -> dict:
        """Unmask shares; with ``calibration`` ({"n_prime"}) also each survivor's calibration term
        (Baek et al. Alg. 2 line 22 / Alg. 3 line 34), per client so the server sums in id order."""
        survivors = set(request["survivors"])
        msgs = self._phase("unmask", lambda c: c.unmask(request), only=survivors)
        terms, sent = {}, {c.id: c.bytes_sent for c in self._sa["clients"].values()}
        if calibration is not None:
            for idx in self._phase("calibration", lambda c: c.id, only=survivors):
                cid, dim = self._sa["cids"][idx], int(self._sa["inputs"][idx].size)
                terms[cid] = calibration_term(self._sa["noise"], cid, self._sa["weights"][idx], dim,
                                              calibration["n_prime"])
                sent[idx] += terms[cid].nbytes
        return {"messages": msgs, "calibration": terms, "bytes_sent": sent}


def make_worker_class(num_cpus: float, num_gpus: float):
    # SPREAD: on a cluster the pool covers every node, each worker with its GPU fraction, instead of
    # filling the driver's node first (Ray's default); on one machine it changes nothing.
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0,
                      scheduling_strategy="SPREAD")(ClientWorker)
