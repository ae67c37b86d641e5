"""A paper as data: ``scenarios/papers/<paper>/paper.yaml`` names the runs that reproduce it, the
numbers the paper reports for them and the claims to check against what the runs measure.

The schema (unknown keys are errors; every error names the file and the key)::

    paper: fu2022                     # the folder's name
    title: "Fu et al. 2022, Adap DP-FL"
    data: fashion_mnist               # the data the paper's numbers were measured on
    notes: "..."                      # optional: what differs from the paper, shown in reproduction.md
    runs:                             # one `dpfl run` each
      - name: adap_as_published       # unique, [a-z0-9_]
        scenario: adap.yaml           # relative to the folder
        set: ["privacy.adap_dpfl.stop_on=claimed"]   # optional --set overrides
        paper: {final_accuracy: 0.7956}              # optional: the paper's values, by metric
        source: "Sec. V-C: ..."       # optional: where the paper states them
        seeds: [1, 2, 3]              # optional: the same run again on each seed, as the runs
                                      # adap_as_published_seed1 ... (its set, then seed=N; its paper values)
    quick:                            # --quick: a CI-sized version of the same runs
      set: ["training.rounds=3"]      # after each run's own set
      runs: [adap_as_published]       # optional subset (default: all)
    claims:
      - id: adap_within_3_points
        text: "..."
        check: {kind: at_least, run: adap_as_published, metric: final_accuracy, value: 0.7656}

Check kinds: ``at_least``, ``at_most``, ``within`` (``run``, ``value``, ``tol``); ``order`` and
``monotone`` (``runs``, ``direction``); ``gap_at_most`` (``run``, ``baseline``, ``value``);
``gap_shrinks`` (``runs``, ``baseline``); ``mean_at_least`` (``runs``, ``value``: their mean);
``mean_gap_at_most`` (``runs``, ``baselines``, ``value``: the baselines' mean minus the runs' mean).

A metric is a key of a run's ``summary.json``, dotted for a nested one (``client_accuracy.mean``;
``[key]`` for a key that is not a plain name: ``client_accuracy.by_group[eps_k=1].mean``),
plus ``final_loss``, ``epsilon``, ``epsilon_claimed`` and ``epsilon_empirical`` (the audit's
estimate) taken from the last round where the summary lacks them (:func:`run_metrics`).
Nothing here runs anything; ``reproduce.py`` does.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from ..errors import DPFLError

PAPER_FILE = "paper.yaml"
MAX_PAPER_BYTES = 1 << 20

RunName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9_]{1,80}$")]
# a key of summary.json, dotted for a nested one; [key] names a key that is not a plain name
# (client_accuracy.by_group[eps_k=2.75].mean: Huang et al.'s Fig. 7 categories)
Metric = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+|\[[^\[\]]+\])*$",
                                          max_length=200)]
Override = Annotated[str, StringConstraints(pattern=r"^[^=\s][^=]*=", max_length=2000)]


def _no_bool(value):
    if isinstance(value, bool):  # YAML's `true` is not the number 1
        raise ValueError(f"must be a number (got {value!r})")
    return value


Number = Annotated[float, BeforeValidator(_no_bool), Field(allow_inf_nan=False, strict=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]


class RunSpec(_Strict):
    name: RunName
    scenario: str = Field(min_length=1)
    set: list[Override] = []
    paper: dict[Metric, Number] = {}
    source: str | None = None
    seeds: list[Seed] = Field(default=[], max_length=100)

    @model_validator(mode="after")
    def _seeds(self):
        twice = [n for i, n in enumerate(self.seeds) if n in self.seeds[:i]]
        if twice:
            raise ValueError(f"seeds: seed {twice[0]} is listed twice")
        fixed = [o for o in self.set if o.split("=", 1)[0].strip() == "seed"]
        if self.seeds and fixed:
            raise ValueError(f"seeds: the run's set already fixes the seed ({fixed[0]})")
        too_long = [n for n in self.seeds if len(self._copy_name(n)) > 80]
        if too_long:
            raise ValueError(f"seeds: {self._copy_name(too_long[0])!r}, a copy's name, is longer than 80 characters")
        return self

    def _copy_name(self, seed: int) -> str:
        return f"{self.name}_seed{seed}"

    def seed_copies(self) -> list[RunSpec]:
        """The run on each of ``seeds``: named NAME_seedN, its overrides then ``seed=N``, the same
        paper values (the paper reports one run; each copy is another draw of the same setting)."""
        return [RunSpec(name=self._copy_name(n), scenario=self.scenario, set=[*self.set, f"seed={n}"],
                        paper=dict(self.paper), source=f"{self.name} on seed {n}") for n in self.seeds]


class QuickSpec(_Strict):
    set: list[Override] = []
    runs: list[RunName] | None = Field(None, min_length=1)  # none: every run; an empty list would run nothing


# --- checks ---------------------------------------------------------------------------------------

class _Check(_Strict):
    metric: Metric

    def run_names(self) -> tuple[str, ...]:
        return tuple(getattr(self, "runs", ())) + tuple(getattr(self, "baselines", ())) + \
            tuple(getattr(self, n) for n in ("run", "baseline") if getattr(self, n, None) is not None)


class AtLeast(_Check):
    kind: Literal["at_least"]
    run: RunName
    value: Number


class AtMost(_Check):
    kind: Literal["at_most"]
    run: RunName
    value: Number


class Within(_Check):
    kind: Literal["within"]
    run: RunName
    value: Number
    tol: Annotated[float, BeforeValidator(_no_bool), Field(ge=0, allow_inf_nan=False, strict=False)]


class Order(_Check):
    kind: Literal["order"]
    runs: list[RunName] = Field(min_length=2)
    direction: Literal["descending", "ascending"]


class Monotone(_Check):
    kind: Literal["monotone"]
    runs: list[RunName] = Field(min_length=2)
    direction: Literal["increasing", "decreasing"]


class GapAtMost(_Check):
    kind: Literal["gap_at_most"]
    run: RunName
    baseline: RunName
    value: Number


class GapShrinks(_Check):
    kind: Literal["gap_shrinks"]
    runs: list[RunName] = Field(min_length=2)
    baseline: RunName


class MeanAtLeast(_Check):
    """The mean over ``runs`` (the same run on several seeds, say) is at least ``value``: for a paper
    that reports one run and no seed, where one seed passing says little."""
    kind: Literal["mean_at_least"]
    runs: list[RunName] = Field(min_length=2)
    value: Number


class MeanGapAtMost(_Check):
    """The mean over ``baselines`` minus the mean over ``runs`` is at most ``value``: a gap_at_most
    for a pair of runs repeated on several seeds."""
    kind: Literal["mean_gap_at_most"]
    runs: list[RunName] = Field(min_length=2)
    baselines: list[RunName] = Field(min_length=2)
    value: Number


_CHECKS = (AtLeast, AtMost, Within, Order, Monotone, GapAtMost, GapShrinks, MeanAtLeast, MeanGapAtMost)
Check = Annotated[Union[_CHECKS], Field(discriminator="kind")]
CHECK_KINDS = tuple(get_args(c.model_fields["kind"].annotation)[0] for c in _CHECKS)


class Claim(_Strict):
    id: RunName
    text: str = Field(min_length=1)
    check: Check


class PaperSpec(_Strict):
    paper: RunName
    title: str = Field(min_length=1)
    data: str = Field(min_length=1)
    notes: str | None = None
    # the runs as paper.yaml lists them; `runs` adds each one's seed copies after it
    declared: list[RunSpec] = Field(alias="runs", min_length=1)
    quick: QuickSpec = QuickSpec()
    claims: list[Claim] = []

    @cached_property
    def runs(self) -> list[RunSpec]:
        """Every run to make: each declared run, then its seed copies (:meth:`RunSpec.seed_copies`)."""
        return [r for run in self.declared for r in (run, *run.seed_copies())]

    @model_validator(mode="after")
    def _names(self):
        seen: set[str] = set()
        for i, run in enumerate(self.declared):
            for key, name in [(f"runs.{i}.name", run.name),
                              *((f"runs.{i}.seeds.{j}", run._copy_name(n)) for j, n in enumerate(run.seeds))]:
                if name in seen:
                    raise ValueError(f"{key}: {name!r} is given twice")
                seen.add(name)
        names = [r.name for r in self.runs]
        for where, listed in (("quick.runs", self.quick.runs or ()),):
            for j, name in enumerate(listed):
                if name not in names:
                    raise ValueError(f"{where}.{j}: no run named {name!r} (runs: {', '.join(names)})")
                if name in listed[:j]:
                    raise ValueError(f"{where}.{j}: {name!r} is listed twice")
        ids = [c.id for c in self.claims]
        for i, claim in enumerate(self.claims):
            if claim.id in ids[:i]:
                raise ValueError(f"claims.{i}.id: {claim.id!r} is given twice")
            for name in claim.check.run_names():
                if name not in names:
                    raise ValueError(f"claims.{i}.check: no run named {name!r} (runs: {', '.join(names)})")
            runs = getattr(claim.check, "runs", ())
            if len(set(runs)) < len(runs):
                raise ValueError(f"claims.{i}.check.runs: a run is listed twice")
        return self

    def run(self, name: str) -> RunSpec:
        return next(r for r in self.runs if r.name == name)

    def metrics(self) -> list[str]:
        """The metrics the paper reports a value for, in order of first mention."""
        out: list[str] = []
        for r in self.runs:
            out += [m for m in r.paper if m not in out]
        return out


def _location(err: dict) -> str:
    """pydantic's location of an error as the key a user wrote (the check's kind tag left out)."""
    parts = [str(p) for p in err["loc"]]
    parts = [p for i, p in enumerate(parts) if not (i and parts[i - 1] == "check" and p in CHECK_KINDS)]
    return ".".join(parts)


def format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc, msg = _location(first), first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] == "union_tag_invalid":
        msg = f"unknown check kind {first['input'].get('kind')!r} (one of {', '.join(CHECK_KINDS)})" \
            if isinstance(first.get("input"), dict) else msg
    elif first["type"] == "string_pattern_mismatch":
        parts = loc.split(".")
        if "set" in parts[-2:-1]:
            what = "is not an override (key.path=value)"
        elif parts[-1] in ("[key]", "metric"):
            what = "is not a metric name (letters, digits and _, dotted for a nested key, [key] for another key)"
        else:
            what = "is not a valid name (lower-case letters, digits and _)"
        loc = loc.removesuffix(".[key]")
        msg = f"{first['input']!r} {what}"
    elif first["type"] not in ("value_error", "missing") and "input" in first:
        msg = f"{msg} (got {str(first['input'])[:80]!r})"
    if first["type"] == "value_error" and re.match(r"[\w.]+: ", msg):  # a model's check names its own key
        key, msg = msg.split(": ", 1)
        loc = f"{loc}.{key}" if loc else key
    extra = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{loc}: {msg}{extra}" if loc else msg + extra


def parse_paper(raw, where: str) -> PaperSpec:
    """A paper.yaml's mapping as a :class:`PaperSpec`; a mistake is one DPFLError naming ``where`` and the key."""
    if not isinstance(raw, dict):
        raise DPFLError("a paper.yaml must be a YAML mapping (paper, title, data, runs, quick, claims)", field=where)
    try:
        return PaperSpec.model_validate(raw)
    except ValidationError as err:
        raise DPFLError(format_error(err), field=where) from None


