"""Huang et al. 2020 (DP-FL for unbalanced data): the pure building blocks of DPAGD and its budgets.

What the paper says, and how it is read here (see docs/record_level_dp.md for the discussion):

* Each client k has its own budget eps_k, set from its data amount (Sec. 4.2, Fig. 7: five size
  categories with eps from 1 to 8) -- :func:`budgets_by_size`.
* Each round the client runs DPAGD (Alg. 1) with the round's share eps_k / T (eq. 11,
  Alg. 3 line 6) -- :meth:`HuangClientBudget.round_budget`.
* DPAGD (Alg. 1): a noisy clipped full-batch gradient paid from eps_g (lines 5-8); a step size
  chosen among the candidates Phi by a Laplace noisy arg-max paid from eps_n (lines 10-12, Alg. 2);
  if no candidate beats "no step" (index 0), eps_n <- (1 + gamma) eps_n and eps_g <- (1 - gamma) eps_g
  (line 18) and the selection is repeated. Budgets are subtracted linearly (lines 8, 11).
* Alg. 1 line 7 writes the noise as N(0, S^2 eps_g) and line 12 gives the arg-max the budget
  sqrt(2 eps_n): both are zCDP conventions (Lee & Kifer 2018, whose algorithm DPAGD adapts), where
  a Gaussian of multiplier z is rho = 1/(2 z^2)-zCDP and an eps'-DP selection is eps'^2/2-zCDP.
  ``calibration="zcdp"`` (default) reads the budgets as rho: z = 1/sqrt(2 eps_g). ``"eq3"`` reads
  them as (eps, delta) and calibrates the Gaussian by the paper's eq. 3,
  z = sqrt(2 ln(1.25/delta)) / eps_g. Both give the arg-max eps' = sqrt(2 eps_n) (line 12 verbatim).

Honest departures, each because the paper's text would break its own guarantee:

* A mechanism runs only if its cost still fits in the budget (Alg. 1 lines 3/14 check *after*
  spending, so the last gradient or selection could overdraw). The client never spends beyond eps_k.
* The candidate losses are per-example cross-entropies clipped to [0, ``loss_clip``] and summed,
  so adding a record can only raise every candidate's loss by at most ``loss_clip``: the scores are
  monotone with sensitivity ``loss_clip``, and Laplace(loss_clip / eps') report-noisy-max is eps'-DP
  (Dwork & Roth 2014, Claim 3.9). The arg-max picks the *lowest* noisy loss (Alg. 2's arg-max of
  the loss values can only mean that).
* Every iteration uses the client's whole data set (the paper's batch of 600 is a whole client of
  MNIST/100), so nothing is amplified by sampling; the gradient sum is divided by the client's
  data amount n, and n sets the client's budget category.

The neighbouring relation is therefore replace-one record (n is released: the update's scale
reveals it, so under add/remove even one round separates 40 from 41 records by mu ~ 2.9). Under
replace-one the clipped sum moves by up to 2S, and each candidate's clipped loss sum by up to
``loss_clip`` in either direction, so the scores are no longer monotone. Booked on the client's
ledger: ``GaussianDpEvent(z / 2)`` per gradient (noise z S over sensitivity 2S) and
``ZCDpEvent((2 eps')^2 / 2)`` per selection (report-noisy-max with Laplace(loss_clip / eps') on
scores of sensitivity loss_clip is 2 eps'-DP, Dwork & Roth 2014, Claim 3.9; eps-DP implies
eps^2/2-zCDP, Bun & Steinke 2016, Prop. 3.3). The paper's own claim (budget units spent) is kept
beside it, unchanged.

What a round books is a bound on every path it could have taken, not the path it took
(:func:`round_dp_events`): how many gradients and selections run, and at which split, follows
from the noisy arg-max's picks, so a neighbouring data set can take a costlier path, and the sum
of what ran is an odometer's reading, not a guarantee (Rogers, Roth, Ullman & Vadhan 2016).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Sequence

import dp_accounting
import numpy as np
from dp_accounting import dp_event as dpe

from ..errors import DPFLError
from ..privacy.randomness import DPRandomness

if TYPE_CHECKING:  # torch is loaded where a client trains (dpagd_update), not where a scenario is read
    import torch
    from torch import nn

__all__ = ["DPAGDConfig", "DPAGDResult", "HuangClientBudget", "budgets_by_size", "gaussian_noise_multiplier",
           "argmax_epsilon", "argmax_dp_event", "noisy_argmax", "dpagd_update", "round_dp_events"]


def _positive(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise DPFLError(f"must be a finite number > 0, got {v!r}", field=name)
    return float(v)


@dataclass(frozen=True)
class DPAGDConfig:
    """Huang et al. 2020, Alg. 1 inputs. ``step_sizes`` is Phi without 0 ("no step" is candidate 0)."""

    clip_norm: float                       # S (Sec. 5.1 uses 0.01)
    step_sizes: tuple[float, ...]          # Phi
    loss_clip: float                       # sensitivity of a candidate's summed loss (Alg. 2's Delta f)
    epsilon_gradient: float                # initial eps_g per iteration
    epsilon_selection: float               # initial eps_n per selection
    gamma: float = 0.1                     # budget increase rate
    calibration: Literal["zcdp", "eq3"] = "zcdp"
    delta: float | None = None             # eq. 3's delta (calibration="eq3" only)
    max_iterations: int = 10_000           # a guard, not a paper parameter

    def __post_init__(self) -> None:
        for name in ("clip_norm", "loss_clip", "epsilon_gradient", "epsilon_selection"):
            _positive(getattr(self, name), name)
        steps = tuple(float(_positive(s, "step_sizes")) for s in self.step_sizes)
        if not steps:
            raise DPFLError("needs at least one step size", field="step_sizes")
        object.__setattr__(self, "step_sizes", steps)
        if not (isinstance(self.gamma, (int, float)) and 0 <= self.gamma < 1):
            raise DPFLError(f"must be in [0, 1), got {self.gamma!r}", field="gamma")
        if self.calibration not in ("zcdp", "eq3"):
            raise DPFLError(f"must be 'zcdp' or 'eq3', got {self.calibration!r}", field="calibration")
        if self.calibration == "eq3" and not (isinstance(self.delta, float) and 0 < self.delta < 1):
            raise DPFLError(f"calibration 'eq3' needs a delta in (0, 1), got {self.delta!r}", field="delta")


def gaussian_noise_multiplier(epsilon_gradient: float, calibration: str, delta: float | None = None) -> float:
    """z = sigma / S for a gradient paid with eps_g: 1/sqrt(2 eps_g) (zCDP, rho = eps_g) or
    sqrt(2 ln(1.25/delta)) / eps_g (Huang et al. 2020, eq. 3)."""
    eps = _positive(epsilon_gradient, "epsilon_gradient")
    if calibration == "zcdp":
        return 1.0 / math.sqrt(2.0 * eps)
    return math.sqrt(2.0 * math.log(1.25 / delta)) / eps


def argmax_epsilon(epsilon_selection: float) -> float:
    """eps' of the Laplace arg-max paid with eps_n: sqrt(2 eps_n) (Huang et al. 2020, Alg. 1 line 12)."""
    return math.sqrt(2.0 * _positive(epsilon_selection, "epsilon_selection"))


