"""A client never reveals both the b-share and the s_sk-share of one peer (Bonawitz et al. 2017, Round 4)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfl_ray.secagg import SecAggClient, SecAggConfig, SecAggServer, UnmaskRefused

N = 6


def clients_after_masking(n=N, threshold=3):
    config = SecAggConfig(n_clients=n, bits=32, threshold=threshold)
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

