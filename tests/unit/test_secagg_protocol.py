"""End-to-end properties of the SecAgg / SecAgg+ state machines and of ``secure_sum``."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpfl_ray.errors import DPFLError
from dpfl_ray.runtime.resources import deal
from dpfl_ray.secagg.keys import expand_masks
from dpfl_ray.secagg import (
    PHASES, SecAggAbort, SecAggClient, SecAggRoundConfig, SecAggProtocolError, SecAggServer, presum_masked,
    secure_sum,
)

DTYPE = {32: np.uint32, 64: np.uint64}


def expected_sum(vectors, members, bits):
    total = np.zeros(len(vectors[0]), dtype=DTYPE[bits])
    for u in members:
        total += vectors[u]  # numpy wraps mod 2^bits
    return total


def connected(graph, members):
    """Breadth-first search over the graph restricted to ``members``."""
    members = set(members)
    if not members:
        return False
    seen, frontier = set(), [min(members)]
    while frontier:
        u = frontier.pop()
        if u not in seen:
            seen.add(u)
            frontier.extend((graph.neighbours[u] & members) - seen)
    return seen == members


def predicted_abort(graph, leaves):
    """Independent statement of when a round must abort: a live client below its threshold of live
    holders after some phase, a disconnected survivor graph, or a needed secret with fewer shares
    than its threshold."""
    n = graph.n
    live = [frozenset(u for u in range(n) if leaves.get(u, 4) > p) for p in range(4)]
    for phase_live in live[:3]:
        if not phase_live or any(len(graph.holders(u) & phase_live) < graph.thresholds[u] for u in phase_live):
            return True
    u2, u3, u4 = live[1], live[2], live[3]
    if not connected(graph, u3):
        return True
    if not u4 or any(len(graph.holders(u) & u4) < graph.thresholds[u] for u in u4):
        return True
    if any(len(graph.holders(u) & u4) < graph.thresholds[u] for u in u3):
        return True
    return any(len(graph.neighbours[u] & u4) < graph.thresholds[u] for u in u2 - u3)


@st.composite
def rounds(draw):
    bits = draw(st.sampled_from([32, 64]))
    protocol = draw(st.sampled_from(["secagg", "secagg+"]))
    n = draw(st.integers(1, 9))
    degree = None
    if protocol == "secagg+" and n >= 4:
        degree = draw(st.one_of(st.none(), st.sampled_from([k for k in range(2, n - 1, 2)] or [n - 1])))
    config = SecAggRoundConfig(n_clients=n, bits=bits, protocol=protocol, degree=degree)
    smallest = min(len(h) + 1 for h in config.graph.neighbours)
    threshold = draw(st.one_of(st.none(), st.integers(1, smallest)))
    dim = draw(st.integers(1, 6))
    vectors = [np.array(draw(st.lists(st.integers(0, 2**bits - 1), min_size=dim, max_size=dim)),
                        dtype=DTYPE[bits]) for _ in range(n)]
    dropouts = draw(st.dictionaries(st.integers(0, n - 1), st.sampled_from(PHASES), max_size=n))
    return dict(vectors=vectors, bits=bits, protocol=protocol, threshold=threshold, dropouts=dropouts,
                degree=degree, round_id=draw(st.integers(0, 5)), graph_seed=draw(st.integers(0, 3)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rounds())
def test_secure_sum_is_the_plain_sum_of_the_clients_that_sent_masked_input(case):
    config = SecAggRoundConfig(n_clients=len(case["vectors"]), bits=case["bits"], protocol=case["protocol"],
                          threshold=case["threshold"], degree=case["degree"], round_id=case["round_id"],
                          graph_seed=case["graph_seed"])
    leaves = {u: PHASES.index(p) for u, p in case["dropouts"].items()}
    if predicted_abort(config.graph, leaves):
        with pytest.raises(SecAggAbort):
            secure_sum(**case)
        return
    result = secure_sum(**case)
    included = [u for u in range(config.n_clients) if leaves.get(u, 4) > PHASES.index("masked_input")]
    assert result.survivors == tuple(included)
    assert result.sum.dtype == DTYPE[case["bits"]]
    np.testing.assert_array_equal(result.sum, expected_sum(case["vectors"], included, case["bits"]))
    for phase in PHASES:
        assert result.dropped_by_phase[phase] == tuple(sorted(u for u, p in case["dropouts"].items() if p == phase))


@pytest.mark.parametrize("phase", PHASES)
def test_fewer_than_t_remaining_aborts_in_every_phase(phase):
    vectors = [np.arange(4, dtype=np.uint32) + u for u in range(6)]
    ok = secure_sum(vectors, bits=32, threshold=5, dropouts={0: phase})
    assert ok.survivors == (tuple(range(1, 6)) if phase != "unmask" else tuple(range(6)))
    with pytest.raises(SecAggAbort) as err:
        secure_sum(vectors, bits=32, threshold=5, dropouts={0: phase, 1: phase})
    assert err.value.needed == 5 and err.value.available == 4
    assert err.value.phase == phase


def test_client_dropping_at_unmask_is_in_the_sum_and_early_droppers_are_not():
    vectors = [np.full(3, 10 ** u, dtype=np.uint64) for u in range(7)]
    result = secure_sum(vectors, bits=64, threshold=3,
                        dropouts={0: "advertise", 1: "share", 2: "masked_input", 3: "unmask"})
    assert result.survivors == (3, 4, 5, 6)
    np.testing.assert_array_equal(result.sum, np.full(3, 1000 + 10**4 + 10**5 + 10**6, dtype=np.uint64))


def test_default_threshold_is_two_thirds_plus_one():
    vectors = [np.ones(2, dtype=np.uint32)] * 9  # t = 7: two dropouts are fine, three are not
    assert secure_sum(vectors, bits=32, dropouts={0: "share", 1: "masked_input"}).sum.tolist() == [7, 7]
    with pytest.raises(SecAggAbort):
        secure_sum(vectors, bits=32, dropouts={0: "share", 1: "masked_input", 2: "unmask"})


def test_bytes_are_counted_per_message_part():
    vectors = [np.zeros(10, dtype=np.uint32)] * 3
    result = secure_sum(vectors, bits=32, threshold=2)
    # advertise: round, id, two 32 B keys; share: round, id, 2 x (id + 12 B nonce + 2 x 66 B + 16 B tag);
    # masked: round, [id], 10 x 4 B; unmask: round, id, 3 x (id + 66 B b-share).
    per_client = (4 + 4 + 64) + (4 + 4 + 2 * (4 + 160)) + (4 + 4 + 40) + (4 + 4 + 3 * (4 + 66))
    assert result.bytes_per_client == {0: per_client, 1: per_client, 2: per_client}
    assert result.server_bytes_received == 3 * per_client
    assert set(result.seconds_by_phase) == set(PHASES) | {"reconstruct"}


def test_a_ring_narrower_than_its_words_sums_exactly_and_sends_only_its_bits():
    """Z_2^b for b < 32 (integer noise, secagg/ring.py) in uint32 words: the sum mod 2^b is exact
    whoever drops when, each masked input is reduced mod 2^b before it is sent and counted at b bits a
    word, and a word outside the ring (a malformed or malicious upload) is refused by the server."""
    rng = np.random.default_rng(4)
    dim, n = 1001, 7
    for bits in (8, 16, 20, 31):
        vectors = [rng.integers(0, 1 << bits, size=dim, dtype=np.uint32) for _ in range(n)]
        result = secure_sum(vectors, bits=bits, dropouts={1: "masked_input", 4: "unmask"}, threshold=4)
        expected = np.sum(np.stack([vectors[u] for u in result.survivors]).astype(np.uint64), axis=0) % (1 << bits)
        assert list(result.survivors) == [0, 2, 3, 4, 5, 6]
        np.testing.assert_array_equal(result.sum, expected.astype(np.uint32))
        wide = secure_sum(vectors, bits=32, dropouts={1: "masked_input", 4: "unmask"}, threshold=4)
        # the masked input is the only message whose size depends on the ring: b/8 bytes a word, not 4
        assert wide.bytes_per_client[0] - result.bytes_per_client[0] == dim * 4 - -(-dim * bits // 8)
    with pytest.raises(DPFLError, match="outside"):
        secure_sum([np.full(3, 1 << 16, np.uint32)] * 3, bits=16)
    config = SecAggRoundConfig(n_clients=3, bits=16)
    server = SecAggServer(config)
    clients = [SecAggClient(u, config) for u in range(3)]
    keys = server.receive_keys([c.advertise_keys() for c in clients])
    forwarded = server.receive_shares([c.share_keys(keys) for c in clients])
    masked = [c.masked_input(forwarded[c.id], np.ones(4, np.uint32)) for c in clients]
    assert all(int(m["masked"].max()) < 1 << 16 for m in masked)
    masked[1] = {**masked[1], "masked": masked[1]["masked"] | np.uint32(1 << 20)}
    with pytest.raises(SecAggProtocolError, match="words outside Z_2\\^16"):
        server.receive_masked(masked)


def test_bad_arguments_are_user_errors():
    with pytest.raises(DPFLError):
        secure_sum([np.zeros(2, np.uint32)] * 3, bits=7)
    with pytest.raises(DPFLError):
        secure_sum([np.zeros(2, np.uint32)] * 3, bits=33)
    with pytest.raises(DPFLError):
        secure_sum([np.zeros(2, np.uint32)] * 3, bits=32, dropouts={5: "share"})
    with pytest.raises(DPFLError):
        secure_sum([np.zeros(2, np.uint32)] * 3, bits=32, dropouts={1: "later"})
    with pytest.raises(DPFLError):
        secure_sum([np.zeros(2)] * 3, bits=32)  # floats must be encoded first
    with pytest.raises(DPFLError):
        secure_sum([np.zeros(2, np.uint32)] * 3, bits=32, threshold=4)


def drive(config, vectors, *, tamper=None, roundtrip=lambda m: m, workers=None):
    """Run the state machines by hand; ``tamper(forwarded)`` may edit the forwarded shares and
    ``roundtrip`` is applied to every message (e.g. a pickle round trip)."""
    n = config.n_clients
    clients = [roundtrip(SecAggClient(u, config)) for u in range(n)]
    server = SecAggServer(config)
    keys = roundtrip(server.receive_keys([roundtrip(c.advertise_keys()) for c in clients]))
    forwarded = roundtrip(server.receive_shares([roundtrip(c.share_keys(keys)) for c in clients]))
    if tamper is not None:
        tamper(forwarded)
    clients = [roundtrip(c) for c in clients]
    masked = [roundtrip(c.masked_input(forwarded[c.id], vectors[c.id])) for c in clients]
    if workers is not None:
        masked = [presum_masked([masked[u] for u in group], config.bits) for group in workers]
    request = roundtrip(server.receive_masked(masked))
    replies = [roundtrip(c.unmask(request)) for c in clients]
    return server.receive_unmask(replies), server, replies


def flip_bit(forwarded, receiver, sender, bit=0):
    ct = bytearray(forwarded[receiver]["ciphertexts"][sender])
    ct[len(ct) // 2 + bit // 8] ^= 1 << (bit % 8)
    forwarded[receiver]["ciphertexts"][sender] = bytes(ct)


@pytest.mark.parametrize("bit", [0, 7, 300])
def test_tampered_share_is_rejected_and_ignored(bit):
    config = SecAggRoundConfig(n_clients=5, bits=32, threshold=3)
    vectors = [np.full(4, u + 1, dtype=np.uint32) for u in range(5)]
    total, server, replies = drive(config, vectors, tamper=lambda f: flip_bit(f, 2, 0, bit))
    np.testing.assert_array_equal(total, np.full(4, 15, dtype=np.uint32))
    assert replies[2]["rejected"] == [0] and 0 not in replies[2]["b_shares"]
    assert replies[1]["rejected"] == [] and 0 in replies[1]["b_shares"]
    assert server.rejected_shares == [(2, 0)]


def test_tampered_share_that_leaves_too_few_shares_aborts():
    config = SecAggRoundConfig(n_clients=4, bits=32, threshold=4)
    vectors = [np.zeros(2, dtype=np.uint32)] * 4
    with pytest.raises(SecAggAbort) as err:
        drive(config, vectors, tamper=lambda f: flip_bit(f, 3, 1))
    assert err.value.client == 1 and err.value.phase == "reconstruct"


@pytest.mark.parametrize("protocol", ["secagg", "secagg+"])
def test_messages_and_clients_survive_pickling_and_presummed_inputs_work(protocol):
    config = SecAggRoundConfig(n_clients=8, bits=64, protocol=protocol, degree=4 if protocol == "secagg+" else None)
    rng = np.random.default_rng(3)
    vectors = [rng.integers(0, 2**63, 5, dtype=np.uint64) for _ in range(8)]
    total, server, _ = drive(config, vectors, roundtrip=lambda m: pickle.loads(pickle.dumps(m)),
                             workers=[[0, 3, 5], [1], [2, 4, 6, 7]])
    np.testing.assert_array_equal(total, expected_sum(vectors, range(8), 64))


def test_server_rejects_out_of_order_and_duplicate_messages():
    config = SecAggRoundConfig(n_clients=3, bits=32, threshold=2)
    clients = [SecAggClient(u, config) for u in range(3)]
    server = SecAggServer(config)
    with pytest.raises(SecAggProtocolError):
        server.receive_shares([])
    adverts = [c.advertise_keys() for c in clients]
    with pytest.raises(SecAggProtocolError):
        SecAggServer(config).receive_keys(adverts + adverts[:1])
    keys = server.receive_keys(adverts)
    forwarded = server.receive_shares([c.share_keys(keys) for c in clients])
    masked = [c.masked_input(forwarded[c.id], np.zeros(3, np.uint32)) for c in clients]
    with pytest.raises(SecAggProtocolError):
        server.receive_masked([masked[0], presum_masked(masked[:2], 32)])
    with pytest.raises(SecAggProtocolError):
        clients[0].share_keys(keys)  # a phase cannot be repeated


def test_messages_that_name_no_client_or_carry_no_share_are_protocol_errors():
    """A float or bool id was taken for a client (1.9 for client 1); a share that is no bytes, or a
    list of rejected shares that names no client, raised TypeError, which ended the run: each is now
    a SecAggError, which aborts the round alone (runtime/secagg_round.py)."""
    from dpfl_ray.secagg.errors import SecAggError

    config = SecAggRoundConfig(n_clients=3, bits=32, threshold=2)

    def to_masked():
        clients = [SecAggClient(u, config) for u in range(3)]
        server = SecAggServer(config)
        keys = server.receive_keys([c.advertise_keys() for c in clients])
        forwarded = server.receive_shares([c.share_keys(keys) for c in clients])
        return clients, server, [c.masked_input(forwarded[c.id], np.zeros(3, np.uint32)) for c in clients]

    adverts = [SecAggClient(u, config).advertise_keys() for u in range(3)]
    with pytest.raises(SecAggProtocolError, match="which is no client id"):  # True was taken for client 1
        SecAggServer(config).receive_keys(adverts[:1] + [{**adverts[1], "client": True}] + adverts[2:])
    for bad in (1.9, True, None):
        clients, server, masked = to_masked()
        masked[1] = {**masked[1], "clients": [bad]}
        with pytest.raises(SecAggProtocolError, match="which is no client id"):
            server.receive_masked(masked)
    for field, spoil in (("b_shares", lambda shares: {u: "not bytes" for u in shares}),
                         ("b_shares", lambda shares: {0.5: b for b in shares.values()}),
                         ("rejected", lambda _: ["x"]), ("rejected", lambda _: "0")):
        clients, server, masked = to_masked()
        request = server.receive_masked(masked)
        replies = [c.unmask(request) for c in clients]
        replies[0] = {**replies[0], field: spoil(replies[0][field])}
        with pytest.raises(SecAggError):
            server.receive_unmask(replies)


def test_server_rejects_a_share_message_that_skips_a_neighbour():
    config = SecAggRoundConfig(n_clients=3, bits=32, threshold=2)
    clients = [SecAggClient(u, config) for u in range(3)]
    server = SecAggServer(config)
    keys = server.receive_keys([c.advertise_keys() for c in clients])
    shares = [c.share_keys(keys) for c in clients]
    del shares[0]["ciphertexts"][1]  # masks of 0 and 1 would no longer cancel
    with pytest.raises(SecAggProtocolError):
        server.receive_shares(shares)


def test_wrong_round_is_rejected():
    clients = [SecAggClient(u, SecAggRoundConfig(n_clients=2, bits=32, round_id=r)) for u, r in ((0, 1), (1, 2))]
    server = SecAggServer(SecAggRoundConfig(n_clients=2, bits=32, round_id=1))
    with pytest.raises(SecAggProtocolError):
        server.receive_keys([c.advertise_keys() for c in clients])


def test_errors_keep_their_details_through_pickle():
    err = SecAggAbort("too few", "threshold", phase="share", needed=5, available=4)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is SecAggAbort and str(back) == str(err)
    assert (back.phase, back.needed, back.available, back.field) == ("share", 5, 4, "threshold")
    assert isinstance(back, DPFLError)


def test_secagg_plus_reconstructs_dropped_clients_from_their_neighbours_only():
    config = SecAggRoundConfig(n_clients=24, bits=32, protocol="secagg+", degree=8, graph_seed=11)
    dropouts = {0: "advertise", 5: "share", 9: "masked_input", 13: "unmask", 17: "masked_input"}
    assert not predicted_abort(config.graph, {u: PHASES.index(p) for u, p in dropouts.items()})
    rng = np.random.default_rng(0)
    vectors = [rng.integers(0, 2**32, 7, dtype=np.uint32) for _ in range(24)]
    result = secure_sum(vectors, bits=32, protocol="secagg+", degree=8, graph_seed=11, dropouts=dropouts)
    included = [u for u in range(24) if u not in (0, 5, 9, 17)]
    assert result.survivors == tuple(included)
    np.testing.assert_array_equal(result.sum, expected_sum(vectors, included, 32))
    # Sparse graph: a client seals shares for its 8 neighbours only, not for all 23 peers.
    dense = secure_sum(vectors, bits=32, dropouts=dropouts)
    assert result.bytes_per_client[1] < dense.bytes_per_client[1]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_the_servers_mask_expansion_shared_among_workers_gives_the_same_sum(workers):
    """The runtime lends the server's PRG expansion to idle workers (runtime.secagg_round.pool_expander):
    any split of the masks, expanded apart and added mod 2^bits, unmasks the same sum."""
    config = SecAggRoundConfig(n_clients=6, bits=32, threshold=4)
    rng = np.random.default_rng(5)
    vectors = [rng.integers(0, 2**32, 7, dtype=np.uint32) for _ in range(6)]
    clients = [SecAggClient(u, config) for u in range(6)]
    server = SecAggServer(config)
    keys = server.receive_keys([c.advertise_keys() for c in clients])
    forwarded = server.receive_shares([c.share_keys(keys) for c in clients])
    senders = [c for c in clients if c.id != 4]  # client 4 drops before its masked input
    request = server.receive_masked([c.masked_input(forwarded[c.id], vectors[c.id]) for c in senders])
    seen = []

    def shared(masks, dim, dtype):
        seen.append(len(masks))
        total = np.zeros(dim, np.dtype(dtype))
        for share in deal(list(masks), workers):
            total += expand_masks(share, dim, dtype)
        return total

    total = server.receive_unmask([c.unmask(request) for c in senders], shared)
    np.testing.assert_array_equal(total, expected_sum(vectors, [0, 1, 2, 3, 5], 32))
    assert seen == [5 + 5]  # the five survivors' self-masks, and client 4's pairwise masks with them