def load_paper(folder: Path) -> PaperSpec:
    """Read and check ``folder/paper.yaml``, including that every run's scenario file exists."""
    from ..scenario import load_yaml

    path = Path(folder) / PAPER_FILE
    if not path.is_file():
        raise DPFLError(f"no {PAPER_FILE} in {folder}")
    if path.stat().st_size > MAX_PAPER_BYTES:
        raise DPFLError(f"{path.stat().st_size} bytes; a paper.yaml is at most {MAX_PAPER_BYTES}", field=str(path))
    try:
        raw = load_yaml(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DPFLError("not a text (UTF-8) file", field=str(path)) from None
    except DPFLError as err:
        raise DPFLError(str(err), field=str(path)) from None
    except Exception as err:  # noqa: BLE001 - yaml.YAMLError and its kin: where, not a traceback
        mark = getattr(err, "problem_mark", None)
        raise DPFLError(f"not valid YAML{f' (line {mark.line + 1})' if mark else ''}", field=str(path)) from None
    spec = parse_paper(raw, str(path))
    for i, run in enumerate(spec.declared):
        if Path(run.scenario).is_absolute():
            raise DPFLError(f"{run.scenario!r} must be relative to the paper's folder",
                            field=f"{path}: runs.{i}.scenario")
        if not (Path(folder) / run.scenario).is_file():
            raise DPFLError(f"no scenario file {run.scenario!r} in {folder}", field=f"{path}: runs.{i}.scenario")
    return spec


# --- metrics and checks ------------------------------------------------------------------------------

def run_metrics(summary: dict, rounds: list[dict]) -> dict:
    """What a finished run offers as metrics: its summary, plus ``final_loss``, ``epsilon`` and
    ``epsilon_claimed`` from the last round that has them where the summary lacks them, and
    ``epsilon_empirical`` as the audit's estimate (its interval stays in ``epsilon_empirical_low``
    / ``_high``)."""
    values = dict(summary)
    for key, row_key in (("final_loss", "test_loss"), ("epsilon", "epsilon"), ("epsilon_claimed", "epsilon_claimed")):
        if values.get(key) is None:
            values[key] = next((r[row_key] for r in reversed(rounds) if r.get(row_key) is not None), None)
    audit = values.get("epsilon_empirical")
    if isinstance(audit, dict):
        values["epsilon_empirical"] = audit.get("epsilon")
        values["epsilon_empirical_low"], values["epsilon_empirical_high"] = audit.get("low"), audit.get("high")
    within = within_budget(values, rounds)
    if within is not None:
        values["accuracy_within_budget"], values["round_within_budget"] = within
    return values


def within_budget(summary: dict, rounds: list[dict]) -> tuple[float, int] | None:
    """For a run with a per-client budget (``epsilon_budget``: Fu et al.): the test accuracy of its
    last evaluation whose accounted epsilon is within the budget, and that round. A run stopped on
    the paper's claim (``stop_on: claimed``) goes on past the budget by its ledger; the same run
    stopped on the accounted epsilon has the same rows up to its stop, so this is what it reaches
    (to the evaluation before its last round). None for a run without a budget or an evaluation."""
    budget = summary.get("epsilon_budget")
    if not isinstance(budget, (int, float)):
        return None
    last = None
    for r in rounds:
        eps = r.get("epsilon")
        if isinstance(eps, (int, float)) and eps > budget:
            break
        if isinstance(r.get("test_accuracy"), (int, float)):
            last = r
    return None if last is None else (float(last["test_accuracy"]), int(last["round"]))


class MetricMissing(Exception):
    """A metric a check needs is not there (or not a number)."""


def metric(values: dict, name: str, run: str) -> float:
    """``values[name]``, walking a dotted name into nested mappings; raises :class:`MetricMissing`."""
    node = values.get(name) if name in values else values
    if name not in values:
        for plain, bracketed in re.findall(r"([A-Za-z0-9_]+)|\[([^\[\]]+)\]", name):
            part = plain or bracketed
            node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        raise MetricMissing(f"{run} has no {name}")
    if isinstance(node, bool) or not isinstance(node, (int, float)) or math.isnan(node):
        raise MetricMissing(f"{run}'s {name} is not a number ({str(node)[:40]})")
    return float(node)


@dataclass(frozen=True)
class ClaimResult:
    """A claim's verdict: 'PASS', 'FAIL', or 'SKIP' (a run it names has no result here), and the
    numbers it compared as text."""

    id: str
    text: str
    status: str
    compared: str


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.3e}"


