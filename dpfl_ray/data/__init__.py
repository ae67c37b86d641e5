"""Data: sources, partitions and the :class:`Federation` that ties them to clients."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .. import rng as rngmod
from ..errors import DPFLError
from ..scenario import MAX_EXAMPLES
from . import partition as P
from .sources import Dataset, load_source


@dataclass(frozen=True)
class Federation:
    """The clients of a run: who holds which training examples, and each client's weight.

    Indices are stored flat (``indices[offsets[i]:offsets[i+1]]`` is client i) so the whole
    federation travels to the workers as three arrays.
    """

    dataset: Dataset
    indices: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray
    validation: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # held out of every client
    # (x, y) held out of the test split instead (data.validation_from: test); dataset.x_test is then the rest
    held_from_test: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def client_indices(self, client_id: int) -> np.ndarray:
        return self.indices[self.offsets[client_id]:self.offsets[client_id + 1]]

    def validation_split(self) -> tuple[np.ndarray, np.ndarray]:
        """The server's validation inputs and labels (empty when the scenario holds none out)."""
        if self.held_from_test is not None:
            return self.held_from_test
        return self.dataset.x_train[self.validation], self.dataset.y_train[self.validation]


def _drawn_sizes(p, num_clients: int, g) -> np.ndarray:
    """The clients' drawn sizes, refused before any index is made if a heavy tail draws more examples
    in all than a scenario may ask for (MAX_EXAMPLES, as num_clients x examples_per_client)."""
    sizes = P.unbalanced_sizes(num_clients, p.size_distribution, p.size_mean, p.size_sigma, p.min_size, g)
    if int(sizes.sum()) > MAX_EXAMPLES:
        lognormal = p.size_distribution == "lognormal"  # its tail is size_sigma's; the others' sum is size_mean's
        raise DPFLError(f"the {p.size_distribution} sizes drawn for {num_clients} clients sum to {int(sizes.sum()):,} "
                        f"examples; at most {MAX_EXAMPLES:,}: lower size_mean{' or size_sigma' if lognormal else ''}",
                        field="data.partition.size_sigma" if lognormal else "data.partition.size_mean")
    return sizes


def make_partition(labels: np.ndarray, data_cfg, seed: int) -> list[np.ndarray]:
    p, k = data_cfg.partition, data_cfg.num_clients
    g = rngmod.generator(seed, "partition")
    epc, rep = data_cfg.examples_per_client, data_cfg.repeat
    if p.kind == "iid":
        return P.iid(labels, k, g, epc, rep)
    if p.kind == "shards":
        return P.shards(labels, k, p.shards_per_client, g, epc, rep)
    if p.kind == "dirichlet":
        if p.sizes == "unbalanced":
            if epc is not None:
                raise DPFLError("partition.sizes: unbalanced draws each client's size; remove examples_per_client",
                                field="data.examples_per_client")
            epc = _drawn_sizes(p, k, g)
        return P.dirichlet(labels, k, p.alpha, g, epc, rep, p.min_size)
    if p.kind == "unbalanced":
        if epc is not None:
            raise DPFLError("unbalanced partitions draw their own sizes; remove examples_per_client",
                            field="data.examples_per_client")
        sizes = _drawn_sizes(p, k, g)
        return P.unbalanced(labels, k, sizes, g, rep)
    raise DPFLError(f"unknown partition {p.kind!r}", field="data.partition.kind")


def _held_out(labels: np.ndarray, fraction: float, seed: int, split: str) -> np.ndarray:
    """A seeded, stratified hold-out of ``fraction`` of each class (sorted indices into ``labels``)."""
    g = rngmod.generator(seed, "validation")
    held = [g.permutation(np.flatnonzero(labels == label)) for label in np.unique(labels)]
    out = np.sort(np.concatenate([h[:int(round(len(h) * fraction))] for h in held])).astype(np.int64)
    if len(out) == 0:  # what reads it (Fu's noise decay) would silently never run
        raise DPFLError(f"{fraction:g} of {len(labels)} {split} examples in {len(held)} classes holds none out "
                        "(each class rounds its share); raise it or use more data", field="data.validation_fraction")
    return out


def build_federation(scenario) -> Federation:
    dataset = load_source(scenario.data, scenario.seed)
    pool, validation = np.arange(len(dataset.y_train)), np.zeros(0, dtype=np.int64)
    held_from_test = None
    fraction = scenario.data.validation_fraction
    if fraction > 0 and scenario.data.validation_from == "test":
        # the server's validation split comes out of the test split; every training example stays dealt
        held = _held_out(dataset.y_test, fraction, scenario.seed, "test")
        rest = np.setdiff1d(np.arange(len(dataset.y_test)), held)
        held_from_test = (dataset.x_test[held], dataset.y_test[held])
        dataset = replace(dataset, x_test=dataset.x_test[rest], y_test=dataset.y_test[rest])
    elif fraction > 0:
        # a hold-out that no client ever trains on (Fu et al.'s validation split)
        validation = _held_out(dataset.y_train, fraction, scenario.seed, "training")
        pool = np.setdiff1d(pool, validation)
    parts = [pool[p] for p in make_partition(dataset.y_train[pool], scenario.data, scenario.seed)]
    sizes = np.array([len(p) for p in parts], dtype=np.int64)
    if sizes.min() < 1:
        raise DPFLError("some client received no examples", field="data.partition")
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    weights = P.client_weights(sizes, scenario.data.n_max)
    return Federation(dataset, np.concatenate(parts).astype(np.int64), offsets, weights, validation, held_from_test)


__all__ = ["Dataset", "Federation", "build_federation", "load_source", "make_partition"]
