"""ClientWorker: a long-lived actor that hosts many logical clients.

It keeps the training data and one model copy for its whole life; per round it receives one
message (the model's object-store reference and its list of clients) and returns one reply
carrying the updates of all its clients. No task, no model pickling per client. What a client does
to its update before it leaves is the algorithm's ClientSpec; the worker never asks which
algorithm runs.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import TYPE_CHECKING

import numpy as np
import ray

from .. import rng as rngmod
from ..algorithms import ClientReport, ClientSpec
from ..training.evaluation import combine_shards, eval_shards
from ..scenario import Scenario
from ..training.heap import keep_freed_memory
from ..secagg import PHASES as PROTOCOL_PHASES
from ..secagg import EncodingError, EncodingOverflow, SecAggClient, encode, presum_masked
from ..secagg.keys import expand_masks
from ..faults.plan import check_update, corrupt, corruption_rng
from .messages import Canaries, Encoding, LocalReply, PhaseReply, WorkerChaos

if TYPE_CHECKING:
    import torch

    from ..training.local import local_update
    from ..training.local_batched import (
        batched_local_updates, batching_pays, clients_per_batch, reset_stack_usage, stack_padding, warm_up,
    )
    from ..training.models import build_model, initial_theta, model_file_bytes, one_thread, set_flat, shard_sums


def _load_training() -> None:
    """Bind torch and the training code into this module's namespace, when a ClientWorker starts.

    Not at import: Ray imports an actor's class module wherever a handle to it is deserialized,
    and the coordinator holds handles to every worker but trains nothing; importing torch there
    cost every run a second of CPU and 200 MB."""
    global torch, local_update, batched_local_updates, batching_pays, clients_per_batch, stack_padding  # noqa: PLW0603
    global warm_up, reset_stack_usage  # noqa: PLW0603
    global build_model, initial_theta, model_file_bytes, one_thread, set_flat, shard_sums  # noqa: PLW0603
    import torch

    from ..training.local import local_update
    from ..training.local_batched import (
        batched_local_updates, batching_pays, clients_per_batch, reset_stack_usage, stack_padding, warm_up,
    )
    from ..training.models import (
        allow_read_only_arrays, build_model, initial_theta, model_file_bytes, one_thread, set_flat, shard_sums,
    )

    allow_read_only_arrays()


# The worker's phases: the protocol's, then a calibration phase after unmasking (Baek et al.
# Alg. 2 line 22), for algorithms whose ClientNoise has one.
WORKER_PHASES = PROTOCOL_PHASES + ("calibration",)
# Memory a worker gives one batched training step (it sets K, the clients per stack).
BATCH_BUDGET_BYTES = 256 << 20
# clients trained, checked and summed before the next slice starts (a multiple of the batch stack)
SUM_CHUNK_CLIENTS = 256


def unencodable(err: EncodingError) -> str:
    """Why a client's value could not enter SecAgg's ring, naming no figure of it (its largest
    coordinate, its norm): the reason reaches rounds.jsonl, as faults.check_update's reasons do, and
    the value is one client's weighted update and noise share."""
    if isinstance(err, EncodingOverflow):
        return ("overflow: its value exceeds the fixed-point range of the ring (secagg.bits, secagg.scale; "
                "secagg.overflow: clip cuts it)")
    return f"its value cannot be encoded in the ring ({type(err).__name__}, {err.field or 'values'})"