def evaluate_check(check, results: dict[str, dict | None]) -> tuple[str, str]:
    """(status, compared) of one check. ``results``: run name -> its metrics (:func:`run_metrics`),
    or None for a run that did not finish here; a run missing from ``results`` was not run."""
    absent = [n for n in dict.fromkeys(check.run_names()) if results.get(n) is None]
    if absent:
        why = ", ".join(f"{n} {'did not finish' if n in results else 'was not run'}" for n in absent)
        broken = _broken_order(check, results, absent)
        return ("FAIL", f"{broken}; {why}") if broken else ("SKIP", why)
    m = check.metric
    try:
        get = {n: metric(results[n], m, n) for n in check.run_names()}
    except MetricMissing as err:
        return "FAIL", f"{m}: {err}"
    kind = check.kind
    if kind in ("at_least", "at_most", "within"):
        here = get[check.run]
        if kind == "within":
            ok = abs(here - check.value) <= check.tol
            return _verdict(ok), f"{m}: |{check.run} {_fmt(here)} - {_fmt(check.value)}| = " \
                                 f"{_fmt(abs(here - check.value))} {'<=' if ok else '>'} {_fmt(check.tol)}"
        ok = here >= check.value if kind == "at_least" else here <= check.value
        op = (">=" if ok else "<") if kind == "at_least" else ("<=" if ok else ">")
        return _verdict(ok), f"{m}: {check.run} {_fmt(here)} {op} {_fmt(check.value)}"
    if kind in ("order", "monotone"):
        vals = [get[n] for n in check.runs]
        ok = all(_in_order(check, a, b) for a, b in zip(vals, vals[1:]))
        sym = _order_symbol(check)
        return _verdict(ok), f"{m}: " + f" {sym} ".join(f"{n} {_fmt(v)}" for n, v in zip(check.runs, vals)) + \
            ("" if ok else " (not so)")
    if kind == "mean_at_least":
        mean, listed = _mean(check.runs, get)
        ok = mean >= check.value
        return _verdict(ok), f"{m}: {listed} {'>=' if ok else '<'} {_fmt(check.value)}"
    if kind == "mean_gap_at_most":
        (base, base_listed), (here, listed) = _mean(check.baselines, get), _mean(check.runs, get)
        ok = base - here <= check.value
        return _verdict(ok), f"{m}: {base_listed}, minus {listed}: {_fmt(base - here)} " \
                             f"{'<=' if ok else '>'} {_fmt(check.value)}"
    if kind == "gap_at_most":
        gap = get[check.baseline] - get[check.run]
        ok = gap <= check.value
        return _verdict(ok), f"{m}: {check.baseline} {_fmt(get[check.baseline])} - {check.run} " \
                             f"{_fmt(get[check.run])} = {_fmt(gap)} {'<=' if ok else '>'} {_fmt(check.value)}"
    gaps = [get[check.baseline] - get[n] for n in check.runs]  # gap_shrinks: strictly, run after run
    ok = all(a > b for a, b in zip(gaps, gaps[1:]))
    return _verdict(ok), f"{m}: gap to {check.baseline} {_fmt(get[check.baseline])}: " + \
        ", ".join(f"{n} {_fmt(g)}" for n, g in zip(check.runs, gaps)) + (" (shrinks)" if ok else " (does not shrink)")


