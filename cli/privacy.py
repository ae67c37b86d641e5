"""``dpfl privacy``: epsilon for a schedule, the noise for a budget, and the Baek et al. style table.

Mounted by the main CLI as ``app.add_typer(privacy.app, name="privacy")``. Every number comes from
:mod:`dpfl_ray.privacy.ledger` (dp_accounting underneath). A bad parameter prints one line,
``error: <field>: <message>``, on stderr and exits with status 2.
"""
from __future__ import annotations

import csv
import io
import json
import math
from typing import TYPE_CHECKING, Annotated, Optional

import numpy as np
import typer

# Every dpfl command imports this module to list its options: the accounting library
# (dp_accounting, and torch through the algorithms: ~3 s) is imported by the commands that use it.
from dpfl_ray.defaults import DEFAULT_ACCOUNTANT, DEFAULT_MAX_ROUNDS, MAX_NOISE_MULTIPLIER, MIN_NOISE_MULTIPLIER
from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.dropouts import CALIBRATIONS

if TYPE_CHECKING:
    from dpfl_ray.privacy.ledger import Sampling

from .common import user_errors

app = typer.Typer(
    help="Privacy accounting: epsilon of a schedule, noise for a budget, rounds within budgets.",
    no_args_is_help=True,
)

DEFAULT_TABLE_ROUNDS = "1,10,100,1000,10000,100000"

AccountantOpt = Annotated[str, typer.Option(help="pld (tightest, default), rdp, or rdp-classic (TF-Privacy 2019-21 convention).")]
SamplingRateOpt = Annotated[Optional[float], typer.Option(help="Poisson sampling rate q in (0, 1] (add/remove-one-client relation).")]
ClientsPerRoundOpt = Annotated[Optional[int], typer.Option(help="Fixed-size cohorts: clients per round m (with --num-clients; replace-one relation).")]
NumClientsOpt = Annotated[Optional[int], typer.Option(help="Fixed-size cohorts: population size K.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a sentence.")]
MechanismOpt = Annotated[str, typer.Option(
    help="dp_fedavg: central noise of std z*S on the sum of S-clipped updates (z = std / clip norm; booked z "
         "under Poisson sampling, z/2 under fixed-size cohorts, whose replace-one sensitivity is 2S). baek: "
         "distributed noise of std 2Cz (Baek et al.'s z = std / 2C; booked z under both). nbafl: Wei et al. "
         "2020, noise from the paper's epsilon (--nbafl-epsilon, --clip-norm, --min-size, --exposures, "
         "--clients, --rounds, --delta). auto: baek when a dropout or calibration option is given, dp_fedavg "
         "otherwise.")]
MECHANISMS = ("auto", "dp_fedavg", "baek", "nbafl")


def _mechanism(mechanism: str, distributed_options: bool) -> str:
    if mechanism not in MECHANISMS:
        raise DPFLError(f"unknown mechanism {mechanism!r}; choose one of {', '.join(MECHANISMS)}", field="mechanism")
    if mechanism == "auto":
        return "baek" if distributed_options else "dp_fedavg"
    if mechanism == "nbafl" and distributed_options:
        raise DPFLError("nbafl's noise does not depend on dropouts or calibration options", field="mechanism")
    if mechanism == "dp_fedavg" and distributed_options:
        raise DPFLError("dp_fedavg adds its noise centrally, after the dropouts: dropout and calibration options "
                        "describe distributed noise (--mechanism baek)", field="mechanism")
    return mechanism


MAX_TABLE_COLUMNS = 20
MAX_TABLE_ROWS = 20  # dropout rates
# each entry is a composition of its own (a row's epsilon at a round count, or its search for a budget's
# rounds): seconds each with pld, about 25 s for the default 3 x (4 + 3)
MAX_TABLE_ENTRIES = 60
MAX_NBAFL_CLIENTS = 10_000_000


def _not_nbafl(mechanism: str, command: str) -> None:
    """``noise`` and ``table`` speak of a noise multiplier; NbAFL's noise comes from its own epsilon."""
    if mechanism == "nbafl":
        raise DPFLError(f"`dpfl privacy {command}` is for dp_fedavg and baek, whose noise is a multiplier; nbafl "
                        "calibrates its noise from its epsilon: dpfl privacy epsilon --mechanism nbafl ...",
                        field="mechanism")


