"""Noise layer seeds in SecAgg / SecAgg+: shared like b_u, revealed only from layer d + 1 on."""
from __future__ import annotations

import os

import numpy as np
import pytest

from dpfl_ray.secagg import (
    SecAggAbort, SecAggClient, SecAggRoundConfig, SecAggProtocolError, SecAggServer, UnmaskRefused, shamir,
)

SEALED_OVERHEAD = 12 + 16  # ChaCha20-Poly1305 nonce + tag


def expected_sum(vectors, members):
    total = np.zeros(len(vectors[0]), dtype=vectors[0].dtype)
    for u in members:
        total += vectors[u]
    return total


class Round:
    """One round driven by hand with real keys; every client has ``n_layers`` random layer seeds."""

    def __init__(self, config, *, n_layers=3, absent=1, drop=(), layer_counts=None, dim=4):
        self.config = config
        n = config.n_clients
        counts = layer_counts or [n_layers] * n
        self.seeds = {u: [os.urandom(shamir.SECRET_BYTES) for _ in range(counts[u])] for u in range(n)}
        rng = np.random.default_rng(7)
        self.vectors = [rng.integers(0, 2**32, dim, dtype=np.uint32) for _ in range(n)]
        self.clients = [SecAggClient(u, config) for u in range(n)]
        self.server = SecAggServer(config)
        keys = self.server.receive_keys([c.advertise_keys() for c in self.clients])
        self.shares = [c.share_keys(keys, layer_seeds=self.seeds[c.id], absent=absent) for c in self.clients]
        self.forwarded = self.server.receive_shares(self.shares)
        self.survivors = [u for u in range(n) if u not in drop]
        self.request = self.server.receive_masked(
            [self.clients[u].masked_input(self.forwarded[u], self.vectors[u]) for u in self.survivors])

    def finish(self, layers_from=None, *, vanish=(), tamper=None):
        request = self.request if layers_from is None else self.server.request_layers(self.request, layers_from)
        replies = [self.clients[u].unmask(request) for u in self.survivors if u not in vanish]
        if tamper is not None:
            tamper(replies)
        self.replies = replies
        return self.server.receive_unmask(replies)

    def layers(self, owners, first):
        return {u: {k: self.seeds[u][k - 1] for k in range(first, len(self.seeds[u]) + 1)} for u in owners}


def test_server_recovers_exactly_the_layers_above_the_dropout_count():
    r = Round(SecAggRoundConfig(n_clients=8, bits=32, threshold=5), n_layers=5, absent=1, drop=(6,))
    total = r.finish(layers_from=3)  # N = 9, d = 1 absent + 1 dropped = 2
    np.testing.assert_array_equal(total, expected_sum(r.vectors, r.survivors))
    assert r.server.layer_seeds == r.layers(r.survivors, 3)
    assert all(set(k) == {3, 4, 5} for reply in r.replies for k in reply["layer_shares"].values())


def test_two_dropouts_raise_the_first_revealed_layer():
    r = Round(SecAggRoundConfig(n_clients=8, bits=32, threshold=4), n_layers=5, absent=1, drop=(2, 5))
    total = r.finish(layers_from=4)  # d = 1 + 2 = 3
    np.testing.assert_array_equal(total, expected_sum(r.vectors, r.survivors))
    assert r.server.layer_seeds == r.layers(r.survivors, 4)


def test_survivor_vanishing_during_unmask_still_has_its_layers_reconstructed():
    r = Round(SecAggRoundConfig(n_clients=7, bits=32, threshold=4), n_layers=3, absent=1, drop=(0,))
    total = r.finish(layers_from=3, vanish=(4,))  # d = 2; client 4 sent y_4, then vanished
    np.testing.assert_array_equal(total, expected_sum(r.vectors, r.survivors))
    assert 4 in r.server.layer_seeds and r.server.layer_seeds == r.layers(r.survivors, 3)


def test_clients_with_different_numbers_of_layers_mix():
    counts = [0, 1, 2, 3, 4, 5]
    r = Round(SecAggRoundConfig(n_clients=6, bits=32, threshold=4), layer_counts=counts, absent=0)
    total = r.finish(layers_from=1)  # nobody missing: d = 0
    np.testing.assert_array_equal(total, expected_sum(r.vectors, range(6)))
    assert r.server.layer_seeds == r.layers(range(6), 1)
    assert r.server.layer_seeds[0] == {}
    for u in range(6):
        for ct in r.shares[u]["ciphertexts"].values():
            assert len(ct) == SEALED_OVERHEAD + (2 + counts[u]) * shamir.SHARE_BYTES


