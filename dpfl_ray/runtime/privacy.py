"""The run's privacy bookkeeping: one PrivacyLedger fed by the algorithm's actual Mechanism each
round, the budget rules that stop a run *before* a round that would break them, and the epsilon
against the server itself."""
from __future__ import annotations

import math

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from ..algorithms import Mechanism, make_algorithm
from ..errors import DPFLError
from ..privacy import PoissonSampling, PrivacyLedger, calibrate_noise_multiplier
from ..privacy.client_ledgers import FU_EQ10_ORDERS, ClientLedgers

SERVER_SEES_UPDATES = "central DP: the server sees each client's update before it adds the noise"


def equivalent_multiplier(zs) -> float:
    """The single Gaussian that several Gaussians on the same sample compose to (dp_accounting's
    helper, the one its RDP accountant uses)."""
    if len(zs) == 1:
        return float(zs[0])
    composed = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(float(z)) for z in zs])
    return float(rdp_privacy_accountant._effective_gaussian_noise_multiplier(composed))


def calibrated_noise_multiplier(scenario, weights, sizes, accountant: str) -> float:
    """The user-facing z that meets ``privacy.target_epsilon`` over the planned rounds with
    ``accountant``: the booked multiplier the accountant needs, divided by what one unit of z books
    (every algorithm's booked multipliers are linear in z)."""
    p = scenario.privacy
    unit = make_algorithm(scenario, weights, 1.0, sizes=sizes).planned_mechanism()
    try:
        booked = calibrate_noise_multiplier(p.target_epsilon, p.delta, unit.sampling, scenario.training.rounds,
                                            accountant)
    except DPFLError as err:
        raise (err.about("privacy.target_epsilon") if err.field == "epsilon" else err) from None
    return booked / equivalent_multiplier(unit.noise_multipliers)


def planned_mechanism(scenario) -> Mechanism | None:
    """A private scenario's round as planned, before any data exists: the algorithm over
    placeholder equal weights and sizes (no booked multiplier depends on them, except NbAFL's: its
    noise is calibrated to 2C/m, its booking to the 2C it enforces, so m = 1 here books m times the
    run's; nbafl has no target epsilon and refuses pld, the two uses of this plan that read z).
    A target epsilon is calibrated with rdp here (rdp-classic if the scenario says so):
    milliseconds, and a target no noise can meet is found before Ray starts. None for an
    algorithm without a ledger or with per-client (record-level) ledgers."""
    from ..algorithms import algorithm_class

    if not algorithm_class(scenario).client_level():
        return None
    p = scenario.privacy
    weights = np.ones(scenario.data.num_clients)
    sizes = np.ones(scenario.data.num_clients, dtype=np.int64)
    z = p.noise_multiplier
    if z is None and p.target_epsilon is not None:
        z = calibrated_noise_multiplier(scenario, weights, sizes,
                                        "rdp-classic" if p.accountant == "rdp-classic" else "rdp")
    return make_algorithm(scenario, weights, z, sizes=sizes).planned_mechanism()


def _finite(eps: float) -> float | None:
    return None if math.isinf(eps) else eps


