"""Fu et al. 2022, Adap DP-FL (Algorithm 1) on the Algorithm interface.

Every round each sampled client runs per-example DP-SGD (Poisson lots of expected size L, Adam)
with its own clipping threshold C_t^k (eq. 6-8, initialised on random noise) and the round's noise
multiplier sigma_t; the server averages (eq. 1) and decays sigma_{t+1} = beta sigma_t after three
consecutive drops of the validation loss (eq. 9). A client stops uploading once its epsilon would
pass the budget (Alg. 1 lines 16-19): it is recorded as an ``exhausted@training`` dropout.

Which epsilon decides the stop (``stop_on``): by default the effective one, booked on the client's
own ledger, which counts the norm query of eq. 6 beside the gradient (docs/record_level_dp.md). The
paper's eq. 10, which counts the gradient only, is kept beside it as the claim; ``stop_on: claimed``
stops on the claim instead, which is the run as published: its accounted epsilon passes the budget,
and the run's ledger says by how much. With ``alpha: null`` the threshold is the
constant privacy.clipping.norm and no norm query runs; with ``beta: null`` sigma stays constant:
together they are the paper's constant-sigma baseline.

Adam (Sec. V-A) starts anew in every client round by default (``optimizer_state: round``): a round
of one lot is then Adam's first step, about lr times the sign of the noisy gradient. With
``optimizer_state: client`` each client keeps its moments from one of its rounds to the next (as
one optimizer object per client does); they are post-processing of its booked noisy gradients.
With ``optimizer_state: server`` the clients take no step: each releases its noisy mean gradient
(Alg. 1 line 13), the server averages them as line 23 averages the models, and one Adam, kept
across rounds, steps the global model on that average (lines 15 and 23 read as one gradient step
on the average, with Adam in place of the plain step). Also post-processing: the same booked
noisy gradients, the same accounting.
"""
from __future__ import annotations

from dataclasses import dataclass

import dp_accounting
import numpy as np

from ..training.dpsgd_config import AdamState, DPSGDConfig
from ..privacy.client_ledgers import ClientLedgers
from ..privacy.randomness import DPRandomness
from .adap_dpfl_core import (
    MIN_CLIP_NORM, claimed_ledgers, client_config, decayed_noise_multiplier, initial_clip_threshold, next_clip_threshold,
    round_events,
)
from .base import Aggregate, Algorithm, ClientReport, ClientSpec, LocalProcedure, RoundOutcome
from .fedavg import FedAvg


def _claimed_event(sampling_rate: float, sigma: float, steps: int):
    """What eq. 10 counts for one client and round: the gradient's sampled Gaussian, per lot."""
    return dp_accounting.SelfComposedDpEvent(round_events(sampling_rate, sigma, book_threshold_query=False)[1], steps)


@dataclass(frozen=True)
class AdapDPSGD(LocalProcedure):
    """One round of Alg. 1 lines 6-15 on each sampled client. ``clips``: client id -> C_t^k
    (missing: the client's first round, C_0 from random noise; ``initial_clip``: ``eq6`` scales it
    by alpha); ``alpha`` None: constant clip.
    ``randomness`` travels to the workers: it draws every client's lots and noise (C_0's random
    inputs touch no data and stay on the scenario seed). ``adam_states``: client id -> its Adam
    moments from its last round, with ``keep_adam_state`` (``optimizer_state: client``).
    ``optimizer``: ``adam``, or ``none`` (``optimizer_state: server``: the client releases its noisy
    gradient and the server steps)."""

    noise_multiplier: float
    lot_size: int
    lr: float
    steps: int
    alpha: float | None
    clip_norm: float
    clips: tuple[tuple[int, float], ...]
    randomness: DPRandomness
    adam_states: tuple[tuple[int, AdamState], ...] = ()
    keep_adam_state: bool = False
    optimizer: str = "adam"
    min_clip_norm: float = MIN_CLIP_NORM
    initial_clip: str = "noise"

    def _threshold(self, model, theta, x, client_id, seed) -> float:
        if self.alpha is None:
            return self.clip_norm
        known = dict(self.clips)
        if client_id in known:
            return known[client_id]
        import torch  # on the worker, which has it loaded: this module is also read where nothing trains

        with torch.no_grad():  # the model's number of classes, from one forward pass
            probe = torch.zeros((1, *x.shape[1:]), dtype=torch.float32, device=next(model.parameters()).device)
            num_classes = int(model(probe).shape[-1])
        return initial_clip_threshold(model, theta, x.shape[1:], num_classes, self.lot_size, seed=seed,
                                      client_id=client_id, floor=self.min_clip_norm,
                                      alpha=self.alpha if self.initial_clip == "eq6" else 1.0)

    def run(self, model, theta, x, y, *, seed, round_idx, client_id):
        from ..training.local_dp import dpsgd_update

        clip = self._threshold(model, theta, x, client_id, seed)
        if self.alpha is None:
            cfg = DPSGDConfig(clip_norm=clip, noise_multiplier=self.noise_multiplier, lr=self.lr,
                              lot_size=self.lot_size, sampling="poisson", steps=self.steps, optimizer=self.optimizer)
        else:
            cfg = client_config(clip, self.noise_multiplier, self.lr, self.lot_size, steps=self.steps,
                                optimizer=self.optimizer)
        res = dpsgd_update(model, theta, x, y, cfg, seed=seed, round_idx=round_idx, client_id=client_id,
                           randomness=self.randomness, adam_state=dict(self.adam_states).get(client_id),
                           keep_adam_state=self.keep_adam_state)
        nxt = clip if self.alpha is None else next_clip_threshold(res, self.alpha, self.min_clip_norm)
        claimed = _claimed_event(res.sampling_rate, res.noise_multiplier, res.steps)
        return res.update, ClientReport(events=((res.dp_event(), 1),), claimed_events=((claimed, 1),),
                                        values={"clip_norm": float(nxt), "clip_used": float(clip)},
                                        client_state=res.adam_state)