def _booked(mechanism: str, z: float, samp: Sampling) -> float:
    """The multiplier the ledger books for a round whose noise is z (std / clip norm for dp_fedavg,
    std / 2C for baek): the algorithms' own rule (dpfl_ray.privacy.sensitivity)."""
    from dpfl_ray.algorithms.baek import booked_multiplier as baek_booked
    from dpfl_ray.algorithms.dp_fedavg import booked_multipliers as dp_fedavg_booked

    if mechanism == "baek":
        return baek_booked(z)
    return dp_fedavg_booked(z, None, samp.neighboring_relation)[0]


def _sampling(sampling_rate: float | None, clients_per_round: int | None, num_clients: int | None,
              default_rate: float | None = None) -> Sampling:
    from dpfl_ray.privacy.ledger import FixedSizeSampling, PoissonSampling

    fixed = clients_per_round is not None or num_clients is not None
    if fixed and sampling_rate is not None:
        raise DPFLError("give --sampling-rate or --clients-per-round with --num-clients, not both",
                        field="sampling_rate")
    if fixed:
        if clients_per_round is None:
            raise DPFLError("--num-clients needs --clients-per-round", field="clients_per_round")
        if num_clients is None:
            raise DPFLError("--clients-per-round needs --num-clients", field="num_clients")
        if clients_per_round < 1:  # the ledger books an empty round; a planned schedule has none
            raise DPFLError(f"must be >= 1, got {clients_per_round}", field="clients_per_round")
        return FixedSizeSampling(clients_per_round, num_clients)
    if sampling_rate is None:
        if default_rate is None:
            raise DPFLError("required: give --sampling-rate, or --clients-per-round with --num-clients",
                            field="sampling_rate")
        sampling_rate = default_rate
    return PoissonSampling(sampling_rate)


def _sampling_fields(s: Sampling) -> dict:
    from dpfl_ray.privacy.ledger import PoissonSampling

    if isinstance(s, PoissonSampling):
        return {"sampling": "poisson", "sampling_rate": s.rate, "clients_per_round": None,
                "num_clients": None, "neighboring_relation": "add_or_remove_one"}
    return {"sampling": "fixed_size", "sampling_rate": None, "clients_per_round": s.clients_per_round,
            "num_clients": s.num_clients, "neighboring_relation": "replace_one"}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _used_note(accountant: str, used: str, note: str) -> str:
    """``; accountant_used=rdp (...)`` where pld fell back or ran on a coarse grid, else ''."""
    if used != accountant:
        return f"; accountant_used={used} ({note})"
    return f"; {note}" if note else ""


def _check_planned_noise(z: float, field: str = "noise_multiplier") -> float:
    from dpfl_ray.privacy.validation import _check_noise

    z = _check_noise(z, field)
    if z > MAX_NOISE_MULTIPLIER:
        raise DPFLError(f"must be at most {MAX_NOISE_MULTIPLIER:g} (epsilon is 0 to every printed digit long "
                        f"before), got {z:g}", field=field)
    if z < MIN_NOISE_MULTIPLIER:
        raise DPFLError(f"must be at least {MIN_NOISE_MULTIPLIER:g} (epsilon means nothing long before: about "
                        f"5e17 for one round at q = 0.01), got {z:g}", field=field)
    return z


def _floats(text: str, field: str) -> list[float]:
    parts = [v.strip() for v in text.split(",")]
    if not any(parts):
        raise DPFLError("needs at least one value", field=field)
    if "" in parts:
        raise DPFLError(f"has an empty value ({text!r})", field=field)
    try:
        return [float(v) for v in parts]
    except ValueError:
        raise DPFLError(f"expected comma-separated numbers, got {text!r}", field=field) from None


def _ints(text: str, field: str) -> list[int]:
    values = _floats(text, field)
    if any(not v.is_integer() or v < 1 for v in values):
        raise DPFLError(f"expected comma-separated integers >= 1, got {text!r}", field=field)
    return [int(v) for v in values]


def _calibration_note(calibration: str, min_weight_fraction: float, dropout_rate: float,
                      calibration_dropout_rate: float) -> str:
    """``calibration=baek-extended (F=0.5), dropout rate 0.3``: the settings that shape the round."""
    note = f"calibration={calibration}"
    if calibration in ("baek-extended", "layered"):
        note += f" (F={min_weight_fraction:g})"
    if dropout_rate and calibration != "none":  # none: the dropout note already says it
        note += f", dropout rate {dropout_rate:g}"
    if calibration_dropout_rate and (calibration == "baek-extended" or (calibration == "baek" and dropout_rate)):
        note += f", calibration dropout rate {calibration_dropout_rate:g}"
    return note


