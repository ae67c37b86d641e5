"""Fault plans (dpfl_ray.faults.plan): every kind drawn from the seed, one vocabulary, the checks that
keep corrupt updates out, and the schema's one-line errors. Pure: no Ray."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfl_ray import rng as rngmod
from dpfl_ray.errors import DPFLError
from dpfl_ray.faults.plan import (CAUSES, CORRUPTIONS, Dropout, FaultPlan, WorkerCrash, check_update, corrupt,
                             corruption_rng, load_trace, overcommitted, plan_round, select_reporters, tally)
from dpfl_ray.scenario import DropoutConfig, SamplingConfig, scenario_from_dict


def scenario(faults=None, **sections):
    raw = {"seed": 3, "data": {"source": "synthetic", "num_clients": 40},
           "training": {"rounds": 10}, "sampling": {"mode": "fixed", "clients_per_round": 10},
           "resources": {"workers": 4}, "faults": faults or {}}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return scenario_from_dict(raw)


# --- the dropout plan stays what it was ---------------------------------------------------------

@pytest.mark.parametrize("cfg, seed, t, sampled, dropped, order", [
    (DropoutConfig(model="tail", rate=0.3, phase="upload"), 1, 4, list(range(10)),
     {5: "upload", 6: "upload", 7: "upload"}, (8, 9, 4, 1, 0, 2, 3, 5, 7, 6)),
    (DropoutConfig(model="bernoulli", rate=0.2, phase="training"), 0, 3, [3, 5, 8, 13, 21, 34, 55],
     {3: "training", 21: "training"}, (21, 8, 13, 5, 34, 3, 55)),
    ([DropoutConfig(model="bernoulli", rate=0.1, phase="advertise"), DropoutConfig(model="tail", rate=0.25, phase="unmask"),
      DropoutConfig(model="bernoulli", rate=0.3, phase="calibration")], 7, 2, list(range(10)),
     {4: "calibration", 5: "advertise", 6: "calibration", 7: "unmask", 8: "calibration", 9: "unmask"},
     (8, 1, 6, 2, 3, 4, 0, 9, 7, 5)),
])
def test_dropout_plans_are_bit_identical_to_before(cfg, seed, t, sampled, dropped, order):
    # pinned from the plan of the commit before stragglers, crashes & co. existed
    plan = plan_round(cfg, np.array(sampled), seed, t)
    assert plan.dropped == dropped and plan.report_order == order


def test_other_fault_kinds_never_change_who_drops_out():
    drop = {"model": "bernoulli", "rate": 0.3, "phase": "upload"}
    plain = FaultPlan.from_scenario(scenario({"dropout": drop}))
    busy = FaultPlan.from_scenario(scenario({
        "dropout": drop, "stragglers": {"fraction": 0.5}, "crash": {"rate": 0.5},
        "corrupt": {"fraction": 0.5}, "node_failure": {"at_round": [1, 2, 3]}}))
    seen = []
    for t in range(10):
        sampled = np.arange(40)[t::4]
        a, b = plain.plan(t, sampled, 4), busy.plan(t, sampled, 4)
        assert a.dropped == b.dropped == plan_round(plain.faults.dropouts, sampled, 3, t).dropped
        assert bool(b.nodes_lost) == (t < 3)
        seen.append((len(b.delays), len(b.crashes), len(b.corrupt)))
    assert all(sum(kind) > 0 for kind in zip(*seen))  # the other kinds did happen


def test_the_same_seed_gives_the_same_faults_and_another_seed_others():
    faults = {"dropout": {"model": "tail", "rate": 0.2}, "stragglers": {"fraction": 0.3},
              "crash": {"rate": 0.3}, "corrupt": {"fraction": 0.3, "kind": ["nan", "shape"]}}
    one, two = (FaultPlan.from_scenario(scenario(faults)) for _ in range(2))
    other = FaultPlan.from_scenario(scenario(faults).model_copy(update={"seed": 4}))
    plans = [[p.plan(t, np.arange(10 * t % 30, 10 * t % 30 + 10), 4) for t in range(6)] for p in (one, two, other)]
    assert plans[0] == plans[1] and plans[0] != plans[2]


# --- stragglers, deadlines, overcommit ----------------------------------------------------------

def test_straggler_fraction_tiers_and_latencies():
    plan = FaultPlan.from_scenario(scenario({"stragglers": {
        "fraction": 0.3, "latency": {"distribution": "lognormal", "median_s": 2.0, "sigma": 0.5},
        "tiers": [{"clients": [0, 1], "latency": {"distribution": "fixed", "seconds": 7.5}},
                  {"share": 0.25, "latency": {"distribution": "uniform", "low_s": 1, "high_s": 3}}]}}))
    assert sum(1 for c, tier in plan.tiers.items() if tier == 1) == 10 and plan.tiers[0] == plan.tiers[1] == 0
    others, rounds = [], 300
    for t in range(rounds):
        delays = plan.plan(t, np.arange(40), 4).delays
        assert delays[0] == delays[1] == 7.5  # slow devices straggle whenever sampled
        assert all(1 <= delays[c] <= 3 for c, tier in plan.tiers.items() if tier == 1)
        others += [delays.get(c) for c in range(40) if c not in plan.tiers]
    hit = [d for d in others if d is not None]
    assert abs(len(hit) / len(others) - 0.3) < 0.02 and abs(np.median(hit) - 2.0) < 0.1


def test_select_reporters_closes_at_the_deadline_or_the_target():
    times = {1: 0.0, 2: 5.0, 3: 0.0, 4: 1.0, 5: 9.0}
    assert select_reporters(times, 4.0, None) == ([1, 3, 4], [2, 5])
    assert select_reporters(times, None, 2, order=[3, 1]) == ([1, 3], [4, 2, 5])
    # equal times go by the round's report order
    assert select_reporters(times, 6.0, 2, order=[3, 4, 1]) == ([1, 3], [4, 2, 5])
    assert select_reporters(times, None, None) == ([1, 2, 3, 4, 5], [])


def test_overcommit_keeps_the_first_m_and_records_the_rest_as_late():
    sc = scenario({"stragglers": {"fraction": 0.4, "latency": {"distribution": "uniform", "low_s": 1, "high_s": 9}},
                   "dropout": {"model": "tail", "rate": 0.1, "phase": "training"}},
                  sampling={"overcommit": 1.3}, training={"round_deadline_s": 5.0})
    assert overcommitted(sc.sampling).clients_per_round == 13
    plan = FaultPlan.from_scenario(sc)
    assert plan.target == 10 and plan.deadline_s == 5.0
    surplus = past_deadline = 0
    for t in range(20):
        rf = plan.plan(t, np.arange(13) + t, 4)
        kept = rf.survivors(np.arange(13) + t)
        late = [c for c, d in rf.dropouts().items() if d.cause == "straggler"]
        assert len(kept) <= 10 and all(rf.dropouts()[c] == Dropout("straggler", "upload") for c in late)
        assert all(rf.delays.get(c, 0) <= 5.0 for c in kept) and len(kept) + len(rf.dropped) == 13
        # a spare that came in time but after the first ten is late too, and no kept one came after it
        on_time_late = [c for c in late if rf.delays.get(c, 0) <= 5.0]
        assert all(rf.delays.get(k, 0) <= rf.delays.get(c, 0) for k in kept for c in on_time_late)
        surplus, past_deadline = surplus + len(on_time_late), past_deadline + len(late) - len(on_time_late)
    assert surplus > 0 and past_deadline > 0


def test_overcommitted_sampling():
    fixed = SamplingConfig(mode="fixed", clients_per_round=10, overcommit=1.3)
    poisson = SamplingConfig(mode="poisson", rate=0.1, clients_per_round=None, overcommit=1.5)
    assert overcommitted(fixed).clients_per_round == 13 and overcommitted(poisson).rate == pytest.approx(0.15)
    plain = SamplingConfig(mode="fixed", clients_per_round=10)
    assert overcommitted(plain) is plain


# --- crashes and node losses --------------------------------------------------------------------

def test_crashes_at_listed_points_and_at_a_rate():
    plan = FaultPlan.from_scenario(scenario({"crash": {"at": [[3, "training"], [3, "upload", 2], [5, "upload", 2],
                                                              [5, "training", 2]]}}))
    assert [plan.plan(t, np.arange(10), 4).crashes != () for t in range(10)] == [t in (2, 4) for t in range(10)]
    r3 = plan.plan(2, np.arange(10), 4).crashes
    assert WorkerCrash(2, "upload") in r3 and len(r3) == 2  # rounds count from 1
    assert plan.plan(4, np.arange(10), 4).crashes == (WorkerCrash(2, "training"),)  # the earlier phase wins
    rated = FaultPlan.from_scenario(scenario({"crash": {"rate": 0.25, "phase": "upload"}}))
    hits = [c for t in range(400) for c in rated.plan(t, np.arange(10), 4).crashes]
    assert abs(len(hits) / 1600 - 0.25) < 0.04 and {c.phase for c in hits} == {"upload"}


def test_node_losses_happen_in_the_listed_rounds():
    plan = FaultPlan.from_scenario(scenario({"node_failure": {"at_round": [2, 7], "nodes": 2}}))
    lost = [plan.plan(t, np.arange(10)).nodes_lost for t in range(10)]
    assert [bool(x) for x in lost] == [t in (1, 6) for t in range(10)] and len(lost[1]) == 2


# --- corrupt updates ----------------------------------------------------------------------------

def test_corrupt_clients_listed_and_drawn():
    plan = FaultPlan.from_scenario(scenario({"corrupt": {"clients": [4, 5], "fraction": 0.1,
                                                         "kind": ["nan", "norm"]},
                                             "dropout": {"model": "tail", "rate": 0.1, "phase": "training"}}))
    drawn = 0
    for t in range(200):
        rf = plan.plan(t, np.arange(20), 4)
        assert {4, 5} - set(rf.dropped) <= set(rf.corrupt)  # listed clients that deliver corrupt every time
        assert set(rf.corrupt.values()) <= {"nan", "norm"} and not set(rf.corrupt) & set(rf.dropped)
        drawn += len(set(rf.corrupt) - {4, 5})
    assert 0.07 < drawn / (200 * 17) < 0.13


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_every_corruption_is_rejected_for_its_own_reason(kind):
    honest = np.random.default_rng(0).normal(size=500).astype(np.float32)
    assert check_update(honest, 500, 1e6) is None
    bad = corrupt(honest, kind, corruption_rng(0, 1, 2))
    assert check_update(bad, 500, 1e6).startswith(kind + ":")
    assert np.array_equal(bad, corrupt(honest, kind, corruption_rng(0, 1, 2)), equal_nan=True)  # from the seed
    assert check_update(honest, 500, 1e6) is None  # the original is untouched


def test_check_update_reasons():
    assert check_update(np.zeros((2, 3)), 6, None).startswith("shape:")
    assert check_update(np.array(["a", "b"]), 2, None).startswith("shape:")
    # no figure of the vector in the reason: it reaches rounds.jsonl by client id
    assert check_update(np.array([1.0, np.nan, np.inf]), 3, None) == "nan: NaN values"
    assert check_update(np.array([1.0, np.inf]), 2, None) == "inf: infinite values"
    assert check_update(np.array([30.0, 40.0]), 2, 5.0) == "norm: above faults.max_update_norm=5"
    assert check_update(np.array([3.0, 4.0]), 2, 5.0) is None and check_update(np.array([3.0, 4.0]), 2, 4.9)
    assert check_update(np.full(4, 1e30, dtype=np.float32), 4, 1e6).startswith("norm:")  # no float32 overflow
    # complex values (their imaginary part was dropped when summed) and ragged input are no update
    assert check_update(np.array([1 + 2j, 0j]), 2, None) == "shape: complex128 values instead of real numbers"
    assert check_update([[1.0, 2.0], [3.0]], 2, None) == "shape: not an array of numbers"


def test_an_update_past_its_clipping_bound_is_refused_as_the_ledger_s_sensitivity_would_be_broken():
    """faults.max_update_norm (1e6 by default) stops absurd norms; the bound the ledger books is the
    clip norm: a client that did not clip to it is refused, whatever max_update_norm says."""
    from dpfl_ray.algorithms.base import ClientSpec

    update = np.random.default_rng(1).normal(size=300).astype(np.float32) * 10
    for indicator in (False, True):
        spec = ClientSpec(clip_norm=0.5, indicator=indicator)
        sent = spec.prepare(update, np.zeros(300, np.float32))
        dim = spec.prepared_dim(300)
        assert check_update(sent, dim, 1e6, 0.5, indicator) is None  # clipped in float32: within the tolerance
        far = sent.copy()
        far[:300] *= 2
        assert check_update(far, dim, 1e6, 0.5, indicator) == "norm: above the clipping bound 0.5"
    bit = ClientSpec(clip_norm=0.5, indicator=True).prepare(update, np.zeros(300, np.float32))
    bit[-1] = 3.0
    assert check_update(bit, 301, 1e6, 0.5, True) == "norm: its clipped-count bit is neither +1/2 nor -1/2"
    assert check_update(update, 300, 1e6) is None  # no clip norm (record-level runs): only the absurd is refused


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=200), st.sampled_from(CORRUPTIONS),
       st.integers(0, 2 ** 31))
def test_any_corruption_of_any_update_is_caught(values, kind, seed):
    v = np.array(values, dtype=np.float32)
    assert check_update(v, v.size, 1e6) is None
    assert check_update(corrupt(v, kind, np.random.default_rng(seed)), v.size, 1e6) is not None


# --- availability traces ------------------------------------------------------------------------

def test_trace_marks_listed_rounds_unavailable(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("# a comment\nclient_id,round,available\n3,2,0\n4,2,false\n3,3,1\n5,1,no\n")
    assert load_trace(path, 10) == {(2, 3), (2, 4), (1, 5)}
    plan = FaultPlan.from_scenario(scenario({"availability": {"trace": str(path)}}))
    rf = plan.plan(1, np.arange(10), 4)  # round 2
    assert {c: d for c, d in rf.dropouts().items()} == {3: Dropout("unavailable", "training"),
                                                       4: Dropout("unavailable", "training")}
    assert 3 not in rf.delays and rf.survivors(range(10)) == [0, 1, 2, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("text, needle", [
    ("", "line 1: expected the header client_id,round,available"),
    ("client,round,available\n", "line 1: expected the header"),
    ("client_id,round,available\n1,2\n", "line 2: expected 3 fields"),
    ("client_id,round,available\n\n1,2,maybe\n", "line 3: available must be 0/1/true/false (got 'maybe')"),
    ("client_id,round,available\nx,2,0\n", "line 2: client_id must be an integer"),
    ("client_id,round,available\n1,0,0\n", "line 2: round must be an integer >= 1"),
    ("client_id,round,available\n99,1,0\n", "line 2: client 99 does not exist (data.num_clients=40)"),
    ("client_id,round,available\n1,1,0\n1,1,1\n", "line 3: client 1 round 1 is listed twice (first on line 2)"),
])
def test_bad_traces_are_one_line_naming_the_line(tmp_path, text, needle):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(DPFLError) as err:
        scenario({"availability": {"trace": str(path)}})
    message = str(err.value)
    assert "\n" not in message and message.startswith("faults.availability.trace: ") and needle in message


# --- vocabulary and records ---------------------------------------------------------------------

def test_dropout_labels_old_and_new():
    assert Dropout.parse("upload") == Dropout("dropout", "upload")
    assert Dropout.parse("crash") == Dropout("crash", "training")
    assert Dropout.parse("crash@advertise") == Dropout("crash", "advertise")
    assert Dropout.parse("deadline@masked_input") == Dropout("straggler", "upload")
    assert all(Dropout.parse(Dropout(c, "share").label) == Dropout(c, "share") for c in CAUSES)
    with pytest.raises(ValueError):
        Dropout("lost", "upload")


def test_tally_writes_the_round_row_fields():
    row = tally({7: Dropout("crash", "training"), 2: "upload", 9: "crash", 4: Dropout("rejected", "upload")})
    assert row == {"dropped": {"dropout": {"upload": 1}, "rejected": {"upload": 1}, "crash": {"training": 2}},
                   "dropped_clients": {"dropout": [2], "rejected": [4], "crash": [7, 9]},
                   "dropped_by_phase": {"upload": 2, "training": 2}}


def test_new_streams_come_after_the_old_ones():
    assert rngmod.purpose_id("layers") == 12 and rngmod.purpose_id("faults") == 3
    assert [rngmod.purpose_id(p) for p in ("stragglers", "straggler_tiers", "crash", "node_failure", "corrupt")] == \
        list(range(13, 18))


# --- schema ------------------------------------------------------------------------------------

def test_a_full_faults_section_round_trips():
    sc = scenario({"stragglers": {"fraction": 0.3, "tiers": [{"clients": [1], "latency": {"distribution": "fixed"}}]},
                   "crash": {"rate": 0.1, "at": [[2, "training"], [4, "upload", 1]]},
                   "node_failure": {"at_round": 5}, "corrupt": {"kind": "inf", "clients": [2]},
                   "max_update_norm": 50},
                  training={"round_deadline_s": 3}, sampling={"overcommit": 1.5}, output={"checkpoint_every": 2})
    again = scenario_from_dict(__import__("yaml").safe_load(sc.to_yaml()))
    assert again == sc and again.faults.node_failure.rounds == [5] and again.faults.corrupt.kinds == ["inf"]


@pytest.mark.parametrize("faults, sections, needle", [
    ({"crash": {"at": [[11, "training"]]}}, {}, "faults.crash.at: round 11 is past training.rounds=10"),
    ({"crash": {"at": [[2, "uplaod"]]}}, {}, "faults.crash.at"),
    ({"crash": {"at": [[2, "training", 4]]}}, {}, "faults.crash.at: worker 4 does not exist"),
    ({"crash": {"phase": "advertise", "rate": 0.1}}, {}, "exists only with secagg.enabled"),
    ({"crash": {"at": [[2, "calibration"]]}}, {}, "has no calibration phase"),
    ({"crash": {"rate": 1.5}}, {}, "faults.crash.rate"),
    ({"node_failure": {"at_round": 0}}, {}, "faults.node_failure.at_round"),
    ({"node_failure": {"at_round": [3, 12]}}, {}, "round 12 is past training.rounds=10"),
    ({"corrupt": {"clients": [40]}}, {}, "faults.corrupt.clients: client 40 does not exist"),
    ({"corrupt": {"kind": "zeros"}}, {}, "faults.corrupt.kind"),
    ({"stragglers": {"tiers": [{"share": 0.6}, {"share": 0.6}]}}, {}, "shares add up to more than 1"),
    ({"stragglers": {"tiers": [{"latency": {}}]}}, {}, "exactly one of clients or share"),
    ({"stragglers": {"latency": {"distribution": "uniform", "low_s": 5, "high_s": 1}}}, {}, "low_s=5.0 exceeds"),
    ({"availability": {"trace": "/nonexistent/trace.csv"}}, {}, "no trace file at /nonexistent/trace.csv"),
    ({"max_update_norm": 0}, {}, "faults.max_update_norm"),
    ({}, {"sampling": {"overcommit": 5}}, "sampling.overcommit: 5 x 10 clients needs 50"),
    ({}, {"sampling": {"overcommit": 0.5}}, "sampling.overcommit"),
    ({}, {"training": {"round_deadline_s": 0}}, "training.round_deadline_s"),
    ({}, {"output": {"checkpoint_every": -1}}, "output.checkpoint_every"),
])
def test_impossible_fault_settings_are_one_line(faults, sections, needle):
    with pytest.raises(DPFLError) as err:
        scenario(faults, **sections)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_processes_without_the_trace_file_skip_reading_it(tmp_path):
    from dpfl_ray.scenario import Scenario

    path = tmp_path / "trace.csv"
    path.write_text("client_id,round,available\n1,1,0\n")
    sc = scenario({"availability": {"trace": str(path)}})
    plan = FaultPlan.from_scenario(sc)  # the driver reads it once ...
    path.unlink()
    remote = Scenario.model_validate(sc.model_dump(mode="json"), context={"read_files": False})  # ... others need not
    assert remote == sc and plan.plan(0, np.arange(4)).dropouts() == {1: Dropout("unavailable", "training")}
    with pytest.raises(Exception, match="no trace file"):
        Scenario.model_validate(sc.model_dump(mode="json"))


def test_a_lognormal_delay_is_cut_at_a_day_and_the_schema_bounds_every_delay():
    """A tail draw past the clock's range stopped a run with an OverflowError (timestamp out of range)."""
    from dpfl_ray.defaults import MAX_LATENCY_S
    from dpfl_ray.faults.plan import draw_latency
    from dpfl_ray.scenario import LatencyConfig

    heavy = LatencyConfig(distribution="lognormal", median_s=MAX_LATENCY_S, sigma=10)
    g = np.random.default_rng(0)
    draws = [draw_latency(heavy, g) for _ in range(200)]
    assert max(draws) == MAX_LATENCY_S and min(draws) < MAX_LATENCY_S
    for field in ("seconds", "median_s", "low_s", "high_s"):
        with pytest.raises(ValueError, match="less than or equal to 86400"):
            LatencyConfig(**{field: 1e308})