def argmax_dp_event(epsilon: float) -> dpe.DpEvent:
    """An eps'-DP selection as dp_accounting sees it: ``ZCDpEvent(eps'^2 / 2)`` (Bun & Steinke 2016,
    Prop. 3.3), valid under any neighbouring relation."""
    return dp_accounting.ZCDpEvent(rho=_positive(epsilon, "epsilon") ** 2 / 2.0)


# Replace-one moves the clipped gradient sum by 2S (the noise is z S) and each candidate's score by
# up to loss_clip either way (the arg-max is then 2 eps'-DP): see the module docstring.
REPLACE_ONE_GRADIENT_FACTOR = 2.0
REPLACE_ONE_ARGMAX_FACTOR = 2.0


def noisy_argmax(scores: np.ndarray, sensitivity: float, epsilon: float, rng: np.random.Generator) -> int:
    """Huang et al. 2020, Alg. 2: arg-max_i (v_i + Lap(sensitivity / epsilon)), one draw per candidate."""
    scores = np.asarray(scores, dtype=np.float64)
    noisy = scores + rng.laplace(0.0, sensitivity / epsilon, size=scores.shape)
    return int(np.argmax(noisy))


# Budgets are sums of floats: after 19 rounds of 0.04 + 0.01 a budget of 1 has 0.04999999999999982
# left, and the 20th round's 0.05 would be refused. A cost fits if it passes what is left by no more
# than this fraction of the budget: float rounding, never a mechanism's worth.
BUDGET_SLACK = 1e-12


