"""Client partitions of a training set (pure NumPy).

A partition is a list of index arrays into the training set, one per client. Repetition
(``repeat: true``) lets ``examples_per_client * num_clients`` exceed the data, as Geyer et al. 2017
and Baek et al. 2021 do to simulate thousands of users from MNIST; without it that is an error.
"""
from __future__ import annotations

import numpy as np

from ..errors import DPFLError


def _check_total(needed: int, available: int, repeat: bool, what: str) -> None:
    if needed > available and not repeat:
        raise DPFLError(
            f"{what} needs {needed} examples but the training set has {available}; "
            "set data.repeat: true to reuse examples", field="data.examples_per_client")


def _stretch(order: np.ndarray, needed: int) -> np.ndarray:
    """``order`` cycled (or cut) to length ``needed``: each example used floor/ceil(needed/N) times."""
    return np.resize(order, needed)


def _split_equal(pool: np.ndarray, num_clients: int, per_client: int) -> list[np.ndarray]:
    return [pool[i * per_client:(i + 1) * per_client] for i in range(num_clients)]


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator,
        examples_per_client: int | None = None, repeat: bool = False) -> list[np.ndarray]:
    n = len(labels)
    per = examples_per_client or n // num_clients
    if per < 1:
        raise DPFLError(f"{num_clients} clients cannot share {n} examples", field="data.num_clients")
    _check_total(per * num_clients, n, repeat, f"{num_clients} clients x {per} examples")
    return _split_equal(_stretch(rng.permutation(n), per * num_clients), num_clients, per)


def _label_sorted(labels: np.ndarray, needed: int, rng: np.random.Generator) -> np.ndarray:
    """Indices sorted by label, each class shuffled then cycled to its share of ``needed``.

    Cycling within a class (rather than repeating each example in place) keeps a shard of a
    repeated dataset made of many distinct examples.
    """
    classes, counts = np.unique(labels, return_counts=True)
    shares = np.floor(counts / counts.sum() * needed).astype(int)
    shares[np.argsort(-counts, kind="stable")[: needed - shares.sum()]] += 1
    return np.concatenate([_stretch(rng.permutation(np.flatnonzero(labels == c)), s)
                           for c, s in zip(classes, shares)])


def shards(labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator,
           examples_per_client: int | None = None, repeat: bool = False) -> list[np.ndarray]:
    """Sort by label, cut into ``num_clients * k`` shards, give each client k (McMahan et al. 2017)."""
    n, k = len(labels), shards_per_client
    num_shards = num_clients * k
    if examples_per_client is None:
        shard_size = n // num_shards
        if shard_size < 1:
            raise DPFLError(f"{num_shards} shards of {n} examples would be empty; "
                            "lower shards_per_client or set examples_per_client with repeat",
                            field="data.partition.shards_per_client")
    else:
        if examples_per_client % k:
            raise DPFLError(f"{examples_per_client} examples do not split into {k} equal shards",
                            field="data.examples_per_client")
        shard_size = examples_per_client // k
    needed = num_shards * shard_size
    _check_total(needed, n, repeat, f"{num_shards} shards x {shard_size} examples")
    pool = _label_sorted(labels, needed, rng)
    order = rng.permutation(num_shards)
    return [np.concatenate([pool[s * shard_size:(s + 1) * shard_size] for s in order[i * k:(i + 1) * k]])
            for i in range(num_clients)]


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator,
              examples_per_client: int | np.ndarray | None = None, repeat: bool = False,
              min_size: int = 1, max_tries: int = 100) -> list[np.ndarray]:
    """Label-skewed clients: class mixes drawn from Dir(alpha) (Hsu et al. 2019).

    Without ``examples_per_client`` each class is split over clients by Dir(alpha) proportions
    (sizes vary, all data used once). With it (one size for all, or one per client), each client
    draws its own label mix and that many examples from per-class pools, cycling the pools only
    when ``repeat`` allows.
    """
    classes = np.unique(labels)
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    if examples_per_client is None:
        for _ in range(max_tries):
            parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
            for idx in by_class:
                cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha))) * len(idx)).astype(int)[:-1]
                for client, chunk in enumerate(np.split(idx, cuts)):
                    parts[client].append(chunk)
            result = [np.concatenate(p) for p in parts]
            if min(len(r) for r in result) >= min_size:
                return result
        raise DPFLError(f"after {max_tries} draws some client still had fewer than {min_size} examples; "
                        "raise alpha, lower num_clients, or set examples_per_client",
                        field="data.partition.alpha")
    sizes = np.broadcast_to(np.asarray(examples_per_client, dtype=np.int64), (num_clients,))
    _check_total(int(sizes.sum()), len(labels), repeat,
                 f"{num_clients} clients x {examples_per_client if np.ndim(examples_per_client) == 0 else 'their'} "
                 "examples")
    cursor = np.zeros(len(classes), dtype=np.int64)
    result = []
    for size in sizes:
        counts = rng.multinomial(int(size), rng.dirichlet(np.full(len(classes), alpha)))
        chunks = []
        for c, k in enumerate(counts):
            pool = by_class[c]
            if cursor[c] + k > len(pool) and not repeat:
                raise DPFLError(f"class {classes[c]} runs out of examples; set data.repeat: true",
                                field="data.partition.alpha")
            chunks.append(pool[np.arange(cursor[c], cursor[c] + k) % len(pool)])
            cursor[c] += k
        result.append(np.concatenate(chunks))
    return result


def unbalanced_sizes(num_clients: int, distribution: str, mean: float, sigma: float, min_size: int,
                     rng: np.random.Generator) -> np.ndarray:
    if distribution == "lognormal":
        raw = rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, size=num_clients)
    elif distribution == "uniform":
        raw = rng.uniform(min_size, max(2 * mean - min_size, min_size), size=num_clients)
    else:  # zipf: heavy tail, scaled so the mean is about ``mean``
        z = rng.zipf(2.0, size=num_clients).astype(float)
        raw = z / z.mean() * mean
    return np.maximum(np.round(raw).astype(np.int64), min_size)


def unbalanced(labels: np.ndarray, num_clients: int, sizes: np.ndarray, rng: np.random.Generator,
               repeat: bool = False) -> list[np.ndarray]:
    """IID labels, client sizes given (Huang et al. 2020's unbalanced setting)."""
    total = int(sizes.sum())
    if total > len(labels) and not repeat:
        raise DPFLError(f"client sizes sum to {total} but the training set has {len(labels)}; "
                        "lower partition.size_mean or set data.repeat: true", field="data.partition.size_mean")
    pool = _stretch(rng.permutation(len(labels)), total)
    return np.split(pool, np.cumsum(sizes)[:-1])


def client_weights(sizes: np.ndarray, n_max: float | None = None) -> np.ndarray:
    """w_i = min(n_i / n_max, 1) (Baek et al. 2021, Alg. 2 line 8); n_max defaults to the largest n_i."""
    sizes = np.asarray(sizes, dtype=np.float64)
    cap = float(n_max) if n_max is not None else float(sizes.max())
    return np.minimum(sizes / cap, 1.0)
