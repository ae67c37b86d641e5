"""Server state machine of Bonawitz et al. 2017, Fig. 4 (semi-honest, no Round 3), with the
neighbour graph of SecAgg+ (Bell et al. 2020).

Live sets follow the paper: U_1 advertised keys, U_2 shared keys, U_3 sent masked inputs (their
inputs are in the sum), U_4 answered the unmask request. After every round the server aborts with
:class:`SecAggAbort` if some live client has fewer than its threshold of live holders (for the
complete graph: fewer than ``t`` clients remain), after Round 2 if the graph restricted to U_3 is
disconnected (Bell et al. 2020: each part's sum could be unmasked on its own), and before
reconstructing it aborts if any needed secret has fewer than its threshold of shares.

Masked inputs may arrive pre-summed: a worker hosting several clients may add their ``y_u`` mod
2^bits and send ``{"clients": [...], "masked": sum}``; the server only needs the total and the ids.

Extension -- noise layer seeds, shared like b_u, for :mod:`dpfl_ray.algorithms.baek`'s layered
calibration: between ``receive_masked`` and ``receive_unmask``, :meth:`SecAggServer.request_layers`
asks the survivors for the shares of noise layers ``k..L`` of every client of U_3;
``receive_unmask`` then reconstructs those seeds into :attr:`SecAggServer.layer_seeds`, also for
survivors that vanish during unmasking. Clients refuse ``k <= d`` (``d`` sampled clients missing).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from dpfl_ray.secagg import shamir
from dpfl_ray.secagg.config import SecAggRoundConfig, check_round, reduce_mod, wire_size
from dpfl_ray.secagg.errors import SecAggAbort, SecAggProtocolError, ShamirError
from dpfl_ray.secagg.keys import PURPOSE_MASK, check_public_key, derive_keys, expand_masks, public_key_of

# (masks as (seed, sign), dim, numpy dtype string) -> sum of sign * PRG(seed) mod 2^bits
MaskExpander = Callable[[Sequence[tuple[bytes, int]], int, str], np.ndarray]


def _client_id(u, where: str) -> int:
    """A client id as a message carries it: an integer (a float or a bool names no client)."""
    if not isinstance(u, (int, np.integer)) or isinstance(u, bool):
        raise SecAggProtocolError(f"{where} names client {u!r}, which is no client id")
    return int(u)


class SecAggServer:
    """Call ``receive_keys``, ``receive_shares``, ``receive_masked``, ``receive_unmask`` in order."""

    def __init__(self, config: SecAggRoundConfig):
        self.config = config
        self.graph = config.graph
        self.phase = "created"
        self.bytes_received = 0
        self.bytes_sent = 0
        self.seconds = {"advertise": 0.0, "share": 0.0, "masked_input": 0.0, "unmask": 0.0, "reconstruct": 0.0}
        self.rejected_shares: list[tuple[int, int]] = []  # (holder, owner) pairs that failed AEAD
        self.keys: dict[int, tuple[bytes, bytes]] = {}
        self.u2: frozenset[int] = frozenset()
        self.u3: frozenset[int] = frozenset()
        self.u4: frozenset[int] = frozenset()
        self._masked_sum: np.ndarray | None = None
        self._layers_from: int | None = None  # set by request_layers
        self.layer_seeds: dict[int, dict[int, bytes]] = {}  # owner in U_3 -> {layer: 32-byte seed}

    def _advance(self, expected: str, new: str) -> None:
        if self.phase != expected:
            raise SecAggProtocolError(f"server: {new} in phase {self.phase!r}, expected after {expected!r}")
        self.phase = new

    def _receive(self, messages: Iterable[Mapping], sender_key: str | None = "client") -> list[Mapping]:
        messages = list(messages)
        seen: set[int] = set()
        for m in messages:
            check_round(m, self.config)
            self.bytes_received += wire_size(m, self.config.bits)
            if sender_key is not None:
                sender = _client_id(m.get(sender_key), "a message")
                if not 0 <= sender < self.config.n_clients:
                    raise SecAggProtocolError(f"message from unknown client {sender!r}")
                if sender in seen:
                    raise SecAggProtocolError(f"client {sender} sent twice in one round", client=int(sender))
                seen.add(int(sender))
        return messages

    def _check_live(self, phase: str, live: frozenset[int]) -> None:
        if not live:
            needed = min(self.graph.thresholds)
            raise SecAggAbort(f"abort in phase {phase!r}: no clients remain, threshold is {needed}",
                              phase=phase, needed=needed, available=0)
        for u in sorted(live):
            available = len(self.graph.holders(u) & live)
            if available < self.graph.thresholds[u]:
                raise SecAggAbort(
                    f"abort in phase {phase!r}: client {u} has {available} live holders (itself included) "
                    f"of its secrets, threshold is {self.graph.thresholds[u]}; {len(live)} clients remain",
                    phase=phase, client=u, needed=self.graph.thresholds[u], available=available)

    # Round 0 -- AdvertiseKeys
    def receive_keys(self, messages: Iterable[Mapping]) -> dict:
        """Collect ``(c_pk, s_pk)`` from U_1; returns the broadcast ``{"round_id", "keys"}``."""
        start = time.perf_counter()
        self._advance("created", "advertise")
        for m in self._receive(messages):
            u = int(m["client"])
            self.keys[u] = (check_public_key(m.get("c_pk"), u), check_public_key(m.get("s_pk"), u))
        self._check_live("advertise", frozenset(self.keys))
        out = {"round_id": self.config.round_id, "keys": dict(sorted(self.keys.items()))}
        self.bytes_sent += wire_size(out, self.config.bits) * len(self.keys)
        self.seconds["advertise"] += time.perf_counter() - start
        return out

    # Round 1 -- ShareKeys
    def receive_shares(self, messages: Iterable[Mapping]) -> dict[int, dict]:
        """Collect sealed shares from U_2; returns ``{v: {"round_id", "ciphertexts": {u: sealed}}}``."""
        start = time.perf_counter()
        self._advance("advertise", "share")
        u1 = frozenset(self.keys)
        inbox: dict[int, dict[int, bytes]] = {}
        senders = set()
        for m in self._receive(messages):
            u = int(m["client"])
            sealed = m.get("ciphertexts")
            if u not in u1 or not isinstance(sealed, Mapping):
                raise SecAggProtocolError(f"client {u}: share message without advertised keys or ciphertexts",
                                          client=u)
            # Masks cancel only if u masks with v exactly when v masks with u, so every live
            # neighbour must get a share from u.
            expected = self.graph.neighbours[u] & u1
            if set(sealed) != expected:
                raise SecAggProtocolError(f"client {u} addressed shares to {sorted(sealed)}, expected its live "
                                          f"neighbours {sorted(expected)}", client=u)
            senders.add(u)
            for v, ct in sealed.items():
                inbox.setdefault(int(v), {})[u] = ct
        self.u2 = frozenset(senders)
        self._check_live("share", self.u2)
        out = {v: {"round_id": self.config.round_id, "ciphertexts": dict(sorted(inbox.get(v, {}).items()))}
               for v in sorted(self.u2)}
        self.bytes_sent += sum(wire_size(m, self.config.bits) for m in out.values())
        self.seconds["share"] += time.perf_counter() - start
        return out

    # Round 2 -- MaskedInputCollection
    def receive_masked(self, messages: Iterable[Mapping]) -> dict:
        """Add up ``{"clients": [...], "masked": y}`` messages (single or pre-summed) from U_3.

        Returns the unmask request for every client of U_3: ``{"round_id", "survivors", "dropped",
        "b_shares_for", "sk_shares_for"}`` with dropped = U_2 \\ U_3.
        """
        start = time.perf_counter()
        self._advance("share", "masked_input")
        total: np.ndarray | None = None
        senders: set[int] = set()
        for m in self._receive(messages, sender_key=None):
            ids = m.get("clients")
            y = m.get("masked")
            if not isinstance(ids, (list, tuple)) or not ids or not isinstance(y, np.ndarray):
                raise SecAggProtocolError("masked message needs 'clients' (non-empty list) and 'masked' (array)")
            ids = [_client_id(u, "masked input") for u in ids]
            bad = [u for u in ids if u not in self.u2 or u in senders]
            if bad or len(set(ids)) != len(ids):
                raise SecAggProtocolError(f"masked input from clients {bad or ids} that did not share keys or "
                                          "already sent one", clients=bad or ids)
            if y.dtype != self.config.dtype or y.ndim != 1 or (total is not None and y.shape != total.shape) \
                    or (self.config.dim is not None and y.shape[0] != self.config.dim):
                raise SecAggProtocolError(f"masked input of clients {ids} has dtype {y.dtype} / shape {y.shape}, "
                                          f"expected words of Z_2^{self.config.bits} of one common length", clients=ids)
            if self.config.below is not None and int(y.max()) > self.config.below:
                raise SecAggProtocolError(f"masked input of clients {ids} has words outside Z_2^{self.config.bits}",
                                          clients=ids)
            senders.update(ids)
            total = y.copy() if total is None else np.add(total, y, out=total)
        self.u3 = frozenset(senders)
        self._check_live("masked_input", self.u3)
        parts = self.graph.components(self.u3)
        if parts > 1:
            # Masks between U_3 clients cancel only within one component of the graph restricted
            # to U_3; unmasking a split set would release the sum of every part separately.
            raise SecAggAbort(f"abort in phase 'masked_input': the graph of the {len(self.u3)} survivors splits "
                              f"into {parts} parts, so each part's sum could be unmasked alone",
                              phase="masked_input", components=parts)
        self._masked_sum = total
        survivors, dropped = sorted(self.u3), sorted(self.u2 - self.u3)
        out = {"round_id": self.config.round_id, "survivors": survivors, "dropped": dropped,
               "b_shares_for": survivors, "sk_shares_for": dropped}
        self.bytes_sent += wire_size(out, self.config.bits) * len(survivors)
        self.seconds["masked_input"] += time.perf_counter() - start
        return out

    def request_layers(self, request: Mapping, layers_from: int) -> dict:
        """The unmask ``request`` of :meth:`receive_masked`, also asking every survivor for the
        shares of noise layers ``layers_from..L`` of every client of U_3.

        Call between ``receive_masked`` and ``receive_unmask``; the seeds then land in
        :attr:`layer_seeds`. Clients refuse ``layers_from <= d``, the number of sampled clients
        whose masked input did not arrive.
        """
        if self.phase != "masked_input":
            raise SecAggProtocolError(f"server: request_layers in phase {self.phase!r}, expected after "
                                      "'masked_input'")
        check_round(request, self.config)
        if not isinstance(layers_from, (int, np.integer)) or isinstance(layers_from, bool) or layers_from < 1:
            raise SecAggProtocolError(f"layers_from must be an int >= 1, got {layers_from!r}", "layers_from")
        out = dict(request)
        out["layer_shares_for"] = sorted(self.u3)
        out["layers_from"] = int(layers_from)
        self._layers_from = int(layers_from)
        self.bytes_sent += (wire_size(out) - wire_size(request)) * len(self.u3)
        return out

    # Round 4 -- Unmasking
    def receive_unmask(self, responses: Iterable[Mapping], expand: MaskExpander = expand_masks) -> np.ndarray:
        """Reconstruct ``b_u`` (u in U_3) and ``s_u^SK`` (u in U_2 \\ U_3); returns sum_{U_3} x_u mod 2^bits.

        After :meth:`request_layers` it also reconstructs the requested noise layer seeds of every
        client of U_3 into :attr:`layer_seeds`. ``expand(masks, dim, dtype)`` expands the masks to
        remove, sum of sign * PRG(seed) (:func:`~dpfl_ray.secagg.keys.expand_masks` by default; the
        runtime shares this, the bulk of the work, among its idle workers).
        """
        start = time.perf_counter()
        self._advance("masked_input", "unmask")
        dropped = self.u2 - self.u3
        b_points: dict[int, dict[int, int]] = {u: {} for u in self.u3}
        sk_points: dict[int, dict[int, int]] = {u: {} for u in dropped}
        layer_points: dict[int, dict[int, dict[int, int]]] = {u: {} for u in self.u3}  # owner -> layer -> points
        responders = set()
        for m in self._receive(responses):
            r = int(m["client"])
            if r not in self.u3:
                raise SecAggProtocolError(f"unmask response from client {r}, which sent no masked input", client=r)
            responders.add(r)
            for field, owners, points in (("b_shares", self.u3, b_points), ("sk_shares", dropped, sk_points)):
                shares = m.get(field)
                if not isinstance(shares, Mapping):
                    raise SecAggProtocolError(f"unmask response of client {r} lacks {field!r}", client=r)
                for u, share in shares.items():
                    u = _client_id(u, f"client {r}'s {field}")
                    if u not in owners or r not in self.graph.holders(u):
                        raise SecAggProtocolError(f"client {r} sent an unrequested {field} entry for {u}", client=r)
                    points[u][r + 1] = shamir.decode_share(share)
            self._collect_layers(r, m, layer_points)
            rejected = m.get("rejected", ())
            if not isinstance(rejected, (list, tuple)):
                raise SecAggProtocolError(f"client {r}'s rejected shares must be a list of client ids", client=r)
            self.rejected_shares.extend((r, _client_id(u, f"client {r}'s rejected shares")) for u in rejected)
        self.u4 = frozenset(responders)
        self._check_live("unmask", self.u4)
        self.seconds["unmask"] += time.perf_counter() - start

        start = time.perf_counter()
        total = self._masked_sum
        masks = [(self._recover(u, b_points[u], "b"), -1) for u in sorted(self.u3)]  # self-masks PRG(b_u)
        for u in sorted(dropped):
            s_sk = self._recover(u, sk_points[u], "s_sk")
            if public_key_of(s_sk) != self.keys[u][1]:
                raise SecAggAbort(f"reconstructed s_sk of client {u} does not match its public key",
                                  phase="reconstruct", client=u)
            partners = self.graph.neighbours[u] & self.u3
            seeds = derive_keys(s_sk, u, {v: self.keys[v][1] for v in sorted(partners)},
                                purpose=PURPOSE_MASK, round_id=self.config.round_id)
            # v added PRG(s_uv) if v < u and subtracted it otherwise; undo that.
            masks += [(seed, -1 if v < u else 1) for v, seed in seeds.items()]
        np.add(total, expand(masks, total.shape[0], total.dtype.str), out=total)
        reduce_mod(total, self.config.bits)
        if self._layers_from is not None:
            self.layer_seeds = {u: {k: self._recover(u, layer_points[u][k], f"layer-{k} seed")
                                    for k in sorted(layer_points[u])} for u in sorted(self.u3)}
        self._masked_sum = None
        self.seconds["reconstruct"] += time.perf_counter() - start
        return total

    def _collect_layers(self, r: int, message: Mapping, layer_points: dict[int, dict[int, dict[int, int]]]) -> None:
        """Add the ``"layer_shares"`` of responder ``r`` to ``layer_points[owner][layer]``.

        Every layer for which any share arrives is reconstructed later, so a layer that fewer than
        the owner's threshold of holders revealed aborts the round there.
        """
        shares = message.get("layer_shares")
        if shares is None and self._layers_from is None:
            return
        if not isinstance(shares, Mapping):
            raise SecAggProtocolError(f"unmask response of client {r} lacks 'layer_shares'", client=r)
        if shares and self._layers_from is None:
            raise SecAggProtocolError(f"client {r} sent layer shares, but none were requested", client=r)
        for u, layers in shares.items():
            u = int(u)
            if u not in self.u3 or r not in self.graph.holders(u):
                raise SecAggProtocolError(f"client {r} sent an unrequested layer_shares entry for {u}", client=r)
            if not isinstance(layers, Mapping):
                raise SecAggProtocolError(f"layer shares of client {u} from client {r} must be a dict", client=r)
            for k in layers:
                if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < self._layers_from:
                    raise SecAggProtocolError(f"client {r} sent a share of layer {k!r} of client {u}; layers "
                                              f"{self._layers_from} and up were requested", client=r)
            for k, share in layers.items():
                layer_points[u].setdefault(int(k), {})[r + 1] = shamir.decode_share(share)

    def _recover(self, owner: int, points: dict[int, int], kind: str) -> bytes:
        needed = self.graph.thresholds[owner]
        if len(points) < needed:
            raise SecAggAbort(f"abort: {len(points)} {kind} shares of client {owner} arrived, threshold is "
                              f"{needed}", phase="reconstruct", client=owner, needed=needed, available=len(points))
        try:
            return shamir.int_to_secret(shamir.reconstruct(points, needed))
        except ShamirError as exc:
            raise SecAggAbort(f"{kind} of client {owner} cannot be reconstructed: {exc}",
                              phase="reconstruct", client=owner) from exc