class AdapDPFL(Algorithm):
    record_level = True

    @classmethod
    def adjacencies(cls, sc) -> dict[str, tuple[str, ...]]:
        """DP-SGD with Poisson lots of expected size L, the sum divided by L. The run releases each
        client's record count n (the lot rate q = L / n, eq. 1's aggregation weights), so neighbours
        must share it: zero-out, one record replaced by a null record that contributes nothing
        (not the paper's add/remove, under which n would differ and the release shows it). For a
        Poisson-sampled Gaussian its RDP is add/remove's, which is what the ledgers compute."""
        return {"zero_out": ("each client's record count n (the lot rate q = L / n, the aggregation weights)",)}

    @classmethod
    def check_scenario(cls, sc) -> None:
        a, p = sc.privacy.adap_dpfl, sc.privacy
        cls.adjacency(sc)
        if a is None:
            raise ValueError("privacy.adap_dpfl: adap_dpfl needs its section (epsilon, lot_size, lr, alpha, beta)")
        if p.noise_multiplier is None:
            raise ValueError("privacy.noise_multiplier: adap_dpfl needs sigma_0")
        if a.beta is not None and sc.data.validation_fraction <= 0:
            raise ValueError("data.validation_fraction: the noise decay (privacy.adap_dpfl.beta) reads the "
                             "server's validation loss; hold a split out (e.g. 0.1) or set beta: null")
        if p.audit is not None:
            raise ValueError("privacy.audit: canary clients audit client-level DP; adap_dpfl is record-level")
        if any(d.phase == "calibration" and d.model != "none" for d in sc.faults.dropouts):
            raise ValueError("faults.dropout.phase: adap_dpfl has no calibration phase")
        if a.optimizer_state == "server" and a.steps != 1:
            raise ValueError("privacy.adap_dpfl.optimizer_state: 'server' steps once on each round's mean noisy "
                             f"gradient, one lot per client; set privacy.adap_dpfl.steps: 1 (it is {a.steps})")

    def __init__(self, scenario, weights, noise_multiplier=None, sizes=None,
                 randomness: DPRandomness | None = None):
        a, p = scenario.privacy.adap_dpfl, scenario.privacy
        self.settings, self.budget = a, float(a.epsilon)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.sizes = np.asarray(sizes if sizes is not None else np.ones(len(weights)), dtype=np.int64)
        self.sigma = float(noise_multiplier or p.noise_multiplier)
        self.clip_norm = float(p.clipping.norm)
        self.clips: dict[int, float] = {}
        self.adam_states: dict[int, AdamState] = {}  # optimizer_state: client
        self.server_adam: AdamState | None = None  # optimizer_state: server
        self.validation_losses: list[float] = []
        self.ledgers = ClientLedgers(p.delta, num_clients=len(weights))
        # stop_on: claimed -> the paper's eq. 10 ledger decides the stop (module doc)
        self.claims = claimed_ledgers(p.delta, len(weights)) if a.stop_on == "claimed" else None
        self.randomness = DPRandomness.for_run(scenario, randomness)
        self._sampled: list[int] = []

    def _round_event(self, c: int):
        """What client c's ledger will book for this round, as dpfl_ray.training.local_dp reports it."""
        q = min(1.0, self.settings.lot_size / max(int(self.sizes[c]), 1))
        if self.claims is not None:
            return _claimed_event(q, self.sigma, self.settings.steps)
        effective, _ = round_events(q, self.sigma, book_threshold_query=self.settings.alpha is not None)
        return dp_accounting.SelfComposedDpEvent(effective, self.settings.steps)

    def withdrawals(self, round_idx, sampled) -> dict[int, str]:
        deciding = self.ledgers if self.claims is None else self.claims
        return {int(c): "exhausted" for c in sampled
                if deciding.would_exceed(int(c), self._round_event(int(c)), self.budget)}

    def begin_round(self, round_idx, sampled):
        self._sampled = [int(c) for c in sampled]
        return None

    def client_spec(self) -> ClientSpec:
        a = self.settings
        clips = tuple((c, self.clips[c]) for c in self._sampled if c in self.clips)
        states = tuple((c, self.adam_states[c]) for c in self._sampled if c in self.adam_states)
        return ClientSpec(local=AdapDPSGD(self.sigma, a.lot_size, a.lr, a.steps, a.alpha, self.clip_norm, clips,
                                          self.randomness, states, keep_adam_state=a.optimizer_state == "client",
                                          optimizer="none" if a.optimizer_state == "server" else "adam",
                                          min_clip_norm=a.min_clip_norm, initial_clip=a.initial_clip))

    def finish(self, outcome: RoundOutcome, dim: int) -> Aggregate:
        for c, report in outcome.reports.items():
            for event, count in report.events:
                self.ledgers.record(int(c), event, count)
            for event, count in report.claimed_events if self.claims is not None else ():
                self.claims.record(int(c), event, count)
            self.clips[int(c)] = float(report.values["clip_norm"])
            if report.client_state is not None:
                self.adam_states[int(c)] = report.client_state
        agg = FedAvg(weights=self.weights).finish(outcome, dim)
        if self.settings.optimizer_state == "server" and agg.weight_sum > 0:
            # agg.delta is minus the survivors' weighted mean noisy gradient (each client's Delta is
            # minus its own): Adam's step on that mean is the round's step
            from ..training.local_dp import adam_step

            step, self.server_adam = adam_step(-agg.delta, self.settings.lr, self.server_adam)
            agg = Aggregate(step, agg.weight_sum, agg.info)
        used = [r.values["clip_used"] for r in outcome.reports.values()]
        agg.info.update(noise_multiplier=self.sigma, clip_norm_mean=float(np.mean(used)) if used else None)
        return agg

    def observe(self, round_idx, metrics) -> None:
        """Eq. 9 on the held-out validation loss, before the next round."""
        loss = metrics.get("validation_loss")
        if self.settings.beta is None or loss is None:
            return
        self.validation_losses.append(float(loss))
        self.sigma = decayed_noise_multiplier(self.sigma, self.validation_losses, self.settings.beta)

    def reads_evaluation(self) -> bool:
        return self.settings.beta is not None

    def reads_validation_every_round(self) -> bool:
        return self.settings.beta is not None

    def summary_fields(self) -> dict:
        a = self.settings
        return {"epsilon_budget": self.budget, "adaptive_clipping": a.alpha is not None,
                "noise_decay": a.beta is not None, "noise_multiplier_final": self.sigma, "stop_on": a.stop_on,
                "optimizer_state": a.optimizer_state}

    def state_dict(self) -> dict:
        return {"sigma": self.sigma, "clips": {str(c): v for c, v in self.clips.items()},
                "adam_states": {str(c): st.to_dict() for c, st in self.adam_states.items()},
                **({} if self.server_adam is None else {"server_adam": self.server_adam.to_dict()}),
                "validation_losses": list(self.validation_losses),
                "ledgers": self.ledgers.to_dict(include_epsilon=False),
                **({} if self.claims is None else {"claims": self.claims.to_dict(include_epsilon=False)})}

    def load_state_dict(self, state: dict) -> None:
        self.sigma = float(state["sigma"])
        self.clips = {int(c): float(v) for c, v in state["clips"].items()}
        self.adam_states = {int(c): AdamState.from_dict(v) for c, v in state.get("adam_states", {}).items()}
        self.server_adam = AdamState.from_dict(state["server_adam"]) if "server_adam" in state else None
        self.validation_losses = [float(v) for v in state["validation_losses"]]
        self.ledgers = ClientLedgers.from_dict(state["ledgers"])
        if self.claims is not None:
            self.claims = ClientLedgers.from_dict(state["claims"])