def _check_used_by_calibration(calibration: str, min_weight_fraction: float | None,
                               calibration_dropout_rate: float | None, dropout_rate: float) -> None:
    """A calibration option the chosen --calibration never reads is refused, not silently dropped."""
    for value, name, users in ((min_weight_fraction, "min_weight_fraction", ("baek-extended", "layered")),
                               (calibration_dropout_rate, "calibration_dropout_rate", ("baek", "baek-extended"))):
        if value is not None and calibration in CALIBRATIONS and calibration not in users:
            raise DPFLError(f"is for --calibration {' or '.join(users)}; --calibration {calibration} "
                            "would leave it unused", field=name)
    if calibration_dropout_rate is not None and calibration == "baek" and not dropout_rate:
        raise DPFLError("baek calibrates only after dropouts: give --dropout-rate, or it is left unused",
                        field="calibration_dropout_rate")


@app.command()
@user_errors
def epsilon(
    rounds: Annotated[int, typer.Option(help="Number of rounds T.")],
    delta: Annotated[float, typer.Option(help="Target delta in (0, 1).")],
    noise_multiplier: Annotated[Optional[float], typer.Option(help="Noise multiplier z (noise std / clip norm) as planned (not for nbafl).")] = None,
    sampling_rate: SamplingRateOpt = None,
    clients_per_round: ClientsPerRoundOpt = None,
    num_clients: NumClientsOpt = None,
    accountant: AccountantOpt = DEFAULT_ACCOUNTANT,
    dropout_rate: Annotated[float, typer.Option(help="Dropout rate R in [0, 1): fraction of the sampled weight lost before upload.")] = 0.0,
    calibration: Annotated[str, typer.Option(help="Noise after dropouts: none, baek, baek-extended or layered (see above).")] = "none",
    min_weight_fraction: Annotated[Optional[float], typer.Option(help="F in (0, 1] (default 0.5): baek-extended draws the first noise for n_0 = F*n; layered tolerates dropout up to 1-F.")] = None,
    calibration_dropout_rate: Annotated[Optional[float], typer.Option(help="Fraction in [0, 1] (default 0) of the survivors that vanish before sending their calibration term (baek, baek-extended).")] = None,
    mechanism: MechanismOpt = "auto",
    nbafl_epsilon: Annotated[Optional[float], typer.Option(help="nbafl: the paper's epsilon for the whole training.")] = None,
    clip_norm: Annotated[Optional[float], typer.Option(help="nbafl: C, the clipping bound of the parameters (default 1).")] = None,
    min_size: Annotated[Optional[int], typer.Option(help="nbafl: m, the smallest local dataset (default 1).")] = None,
    exposures: Annotated[Optional[int], typer.Option(help="nbafl: L, uploads per client (default T).")] = None,
    clients: Annotated[Optional[int], typer.Option(help="nbafl: N, the clients aggregated per round (default 1).")] = None,
    threat_model: Annotated[Optional[str], typer.Option(help="nbafl: server (sees each upload, or their sum with --secagg) or broadcast (default server).")] = None,
    secagg: Annotated[bool, typer.Option("--secagg", help="nbafl: the server sees only the sum of the uploads.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Epsilon after T identical rounds, as the server's real view of each round guarantees it.

    --calibration says how the noise is kept up after dropouts (Baek et al. 2021):

    * none: no calibration; the survivors' noise is z*sqrt(1-R).

    * baek: the survivors re-draw their noise for n' (the paper); the server keeps both views, so less than z protects.

    * baek-extended: as baek, with the first noise drawn for n_0 = F*n.

    * layered: layered noise whose removable layers are known exactly; z holds for dropout up to 1-F.

    "epsilon" is always the effective value; "epsilon_claimed" is what the planned z would give.
    """
    from dpfl_ray.privacy.dropouts import planned_noise_multipliers
    from dpfl_ray.privacy.ledger import EpsilonCurve, FixedSizeSampling

    _check_used_by_calibration(calibration, min_weight_fraction, calibration_dropout_rate, dropout_rate)
    min_weight_fraction = 0.5 if min_weight_fraction is None else min_weight_fraction
    calibration_dropout_rate = 0.0 if calibration_dropout_rate is None else calibration_dropout_rate
    mechanism = _mechanism(mechanism, bool(dropout_rate or calibration_dropout_rate or calibration != "none"))
    if mechanism != "nbafl":
        for given, name in ((nbafl_epsilon is not None, "nbafl_epsilon"), (exposures is not None, "exposures"),
                            (secagg, "secagg"), (clip_norm is not None, "clip_norm"), (min_size is not None, "min_size"),
                            (clients is not None, "clients"), (threat_model is not None, "threat_model")):
            if given:
                raise DPFLError(f"is for --mechanism nbafl; {mechanism} would leave it unused", field=name)
    if mechanism == "nbafl":
        for given, name in ((noise_multiplier is not None, "noise_multiplier"),
                            (sampling_rate is not None, "sampling_rate"),
                            (clients_per_round is not None, "clients_per_round"), (num_clients is not None, "num_clients")):
            if given:
                raise DPFLError("nbafl derives its noise from --nbafl-epsilon and aggregates --clients every round "
                                "(no sampling): it would leave this unused", field=name)
        return _nbafl_epsilon(rounds, delta, accountant, nbafl_epsilon, 1.0 if clip_norm is None else clip_norm,
                              1 if min_size is None else min_size, exposures, 1 if clients is None else clients,
                              threat_model or "server", secagg, as_json)
    samp = _sampling(sampling_rate, clients_per_round, num_clients)
    if noise_multiplier is None:
        raise DPFLError("required: give --noise-multiplier (or --mechanism nbafl with its parameters)",
                        field="noise_multiplier")
    _check_planned_noise(noise_multiplier)
    z_claimed, z_eff = planned_noise_multipliers(noise_multiplier, calibration, dropout_rate,
                                                 calibration_dropout_rate, min_weight_fraction)
    booked, booked_claimed = _booked(mechanism, z_eff, samp), _booked(mechanism, z_claimed, samp)
    curve = EpsilonCurve(booked, samp, delta, accountant)  # the dropout is already in z_eff
    eps = curve.epsilon(rounds)
    used, note = curve.accountant_used(rounds)
    eps_claimed = eps if booked_claimed == booked else EpsilonCurve(booked_claimed, samp, delta, accountant).epsilon(rounds)
    if as_json:
        out = {"epsilon": _finite(eps), "epsilon_claimed": _finite(eps_claimed), "delta": delta, "rounds": rounds,
               "accountant": accountant, "accountant_used": used, "accountant_note": note, "mechanism": mechanism,
               "noise_multiplier": noise_multiplier, "dropout_rate": dropout_rate, "noise_multiplier_effective": z_eff,
               "noise_multiplier_booked": booked, "calibration": calibration,
               "min_weight_fraction": min_weight_fraction, "calibration_dropout_rate": calibration_dropout_rate,
               **_sampling_fields(samp)}
        typer.echo(json.dumps(out))
        return
    line = f"epsilon = {eps:.4f} after {rounds} rounds (delta={delta:g}, accountant={accountant})"
    if dropout_rate and calibration == "none":
        line += f"; noise multiplier {noise_multiplier:g} -> {z_eff:.4f} after dropout rate {dropout_rate:g}"
    if calibration != "none" or z_claimed != z_eff:
        line += f"; {_calibration_note(calibration, min_weight_fraction, dropout_rate, calibration_dropout_rate)}: "
        line += f"claimed epsilon {eps_claimed:.4f} (z={z_claimed:g})"
        if calibration != "none":
            line += f", effective noise multiplier {z_eff:.4f} -> the epsilon above"
    if isinstance(samp, FixedSizeSampling):
        line += f"; {samp.describe()}, replace-one relation"
    if booked != z_eff:
        line += f"; booked noise multiplier {booked:.4g} ({mechanism}: the sensitivity is 2S under replace-one)"
    typer.echo(line + _used_note(accountant, used, note))


def _nbafl_epsilon(rounds, delta, accountant, paper_epsilon, clip, min_size, exposures, clients, threat_model,
                   secure, as_json) -> None:
    """NbAFL's noise from the paper's parameters, its claim, and what dp_accounting gives for the
    same noise (record level, replace one, unsampled Gaussians over the T rounds): with the
    sensitivity the code enforces (2C, the run's epsilon) and with the paper's 2C/m (its assumption)."""
    from dpfl_ray.algorithms.nbafl import (ASSUMPTION, PLD_REFUSAL, assumed_bound, claim_note, downlink_std,
                                           enforced_bound, round_multipliers, uplink_std)
    from dpfl_ray.privacy import NoSampling, PrivacyLedger
    from dpfl_ray.privacy.validation import _check_delta, _check_epsilon, _check_rounds

    if paper_epsilon is None:
        raise DPFLError("required with --mechanism nbafl: the paper's epsilon", field="nbafl_epsilon")
    _check_epsilon(paper_epsilon, "nbafl_epsilon")
    _check_delta(delta)
    rounds = _check_rounds(rounds)
    exposures = rounds if exposures is None else exposures
    for value, field in ((min_size, "min_size"), (exposures, "exposures"), (clients, "clients")):
        if value < 1:
            raise DPFLError(f"must be >= 1, got {value}", field=field)
    if exposures > rounds:
        raise DPFLError(f"must be at most --rounds ({rounds}): a client uploads at most once a round, got {exposures}",
                        field="exposures")
    if clients > MAX_NBAFL_CLIENTS:
        raise DPFLError(f"must be at most {MAX_NBAFL_CLIENTS:,} clients a round, got {clients:,}", field="clients")
    if not clip > 0 or not math.isfinite(clip):
        raise DPFLError(f"must be a finite number > 0, got {clip}", field="clip_norm")
    if threat_model not in ("server", "broadcast"):
        raise DPFLError(f"must be server or broadcast, got {threat_model!r}", field="threat_model")
    if accountant == "pld":
        raise DPFLError(PLD_REFUSAL.removeprefix("privacy.accountant: ").replace("rdp or", "--accountant rdp or"),
                        field="accountant")
    sigma_u = uplink_std(paper_epsilon, delta, clip, min_size, exposures)
    sigma_d = downlink_std(paper_epsilon, delta, clip, min_size, exposures, clients, rounds)
    shares = np.full(clients, 1.0 / clients)
    figures = {}
    for name, bound in (("enforced", enforced_bound(clip)), ("assumed", assumed_bound(clip, min_size))):
        z, _ = round_multipliers(sigma_u, sigma_d, bound, shares, secure, threat_model)
        if not z <= MAX_NOISE_MULTIPLIER:
            raise DPFLError(f"{paper_epsilon:g} gives NbAFL a noise multiplier of {z:.3g}, above "
                            f"{MAX_NOISE_MULTIPLIER:g}: epsilon would be 0 to every printed digit", field="nbafl_epsilon")
        if z < MIN_NOISE_MULTIPLIER:
            raise DPFLError(f"{paper_epsilon:g} gives NbAFL a noise multiplier of {z:.3g}, below "
                            f"{MIN_NOISE_MULTIPLIER:g}: no epsilon of it means anything", field="nbafl_epsilon")
        ledger, per_client = PrivacyLedger(accountant, delta), PrivacyLedger(accountant, delta)
        for t in range(rounds):
            ledger.record_round(z, NoSampling(), reason="nbafl", paper_epsilon=paper_epsilon / rounds)
        for t in range(min(exposures, rounds)):  # a record is only in its own client's L uploads
            per_client.record_round(z, NoSampling(), reason="nbafl")
        figures[name] = (z, ledger.epsilon(), per_client.epsilon(), ledger.claimed_epsilon())
    (z, accounted, alone, claimed), (z_a, assumed, alone_a, _) = figures["enforced"], figures["assumed"]
    note = claim_note(paper_epsilon, exposures)
    if as_json:
        typer.echo(json.dumps({"mechanism": "nbafl", "sigma_uplink": sigma_u, "sigma_downlink": sigma_d,
                               "sensitivity": 2 * enforced_bound(clip), "noise_multiplier_booked": z,
                               "epsilon": _finite(accounted), "epsilon_per_client": _finite(alone),
                               "sensitivity_assumed": 2 * assumed_bound(clip, min_size),
                               "noise_multiplier_assumed": z_a, "epsilon_assumed": _finite(assumed),
                               "epsilon_per_client_assumed": _finite(alone_a), "assumption": ASSUMPTION,
                               "epsilon_claimed": claimed, "claim_note": note, "delta": delta, "rounds": rounds,
                               "exposures": exposures, "clients": clients, "min_size": min_size, "clip_norm": clip,
                               "threat_model": threat_model, "secagg": secure, "accountant": accountant,
                               "neighboring_relation": "replace_one"}))
        return
    typer.echo(f"nbafl: sigma_U = {sigma_u:.6g}, sigma_D = {sigma_d:.6g}; after {rounds} rounds (delta={delta:g}, "
               f"accountant={accountant}, threat model {threat_model}{', secagg' if secure else ''}):\n"
               f"  accounted epsilon {accounted:.4f} with the sensitivity the code enforces, 2C = "
               f"{2 * enforced_bound(clip):g} (booked noise multiplier {z:.4g}); over one client's {exposures} "
               f"uploads alone: {alone:.4f}\n"
               f"  epsilon {assumed:.4f} under the paper's assumption Delta s_U = 2C/m = "
               f"{2 * assumed_bound(clip, min_size):g} (booked {z_a:.4g}), not enforced by the code; one client's "
               f"uploads alone: {alone_a:.4f}\n"
               f"  the paper claims {claimed:.4f}" + (f"; {note}" if note else ""))


@app.command()
@user_errors
def noise(
    epsilon: Annotated[float, typer.Option(help="Target epsilon after T rounds (never exceeded).")],
    rounds: Annotated[int, typer.Option(help="Number of rounds T.")],
    delta: Annotated[float, typer.Option(help="Target delta in (0, 1).")],
    sampling_rate: SamplingRateOpt = None,
    clients_per_round: ClientsPerRoundOpt = None,
    num_clients: NumClientsOpt = None,
    accountant: AccountantOpt = DEFAULT_ACCOUNTANT,
    mechanism: MechanismOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """The smallest noise multiplier whose epsilon after T rounds is <= the target."""
    from dpfl_ray.privacy.calibration import calibrate_noise

    samp = _sampling(sampling_rate, clients_per_round, num_clients)
    mechanism = _mechanism(mechanism, False)
    _not_nbafl(mechanism, "noise")
    cal = calibrate_noise(epsilon, delta, samp, rounds, accountant)
    booked, achieved = cal.noise_multiplier, cal.epsilon
    z = booked / _booked(mechanism, 1.0, samp)  # the booked multiplier is linear in z
    if as_json:
        out = {"noise_multiplier": z, "noise_multiplier_booked": booked, "mechanism": mechanism,
               "epsilon": _finite(achieved), "epsilon_target": epsilon, "delta": delta, "rounds": rounds,
               "accountant": accountant, "accountant_used": cal.accountant_used, "accountant_note": cal.note,
               **_sampling_fields(samp)}
        typer.echo(json.dumps(out))
        return
    typer.echo(f"noise multiplier = {z:.4f} (epsilon = {achieved:.4f} <= {epsilon:g} after {rounds} rounds, "
               f"delta={delta:g}, accountant={accountant}"
               + (f"; booked {booked:.4f}, {mechanism} under replace-one)" if booked != z else ")")
               + _used_note(accountant, cal.accountant_used, cal.note))


def _most_rounds(m: int) -> str:
    # the search stops at DEFAULT_MAX_ROUNDS: reaching it means "at least", not "exactly"
    return f">= {DEFAULT_MAX_ROUNDS:.0e}".replace("e+0", "e") if m >= DEFAULT_MAX_ROUNDS else f"{m:,}"


def _curve_notes(curves: list, accountant: str) -> list[str]:
    """Where the table's numbers did not come from ``accountant`` on its usual grid, and why."""
    used = [(t, u, n) for curve in curves for t, (u, n) in curve.accountants_used.items()]
    fallback = sorted({t for t, u, _ in used if u != accountant})
    coarse = sorted({t for t, u, n in used if u == accountant and n})
    notes = []
    if fallback:
        notes.append(f"{accountant} cannot stay within its bounds for T >= {fallback[0]:,}: rdp answered there")
    if coarse:
        notes.append(f"{accountant} used a grid coarser than 1e-4 for T >= {coarse[0]:,} to stay within its "
                     "bounds; still upper bounds")
    return notes


@app.command()
@user_errors
def table(
    noise_multiplier: Annotated[float, typer.Option(help="Planned noise multiplier z.")] = 1.0,
    sampling_rate: SamplingRateOpt = None,
    clients_per_round: ClientsPerRoundOpt = None,
    num_clients: NumClientsOpt = None,
    delta: Annotated[float, typer.Option(help="Target delta.")] = 1e-5,
    dropout_rates: Annotated[str, typer.Option(help="Comma-separated dropout rates, one row each.")] = "0,0.1,0.3",
    budgets: Annotated[str, typer.Option(help="Comma-separated epsilon budgets: most rounds within each.")] = "2,4,8",
    rounds: Annotated[str, typer.Option(help="Comma-separated round counts for the epsilon columns.")] = DEFAULT_TABLE_ROUNDS,
    accountant: AccountantOpt = DEFAULT_ACCOUNTANT,
    mechanism: MechanismOpt = "auto",
    as_csv: Annotated[bool, typer.Option("--csv", help="Write CSV to stdout instead of a table.")] = False,
) -> None:
    """Epsilon after 1..10^5 rounds and the most rounds within each budget, per dropout rate.

    The defaults mirror Baek et al., Table 2: z=1, Poisson q=0.01 (the default when no sampling is
    given), delta=1e-5, dropout 0 / 0.1 / 0.3, budgets 2 / 4 / 8. Each entry is one dp_accounting
    composition of T identical rounds (``count=T``), so the pld table takes ~10-20 s.
    """
    from dpfl_ray.privacy.ledger import EpsilonCurve

    samp = _sampling(sampling_rate, clients_per_round, num_clients, default_rate=0.01)
    rates = _floats(dropout_rates, "dropout_rates")
    budget_list = _floats(budgets, "budgets")
    round_list = _ints(rounds, "rounds")
    # each column is a composition of its own (seconds with pld), and each budget a search over rounds
    for values, field, most in ((round_list, "rounds", MAX_TABLE_COLUMNS), (budget_list, "budgets", MAX_TABLE_COLUMNS),
                                (rates, "dropout_rates", MAX_TABLE_ROWS)):
        if len(values) > most:
            raise DPFLError(f"{len(values)} values; a table shows at most {most}", field=field)
    if len(rates) * (len(round_list) + len(budget_list)) > MAX_TABLE_ENTRIES:
        raise DPFLError(f"{len(rates)} dropout rates x ({len(round_list)} round counts + {len(budget_list)} budgets) "
                        f"= {len(rates) * (len(round_list) + len(budget_list))} entries, each a composition of its "
                        f"own; a table computes at most {MAX_TABLE_ENTRIES}", field="dropout_rates")
    mechanism = _mechanism(mechanism, any(rates))
    _not_nbafl(mechanism, "table")
    _check_planned_noise(noise_multiplier)
    booked = _booked(mechanism, noise_multiplier, samp)
    curves = [EpsilonCurve(booked, samp, delta, accountant, r) for r in rates]
    rows = []
    for r, curve in zip(rates, curves):
        eps = [curve.epsilon(t) for t in round_list]
        most = [curve.max_rounds(b) for b in budget_list]
        rows.append((r, curve.effective_multipliers[0], eps, most))

    notes = _curve_notes(curves, accountant)
    if as_csv:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["dropout_rate", "noise_multiplier_effective"] + [f"epsilon_T{t}" for t in round_list]
                   + [f"max_rounds_eps{b:g}" for b in budget_list])
        for r, z_eff, eps, most in rows:
            w.writerow([f"{r:g}", f"{z_eff:.6g}"] + [f"{e:.6g}" for e in eps]
                       + [f">={m}" if m >= DEFAULT_MAX_ROUNDS else m for m in most])
        typer.echo(buf.getvalue(), nl=False)
        for note in notes:
            typer.echo(f"note: {note}", err=True)
        return

    from rich.console import Console
    from rich.table import Table

    title = (f"epsilon after T rounds and most rounds within budget "
             f"(z={noise_multiplier:g}, {samp.describe()}, delta={delta:g}, accountant={accountant})")
    tbl = Table(title=title)
    tbl.add_column("dropout R", justify="right")
    tbl.add_column("z_eff", justify="right")
    for t in round_list:
        tbl.add_column(f"T={t:,}", justify="right")
    for b in budget_list:
        tbl.add_column(f"max T, eps<={b:g}", justify="right")
    for r, z_eff, eps, most in rows:
        tbl.add_row(f"{r:g}", f"{z_eff:.4f}", *[f"{e:.4f}" for e in eps], *[_most_rounds(m) for m in most])
    if notes:
        tbl.caption = "\n".join(f"note: {n}" for n in notes)
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200))
    console.print(tbl)