class ClientWorker:
    def __init__(self, scenario: dict, data: dict):
        """``data``: the federation's object refs, nested so that Ray hands them over unresolved."""
        keep_freed_memory()
        _load_training()
        self._bind(scenario, data)

    def rebind(self, scenario: dict, data: dict) -> bool:
        """Serve another run (runtime/warm.py): every attribute a run set is dropped and
        ``__init__``'s work is done anew, so the worker is the one a fresh process would be; only
        the imports and the process stay."""
        self._bind(scenario, data)
        return True

    def release(self) -> bool:
        """Drop the run's data and model while the worker waits, parked, for the next run."""
        on_gpu = getattr(self, "device", None) is not None and self.device.type == "cuda"
        self.__dict__.clear()
        gc.collect()
        if on_gpu:  # the cached blocks go back to the GPU while parked
            torch.cuda.empty_cache()
        return True

    def _bind(self, scenario: dict, data: dict) -> None:
        self.__dict__.clear()
        reset_stack_usage()  # summary.placement.stack_padding: this run's stacks only
        self.sc = Scenario.model_validate(scenario, context={"read_files": False})
        torch.set_num_threads(self.sc.resources.torch_threads)
        use_cuda = self.sc.resources.num_gpus_per_worker > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda" if use_cuda else "cpu")
        # Arrays from the object store are read-only shared memory: read them, never copy whole.
        (self.x, self.y, self.indices, self.offsets, self.weights, self.x_test, self.y_test, self.x_val,
         self.y_val) = ray.get([data[k] for k in ("x_train", "y_train", "indices", "offsets", "weights", "x_test",
                                                  "y_test", "x_val", "y_val")], timeout=600)
        self._input_shape, self._num_classes = tuple(data["input_shape"]), data["num_classes"]
        self.model = build_model(self.sc.model, self._input_shape, self._num_classes, self.sc.seed).to(self.device)
        self._canaries: Canaries | None = None
        if use_cuda:  # a client's update must not depend on the kernels cuDNN picks for a stack
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        # Batched training is decided from the scenario alone (never from the pool), as is the
        # stack size K, so every worker trains every client the same way.
        tr, s = self.sc.training, self.sc.sampling
        cohort = s.clients_per_round if s.mode == "fixed" else s.rate * (len(self.offsets) - 1)
        self.batched = batching_pays(self.model, np.diff(self.offsets), cohort)
        if self.batched:
            self.stack = clients_per_batch(self.model, tuple(data["input_shape"]), tr.batch_size, BATCH_BUDGET_BYTES)
            warm_up(self.model, tuple(data["input_shape"]), tr.batch_size, data["num_classes"])

    def initial_model(self) -> np.ndarray:
        """The run's initial model, flat (models.initial_theta): the driver asks a worker, which has
        torch loaded, instead of loading torch itself (about 2 s of CPU a run)."""
        return initial_theta(self.sc.model, self._input_shape, self._num_classes, self.sc.seed)

    @ray.method(concurrency_group="files")
    def model_file(self, theta: np.ndarray) -> bytes:
        """model.pt's bytes for the flat model ``theta``, for the driver. Its own thread: a stopped
        run asks for the committed model while this worker may still train the round in flight, and
        the answer must not wait for that round (model_file_bytes draws nothing from torch's
        generator, and touches neither this worker's model nor its data)."""
        return model_file_bytes(self.sc.model, self._input_shape, self._num_classes, theta)

    def info(self) -> dict:
        """Where this worker runs, and the stack sizes its CPU made it pad (local_batched.stack_padding)."""
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "device": str(self.device),
                "stack_padding": stack_padding()}

    def _local(self, round_idx: int, theta: np.ndarray, cid: int, spec: ClientSpec) -> np.ndarray:
        tr, seed = self.sc.training, self.sc.seed
        idx = self.indices[self.offsets[cid]:self.offsets[cid + 1]]
        return local_update(
            self.model, theta, self.x[idx], self.y[idx], epochs=tr.local_epochs,
            batch_size=tr.batch_size, lr=tr.lr, clip_norm=tr.clip_norm,
            rng=rngmod.generator(seed, "batches", round_idx, cid),
            torch_seed=rngmod.int_seed(seed, "torch", round_idx, cid), prox_mu=spec.prox_mu)

    def _train(self, round_idx: int, theta: np.ndarray, cids: list[int], spec: ClientSpec,
               with_canaries: bool = True) -> dict[int, np.ndarray]:
        """Local updates of ``cids``: the algorithm's own procedure if it has one (its reports are
        kept in ``self._reports``), else Alg. 1 SGD -- K clients at a time as one vectorised
        computation when the scenario batches (dpfl_ray.training.local_batched; same updates to float
        tolerance), else one by one."""
        if with_canaries:
            self._reports = {}
        canaries = self._canaries if with_canaries else None
        if canaries is not None:  # canary clients send their direction and train nothing
            real = [c for c in cids if c < canaries.first_id]
            from ..privacy.audit import canary_update  # only audited runs pay for dp_accounting's import

            out = self._train(round_idx, theta, real, spec, with_canaries=False) if real else {}
            out.update({c: canary_update(canaries.seed, c - canaries.first_id, theta.size, canaries.norm)
                        for c in cids if c >= canaries.first_id})
            return out
        if spec.local is not None:
            out = {}
            for cid in cids:
                idx = self.indices[self.offsets[cid]:self.offsets[cid + 1]]
                out[cid], self._reports[cid] = spec.local.run(self.model, theta, self.x[idx], self.y[idx],
                                                              seed=self.sc.seed, round_idx=round_idx, client_id=cid)
            return out
        if not self.batched or spec.prox_mu or not cids:
            return {cid: self._local(round_idx, theta, cid, spec) for cid in cids}
        tr, seed = self.sc.training, self.sc.seed
        parts = [self.indices[self.offsets[c]:self.offsets[c + 1]] for c in cids]
        deltas = batched_local_updates(
            self.model, theta, [self.x[i] for i in parts], [self.y[i] for i in parts], epochs=tr.local_epochs,
            batch_size=tr.batch_size, lr=tr.lr, clip_norm=tr.clip_norm,
            rngs=[rngmod.generator(seed, "batches", round_idx, c) for c in cids],
            torch_seeds=[rngmod.int_seed(seed, "torch", round_idx, c) for c in cids], max_clients=self.stack)
        return dict(zip(cids, deltas))

    def _checked_updates(self, round_idx: int, theta: np.ndarray, cids: list[int], spec: ClientSpec,
                         chaos: WorkerChaos) -> dict[int, tuple[np.ndarray | None, str | None]]:
        """What each client sends (its update prepared as ``spec`` says: clipped, before weighting
        and noise), corrupted if the fault plan says so, and the server's check of it (NaN, Inf,
        shape, absurd norm): (vector, None) or (None, why it is refused). The check runs here,
        before the vector is summed or masked, because after that no one can look at it alone;
        it stands for the validity proof a client would attach, so it sees what the client sends,
        never the update before its clipping (whose norm the data decides)."""
        out = {}
        trained = self._train(round_idx, theta, cids, spec)
        if spec.evaluate_local:
            self._evaluate_local(theta, trained)
        for cid, delta in trained.items():
            sent = spec.prepare(delta, theta)
            if cid in chaos.corrupt:  # a faulty client: what it sends is broken, whatever it clipped
                sent = corrupt(sent, chaos.corrupt[cid], corruption_rng(self.sc.seed, round_idx, cid))
            reason = check_update(sent, spec.prepared_dim(theta.size), chaos.max_norm, spec.clip_norm,
                                  bool(spec.clip_norm and spec.indicator))
            out[cid] = (None, reason) if reason else (sent, None)
        return out

    def _evaluate_local(self, theta: np.ndarray, trained: dict[int, np.ndarray]) -> None:
        """Each real client's own model theta + Delta on the test split, into its report."""
        first_canary = self._canaries.first_id if self._canaries is not None else None
        for cid, delta in trained.items():
            if first_canary is not None and cid >= first_canary:
                continue
            acc, loss = self.evaluate(theta + delta)
            report = self._reports.get(cid, ClientReport())
            self._reports[cid] = dataclasses.replace(
                report, values={**report.values, "local_test_accuracy": acc, "local_test_loss": loss})

    def run_clients(self, round_idx: int, theta: np.ndarray, groups: dict[int, list[int]],
                    undelivered: list[int], spec: ClientSpec, chaos: WorkerChaos = WorkerChaos(),
                    canaries: Canaries | None = None, evaluate: list[tuple[int, int]] | None = None) -> LocalReply:
        """The uploads of the clients in ``groups`` (summation group -> client ids in id order):
        their local updates from ``theta``, prepared as ``spec`` says, summed per group as
        w_i * upload_i unless the algorithm needs each one. Clients in ``undelivered`` train but
        their upload never arrives (the fault plan), so nothing of theirs returns; refused
        updates come back as reasons. ``evaluate``: test row ranges on which ``theta`` itself (the
        last round's model) is evaluated first, so that its evaluation needs no call of its own."""
        evals, eval_s = None, 0.0
        if evaluate:
            t_eval = time.perf_counter()
            evals = self.evaluate_shards(theta, "test", evaluate)
            eval_s = time.perf_counter() - t_eval
        t0 = time.perf_counter()
        self._canaries = canaries
        lost = set(undelivered)
        ids, uploads, sums, rejected, reports = [], [], {}, {}, {}
        order = [(g, c) for g, members in groups.items() for c in members]
        # Train, check and sum a slice of clients at a time, so that memory does not grow with the
        # cohort (issue #14, W4); the sums still run per group in client-id order.
        step = SUM_CHUNK_CLIENTS
        if self.batched:  # whole stacks per slice: the same stacks as training them all at once
            step = -(-SUM_CHUNK_CLIENTS // self.stack) * self.stack
        for lo in range(0, len(order), step):
            part = order[lo:lo + step]
            checked = self._checked_updates(round_idx, theta, [c for _, c in part], spec, chaos)
            reports.update(self._reports)
            for g, cid in part:
                sent, reason = checked.pop(cid)
                if cid in lost:
                    continue
                if reason:
                    rejected[cid] = reason
                    continue
                value = spec.plain_value(sent, cid)
                ids.append(cid)
                if spec.per_client:
                    uploads.append(value)
                else:
                    term = value.astype(np.float64) * float(self.weights[cid])
                    sums[g] = term if g not in sums else sums[g] + term
        stacked = (np.stack(uploads) if uploads else np.zeros((0, len(theta)), np.float32)) if spec.per_client else None
        if chaos.delay:  # the slowest on-time client of this worker holds the reply back, for real
            time.sleep(chaos.delay)
        return LocalReply(ids, time.perf_counter() - t0, updates=stacked, sums=sums, rejected=rejected,
                          reports={c: reports[c] for c in ids if c in reports}, evals=evals, eval_seconds=eval_s)

    def evaluate(self, theta: np.ndarray, split: str = "test") -> tuple[float, float]:
        """Accuracy and loss of ``theta`` on the test split (or the held-out validation split)."""
        n = len(self.y_test if split == "test" else self.y_val)
        return combine_shards(self.evaluate_shards(theta, split, eval_shards(n)), n)

    def evaluate_shards(self, theta: np.ndarray, split: str, shards: list[tuple[int, int]]) -> list[tuple[int, float]]:
        """(correct, summed loss) of ``theta`` on these row ranges of the test (or validation)
        split, with one thread so the figures never depend on the pool."""
        with one_thread():
            set_flat(self.model, theta)
            x, y = (self.x_test, self.y_test) if split == "test" else (self.x_val, self.y_val)
            return shard_sums(self.model, x, y, shards)

    # -- secure aggregation: the client side of the four rounds, for all of this worker's clients --
    def secagg_start(self, round_idx: int, theta: np.ndarray, clients: dict, leave: dict, config,
                     weights: dict, encoding: Encoding, spec: ClientSpec, chaos: WorkerChaos = WorkerChaos(),
                     canaries: Canaries | None = None) -> PhaseReply:
        """Train, encode w_i * vector (+ the client's noise) into Z_2^b, and advertise keys
        (Bonawitz et al. Round 0).

        ``clients`` maps client id -> protocol index; ``leave`` maps client id -> the worker phase
        (WORKER_PHASES) from which that client sends nothing (the fault plan)."""
        self._canaries = canaries
        self._sa = {"clients": {}, "inputs": {}, "cids": {}, "weights": {}, "spec": spec, "delay": chaos.delay,
                    "leave": {clients[c]: WORKER_PHASES.index(p) for c, p in leave.items() if c in clients}}
        clipped, rejected = 0, {}
        checked = self._checked_updates(round_idx, theta, list(clients), spec, chaos)
        for cid, idx in clients.items():
            sent, reason = checked[cid]
            if reason:  # refused before it is masked: the client never joins the protocol
                rejected[cid] = reason
                continue
            if spec.ring is not None:  # integer noise: the client's words of Z_2^b itself (secagg/ring.py)
                try:
                    self._sa["inputs"][idx] = spec.ring_words(sent, cid, weights[cid])
                except EncodingError as err:
                    return PhaseReply(aborted=f"client {cid}: {unencodable(err)}")
            else:
                value = spec.weighted_value(sent, cid, weights[cid])
                try:
                    enc = encode(value, bits=config.bits, scale=encoding.scale, n_summands=encoding.n_summands,
                                 rng=rngmod.generator(self.sc.seed, "encode", round_idx, cid),
                                 overflow="clip" if encoding.overflow == "clip" else "raise")
                except EncodingError as err:  # the round cannot go on; say why instead of crashing the run
                    return PhaseReply(aborted=f"client {cid}: {unencodable(err)}")
                if enc.clip is not None:
                    clipped += enc.clip.n_clipped
                self._sa["inputs"][idx] = enc.data
            self._sa["clients"][idx] = SecAggClient(idx, config)
            self._sa["cids"][idx], self._sa["weights"][idx] = cid, float(weights[cid])
        reports = {c: self._reports[c] for c in clients if c in self._reports and c not in rejected}
        return PhaseReply(self._phase("advertise", lambda c: c.advertise_keys()), clipped=clipped, rejected=rejected,
                          reports=reports)

    def _phase(self, phase: str, call, only=None) -> list:
        """Call ``call`` for each client still online in ``phase`` (and in ``only``, if given)."""
        order, leave = WORKER_PHASES.index(phase), self._sa["leave"]
        return [call(client) for idx, client in self._sa["clients"].items()
                if leave.get(idx, len(WORKER_PHASES)) > order and (only is None or idx in only)]

    def secagg_share(self, keys: dict, absent: int) -> PhaseReply:
        """Round 1. Noise seeds the ClientNoise wants shared (Baek's layered calibration) are
        Shamir-shared with b_u and s_u^SK; ``absent`` sampled clients never joined the protocol."""
        noise = self._sa["spec"].noise
        if noise is None:
            return PhaseReply(self._phase("share", lambda c: c.share_keys(keys)))
        return PhaseReply(self._phase("share", lambda c: c.share_keys(
            keys, layer_seeds=noise.shared_seeds(self._sa["cids"][c.id]), absent=absent)))

    def secagg_masked(self, forwarded: dict) -> PhaseReply:
        """Masked inputs of this worker's clients, pre-summed mod 2^b into one message."""
        msgs = self._phase("masked_input", lambda c: c.masked_input(forwarded[c.id], self._sa["inputs"][c.id]),
                           only=set(forwarded))
        if self._sa["delay"]:  # the upload phase: stragglers hold it back, for real
            time.sleep(self._sa["delay"])
        if not msgs:
            return PhaseReply([])
        return PhaseReply([presum_masked(msgs, next(iter(self._sa["clients"].values())).config.bits)])

    def secagg_unmask(self, request: dict) -> PhaseReply:
        """Unmask shares of this worker's clients among ``request["survivors"]``."""
        msgs = self._phase("unmask", lambda c: c.unmask(request), only=set(request["survivors"]))
        return PhaseReply(msgs, bytes_sent={c.id: c.bytes_sent for c in self._sa["clients"].values()})

    def secagg_calibrating(self, survivors: list[int]) -> PhaseReply:
        """Which of this worker's ``survivors`` (protocol indices) take part in the calibration (Baek
        et al. Alg. 2 line 22 / Alg. 3 line 34): their client ids, each with no term yet, so that the
        server checks and lists the senders before any term reaches it (``secagg_calibration``)."""
        ready = self._phase("calibration", lambda c: c.id, only=set(survivors))
        return PhaseReply(calibration={self._sa["cids"][idx]: None for idx in ready})

    def secagg_calibration(self, senders: list[int], calibration_n_prime: float) -> PhaseReply:
        """The calibration terms of ``senders`` (protocol indices the server listed), per client id so
        the server sums in id order."""
        noise, terms, sent = self._sa["spec"].noise, {}, {}
        for idx in senders:
            cid, dim = self._sa["cids"][idx], int(self._sa["inputs"][idx].size)
            terms[cid] = noise.calibration_term(cid, self._sa["weights"][idx], dim, calibration_n_prime)
            if self._sa["spec"].ring is None:  # ring words go through their own secure sum, counted there
                sent[idx] = terms[cid].nbytes
        return PhaseReply(calibration=terms, bytes_sent=sent)

    def expand_masks(self, masks: list[tuple[bytes, int]], dim: int, dtype: str) -> np.ndarray:
        """The server's work, lent to this idle worker after the unmask phase: sum of
        sign * PRG(seed) mod 2^bits over its share of the masks to remove (secagg.keys.expand_masks)."""
        return expand_masks(masks, dim, dtype)


def make_worker_class(num_cpus: float, num_gpus: float):
    # SPREAD: on a cluster the pool covers every node, each worker with its GPU fraction, instead of
    # filling the driver's node first (Ray's default); on one machine it changes nothing. Inside a
    # sweep trial's placement group (runtime/trials.py) the workers go into its bundles instead:
    # Ray places them there only when no strategy of their own is given.
    from ray.util import get_current_placement_group

    strategy = None if get_current_placement_group() is not None else "SPREAD"
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, scheduling_strategy=strategy,
                      concurrency_groups={"files": 1})(ClientWorker)
