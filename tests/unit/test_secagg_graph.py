"""Neighbour graphs and thresholds (Bonawitz et al. 2017 complete graph; Bell et al. 2020 Harary graph)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfl_ray.errors import DPFLError
from dpfl_ray.secagg import DEFAULT_DEGREE_FACTOR, build_graph, default_threshold, secagg_plus_degree


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2**32), st.integers(0, 10))
def test_secagg_plus_graph_is_symmetric_and_regular_with_majority_thresholds(n, seed, round_id):
    graph = build_graph(n, "secagg+", seed=seed, round_id=round_id)
    k = secagg_plus_degree(n)
    raw = math.ceil(DEFAULT_DEGREE_FACTOR * math.log2(n)) if n > 1 else 0
    assert k == min(n - 1, raw + raw % 2)
    for u, nbrs in enumerate(graph.neighbours):
        assert u not in nbrs
        assert len(nbrs) == k
        assert all(u in graph.neighbours[v] for v in nbrs)
        assert graph.thresholds[u] == (k + 1) // 2 + 1


@settings(max_examples=40, deadline=None)
@given(st.integers(5, 200), st.data())
def test_explicit_even_degree_gives_exactly_that_degree(n, data):
    k = data.draw(st.sampled_from(range(0, n - 1, 2)))
    graph = build_graph(n, "secagg+", degree=k, seed=data.draw(st.integers(0, 100)))
    assert all(len(s) == k for s in graph.neighbours)
    assert all(u in graph.neighbours[v] for u in range(n) for v in graph.neighbours[u])


def test_graph_is_a_deterministic_function_of_seed_and_round():
    a = build_graph(500, "secagg+", seed=1, round_id=0)
    assert a == build_graph(500, "secagg+", seed=1, round_id=0)
    assert a.neighbours != build_graph(500, "secagg+", seed=2, round_id=0).neighbours
    assert a.neighbours != build_graph(500, "secagg+", seed=1, round_id=1).neighbours


def test_degree_grows_logarithmically():
    assert secagg_plus_degree(100) == 54
    assert secagg_plus_degree(1000) == 80
    assert secagg_plus_degree(10**5) == 134
    assert secagg_plus_degree(10) == 9  # small rounds fall back to the complete graph


@pytest.mark.parametrize("n,t", [(1, 1), (2, 2), (3, 3), (4, 3), (9, 7), (100, 67)])
def test_secagg_default_threshold(n, t):
    assert default_threshold(n) == t
    graph = build_graph(n, "secagg")
    assert graph.thresholds == (t,) * n
    assert all(len(s) == n - 1 for s in graph.neighbours)


def test_invalid_graph_parameters_are_user_errors():
    for kwargs in ({"threshold": 0}, {"threshold": 6}, {"degree": 3}):
        with pytest.raises(DPFLError):
            build_graph(5, "secagg" if "degree" not in kwargs else "secagg+", **kwargs)
    with pytest.raises(DPFLError):
        build_graph(20, "secagg+", degree=5)  # odd degrees below n - 1 are not Harary-regular
    with pytest.raises(DPFLError):
        build_graph(20, "secagg+", degree=4, threshold=6)  # above the neighbourhood size
    with pytest.raises(DPFLError):
        build_graph(5, "gossip")


def bfs_components(graph, members):
    left, parts = set(members), 0
    while left:
        parts += 1
        frontier = [left.pop()]
        while frontier:
            reached = graph.neighbours[frontier.pop()] & left
            left -= reached
            frontier.extend(reached)
    return parts


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 60), st.data())
def test_ring_components_match_a_graph_search(n, data):
    degree = data.draw(st.sampled_from([*range(0, n - 1, 2), n - 1]))
    graph = build_graph(n, "secagg+", degree=degree, seed=data.draw(st.integers(0, 50)))
    chosen = data.draw(st.sets(st.integers(0, n - 1)))
    members = chosen if data.draw(st.booleans()) else set(range(n)) - chosen  # sparse and dense sets
    assert graph.components(members) == bfs_components(graph, members)


def test_complete_graph_keeps_any_nonempty_set_whole():
    graph = build_graph(7, "secagg")
    assert graph.ring == () and graph.components([3]) == graph.components([0, 6]) == 1
    assert graph.components([]) == 0


def test_components_at_n_10000_split_by_two_gaps_and_rejoined_by_one_client():
    graph = build_graph(10000, "secagg+", degree=226, seed=4)
    ring, half = graph.ring, 113
    split = set(range(10000)) - set(ring[:half]) - set(ring[5000:5000 + half])
    assert graph.components(split) == 2
    assert graph.components(split | {ring[0]}) == 1
