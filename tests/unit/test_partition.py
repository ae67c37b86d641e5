import numpy as np
import pytest

from dpfl_ray.data import partition as P
from dpfl_ray.errors import DPFLError

LABELS = np.repeat(np.arange(10), 100)  # 1,000 examples, 100 per class


def g(seed=0):
    return np.random.default_rng(seed)


def test_iid_sizes_and_disjoint():
    parts = P.iid(LABELS, 10, g(), examples_per_client=100)
    assert [len(p) for p in parts] == [100] * 10
    assert len(np.unique(np.concatenate(parts))) == 1000


def test_iid_default_uses_all_data_equally():
    parts = P.iid(LABELS, 7, g())
    assert [len(p) for p in parts] == [142] * 7
    assert len(np.unique(np.concatenate(parts))) == 7 * 142


def test_iid_too_many_examples_needs_repeat():
    with pytest.raises(DPFLError, match="data.examples_per_client"):
        P.iid(LABELS, 100, g(), examples_per_client=40)


def test_iid_repetition_uses_each_example_evenly():
    parts = P.iid(LABELS, 30, g(), examples_per_client=100, repeat=True)  # 3,000 from 1,000
    counts = np.bincount(np.concatenate(parts), minlength=1000)
    assert counts.min() == 3 and counts.max() == 3


def test_shards_have_one_label_each():
    parts = P.shards(LABELS, 20, 2, g())  # 40 shards of 25
    for part in parts:
        assert len(part) == 50
        for shard in (part[:25], part[25:]):
            assert len(np.unique(LABELS[shard])) == 1
    assert len(np.unique(np.concatenate(parts))) == 1000


def test_shards_with_repetition_stay_label_pure_and_diverse():
    # Geyer et al.: many clients x 600 examples from a small set, two shards each.
    parts = P.shards(LABELS, 50, 2, g(), examples_per_client=60, repeat=True)  # 3,000 from 1,000
    for part in parts:
        assert len(part) == 60
        for shard in (part[:30], part[30:]):
            assert len(np.unique(LABELS[shard])) == 1
            assert len(np.unique(shard)) == 30  # cycling within a class, not copies in place
    counts = np.bincount(np.concatenate(parts), minlength=1000)
    assert counts.min() == 3 and counts.max() == 3


def test_shards_impossible():
    with pytest.raises(DPFLError, match="shards_per_client"):
        P.shards(LABELS, 600, 2, g())
    with pytest.raises(DPFLError, match="examples_per_client"):
        P.shards(LABELS, 10, 3, g(), examples_per_client=100)


def test_dirichlet_uses_all_data_and_is_skewed():
    parts = P.dirichlet(LABELS, 10, 0.1, g())
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    dominant = [np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts]
    assert np.mean(dominant) > 0.5  # alpha=0.1 concentrates each client on few labels
    iid_like = P.dirichlet(LABELS, 10, 1000.0, g())
    assert np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in iid_like]) < 0.2


def test_dirichlet_fixed_sizes_with_repeat():
    parts = P.dirichlet(LABELS, 40, 0.5, g(), examples_per_client=50, repeat=True)
    assert [len(p) for p in parts] == [50] * 40
    with pytest.raises(DPFLError):
        P.dirichlet(LABELS, 40, 0.5, g(), examples_per_client=50, repeat=False)


def test_unbalanced_sizes_follow_distribution():
    sizes = P.unbalanced_sizes(2000, "lognormal", 50.0, 1.0, 2, g())
    assert sizes.min() >= 2
    assert 40 < sizes.mean() < 60 and sizes.max() > 5 * np.median(sizes)
    parts = P.unbalanced(np.zeros(sizes.sum(), dtype=int), 2000, sizes, g())
    assert [len(p) for p in parts] == sizes.tolist()
    with pytest.raises(DPFLError, match="size_mean"):
        P.unbalanced(LABELS, 2000, sizes, g())


def test_weights_are_capped_ratios():
    w = P.client_weights(np.array([10, 60, 120, 300]), n_max=120)
    np.testing.assert_allclose(w, [10 / 120, 0.5, 1.0, 1.0])
    np.testing.assert_allclose(P.client_weights(np.array([5, 10])), [0.5, 1.0])


def test_partition_is_a_function_of_the_seed():
    a = P.shards(LABELS, 20, 2, g(5))
    b = P.shards(LABELS, 20, 2, g(5))
    c = P.shards(LABELS, 20, 2, g(6))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