class RunPrivacy:
    def __init__(self, scenario, weights, sizes=None):
        self.sc = scenario
        p = scenario.privacy
        self.ledger = PrivacyLedger(accountant=p.accountant, delta=p.delta)
        # A shadow ledger runs one round ahead, so budgets are checked before a round runs. It books
        # every round as covered: budget rules (Geyer's too) apply to the nominal mechanism, while
        # the real ledger still says when a round is not covered by the DP guarantee.
        self.shadow = PrivacyLedger(accountant=p.accountant, delta=p.delta)
        self.noise_multiplier = p.noise_multiplier
        self.calibrated = False
        self.exhausted = False  # a release was refused: it would have passed the target (set on commit)
        self.algorithm = None
        # epsilon against the server: per client, the precision sum z^-2 of the unamplified
        # Gaussians of the rounds it took part in (Gaussians compose exactly: precisions add)
        self.server_precision = np.zeros(len(weights))
        # ... and for integer noise (Mechanism.event, privacy/discrete_rdp.py), per client the sum of
        # the unamplified RDP curves of its rounds' discrete releases (RDP composes by adding curves)
        self.server_rdp: np.ndarray | None = None
        self.server_blind = True  # every release so far carried noise the server cannot remove
        # the same rounds under a sensitivity a paper assumes and the code does not enforce
        # (Mechanism.assumed_noise_multipliers): its epsilon is reported apart, never as the run's
        self.assumed: PrivacyLedger | None = None
        self.assumption = ""
        if self.noise_multiplier is None and p.target_epsilon is not None:
            self.noise_multiplier = calibrated_noise_multiplier(scenario, weights, sizes, p.accountant)
            self.calibrated = True
        # the ledgers' accountants as of the last committed round (taken at the commit, when no
        # other thread advances them), for the checkpoint: a resume restores them instead of
        # composing every past round again
        self._tracks: dict | None = None

    def bind(self, algorithm) -> None:
        self.algorithm = algorithm

    def next_round_fits(self, t: int) -> bool:
        """Record round t's planned mechanism on the shadow ledger and check the budgets there."""
        p = self.sc.privacy
        if self.exhausted:
            return False
        mech = self.algorithm.planned_mechanism()
        self.shadow.record_round(mech.noise_multipliers, mech.sampling, reason=mech.description, round=t + 1,
                                 mechanism=mech.event)
        if p.target_epsilon is not None and (self.shadow.epsilon() > p.target_epsilon
                                             or self.ledger.epsilon() > p.target_epsilon):
            # the shadow books the planned mechanism; the real ledger may already be past it
            return False
        return p.geyer is None or self.shadow.delta_for_epsilon(p.geyer.epsilon) <= p.geyer.delta_threshold

    def release_fits(self, mech: Mechanism) -> bool:
        """Would releasing the round as it stands keep the real ledger within
        privacy.target_epsilon? Asked after the uploads, before anything is unmasked."""
        p = self.sc.privacy
        if p.target_epsilon is None:
            return True
        trial = PrivacyLedger.from_dict(self.ledger.to_dict(include_epsilon=False))
        trial.record_round(mech.noise_multipliers, mech.sampling, reason="trial", mechanism=mech.event)
        return trial.epsilon() <= p.target_epsilon

    def account(self, t: int, outcome, why: str, dropped: dict | None = None) -> dict:
        """Ledger event of round t; the figures that go into its rounds.jsonl row. The effective
        multipliers are what protects the release after this round's dropouts; the claimed ones
        what the mechanism's paper states."""
        p = self.sc.privacy
        survivors, released = outcome.survivors, outcome.released
        if released:
            mech = self.algorithm.mechanism()
            self.ledger.record_round(mech.noise_multipliers, mech.sampling, reason=mech.description,
                                     covered=mech.covered, claimed_noise_multiplier=mech.claimed_noise_multipliers,
                                     round=t + 1, public=mech.public, paper_epsilon=mech.paper_epsilon,
                                     claim_note=mech.claim_note, dropouts=dropped, mechanism=mech.event)
            if mech.assumed_noise_multipliers is not None:
                if self.assumed is None:
                    self.assumed = PrivacyLedger(accountant=p.accountant, delta=p.delta)
                self.assumed.record_round(mech.assumed_noise_multipliers, mech.sampling, reason=mech.description,
                                          round=t + 1)
                self.assumption = mech.assumption
            if mech.server_noise_multipliers is None:
                self.server_blind = False
            elif mech.event is not None:  # the server sees the sum of the survivors' integer shares
                self._add_server_curve(list(survivors), mech.event)
            else:
                self.server_precision[list(survivors)] += sum(z ** -2 for z in mech.server_noise_multipliers)
        else:
            self.ledger.record_no_release(why, round=t + 1, dropouts=dropped)
            if self.assumed is not None:
                self.assumed.record_no_release(why, round=t + 1)
        eps, claimed_eps = self._round_epsilons(self.ledger)
        row = {"epsilon": None if math.isinf(eps) else eps, "dp_covered": self.ledger.fully_covered}
        if self.algorithm.reports_claimed_epsilon:
            row["epsilon_claimed"] = None if math.isinf(claimed_eps) else claimed_eps
        if not self.ledger.fully_covered:
            row["epsilon_nominal"] = claimed_eps
        if self.assumed is not None:
            row["epsilon_assumed"] = _finite(self.assumed.epsilon())
        if p.geyer is not None:
            # the shadow ledger holds exactly rounds 1..t+1 now: the nominal delta at Geyer's epsilon
            row["delta_at_epsilon"] = self.shadow.delta_for_epsilon(p.geyer.epsilon)
        self._snapshot_tracks(t + 1)
        return row

    def _ledgers(self):
        return [(name, ledger) for name, ledger in (("ledger", self.ledger), ("shadow", self.shadow),
                                                    ("assumed", self.assumed)) if ledger is not None]

    def _snapshot_tracks(self, rounds_done: int) -> None:
        """The accountants after round ``rounds_done``: the shadow too holds exactly rounds
        1..rounds_done at a commit (next_round_fits booked this round before it ran)."""
        if self.sc.output.checkpoint_every:
            self._tracks = {"round": rounds_done, **{name: ledger.tracks_state() for name, ledger in self._ledgers()}}

    def _round_epsilons(self, ledger: PrivacyLedger) -> tuple[float, float | None]:
        """The ledger's epsilon after a round, and its claimed epsilon where the row reports one.

        Which of the ledger's accountants advance in a round is decided here alone, for the live
        run and for its rebuild from a checkpoint (load_state_dict): an accountant asked only at the
        end composes the whole backlog of identical rounds in one call, and dp_accounting's PLD
        gives k rounds composed at once other last digits than k rounds composed one by one. A
        resumed ledger that advanced differently would publish other floats than the run it
        continues."""
        eps = ledger.epsilon()
        if self.algorithm.reports_claimed_epsilon or not ledger.fully_covered:
            return eps, ledger.claimed_epsilon()
        return eps, None

    def _add_server_curve(self, clients: list[int], event) -> None:
        from ..privacy.discrete_rdp import ORDERS, event_rdp_curve

        curve = event_rdp_curve(event, ORDERS, self.ledger.neighboring_relation)  # the event itself: unsampled
        if self.server_rdp is None:
            self.server_rdp = np.zeros((len(self.server_precision), len(ORDERS)))
        self.server_rdp[clients] += curve

    def epsilon_vs_server(self) -> tuple[float | None, str]:
        """Epsilon against the server, which picks the sample, so sampling amplifies nothing: the
        unamplified Gaussians of the rounds the worst-off client took part in, composed."""
        if not self.server_blind:
            return None, SERVER_SEES_UPDATES
        if self.server_rdp is not None:
            return self._epsilon_vs_server_rdp()
        worst = int(np.argmax(self.server_precision)) if self.server_precision.size else 0
        precision = float(self.server_precision[worst]) if self.server_precision.size else 0.0
        if precision == 0.0:
            return 0.0, "no client's data was released"
        single = PrivacyLedger(accountant=self.ledger.accountant, delta=self.ledger.delta)
        single.record_round(precision ** -0.5, PoissonSampling(1.0), reason="unamplified, worst-off client")
        eps = single.epsilon()
        return (None if math.isinf(eps) else eps), f"client {worst}: noise multiplier {precision ** -0.5:.4g} " \
                                                    "over the rounds it took part in, no sampling amplification"

    def _epsilon_vs_server_rdp(self) -> tuple[float | None, str]:
        """The same with integer-noise rounds: each client's curve (its discrete releases, plus the
        Gaussian ones at order/(2 z^2) per unit of precision), converted by dp_accounting; the
        worst-off client's epsilon."""
        from ..privacy.discrete_rdp import ORDERS, epsilon

        curves = self.server_rdp + np.outer(self.server_precision, np.asarray(ORDERS, dtype=float)) / 2.0
        unique, first = np.unique(curves, axis=0, return_index=True)
        eps = [epsilon(c, self.ledger.delta, ORDERS) if c.any() else 0.0 for c in unique]
        i = int(np.argmax(eps))
        if eps[i] == 0.0:
            return 0.0, "no client's data was released"
        worst = int(first[i])
        return (None if math.isinf(eps[i]) else eps[i]), (
            f"client {worst}: the integer-noise sums of the rounds it took part in, no sampling amplification")

    def state_dict(self, rounds_done: int) -> dict:
        """The bookkeeping after ``rounds_done`` committed rounds (the shadow ledger may already
        hold the next round's plan: that is booked again when the round runs)."""
        shadow = self.shadow.to_dict(include_epsilon=False)
        shadow["rounds"] = [r for r in shadow["rounds"] if r["round"] <= rounds_done]
        out = {"ledger": self.ledger.to_dict(include_epsilon=False), "shadow": shadow, "exhausted": self.exhausted,
               "noise_multiplier": self.noise_multiplier, "calibrated": self.calibrated,
               "server_blind": self.server_blind, "arrays": {"server_precision": self.server_precision,
                                                             **({} if self.server_rdp is None
                                                                else {"server_rdp": self.server_rdp})},
               "assumed": None if self.assumed is None else self.assumed.to_dict(include_epsilon=False),
               "assumption": self.assumption}
        if self._tracks is not None and self._tracks["round"] == rounds_done:
            out["tracks"] = {"round": rounds_done}
            for name, ledger in self._ledgers():
                metas, arrays = self._tracks.get(name, ([], {}))
                out["tracks"][name] = metas
                out["arrays"].update({f"tracks.{name}.{k}": v for k, v in arrays.items()})
        return out

    def load_state_dict(self, state: dict) -> None:
        """The bookkeeping of a checkpoint, its ledgers' accountants advanced in the steps the live
        run took (``bind`` first: which ones advance depends on the algorithm)."""
        tracks = state.get("tracks")  # the accountants as they stood (absent in an older checkpoint)
        saved = PrivacyLedger.from_dict(state["ledger"])
        self.ledger = PrivacyLedger(accountant=saved.accountant, delta=saved.delta)
        for r in saved.rounds:  # recorded (and without saved accountants asked) round by round, as account() did
            self.ledger.record_round(r.noise_multipliers, r.sampling, reason=r.reason, covered=r.covered,
                                     claimed_noise_multiplier=r.claimed_noise_multipliers, round=r.round,
                                     public=r.public, paper_epsilon=r.paper_epsilon, claim_note=r.claim_note,
                                     dropouts=r.dropouts, mechanism=r.mechanism)
            if tracks is None:
                self._round_epsilons(self.ledger)
        self.shadow = PrivacyLedger.from_dict(state["shadow"])
        self.assumed = PrivacyLedger.from_dict(state["assumed"]) if state.get("assumed") else None
        self.assumption = state.get("assumption", "")
        for name, ledger in self._ledgers():
            if tracks is not None:
                prefix = f"tracks.{name}."
                ledger.restore_tracks(tracks.get(name, []), {k.removeprefix(prefix): v
                                                             for k, v in state["arrays"].items() if k.startswith(prefix)})
            elif name != "ledger":  # the live run asks these every round (or never): one by one is how they advanced
                ledger.replay()
        self._snapshot_tracks(len(self.ledger.rounds))
        self.exhausted, self.calibrated = state["exhausted"], state["calibrated"]
        self.noise_multiplier, self.server_blind = state["noise_multiplier"], state["server_blind"]
        self.server_precision = np.array(state["arrays"]["server_precision"], dtype=np.float64)
        rdp = state["arrays"].get("server_rdp")
        self.server_rdp = None if rdp is None else np.array(rdp, dtype=np.float64)

    def to_dict(self) -> dict:
        out = self.ledger.to_dict()
        out["noise_multiplier"] = self.noise_multiplier
        out["noise_multiplier_calibrated"] = self.calibrated
        booked = self.algorithm.planned_mechanism().noise_multipliers
        out["noise_multiplier_booked"] = list(booked)
        out["randomness"] = self.sc.privacy.randomness
        if self.assumed is not None:
            out["epsilon_assumed"] = _finite(self.assumed.epsilon())
            out["noise_multiplier_assumed"] = list(self.algorithm.planned_mechanism().assumed_noise_multipliers or [])
            out["assumption"] = self.assumption
        out.update(adjacency_record(self.sc, self.algorithm))
        out["epsilon_vs_server"], out["epsilon_vs_server_note"] = self.epsilon_vs_server()
        return out