def _mean(names: list[str], get: dict[str, float]) -> tuple[float, str]:
    """The mean of the runs' values, and how it was made ("mean of a 0.8, b 0.75 = 0.775")."""
    vals = [get[n] for n in names]
    mean = math.fsum(vals) / len(vals)
    return mean, "mean of " + ", ".join(f"{n} {_fmt(v)}" for n, v in zip(names, vals)) + f" = {_fmt(mean)}"


def _broken_order(check, results: dict[str, dict | None], absent: list[str]) -> str | None:
    """For an order (or monotone) check some of whose runs are missing: two finished runs already
    out of order, which no missing run can mend (an order holds between any two of its runs); None
    if the finished ones agree with it, or a metric is missing."""
    if check.kind not in ("order", "monotone"):
        return None
    try:
        done = [(n, metric(results[n], check.metric, n)) for n in check.runs if n not in absent]
    except MetricMissing:
        return None
    for i, (a, va) in enumerate(done):
        for b, vb in done[i + 1:]:
            if not _in_order(check, va, vb):
                return f"{check.metric}: {a} {_fmt(va)} {_order_symbol(check)} {b} {_fmt(vb)} (not so)"
    return None


def _in_order(check, a: float, b: float) -> bool:
    """Whether ``a`` may come before ``b`` in an order check (strictly) or a monotone one (ties allowed)."""
    strict = check.kind == "order"
    if check.direction in ("descending", "decreasing"):
        return a > b if strict else a >= b
    return a < b if strict else a <= b


def _order_symbol(check) -> str:
    strict = check.kind == "order"
    if check.direction in ("descending", "decreasing"):
        return ">" if strict else ">="
    return "<" if strict else "<="


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def evaluate_claims(spec: PaperSpec, results: dict[str, dict | None]) -> list[ClaimResult]:
    return [ClaimResult(c.id, c.text, *evaluate_check(c.check, results)) for c in spec.claims]