def test_secagg_plus_with_layers():
    config = SecAggRoundConfig(n_clients=10, bits=32, protocol="secagg+", degree=6)
    r = Round(config, n_layers=4, absent=2, drop=(3,))
    total = r.finish(layers_from=4, vanish=(8,))  # d = 2 + 1 = 3
    np.testing.assert_array_equal(total, expected_sum(r.vectors, r.survivors))
    assert r.server.layer_seeds == r.layers(r.survivors, 4)
    for reply in r.replies:  # only a holder of v reveals v's layers
        assert set(reply["layer_shares"]) <= config.graph.holders(reply["client"])


def test_without_layers_nothing_changes_on_the_wire():
    config = SecAggRoundConfig(n_clients=3, bits=32, threshold=2)
    clients = [SecAggClient(u, config) for u in range(3)]
    server = SecAggServer(config)
    keys = server.receive_keys([c.advertise_keys() for c in clients])
    shares = [clients[0].share_keys(keys), clients[1].share_keys(keys, layer_seeds=(), absent=0),
              clients[2].share_keys(keys, absent=3)]
    for message in shares:
        assert all(len(ct) == 12 + 2 * 66 + 16 for ct in message["ciphertexts"].values())
    forwarded = server.receive_shares(shares)
    vectors = [np.zeros(10, dtype=np.uint32)] * 3
    request = server.receive_masked([c.masked_input(forwarded[c.id], vectors[c.id]) for c in clients])
    replies = [c.unmask(request) for c in clients]
    assert all(reply["layer_shares"] == {} for reply in replies)
    server.receive_unmask(replies)
    assert server.layer_seeds == {}
    # Same accounting as test_secagg_protocol.test_bytes_are_counted_per_message_part.
    per_client = (4 + 4 + 64) + (4 + 4 + 2 * (4 + 160)) + (4 + 4 + 40) + (4 + 4 + 3 * (4 + 66))
    assert [c.bytes_sent for c in clients] == [per_client] * 3


def test_layer_seeds_and_absent_are_validated():
    config = SecAggRoundConfig(n_clients=3, bits=32, threshold=2)
    server = SecAggServer(config)
    clients = [SecAggClient(u, config) for u in range(3)]
    keys = server.receive_keys([c.advertise_keys() for c in clients])
    for kwargs in ({"layer_seeds": [os.urandom(31)]}, {"layer_seeds": ["x" * 32]}, {"absent": -1},
                   {"absent": 1.0}, {"absent": True}):
        with pytest.raises(SecAggProtocolError):
            clients[0].share_keys(keys, **kwargs)
    clients[0].share_keys(keys, layer_seeds=[os.urandom(32)], absent=2)  # the bad calls did not use up the phase


@pytest.fixture()
def masked_round():
    # n = 8, absent = 1, client 7 dropped before its masked input: N = 9, d = 2.
    return Round(SecAggRoundConfig(n_clients=8, bits=32, threshold=4), n_layers=5, absent=1, drop=(7,))


def test_client_refuses_layers_that_the_remaining_noise_needs(masked_round):
    r = masked_round
    client = r.clients[0]
    for layers_from in (1, 2):
        with pytest.raises(UnmaskRefused) as err:
            client.unmask(r.server.request_layers(r.request, layers_from))
        assert err.value.missing == 2
    assert set(client.unmask(r.server.request_layers(r.request, 3))["layer_shares"][0]) == {3, 4, 5}


@pytest.mark.parametrize("extra", [
    {"layer_shares_for": [0, 7], "layers_from": 3},   # 7 dropped
    {"layer_shares_for": [0, 1]},                     # layers_from missing
    {"layer_shares_for": [0, 1], "layers_from": 0},
    {"layer_shares_for": [0, 1], "layers_from": True},
    {"layer_shares_for": [0, 1], "layers_from": "3"},
])
def test_malformed_layer_requests_are_refused(masked_round, extra):
    with pytest.raises(UnmaskRefused):
        masked_round.clients[0].unmask({**masked_round.request, **extra})