def adjacency_record(scenario, algorithm) -> dict:
    """The run's neighbouring relation and what it takes as public, for ledger.json."""
    relation, public = type(algorithm).adjacency(scenario)
    return {"adjacency": relation, "adjacency_public": list(public)}


class ClientPrivacy:
    """Record-level bookkeeping (Huang et al. 2020, Fu et al. 2022): one RDP ledger per client,
    fed by the dp_accounting events each client's local procedure reports (ClientReport), only for
    clients whose update reached the server. The run's epsilon is the worst client's; rows also
    carry the median and the best. The papers' own accounting runs beside it: claimed events on
    ledgers of their own, or budget units spent, composed as the papers compose them."""

    def __init__(self, scenario, weights, sizes=None):
        self.sc = scenario
        k = len(weights)
        self.ledgers = ClientLedgers(scenario.privacy.delta, num_clients=k)
        self.claimed = ClientLedgers(scenario.privacy.delta, num_clients=k, orders=FU_EQ10_ORDERS,
                                     conversion="classic")
        self.spent = np.zeros(k)
        self.noise_multiplier = scenario.privacy.noise_multiplier
        self.exhausted = False  # per-client budgets stop clients, never the run
        self.algorithm = None
        self.num_rounds = 0

    def bind(self, algorithm) -> None:
        self.algorithm = algorithm

    def next_round_fits(self, t: int) -> bool:
        """Per-client budgets stop clients; the run stops once every client's budget is spent."""
        k = len(self.spent)
        return self.algorithm is None or len(self.algorithm.withdrawals(t, range(k))) < k

    def release_fits(self, mech) -> bool:
        return True

    def account(self, t: int, outcome, why: str, dropped: dict | None = None) -> dict:
        self.num_rounds = t + 1
        for c in outcome.survivors if outcome.released else ():
            report = outcome.reports.get(c)
            if report is None:
                continue
            for event, count in report.events:
                self.ledgers.record(c, event, count, round=t + 1)
            for event, count in report.claimed_events:
                self.claimed.record(c, event, count, round=t + 1)
            if report.spent is not None:
                self.spent[c] += report.spent
        s = self.ledgers.summary()
        row = {"epsilon": s["epsilon_max"], "epsilon_median": s["epsilon_median"], "epsilon_min": s["epsilon_min"],
               "dp_covered": True}
        claimed = self.claimed_epsilon()
        if claimed is not None:
            row["epsilon_claimed"] = claimed
        return row

    def claimed_epsilon(self) -> float | None:
        """The worst client's claim: its paper's ledger if it books events, else its budget spent."""
        if self.claimed.num_distinct_events:  # the paper books events (Fu eq. 10)
            return self.claimed.summary()["epsilon_max"]
        return float(self.spent.max()) if self.spent.any() else None

    def epsilon_vs_server(self) -> tuple[float | None, str]:
        return self.ledgers.summary()["epsilon_max"], ("record level: each client draws its own lots, which "
                                                        "the server never learns, so its epsilon holds against it")

    def state_dict(self, rounds_done: int) -> dict:
        return {"ledgers": self.ledgers.to_dict(include_epsilon=False), "num_rounds": self.num_rounds,
                "claimed": self.claimed.to_dict(include_epsilon=False), "arrays": {"spent": self.spent}}

    def load_state_dict(self, state: dict) -> None:
        self.ledgers = ClientLedgers.from_dict(state["ledgers"])
        self.claimed = ClientLedgers.from_dict(state["claimed"])
        self.num_rounds = state["num_rounds"]
        self.spent = np.array(state["arrays"]["spent"], dtype=np.float64)

    def to_dict(self) -> dict:
        out = {"record_level": True, "accountant": "rdp", "delta": self.sc.privacy.delta,
               "clients": self.ledgers.to_dict(), "epsilon": self.ledgers.summary()["epsilon_max"],
               "epsilon_claimed": self.claimed_epsilon(), "per_client_epsilon": {
                   str(c): e for c, e in self.ledgers.epsilons().items()},
               "noise_multiplier": self.noise_multiplier, "randomness": self.sc.privacy.randomness,
               "fully_covered": True, "num_rounds": self.num_rounds, **adjacency_record(self.sc, self.algorithm)}
        if self.claimed.num_distinct_events:
            out["claimed_clients"] = self.claimed.to_dict()
        if self.spent.any():
            out["budget_spent"] = {str(c): float(v) for c, v in enumerate(self.spent) if v}
        out["epsilon_vs_server"], out["epsilon_vs_server_note"] = self.epsilon_vs_server()
        return out