def round_dp_events(cfg: "DPAGDConfig", round_budget: float) -> list[tuple[dpe.DpEvent, int]]:
    """What a client's ledger books for one round of DPAGD with ``round_budget`` (eps_k / T): a bound
    on every path the round can take. The budget logic of :func:`dpagd_update` is a filter
    (Feldman & Zrnic 2021, Rényi filters): whatever the picks, the mechanisms that run cost at most
    ``round_budget`` in the paper's units, and every one is zCDP. Every path begins with one gradient
    paid eps_g0 (booked as it runs); each later mechanism's booked rho' is at most r times its cost,
    r the largest such ratio: a selection's is 4 for any eps_n (2 eps' with eps' = sqrt(2 eps_n):
    rho' = (2 eps')^2 / 2), a gradient's is 4 under the zcdp reading (rho' = 1/(2 (z/2)^2) with
    z = 1/sqrt(2 eps_g), Bun & Steinke 2016, Prop. 1.6) and shrinks with eps_g under eq. 3, so it
    is largest at eps_g0. The round is then (rho'(first gradient) + r (B - eps_g0))-zCDP: 4 B under
    the zcdp reading, the budget the docs' table reads. A round that cannot afford one gradient and
    one selection runs nothing and books nothing."""
    if not fits(0.0, cfg.epsilon_gradient + cfg.epsilon_selection, round_budget):
        return []
    z = gaussian_noise_multiplier(cfg.epsilon_gradient, cfg.calibration, cfg.delta)
    first = dp_accounting.GaussianDpEvent(z / REPLACE_ONE_GRADIENT_FACTOR)
    gradient_ratio = 1.0 / (2.0 * first.noise_multiplier ** 2) / cfg.epsilon_gradient
    selection_ratio = argmax_dp_event(REPLACE_ONE_ARGMAX_FACTOR * argmax_epsilon(1.0)).rho  # rho' / eps_n
    most = round_budget * (1 + BUDGET_SLACK)  # what ``fits`` lets a path spend
    rest = max(gradient_ratio, selection_ratio) * (most - cfg.epsilon_gradient)
    return [(first, 1), (dp_accounting.ZCDpEvent(rho=rest), 1)]


def fits(spent: float, cost: float, budget: float) -> bool:
    """``spent + cost <= budget`` up to float rounding (:data:`BUDGET_SLACK` of the budget)."""
    return spent + cost <= budget * (1 + BUDGET_SLACK)


@dataclass(frozen=True)
class HuangClientBudget:
    """A client's budget eps_k and what it spent so far, in the paper's units (linear, Alg. 1)."""

    epsilon: float
    spent: float = 0.0

    def round_budget(self, total_rounds: int) -> float:
        """eps_k / T (eq. 11), never more than what is left."""
        if isinstance(total_rounds, bool) or not isinstance(total_rounds, int) or total_rounds < 1:
            raise DPFLError(f"must be an integer >= 1, got {total_rounds!r}", field="total_rounds")
        return max(0.0, min(self.epsilon / total_rounds, self.epsilon - self.spent))

    def exhausted(self, cfg: DPAGDConfig, total_rounds: int) -> bool:
        """True if this round cannot afford one gradient and one selection: the client quits
        (Huang et al. 2020, Sec. 4.2, after Alg. 3)."""
        return not fits(0.0, cfg.epsilon_gradient + cfg.epsilon_selection, self.round_budget(total_rounds))

    def after(self, spent: float) -> "HuangClientBudget":
        return replace(self, spent=self.spent + spent)


