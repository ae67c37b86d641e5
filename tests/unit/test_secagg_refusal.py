"""A client never reveals both the b-share and the s_sk-share of one peer (Bonawitz et al. 2017, Round 4)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfl_ray.secagg import SecAggAbort, SecAggClient, SecAggRoundConfig, SecAggServer, UnmaskRefused, secure_sum

N = 6


def clients_after_masking(n=N, threshold=3):
    config = SecAggRoundConfig(n_clients=n, bits=32, threshold=threshold)
    clients = [SecAggClient(u, config) for u in range(n)]
    server = SecAggServer(config)
    keys = server.receive_keys([c.advertise_keys() for c in clients])
    forwarded = server.receive_shares([c.share_keys(keys) for c in clients])
    for c in clients:
        c.masked_input(forwarded[c.id], np.zeros(2, np.uint32))
    return clients


def request(survivors, dropped, **extra):
    return {"round_id": 0, "survivors": list(survivors), "dropped": list(dropped), **extra}


@pytest.mark.parametrize("bad", [
    request([0, 1, 2, 3], [3, 4]),                                          # overlap
    request([0, 1, 2, 3], [4, 5], sk_shares_for=[3]),                       # s_sk share of a survivor
    request([0, 1, 2, 3], [4, 5], b_shares_for=[0, 4]),                     # b share of a dropped peer
    request([0, 1, 2, 3], [4, 5], b_shares_for=[1], sk_shares_for=[1]),     # both for one peer
    request([1, 2, 3, 4], [0, 5]),                                          # the client itself "dropped"
    request([0, 1], [2, 3, 4, 5]),                                          # fewer survivors than t
])
def test_dangerous_requests_are_refused(bad):
    client = clients_after_masking()[0]
    with pytest.raises(UnmaskRefused):
        client.unmask(bad)


def test_a_later_request_cannot_flip_the_kind_of_a_revealed_share():
    client = clients_after_masking()[0]
    first = client.unmask(request([0, 1, 2, 3, 4], [5]))
    assert set(first["b_shares"]) == {0, 1, 2, 3, 4} and set(first["sk_shares"]) == {5}
    assert client.unmask(request([0, 1, 2, 3, 4], [5])) is not None  # repeating is harmless
    with pytest.raises(UnmaskRefused) as err:
        client.unmask(request([0, 1, 2, 3], [4, 5]))
    assert err.value.peers == [4]
    with pytest.raises(UnmaskRefused):
        client.unmask(request([0, 1, 2, 3, 4, 5], []))


ids = st.sets(st.integers(0, N - 1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(ids, ids, st.one_of(st.none(), ids), st.one_of(st.none(), ids)), min_size=1, max_size=4))
def test_no_sequence_of_requests_extracts_both_shares_of_a_peer(requests):
    client = clients_after_masking()[0]
    kinds: dict[int, set[str]] = {}
    for survivors, dropped, b_for, sk_for in requests:
        extra = {}
        if b_for is not None:
            extra["b_shares_for"] = sorted(b_for)
        if sk_for is not None:
            extra["sk_shares_for"] = sorted(sk_for)
        try:
            reply = client.unmask(request(sorted(survivors), sorted(dropped), **extra))
        except UnmaskRefused:
            continue
        for v in reply["b_shares"]:
            kinds.setdefault(v, set()).add("b")
        for v in reply["sk_shares"]:
            kinds.setdefault(v, set()).add("sk")
    assert all(len(k) == 1 for k in kinds.values())
    assert "sk" not in kinds.get(0, set())  # never its own s_sk: it did send its masked input


def test_the_first_answered_request_is_the_only_one_a_client_answers():
    client = clients_after_masking()[0]
    first = request([0, 1, 2, 3, 4], [5])
    reply = client.unmask(first)
    assert client.unmask(request([4, 3, 2, 1, 0], [5])) == reply  # the same sets in another order
    for other in (request([0, 1, 2, 3], [4, 5]), request([0, 1, 2, 3, 4], []), request([0, 1, 2, 3, 4, 5], [])):
        with pytest.raises(UnmaskRefused):
            client.unmask(other)
    assert client.unmask({**first, "b_shares_for": [1]})["b_shares"].keys() == {1}


def isolate_block(config, block):
    """Survivors and dropped clients of the chosen-dropout attack on SecAgg+ (issue 9): the k/2 ring
    positions on each side of a block of ``block`` clients drop, which cuts the block off."""
    ring, half = config.graph.ring, len(config.graph.neighbours[0]) // 2
    dropped = frozenset(ring[:half] + ring[half + block:2 * half + block])
    return frozenset(range(config.n_clients)) - dropped, dropped, frozenset(ring[half:half + block])


def thresholds_hold(graph, survivors, dropped):
    """Every survivor keeps t live holders and every dropped client t surviving neighbours."""
    return (all(len(graph.holders(u) & survivors) >= graph.thresholds[u] for u in survivors)
            and all(len(graph.neighbours[u] & survivors) >= graph.thresholds[u] for u in dropped))


def test_chosen_dropouts_isolating_a_block_pass_every_threshold_but_split_the_graph_at_n_1000():
    config = SecAggRoundConfig(n_clients=1000, bits=32, protocol="secagg+", graph_seed=3)
    graph = config.graph
    assert len(graph.neighbours[0]) == 80 and graph.thresholds[0] == 41  # the default degree
    survivors, dropped, block = isolate_block(config, 41)
    assert len(dropped) == 80 and thresholds_hold(graph, survivors, dropped)
    assert graph.components(survivors) == 2
    assert not any(graph.neighbours[u] & (survivors - block) for u in block)
    assert graph.components(survivors | {next(iter(dropped))}) == 1


def test_a_client_of_the_isolated_block_refuses_with_real_keys_at_n_1000():
    config = SecAggRoundConfig(n_clients=1000, bits=32, protocol="secagg+", graph_seed=3, dim=2)
    survivors, dropped, block = isolate_block(config, 41)
    u = min(block)
    # Only u's neighbourhood takes part up to Round 2 (each of them still has t live holders);
    # the server then claims the partitioning survivor set.
    taking_part = sorted(config.graph.holders(u))
    clients = {v: SecAggClient(v, config) for v in taking_part}
    server = SecAggServer(config)
    keys = server.receive_keys([c.advertise_keys() for c in clients.values()])
    forwarded = server.receive_shares([c.share_keys(keys) for c in clients.values()])
    clients[u].masked_input(forwarded[u], np.zeros(2, np.uint32))
    with pytest.raises(UnmaskRefused) as err:
        clients[u].unmask(request(sorted(survivors), sorted(dropped & set(taking_part))))
    assert err.value.components == 2


@pytest.fixture(scope="module")
def split_round():
    """The same partition at n = 40, k = 8: the 4 ring positions each side of a block of 5 drop."""
    config = SecAggRoundConfig(n_clients=40, bits=32, protocol="secagg+", degree=8, graph_seed=5, dim=3)
    survivors, dropped, block = isolate_block(config, 5)
    assert thresholds_hold(config.graph, survivors, dropped) and config.graph.components(survivors) == 2
    return config, survivors, dropped, block


def test_the_server_aborts_when_chosen_dropouts_split_the_survivors(split_round):
    config, survivors, dropped, _ = split_round
    vectors = [np.full(3, u, np.uint32) for u in range(40)]
    with pytest.raises(SecAggAbort) as err:
        secure_sum(vectors, bits=32, protocol="secagg+", degree=8, graph_seed=5,
                   dropouts={v: "masked_input" for v in dropped})
    assert err.value.phase == "masked_input" and err.value.components == 2
    one_back = secure_sum(vectors, bits=32, protocol="secagg+", degree=8, graph_seed=5,
                          dropouts={v: "masked_input" for v in sorted(dropped)[1:]})
    assert one_back.sum.tolist() == [sum(one_back.survivors)] * 3


def test_every_survivor_refuses_a_request_for_a_split_survivor_set(split_round):
    config, survivors, dropped, block = split_round
    clients = [SecAggClient(u, config) for u in range(40)]
    server = SecAggServer(config)
    keys = server.receive_keys([c.advertise_keys() for c in clients])
    forwarded = server.receive_shares([c.share_keys(keys) for c in clients])
    for u in survivors:
        clients[u].masked_input(forwarded[u], np.full(3, u, np.uint32))
    for u in survivors:  # a server that skips its own check and asks anyway
        with pytest.raises(UnmaskRefused) as err:
            clients[u].unmask(request(sorted(survivors), sorted(dropped)))
        assert err.value.components == 2