def test_the_first_answered_request_fixes_survivors_and_dropped(masked_round):
    client = masked_round.clients[0]
    # A request listing only 0..4 as survivors claims d = 1 + 3 = 4 (no layers asked, so it is answered).
    first = {"round_id": 0, "survivors": [0, 1, 2, 3, 4], "dropped": []}
    client.unmask(first)
    honest = masked_round.server.request_layers(masked_round.request, 3)  # d = 2 for this one
    for later in (honest, {**honest, "layers_from": 5}, masked_round.request):
        with pytest.raises(UnmaskRefused) as err:
            client.unmask(later)
        assert err.value.peers == [5, 6, 7]
    assert set(client.unmask({**first, "layer_shares_for": [0], "layers_from": 5})["layer_shares"][0]) == {5}
    with pytest.raises(UnmaskRefused):
        client.unmask({**first, "layer_shares_for": [0], "layers_from": 4})  # its own d still applies


def test_revealed_layers_block_a_later_s_sk_request_for_the_same_peer(masked_round):
    client = masked_round.clients[0]
    client.unmask({**masked_round.request, "b_shares_for": [], "layer_shares_for": [5], "layers_from": 3})
    with pytest.raises(UnmaskRefused) as err:
        client.unmask({"round_id": 0, "survivors": [0, 1, 2, 3, 4, 6], "dropped": [5, 7]})
    assert err.value.peers == [5]


def lying_then_honest(config):
    """Issue 9's attack: 5 clients, t = 3, client 4 drops before its masked input (d = 1). The
    lying request lists 4 as a survivor (d = 0), leaves it out of the b shares, and asks for layer
    1; the honest one then asks for the s_sk shares of 4. Layer 1 plus the unmasked sum would strip
    noise that the sum of 0..3 still needs."""
    r = Round(config, n_layers=2, absent=0, drop=(4,))
    lying = {"round_id": 0, "survivors": [0, 1, 2, 3, 4], "dropped": [], "b_shares_for": [0, 1, 2, 3],
             "layer_shares_for": [0, 1, 2, 3], "layers_from": 1}
    honest = r.server.request_layers(r.request, 2)
    return r, lying, honest


def collect(replies, field, owner, layer=None):
    points = {}
    for reply in replies:
        shares = reply[field].get(owner, {})
        share = shares.get(layer) if layer is not None else shares
        if share:
            points[reply["client"] + 1] = shamir.decode_share(share)
    return points


@pytest.mark.parametrize("lied_to", [(0, 1, 2, 3), (0, 1, 2), (0, 1), (3,), ()])
def test_a_lie_about_who_dropped_never_yields_both_layer_1_and_the_dropped_clients_s_sk(lied_to):
    r, lying, honest = lying_then_honest(SecAggRoundConfig(n_clients=5, bits=32, threshold=3))
    replies = []
    for u in r.survivors:  # each client gets one request first, then the other
        for request in ((lying, honest) if u in lied_to else (honest, lying)):
            try:
                replies.append(r.clients[u].unmask(request))
            except UnmaskRefused as err:
                assert "other survivors or dropped" in str(err)
    assert len(replies) == 4  # exactly one answer per client
    layer_1 = collect(replies, "layer_shares", 0, layer=1)
    sk_4 = {reply["client"] + 1: shamir.decode_share(reply["sk_shares"][4]) for reply in replies
            if 4 in reply["sk_shares"]}
    # No client can tell the lie from the truth, so the lie's layer 1 may be rebuilt -- but then
    # s_sk of 4 stays below t, so the sum that layer 1 would denoise cannot be unmasked.
    assert len(layer_1) < 3 or len(sk_4) < 3
    if len(layer_1) >= 3:
        assert shamir.int_to_secret(shamir.reconstruct(layer_1, 3)) == r.seeds[0][0]
    for reply in replies:  # the server keeps layer 1 aside and tries to finish the round
        reply["layer_shares"] = {v: {k: sh for k, sh in shares.items() if k >= 2}
                                 for v, shares in reply["layer_shares"].items()}
    if len(sk_4) < 3:
        with pytest.raises(SecAggAbort) as err:
            r.server.receive_unmask(replies)
        assert err.value.client == 4 and err.value.available == len(sk_4)
    else:
        assert len(layer_1) < 3
        np.testing.assert_array_equal(r.server.receive_unmask(replies), expected_sum(r.vectors, r.survivors))