def budgets_by_size(sizes: Sequence[int], category_budgets: Sequence[float]) -> np.ndarray:
    """eps_k from data amounts (Huang et al. 2020, Sec. 4.2 and Fig. 7): clients ranked by size
    (ties by id) fall into len(category_budgets) equal-count categories, smallest first; category i
    gets category_budgets[i]. The paper does not say which way budgets grow with data; the order of
    ``category_budgets`` decides."""
    sizes = np.asarray(sizes)
    budgets = np.array([_positive(b, "category_budgets") for b in category_budgets])
    if len(budgets) == 0 or len(sizes) < len(budgets):
        raise DPFLError(f"{len(sizes)} clients cannot fill {len(budgets)} categories", field="category_budgets")
    out = np.empty(len(sizes))
    for i, group in enumerate(np.array_split(np.argsort(sizes, kind="stable"), len(budgets))):
        out[group] = budgets[i]
    return out


@dataclass(frozen=True)
class DPAGDResult:
    """One client's DPAGD run in one round.

    ``spent``: budget used in the paper's units (the paper's claim composes these linearly).
    ``gradient_noise_multipliers`` / ``argmax_epsilons``: the mechanisms that ran, in order.
    ``selections``: the chosen candidate index per selection (0 = no step).
    """

    update: np.ndarray
    spent: float
    gradient_noise_multipliers: tuple[float, ...]
    argmax_epsilons: tuple[float, ...]
    selections: tuple[int, ...]
    steps_taken: int
    epsilon_gradient: float                # the split after the run
    epsilon_selection: float
    split_updates: int = field(default=0)

    def dp_events(self) -> list[tuple[dpe.DpEvent, int]]:
        """(event, count) pairs of the mechanisms that ran, under replace-one record (identical
        mechanisms grouped): each gradient's Gaussian at z / 2, each selection at 2 eps'. What ran is
        one path of the round's; the ledger books the bound on every path (:func:`round_dp_events`)."""
        g = Counter(self.gradient_noise_multipliers)
        a = Counter(self.argmax_epsilons)
        return ([(dp_accounting.GaussianDpEvent(z / REPLACE_ONE_GRADIENT_FACTOR), n) for z, n in g.items()]
                + [(argmax_dp_event(REPLACE_ONE_ARGMAX_FACTOR * e), n) for e, n in a.items()])


def _candidate_scores(model: nn.Module, params: dict, grad: dict, candidates: Sequence[float],
                      x: torch.Tensor, y: torch.Tensor, loss_clip: float) -> np.ndarray:
    """-sum_i min(loss(w - eta g; x_i), loss_clip) per candidate eta (higher is better).

    The forward passes run through the model's pool twin (max-pools channels-last, the same maxima,
    faster on CPU): the arg-max passes over a user's whole data set once per candidate, the bulk of a
    DPAGD iteration."""
    import torch
    from torch import nn
    from torch.func import functional_call

    from ..training.models import pool_twin

    buffers = dict(model.named_buffers())
    twin = pool_twin(model)
    out = []
    with torch.no_grad():
        for eta in candidates:
            moved = {k: p - eta * grad[k] for k, p in params.items()}
            total = None
            for part in _chunks(len(y)):
                losses = nn.functional.cross_entropy(functional_call(twin, (moved, buffers), (x[part],)), y[part],
                                                     reduction="none")
                s = losses.clamp(0.0, loss_clip).sum()
                total = s if total is None else total + s
            out.append(total)
    return -torch.stack(out).double().cpu().numpy()


# DPAGD passes over a user's whole data set in chunks of this many records: over 6,000 CNN inputs at
# once, the per-example gradients' and the arg-max's activations no longer fit in cache, and an
# iteration takes about twice as long as in chunks of 600 (one thread). 600, the paper's batch, leaves
# a user of at most 600 records (the 100- and 1,000-user rows) one chunk: the same sums, to the bit,
# as one pass.
DPAGD_CHUNK = 600


