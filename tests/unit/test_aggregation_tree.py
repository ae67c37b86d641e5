"""The aggregation tree's leaves: summation groups that depend on the model, never on the pool."""
import numpy as np

from dpfl_ray.algorithms import weighted_sum
from dpfl_ray.runtime.resources import assign_groups, summation_groups


def test_groups_depend_on_the_model_size_only():
    assert summation_groups(26_000) == 64
    assert summation_groups(10_000_000) == 1
    assert 1 < summation_groups(1_000_000) < 64


def _tree_sum(ids, updates, weights, sizes, workers):
    """What workers and coordinator compute: per-group sums in id order, then groups in order."""
    sums = {}
    for groups in assign_groups(ids, sizes, 8, workers):
        for g, members in groups.items():
            assert members == sorted(members)
            sums[g] = weighted_sum({c: updates[c] for c in members}, weights)[0]
    return sum(sums[g] for g in sorted(sums))


def test_the_sum_is_bitwise_the_same_for_any_number_of_workers():
    rng = np.random.default_rng(0)
    ids = sorted(rng.choice(500, 100, replace=False).tolist())
    updates = {c: rng.normal(size=1000).astype(np.float32) for c in ids}
    weights, sizes = rng.uniform(0.2, 1.0, 500), rng.integers(1, 50, 500)
    results = [_tree_sum(ids, updates, weights, sizes, w) for w in (1, 2, 3, 7, 16)]
    assert all(np.array_equal(r, results[0]) for r in results)
    np.testing.assert_allclose(results[0], weighted_sum(updates, weights)[0], rtol=1e-12, atol=1e-12)
    for w in (2, 7):  # every client exactly once, whole groups per worker
        assigned = [c for groups in assign_groups(ids, sizes, 8, w) for m in groups.values() for c in m]
        assert sorted(assigned) == ids