def test_honest_request_first_then_the_lie_is_refused_and_layer_1_stays_secret():
    r, lying, honest = lying_then_honest(SecAggRoundConfig(n_clients=5, bits=32, threshold=3))
    replies = [r.clients[u].unmask(honest) for u in r.survivors]
    for u in r.survivors:
        with pytest.raises(UnmaskRefused):
            r.clients[u].unmask(lying)
        assert r.clients[u].unmask(honest)["layer_shares"] == replies[u]["layer_shares"]  # a repeat still works
    assert collect(replies, "layer_shares", 0, layer=1) == {}
    np.testing.assert_array_equal(r.server.receive_unmask(replies), expected_sum(r.vectors, r.survivors))
    assert r.server.layer_seeds == r.layers(r.survivors, 2)


def drop_layer_shares(owner, holders, layer=None):
    def tamper(replies):
        for reply in replies:
            if reply["client"] in holders and owner in reply["layer_shares"]:
                if layer is None:
                    del reply["layer_shares"][owner]
                else:
                    del reply["layer_shares"][owner][layer]
    return tamper


@pytest.mark.parametrize("layer", [None, 5])
def test_too_few_layer_shares_abort(masked_round, layer):
    with pytest.raises(SecAggAbort) as err:
        masked_round.finish(layers_from=3, tamper=drop_layer_shares(0, {1, 2, 3, 4}, layer))  # 3 left, t = 4
    assert err.value.client == 0 and err.value.phase == "reconstruct" and err.value.available == 3


def test_enough_layer_shares_after_some_are_missing_still_reconstruct(masked_round):
    masked_round.finish(layers_from=3, tamper=drop_layer_shares(0, {1, 2, 3}))  # 4 left, t = 4
    assert masked_round.server.layer_seeds == masked_round.layers(range(7), 3)


def set_share(reply_client, owner, layer):
    def tamper(replies):
        reply = next(r for r in replies if r["client"] == reply_client)
        reply["layer_shares"].setdefault(owner, {})[layer] = bytes(shamir.SHARE_BYTES)
    return tamper


@pytest.mark.parametrize("tamper", [
    set_share(1, 0, 2),                                                # below layers_from
    set_share(1, 7, 3),                                                # owner not in U_3
    set_share(1, 99, 3),                                               # no such client
    lambda replies: replies[0]["layer_shares"][0].update({"4": b""}),  # index not an int
    lambda replies: replies[0].pop("layer_shares"),                    # field missing although requested
])
def test_server_rejects_bad_layer_shares(masked_round, tamper):
    with pytest.raises(SecAggProtocolError):
        masked_round.finish(layers_from=3, tamper=tamper)


def test_server_rejects_unrequested_layer_shares_and_misplaced_request_layers(masked_round):
    layered = masked_round.server.request_layers(masked_round.request, 3)
    masked_round.server._layers_from = None  # as if the plain request had gone out
    replies = [masked_round.clients[u].unmask(layered) for u in masked_round.survivors]
    with pytest.raises(SecAggProtocolError):
        masked_round.server.receive_unmask(replies)
    with pytest.raises(SecAggProtocolError):
        masked_round.server.request_layers(masked_round.request, 3)  # after unmask
    with pytest.raises(SecAggProtocolError):
        SecAggServer(masked_round.config).request_layers(masked_round.request, 3)  # before masked input


@pytest.mark.parametrize("layers_from", [0, -1, True, 2.0])
def test_request_layers_validates_layers_from(masked_round, layers_from):
    with pytest.raises(SecAggProtocolError):
        masked_round.server.request_layers(masked_round.request, layers_from)


def test_secagg_plus_holder_outside_the_neighbourhood_is_rejected():
    config = SecAggRoundConfig(n_clients=10, bits=32, protocol="secagg+", degree=6)
    r = Round(config, n_layers=2, absent=0)
    outsider = next(v for v in range(10) if v not in config.graph.holders(0))
    with pytest.raises(SecAggProtocolError):
        r.finish(layers_from=1, tamper=set_share(outsider, 0, 1))