def _chunks(n: int) -> list[slice]:
    return [slice(i, min(i + DPAGD_CHUNK, n)) for i in range(0, n, DPAGD_CHUNK)]


def _clipped_gradient_sum(grads_of, params: dict, x: torch.Tensor, y: torch.Tensor,
                          clip_norm: float) -> dict[str, torch.Tensor]:
    """sum_i clip(grad loss(x_i)) over the whole data set, a chunk at a time (see ``DPAGD_CHUNK``)."""
    from ..training.local_dp import clip_and_sum

    total = None
    for part in _chunks(len(y)):
        summed, _ = clip_and_sum(grads_of(params, x[part], y[part]), clip_norm)
        total = summed if total is None else {k: total[k] + v for k, v in summed.items()}
    return total


def dpagd_update(model: nn.Module, theta: np.ndarray, x: np.ndarray, y: np.ndarray, cfg: DPAGDConfig,
                 round_budget: float, *, seed: int, round_idx: int, client_id: int,
                 randomness: DPRandomness | None = None) -> DPAGDResult:
    """Huang et al. 2020, Alg. 1 on one client's data from ``theta``, spending at most ``round_budget``.

    Returns Delta = w - theta (float32). Never runs a mechanism whose cost no longer fits.
    ``randomness`` draws the gradient noise and the arg-max's Laplace noise (None: the
    reproducible streams of ``seed``).
    """
    import torch

    from ..training.local_dp import TorchNormal, per_example_grad_fn
    from ..training.models import set_flat

    n = len(y)
    if n == 0:
        raise DPFLError("a client with no examples cannot run DPAGD", field="data")
    set_flat(model, theta)
    device = next(model.parameters()).device
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    start = {k: v.clone() for k, v in params.items()}
    xt = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    yt = torch.from_numpy(np.ascontiguousarray(y)).to(device)
    randomness = randomness or DPRandomness("reproducible", int(seed))
    gen = TorchNormal(device, randomness, "dpagd_noise", round_idx, client_id)
    lap_rng = randomness.generator("dpagd_argmax", round_idx, client_id)
    candidates = (0.0,) + cfg.step_sizes
    eps_g, eps_n, spent = cfg.epsilon_gradient, cfg.epsilon_selection, 0.0
    zs: list[float] = []
    eps_args: list[float] = []
    picks: list[int] = []
    steps = splits = 0
    grads_of = per_example_grad_fn(model)

    def affordable(cost: float) -> bool:
        return fits(spent, cost, round_budget)

    while affordable(eps_g + eps_n) and len(zs) < cfg.max_iterations:
        z = gaussian_noise_multiplier(eps_g, cfg.calibration, cfg.delta)  # lines 5-8
        summed = _clipped_gradient_sum(grads_of, params, xt, yt, cfg.clip_norm)
        grad = {k: (s + z * cfg.clip_norm * gen.randn(s.shape)) / n
                for k, s in summed.items()}
        spent += eps_g
        zs.append(z)
        while affordable(eps_n):  # lines 9-20
            spent += eps_n
            e = argmax_epsilon(eps_n)
            eps_args.append(e)
            i = noisy_argmax(_candidate_scores(model, params, grad, candidates, xt, yt, cfg.loss_clip),
                             cfg.loss_clip, e, lap_rng)
            picks.append(i)
            if i > 0:
                with torch.no_grad():
                    for k in params:
                        params[k].sub_(candidates[i] * grad[k])
                steps += 1
                break
            eps_n, eps_g = (1 + cfg.gamma) * eps_n, (1 - cfg.gamma) * eps_g  # line 18
            splits += 1
        else:
            break  # the selection no longer fits: this gradient is dropped, the round ends

    with torch.no_grad():
        delta = torch.cat([(params[k] - start[k]).reshape(-1) for k in params])
    return DPAGDResult(update=delta.cpu().numpy().astype(np.float32), spent=spent,
                       gradient_noise_multipliers=tuple(zs), argmax_epsilons=tuple(eps_args),
                       selections=tuple(picks), steps_taken=steps, epsilon_gradient=eps_g,
                       epsilon_selection=eps_n, split_updates=splits)
