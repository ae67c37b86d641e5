"""SecAgg+ degree and threshold from a dropout fraction (Bell et al. 2020), checked against exact
counts on small graphs, random dropouts on large ones, and full rounds with real keys."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from pydantic import ValidationError

from dpfl_ray.errors import DPFLError
from dpfl_ray.scenario import SecAggConfig as SecAggSection
from dpfl_ray.scenario import load_scenario
from dpfl_ray.secagg import SecAggRoundConfig, build_graph, secagg_plus_parameters, secure_sum
from dpfl_ray.secagg.parameters import disconnection_bound, evaluate, shortfall_bound

# (n, gamma) -> (k, t) as picked for failure <= 2^-20; also the table of docs/secagg.md.
TABLE = {(100, 0.1): (18, 10), (100, 0.3): (58, 30), (1000, 0.1): (32, 17), (1000, 0.3): (168, 85),
         (10000, 0.1): (38, 20), (10000, 0.3): (226, 114)}


@pytest.mark.parametrize("n,gamma", sorted(TABLE))
def test_picked_degree_is_the_smallest_even_one_meeting_the_bound(n, gamma):
    chosen = secagg_plus_parameters(n, gamma)
    assert (chosen.degree, chosen.threshold) == TABLE[n, gamma]
    assert chosen.dropouts == math.floor(gamma * n) and chosen.failure <= 2.0 ** -20
    assert chosen.threshold == (chosen.degree + 1) // 2 + 1  # a strict majority of the k + 1 holders
    smaller = chosen.degree - 2
    assert evaluate(n, smaller, (smaller + 1) // 2 + 1, gamma).failure > 2.0 ** -20


def test_a_stricter_failure_target_or_more_dropouts_need_a_larger_degree():
    base = secagg_plus_parameters(1000, 0.3)
    assert secagg_plus_parameters(1000, 0.3, 40).degree > base.degree
    assert secagg_plus_parameters(1000, 0.3, 40).failure <= 2.0 ** -40
    assert secagg_plus_parameters(1000, 0.35).degree > base.degree > secagg_plus_parameters(1000, 0.2).degree


def test_small_rounds_fall_back_to_the_complete_graph_and_half_is_infeasible():
    assert secagg_plus_parameters(20, 0.3).failure == 0.0  # k = 12 > 6 dropouts: no split, no shortfall
    chosen = secagg_plus_parameters(5, 0.45)  # k = 2 could leave a dropped client one holder of t = 2
    assert (chosen.degree, chosen.threshold, chosen.failure) == (4, 3, 0.0)
    for bad in (0.5, 0.7, -0.1, 1.0, True):
        with pytest.raises(DPFLError):
            secagg_plus_parameters(100, bad)
    for kwargs in ({"n": 0, "dropout_fraction": 0.1}, {"n": 100, "dropout_fraction": 0.1, "failure_log2": 0}):
        with pytest.raises(DPFLError):
            secagg_plus_parameters(**kwargs)


def test_colluding_clients_raise_the_threshold_above_the_majority():
    honest = secagg_plus_parameters(1000, 0.1)
    colluding = secagg_plus_parameters(1000, 0.1, corrupt_fraction=0.05)
    assert colluding.corrupt == 50 and colluding.security <= 2.0 ** -40
    assert colluding.threshold > (colluding.degree + 1) // 2 + 1
    assert honest.security == 0.0 and evaluate(1000, 32, 16, 0.1).security == 1.0  # t below a majority


def exact_failure(n, degree, threshold, dropouts):
    """Fraction of all dropout sets of the given size that split the survivors or leave a client
    short of holders, on one Harary graph (every set is equally likely under a random relabelling)."""
    graph = build_graph(n, "secagg+", degree=degree, threshold=threshold)
    failed = total = 0
    for dropped in itertools.combinations(range(n), dropouts):
        survivors = frozenset(range(n)) - set(dropped)
        total += 1
        failed += (graph.components(survivors) > 1
                   or any(len(graph.holders(u) & survivors) < threshold for u in range(n)))
    return failed / total


@pytest.mark.parametrize("n,degree,threshold,dropouts", [(12, 4, 3, 3), (12, 4, 3, 5), (14, 6, 4, 4),
                                                         (16, 4, 2, 6), (13, 6, 4, 4)])
def test_the_bounds_hold_against_exact_counts_on_small_graphs(n, degree, threshold, dropouts):
    exact = exact_failure(n, degree, threshold, dropouts)
    bound = disconnection_bound(n, degree, dropouts) + shortfall_bound(n, degree, threshold, dropouts)
    assert exact <= bound
    assert exact > 0  # the cases are not vacuous


def test_disconnection_bound_is_exact_for_two_gaps_on_a_ring():
    # k = 2: a ring splits iff two non-adjacent clients drop; the union bound counts each such pair once.
    n, dropouts = 10, 2
    pairs = n * (n - 3) / 2
    assert disconnection_bound(n, 2, dropouts) == pytest.approx(pairs / math.comb(n, 2))
    assert exact_failure(n, 2, 1, dropouts) == pytest.approx(pairs / math.comb(n, 2))


def test_random_dropouts_at_the_tolerance_never_split_or_starve_a_round_of_1000():
    config = SecAggRoundConfig(n_clients=1000, bits=32, protocol="secagg+", dropout_fraction=0.3, graph_seed=11)
    graph = config.graph
    assert (len(graph.neighbours[0]), graph.thresholds[0]) == TABLE[1000, 0.3]
    adjacency = np.zeros((1000, 1000), dtype=np.int64)
    for u, neighbours in enumerate(graph.neighbours):
        adjacency[u, sorted(neighbours)] = 1
    rng = np.random.default_rng(2)
    for _ in range(200):
        alive = np.ones(1000, dtype=np.int64)
        alive[rng.permutation(1000)[:300]] = 0
        assert graph.components(np.flatnonzero(alive)) == 1
        assert (adjacency @ alive + alive >= graph.thresholds[0]).all()  # holders of every client that survive


@pytest.mark.parametrize("gamma", [0.1, 0.3])
def test_a_full_round_with_random_dropouts_at_the_tolerance_completes_with_the_exact_sum(gamma):
    n = 120
    chosen = secagg_plus_parameters(n, gamma)
    assert chosen.degree < n - 1  # a sparse graph, not the complete one
    rng = np.random.default_rng(int(gamma * 10))
    vectors = [rng.integers(0, 2**32, 4, dtype=np.uint32) for _ in range(n)]
    dropped = rng.permutation(n)[:chosen.dropouts]
    phases = ["share", "masked_input", "unmask"]
    dropouts = {int(u): phases[i % 3] for i, u in enumerate(dropped)}
    result = secure_sum(vectors, bits=32, protocol="secagg+", dropout_fraction=gamma, graph_seed=9,
                        dropouts=dropouts)
    included = [u for u in range(n) if dropouts.get(u) in (None, "unmask")]
    assert result.survivors == tuple(included)
    np.testing.assert_array_equal(result.sum, np.sum([vectors[u] for u in included], axis=0, dtype=np.uint32))


def test_config_and_graph_use_the_parameters_and_an_explicit_degree_still_wins():
    config = SecAggRoundConfig(n_clients=1000, protocol="secagg+", dropout_fraction=0.1)
    assert (len(config.graph.neighbours[0]), config.graph.thresholds[0]) == TABLE[1000, 0.1]
    assert config.guarantee == secagg_plus_parameters(1000, 0.1)
    old_default = SecAggRoundConfig(n_clients=1000, protocol="secagg+", degree=80, dropout_fraction=0.3)
    assert len(old_default.graph.neighbours[0]) == 80
    assert old_default.guarantee.failure > 0.01  # ceil(8 log2 n) promises little at 30 % dropouts
    assert SecAggRoundConfig(n_clients=1000, protocol="secagg+").guarantee is None
    with pytest.raises(DPFLError):
        SecAggRoundConfig(n_clients=10, protocol="secagg", dropout_fraction=0.1)
    with pytest.raises(DPFLError):
        SecAggRoundConfig(n_clients=10, protocol="secagg+", dropout_fraction=0.6)


def test_scenario_knobs():
    section = SecAggSection(enabled=True, protocol="secagg+", dropout_tolerance=0.3, failure_log2=30)
    assert (section.dropout_tolerance, section.failure_log2) == (0.3, 30)
    assert SecAggSection().dropout_tolerance is None and SecAggSection().failure_log2 == 20
    for bad in ({"dropout_tolerance": 0.3}, {"protocol": "secagg+", "dropout_tolerance": 0.5},
                {"protocol": "secagg+", "failure_log2": 0}):
        with pytest.raises(ValidationError):
            SecAggSection(**bad)
    with pytest.raises(DPFLError) as err:
        load_scenario("scenarios/quickstart.yaml", ["secagg.enabled=true", "secagg.dropout_tolerance=0.2"])
    assert "secagg" in str(err.value) and "\n" not in str(err.value)
