"""Client state machine of Bonawitz et al. 2017, Fig. 4 (semi-honest: Round 3 ConsistencyCheck
omitted), restricted to a neighbour graph as in SecAgg+ (Bell et al. 2020).

Messages in and out are plain dicts of ints, bytes and NumPy arrays. The client keeps its private
keys as raw bytes, so the object itself can be pickled at any point of the round.

Tampered shares: a share is only decrypted when the server asks for it (Round 4, as in the
paper). If its ciphertext fails authentication the client leaves that share out of its reply and
lists the sender under ``"rejected"``; the round continues as long as the other holders reach the
threshold. The sender is *not* blamed, because a bit flip in transit (or by the server, which
forwards every ciphertext) looks the same as a misbehaving sender.

Extension -- noise layer seeds, shared like b_u, for :mod:`dpfl_ray.algorithms.baek`'s layered
calibration: a client's DP noise is a sum of layers ``k = 0..L``, each drawn from a 32-byte PRG
seed. ``share_keys(..., layer_seeds=...)`` Shamir-shares the seeds of layers ``1..L`` (layer 0 is
never shared) to the same holders, with the same threshold, in the same sealed ciphertext as the
shares of ``s_u^SK`` and ``b_u``. In Round 4 the server may ask (``"layer_shares_for"``,
``"layers_from": k``) for the shares of layers ``k..L`` of survivors; with ``d`` of the ``N``
sampled clients missing from the sum, a client refuses any ``k <= d``, so the server never learns
the seeds of layers ``1..d`` that the surviving noise still needs. ``d`` comes from the one
survivor set the client ever answers for: the first answered request fixes it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from dpfl_ray.secagg import shamir
from dpfl_ray.secagg.config import SecAggRoundConfig, as_ring_vector, check_round, reduce_mod, wire_size
from dpfl_ray.secagg.errors import SecAggAbort, SecAggProtocolError, ShareAuthenticationError, UnmaskRefused
from dpfl_ray.secagg.keys import (
    PURPOSE_ENCRYPTION, PURPOSE_MASK, KeyPair, add_prg, check_public_key, derive_keys, generate_keypair,
    open_sealed, seal,
)

_SHARE = shamir.SHARE_BYTES


def _ids(values: object, what: str) -> frozenset[int]:
    if not isinstance(values, (list, tuple, set, frozenset)):
        raise SecAggProtocolError(f"unmask request field {what!r} must be a list of client ids")
    return frozenset(int(v) for v in values)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


class SecAggClient:
    """One user ``u``; call the four round methods in order, each at most once (``unmask`` may repeat)."""

    def __init__(self, client_id: int, config: SecAggRoundConfig):
        if not 0 <= client_id < config.n_clients:
            raise SecAggProtocolError(f"client id {client_id} outside 0..{config.n_clients - 1}")
        self.id = int(client_id)
        self.config = config
        self.neighbours = config.graph.neighbours[self.id]
        self.threshold = config.graph.thresholds[self.id]
        self.phase = "created"
        self.bytes_sent = 0
        self._c: KeyPair | None = None
        self._s: KeyPair | None = None
        self._b: bytes | None = None
        self._peer_s_pk: dict[int, bytes] = {}
        self._enc_keys: dict[int, bytes] = {}
        self._own_shares: tuple[int, int] | None = None  # (s_sk share, b share) held by u itself
        self._own_layer_shares: tuple[int, ...] = ()     # u's shares of its own layer seeds 1..L
        self._absent = 0                                 # sampled clients that never joined the protocol
        self._inbox: dict[int, bytes] = {}               # sender -> sealed (s_sk, b, layer 1..L shares) for u
        # (survivors, dropped) of the first answered unmask request; every later one must repeat it.
        self._view: tuple[frozenset[int], frozenset[int]] | None = None

    def __repr__(self) -> str:
        return f"SecAggClient(id={self.id}, phase={self.phase!r})"

    def _advance(self, expected: str, new: str) -> None:
        if self.phase != expected:
            raise SecAggProtocolError(f"client {self.id}: {new} called in phase {self.phase!r}, "
                                      f"expected after {expected!r}", client=self.id)
        self.phase = new

    def _send(self, message: dict) -> dict:
        self.bytes_sent += wire_size(message, self.config.bits)
        return message

    # Round 0 -- AdvertiseKeys
    def advertise_keys(self) -> dict:
        """Fresh key pairs ``(c_u, s_u)``; sends both public keys."""
        self._advance("created", "advertise")
        self._c, self._s = generate_keypair(), generate_keypair()
        return self._send({"round_id": self.config.round_id, "client": self.id,
                           "c_pk": self._c.public, "s_pk": self._s.public})

    # Round 1 -- ShareKeys
    def share_keys(self, keys_message: Mapping, layer_seeds: Sequence[bytes] = (), absent: int = 0) -> dict:
        """Shamir-share ``b_u`` and ``s_u^SK`` among the live neighbours and seal each pair of shares.

        ``keys_message``: ``{"round_id", "keys": {v: (c_pk, s_pk)}}`` as broadcast by the server.
        ``layer_seeds[j]``: the 32-byte PRG seed of noise layer ``j + 1`` (``L = len(layer_seeds)``);
        each is shared like ``b_u`` and its shares travel in the same ciphertext, after the
        ``s_u^SK`` and ``b_u`` shares. ``absent``: clients sampled for the round that take no part
        in the protocol, so ``N = absent + config.n_clients`` clients were sampled. Without layer
        seeds the messages are exactly those of the plain protocol.
        """
        layer_seeds = tuple(layer_seeds)
        for j, seed in enumerate(layer_seeds):
            if not isinstance(seed, bytes) or len(seed) != shamir.SECRET_BYTES:
                raise SecAggProtocolError(f"client {self.id}: seed of layer {j + 1} must be {shamir.SECRET_BYTES} "
                                          "bytes", client=self.id)
        if not _is_int(absent) or absent < 0:
            raise SecAggProtocolError(f"client {self.id}: absent must be an int >= 0, got {absent!r}", client=self.id)
        self._advance("advertise", "share")
        self._absent = int(absent)
        check_round(keys_message, self.config)
        keys = keys_message.get("keys")
        if not isinstance(keys, Mapping) or tuple(keys.get(self.id) or ()) != (self._c.public, self._s.public):
            raise SecAggProtocolError(f"client {self.id}: key list lacks this client's own keys", client=self.id)
        seen: set[bytes] = set()
        for v, pair in keys.items():
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise SecAggProtocolError(f"key entry of client {v} is not a (c_pk, s_pk) pair", client=v)
            for pk in pair:
                check_public_key(pk, v)
                if pk in seen:  # Fig. 4 Round 1: all public keys must be distinct
                    raise SecAggProtocolError(f"public key of client {v} is repeated", client=v)
                seen.add(pk)
        peers = sorted(int(v) for v in keys if int(v) in self.neighbours)
        if len(peers) + 1 < self.threshold:
            raise SecAggAbort(f"client {self.id}: {len(peers) + 1} live holders < threshold {self.threshold}",
                              phase="share", needed=self.threshold, available=len(peers) + 1)
        self._peer_s_pk = {v: keys[v][1] for v in peers}
        self._enc_keys = derive_keys(self._c.private, self.id, {v: keys[v][0] for v in peers},
                                     purpose=PURPOSE_ENCRYPTION, round_id=self.config.round_id)
        self._b = os.urandom(shamir.SECRET_BYTES)
        points = [v + 1 for v in peers] + [self.id + 1]
        s_shares = shamir.split(shamir.secret_to_int(self._s.private), self.threshold, points)
        b_shares = shamir.split(shamir.secret_to_int(self._b), self.threshold, points)
        layer_shares = [shamir.split(shamir.secret_to_int(seed), self.threshold, points) for seed in layer_seeds]
        self._own_shares = (s_shares[self.id + 1], b_shares[self.id + 1])
        self._own_layer_shares = tuple(shares[self.id + 1] for shares in layer_shares)
        secrets = (s_shares, b_shares, *layer_shares)  # plaintext order: s_sk, b, layer 1..L
        sealed = {v: seal(self._enc_keys[v], b"".join(shamir.encode_share(shares[v + 1]) for shares in secrets),
                          sender=self.id, receiver=v, round_id=self.config.round_id) for v in peers}
        return self._send({"round_id": self.config.round_id, "client": self.id, "ciphertexts": sealed})

    # Round 2 -- MaskedInputCollection
    def masked_input(self, forwarded: Mapping, vector: object) -> dict:
        """``y_u = x_u + PRG(b_u) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv)  (mod 2^bits)``.

        ``forwarded``: ``{"round_id", "ciphertexts": {v: sealed}}`` -- the shares addressed to
        ``u``; their senders (U_2 within the neighbourhood) are exactly the peers ``u`` masks with.
        """
        self._advance("share", "masked_input")
        check_round(forwarded, self.config)
        inbox = forwarded.get("ciphertexts")
        if not isinstance(inbox, Mapping):
            raise SecAggProtocolError(f"client {self.id}: forwarded shares must be a dict", client=self.id)
        inbox = {int(v): ct for v, ct in inbox.items()}
        strangers = set(inbox) - set(self._peer_s_pk)
        if strangers:
            raise SecAggProtocolError(f"client {self.id}: shares from non-neighbours {sorted(strangers)}",
                                      client=self.id)
        if len(inbox) + 1 < self.threshold:
            raise SecAggAbort(f"client {self.id}: {len(inbox) + 1} sharing neighbours < threshold "
                              f"{self.threshold}", phase="masked_input", needed=self.threshold,
                              available=len(inbox) + 1)
        y = as_ring_vector(vector, self.config)
        self._inbox = inbox
        add_prg(y, self._b)
        seeds = derive_keys(self._s.private, self.id, {v: self._peer_s_pk[v] for v in sorted(inbox)},
                            purpose=PURPOSE_MASK, round_id=self.config.round_id)
        for v, seed in seeds.items():
            add_prg(y, seed, 1 if self.id < v else -1)
        reduce_mod(y, self.config.bits)  # a ring narrower than its words: only its bits are sent
        return self._send({"round_id": self.config.round_id, "clients": [self.id], "masked": y})

    # Round 4 -- Unmasking
    def unmask(self, request: Mapping) -> dict:
        """Reveal b-shares of survivors and s_sk-shares of dropped peers, never both for one peer.

        ``request``: ``{"round_id", "survivors", "dropped"}`` plus optional explicit
        ``"b_shares_for"`` / ``"sk_shares_for"`` (defaulting to survivors / dropped). Raises
        :class:`UnmaskRefused` for any request that could leak both secrets of a peer.

        Optional ``"layer_shares_for"`` (survivors) with ``"layers_from": k >= 1`` asks for the
        shares of layers ``k..L_v`` of each listed ``v``; they come back as ``"layer_shares":
        {v: {layer: share}}`` (always present, empty when none were asked). With
        ``d = absent + n_clients - len(survivors)`` sampled clients missing from the sum, ``k <= d``
        is refused.

        The first answered request fixes ``survivors`` and ``dropped``; a later request listing
        other sets is refused, so what ``u`` reveals always follows from one claim about who
        dropped (else a server could take layer shares under a claim of fewer dropouts, then the
        dropped client's ``s_sk`` shares under the true one). A survivor set whose graph is
        disconnected is refused too (Bell et al. 2020): each part's sum could be unmasked alone.
        """
        if self.phase not in ("masked_input", "unmask"):
            raise SecAggProtocolError(f"client {self.id}: unmask called in phase {self.phase!r}", client=self.id)
        check_round(request, self.config)
        survivors = _ids(request.get("survivors"), "survivors")
        dropped = _ids(request.get("dropped"), "dropped")
        b_for = _ids(request.get("b_shares_for", survivors), "b_shares_for")
        sk_for = _ids(request.get("sk_shares_for", dropped), "sk_shares_for")
        layer_for = _ids(request.get("layer_shares_for", ()), "layer_shares_for")
        layers_from = request.get("layers_from")
        self._check_request(survivors, dropped, b_for, sk_for)
        self._check_layer_request(survivors, layer_for, layers_from)
        self._view = (survivors, dropped)
        self.phase = "unmask"

        b_shares: dict[int, bytes] = {}
        sk_shares: dict[int, bytes] = {}
        layer_shares: dict[int, dict[int, bytes]] = {}
        rejected: list[int] = []
        for v in sorted((b_for | sk_for | layer_for) & (set(self._inbox) | {self.id})):
            if v == self.id:
                s_share, b_share = self._own_shares
                layers = self._own_layer_shares
            else:
                try:
                    plain = open_sealed(self._enc_keys[v], self._inbox[v], sender=v, receiver=self.id,
                                        round_id=self.config.round_id)
                except ShareAuthenticationError:
                    rejected.append(v)
                    continue
                if len(plain) < 2 * _SHARE or len(plain) % _SHARE:  # (2 + L_v) shares, any L_v >= 0
                    rejected.append(v)
                    continue
                s_share, b_share, *layers = (int.from_bytes(plain[i:i + _SHARE], "big")
                                             for i in range(0, len(plain), _SHARE))
            if v in b_for:
                b_shares[v] = shamir.encode_share(b_share)
            elif v in sk_for:
                sk_shares[v] = shamir.encode_share(s_share)
            if v in layer_for:
                wanted = {k: shamir.encode_share(layers[k - 1]) for k in range(int(layers_from), len(layers) + 1)}
                if wanted:
                    layer_shares[v] = wanted
        return self._send({"round_id": self.config.round_id, "client": self.id, "b_shares": b_shares,
                           "sk_shares": sk_shares, "layer_shares": layer_shares, "rejected": rejected})

    def _check_layer_request(self, survivors, layer_for, layers_from) -> None:
        def refuse(reason: str, **details):
            raise UnmaskRefused(f"client {self.id} refuses to reveal layer shares: {reason}", client=self.id,
                                **details)

        if not layer_for:
            return
        if not layer_for <= survivors:
            refuse(f"layer shares asked for clients {sorted(layer_for - survivors)} that are not survivors",
                   peers=sorted(layer_for - survivors))
        if not _is_int(layers_from) or layers_from < 1:
            refuse(f"'layers_from' must be an int >= 1, got {layers_from!r}")
        missing = self._absent + self.config.n_clients - len(survivors)
        if layers_from <= missing:
            refuse(f"layers_from={layers_from} but {missing} sampled clients are missing from the sum, "
                   f"so layers 1..{missing} must stay secret", layers_from=int(layers_from), missing=missing)

    def _check_request(self, survivors, dropped, b_for, sk_for) -> None:
        def refuse(reason: str, **details):
            raise UnmaskRefused(f"client {self.id} refuses to unmask: {reason}", client=self.id, **details)

        if self._view is not None and (survivors, dropped) != self._view:
            refuse("the request lists other survivors or dropped clients than the first one it answered",
                   peers=sorted((survivors ^ self._view[0]) | (dropped ^ self._view[1])))
        unknown = sorted(v for v in survivors | dropped if not 0 <= v < self.config.n_clients)
        if unknown:
            refuse(f"unknown client ids {unknown}", peers=unknown)
        if survivors & dropped:
            refuse(f"clients {sorted(survivors & dropped)} are listed both as survivors and as dropped",
                   peers=sorted(survivors & dropped))
        if sk_for & survivors:
            refuse(f"s_sk shares asked for survivors {sorted(sk_for & survivors)}", peers=sorted(sk_for & survivors))
        if b_for & dropped:
            refuse(f"b shares asked for dropped clients {sorted(b_for & dropped)}", peers=sorted(b_for & dropped))
        if b_for & sk_for:
            refuse(f"both shares asked for clients {sorted(b_for & sk_for)}", peers=sorted(b_for & sk_for))
        if not b_for <= survivors or not sk_for <= dropped:
            refuse("shares asked for clients listed neither as survivor nor as dropped")
        if self.id not in survivors:
            # u did send y_u; a request calling it dropped would expose s_u^SK next to u's own b share.
            refuse("this client sent its masked input but is not listed as a survivor")
        live = len(survivors & (self.neighbours | {self.id}))
        if live < self.threshold:
            refuse(f"only {live} survivors in the neighbourhood, threshold is {self.threshold}")
        parts = self.config.graph.components(survivors)
        if parts > 1:
            refuse(f"the graph of the {len(survivors)} survivors splits into {parts} parts, so the sum of "
                   "each part could be unmasked alone", components=parts)
