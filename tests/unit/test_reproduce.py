"""`dpfl reproduce` without Ray: the paper.yaml schema, every check kind, the rows, the markdown and
the csv read from hand-made run directories, the plan and the resumable manifest, and a dry run of
every paper folder shipped under scenarios/papers (each helper's folder is checked by the suite)."""
from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import pytest
import yaml

from dpfl_ray.errors import DPFLError
from dpfl_ray.runs import papers as pp
from dpfl_ray.runs import reproduce as rp
from dpfl_ray.runs import sweep as sw
from tests.helpers import dpfl_in_process

BASE = {
    "paper": "toy", "title": "Toy et al. 2099", "data": "synthetic",
    "runs": [
        {"name": "a", "scenario": "s.yaml", "paper": {"final_accuracy": 0.8}, "source": "Table 1"},
        {"name": "b", "scenario": "s.yaml", "set": ["training.lr=0.1"], "paper": {"final_accuracy": 0.7}},
        {"name": "c", "scenario": "s.yaml"},
    ],
    "quick": {"set": ["training.rounds=1"], "runs": ["a", "b"]},
    "claims": [{"id": "a_good", "text": "a reaches 75%", "check": {"kind": "at_least", "run": "a",
                                                                      "metric": "final_accuracy", "value": 0.75}}],
}
SCENARIO = {"name": "toy", "seed": 1, "data": {"source": "synthetic", "num_clients": 4, "synthetic_examples": 80},
            "model": {"name": "logistic"}, "training": {"rounds": 2},
            "sampling": {"mode": "fixed", "clients_per_round": 2}}


def spec_with(change=None) -> pp.PaperSpec:
    raw = copy.deepcopy(BASE)
    if change:
        change(raw)
    return pp.parse_paper(raw, "toy/paper.yaml")


@pytest.fixture
def folder(tmp_path) -> Path:
    d = tmp_path / "toy"
    d.mkdir()
    (d / "paper.yaml").write_text(yaml.safe_dump(BASE, sort_keys=False))
    (d / "s.yaml").write_text(yaml.safe_dump(SCENARIO))
    return d


# --- schema -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(extra=1), "toy/paper.yaml: extra: unknown key"),
    (lambda r: r["runs"][1].update(sett=["x=1"]), "toy/paper.yaml: runs.1.sett: unknown key"),
    (lambda r: r["claims"][0]["check"].update(tolerance=1), "claims.0.check.tolerance: unknown key"),
    (lambda r: r["runs"].append({"name": "a", "scenario": "t.yaml"}), "runs.3.name: 'a' is given twice"),
    (lambda r: r["claims"][0]["check"].update(run="zz"), "claims.0.check: no run named 'zz'"),
    (lambda r: r["claims"].append({"id": "o", "text": "t", "check": {"kind": "order", "runs": ["a", "q"],
                                                                     "metric": "m", "direction": "ascending"}}),
     "claims.1.check: no run named 'q'"),
    (lambda r: r["claims"].append({"id": "g", "text": "t", "check": {"kind": "gap_shrinks", "runs": ["a", "b"],
                                                                     "metric": "m", "baseline": "nope"}}),
     "claims.1.check: no run named 'nope'"),
    (lambda r: r["claims"].append({"id": "g", "text": "t", "check": {"kind": "mean_gap_at_most", "runs": ["a", "b"],
                                                                     "baselines": ["c", "cc"], "metric": "m",
                                                                     "value": 0.02}}),
     "claims.1.check: no run named 'cc'"),
    (lambda r: r["claims"].append(copy.deepcopy(r["claims"][0])), "claims.1.id: 'a_good' is given twice"),
    (lambda r: r["quick"].update(runs=["a", "x"]), "quick.runs.1: no run named 'x'"),
    (lambda r: r["quick"].update(runs=[]), "quick.runs: List should have at least 1 item"),
    (lambda r: r["claims"][0]["check"].update(kind="atleast"), "claims.0.check: unknown check kind 'atleast'"),
    (lambda r: r["claims"][0]["check"].pop("value"), "claims.0.check.value: Field required"),
    (lambda r: r["runs"][0].update(name="Run-A"), "runs.0.name: 'Run-A' is not a valid name"),
    (lambda r: r["runs"][0].update(set=["training.rounds"]), "runs.0.set.0: 'training.rounds' is not an override"),
    (lambda r: r["runs"][0].update(paper={"final_accuracy": True}), "runs.0.paper.final_accuracy: must be a number"),
    (lambda r: r["runs"][0].update(paper={"final accuracy": 0.5}), "'final accuracy' is not a metric name"),
    (lambda r: r["runs"].clear(), "runs: List should have at least 1 item"),
    (lambda r: r.pop("title"), "title: Field required"),
    (lambda r: r["runs"][0].update(seeds=[1, 1]), "runs.0.seeds: seed 1 is listed twice"),
    (lambda r: r["runs"][1].update(seeds=[2], set=["training.lr=0.1", "seed=5"]),
     "runs.1.seeds: the run's set already fixes the seed (seed=5)"),
    (lambda r: r["runs"][0].update(seeds=[-1]), "runs.0.seeds.0: Input should be greater than or equal to 0"),
    (lambda r: r["runs"][0].update(seeds=[True]), "runs.0.seeds.0: Input should be a valid integer"),
    (lambda r: r["runs"][2].update(seeds=[7]) or r["runs"].insert(0, {"name": "c_seed7", "scenario": "s.yaml"}),
     "runs.3.seeds.0: 'c_seed7' is given twice"),
    (lambda r: r["runs"][0].update(seeds=[7]) or r["runs"].append({"name": "a_seed7", "scenario": "s.yaml"}),
     "runs.3.name: 'a_seed7' is given twice"),
    (lambda r: r["runs"][0].update(name="a" * 76, seeds=[12]), "runs.0.seeds: '" + "a" * 76 + "_seed12', a copy's name,"),
])
def test_schema_mistakes_name_the_file_and_the_key(change, message):
    with pytest.raises(DPFLError) as err:
        spec_with(change)
    assert message in str(err.value) and str(err.value).startswith("toy/paper.yaml: ") and "\n" not in str(err.value)


def test_a_valid_spec_and_its_metrics():
    spec = spec_with()
    assert [r.name for r in spec.runs] == ["a", "b", "c"] and spec.quick.runs == ["a", "b"]
    assert spec.metrics() == ["final_accuracy"] and spec.run("b").set == ["training.lr=0.1"]


def test_a_run_on_several_seeds_is_the_run_then_a_copy_a_seed(folder):
    raw = copy.deepcopy(BASE)
    raw["runs"][0].update(seeds=[3, 1])
    raw["claims"].append({"id": "mean", "text": "t", "check": {"kind": "mean_at_least", "metric": "final_accuracy",
                                                              "runs": ["a", "a_seed1", "a_seed3"], "value": 0.7}})
    raw["quick"]["runs"] = ["a_seed1"]
    spec = pp.parse_paper(raw, "toy/paper.yaml")
    assert [r.name for r in spec.runs] == ["a", "a_seed3", "a_seed1", "b", "c"]
    a, copy3 = spec.run("a"), spec.run("a_seed3")
    # its overrides, then the seed; the paper's values, which the paper reports for its one run
    assert (copy3.scenario, copy3.set, copy3.paper, copy3.seeds) == (a.scenario, [*a.set, "seed=3"], a.paper, [])
    assert spec.metrics() == ["final_accuracy"] and [r.name for r in spec.declared] == ["a", "b", "c"]
    # a copy is a run like any other: planned with the quick overrides after its own
    (planned,) = rp.plan(folder, spec, quick=True)
    assert (planned.name, planned.overrides) == ("a_seed1", (*a.set, "seed=1", "training.rounds=1"))


def test_load_paper_checks_the_file_and_the_scenarios(folder):
    assert pp.load_paper(folder).title == "Toy et al. 2099"
    (folder / "s.yaml").unlink()
    with pytest.raises(DPFLError, match=r"paper.yaml: runs.0.scenario: no scenario file 's.yaml'"):
        pp.load_paper(folder)
    (folder / "paper.yaml").write_text("paper: toy\npaper: again\n")
    with pytest.raises(DPFLError, match=r"paper.yaml: line 2: key 'paper' is given twice"):
        pp.load_paper(folder)
    (folder / "paper.yaml").write_text("runs: [\n")
    with pytest.raises(DPFLError, match=r"paper.yaml: not valid YAML"):
        pp.load_paper(folder)
    with pytest.raises(DPFLError, match="no paper.yaml"):
        pp.load_paper(folder.parent)


# --- checks -----------------------------------------------------------------------------------------

RESULTS = {"a": {"final_accuracy": 0.80, "epsilon": 2.5, "client_accuracy": {"mean": 0.6}},
           "b": {"final_accuracy": 0.75, "epsilon": 2.0},
           "c": {"final_accuracy": 0.75, "epsilon": 1.0},
           "base": {"final_accuracy": 0.90}}


def check(**fields):
    claim = {"id": "x", "text": "t", "check": {"metric": "final_accuracy", **fields}}
    names = ["a", "b", "c", "base"]
    raw = {**BASE, "runs": [{"name": n, "scenario": "s.yaml"} for n in names], "quick": {}, "claims": [claim]}
    return pp.parse_paper(raw, "p").claims[0].check


@pytest.mark.parametrize("fields, status, compared", [
    (dict(kind="at_least", run="a", value=0.79), "PASS", "final_accuracy: a 0.8 >= 0.79"),
    (dict(kind="at_least", run="b", value=0.79), "FAIL", "final_accuracy: b 0.75 < 0.79"),
    (dict(kind="at_most", run="a", value=0.81), "PASS", "a 0.8 <= 0.81"),
    (dict(kind="at_most", run="a", value=0.7), "FAIL", "a 0.8 > 0.7"),
    (dict(kind="at_most", run="a", metric="epsilon", value=2), "FAIL", "epsilon: a 2.5 > 2"),
    (dict(kind="at_least", run="a", metric="client_accuracy.mean", value=0.5), "PASS", "a 0.6 >= 0.5"),
    (dict(kind="within", run="a", value=0.82, tol=0.03), "PASS", "|a 0.8 - 0.82| = 0.02 <= 0.03"),
    (dict(kind="within", run="a", value=0.9, tol=0.05), "FAIL", "|a 0.8 - 0.9| = 0.1 > 0.05"),
    (dict(kind="order", runs=["a", "b"], direction="descending"), "PASS", "a 0.8 > b 0.75"),
    (dict(kind="order", runs=["a", "b", "c"], direction="descending"), "FAIL", "(not so)"),  # a tie is no order
    (dict(kind="order", runs=["b", "a"], direction="ascending"), "PASS", "b 0.75 < a 0.8"),
    (dict(kind="order", runs=["a", "b"], direction="ascending"), "FAIL", "(not so)"),
    (dict(kind="monotone", runs=["a", "b", "c"], direction="decreasing"), "PASS", "a 0.8 >= b 0.75 >= c 0.75"),
    (dict(kind="monotone", runs=["c", "b", "a"], direction="decreasing"), "FAIL", "(not so)"),
    (dict(kind="monotone", runs=["c", "b", "a"], direction="increasing"), "PASS", "c 0.75 <= b 0.75 <= a 0.8"),
    (dict(kind="monotone", runs=["a", "c"], metric="epsilon", direction="increasing"), "FAIL", "(not so)"),
    (dict(kind="gap_at_most", run="a", baseline="base", value=0.1), "PASS", "base 0.9 - a 0.8 = 0.1 <= 0.1"),
    (dict(kind="gap_at_most", run="b", baseline="base", value=0.1), "FAIL", "base 0.9 - b 0.75 = 0.15 > 0.1"),
    (dict(kind="gap_shrinks", runs=["b", "a"], baseline="base"), "PASS", "b 0.15, a 0.1 (shrinks)"),
    (dict(kind="gap_shrinks", runs=["a", "b"], baseline="base"), "FAIL", "(does not shrink)"),
    (dict(kind="gap_shrinks", runs=["b", "c"], baseline="base"), "FAIL", "(does not shrink)"),
    (dict(kind="mean_at_least", runs=["a", "b", "c"], value=0.76), "PASS",
     "final_accuracy: mean of a 0.8, b 0.75, c 0.75 = 0.7667 >= 0.76"),
    (dict(kind="mean_at_least", runs=["a", "b", "c"], value=0.77), "FAIL", "= 0.7667 < 0.77"),  # a passes alone
    (dict(kind="mean_gap_at_most", runs=["a", "b"], baselines=["base", "c"], value=0.05), "PASS",
     "final_accuracy: mean of base 0.9, c 0.75 = 0.825, minus mean of a 0.8, b 0.75 = 0.775: 0.05 <= 0.05"),
    # each pair alone: base - a = 0.1 fails, c - b = 0 passes; the means decide
    (dict(kind="mean_gap_at_most", runs=["a", "b"], baselines=["base", "c"], value=0.04), "FAIL", ": 0.05 > 0.04"),
])
def test_every_check_kind_passes_and_fails_with_the_numbers_it_compared(fields, status, compared):
    got, text = pp.evaluate_check(check(**fields), RESULTS)
    assert got == status and compared in text, text


def test_a_missing_metric_fails_and_an_absent_run_is_skipped():
    assert pp.evaluate_check(check(kind="at_least", run="c", metric="epsilon_empirical", value=1), RESULTS) == \
        ("FAIL", "epsilon_empirical: c has no epsilon_empirical")
    assert pp.evaluate_check(check(kind="at_least", run="a", metric="client_accuracy.max", value=1), RESULTS)[0] \
        == "FAIL"
    weird = {**RESULTS, "a": {"final_accuracy": "high"}}
    assert "not a number" in pp.evaluate_check(check(kind="at_least", run="a", value=1), weird)[1]
    partial = {"a": RESULTS["a"], "b": None}  # b did not finish, c was never run
    assert pp.evaluate_check(check(kind="order", runs=["a", "b", "c"], direction="descending"), partial) == \
        ("SKIP", "b did not finish, c was not run")
    # a mean is of every run it names: one that did not finish leaves it unknown, however high the rest
    assert pp.evaluate_check(check(kind="mean_at_least", runs=["a", "b"], value=0.5), partial) == \
        ("SKIP", "b did not finish")
    assert pp.evaluate_check(check(kind="mean_gap_at_most", runs=["a", "c"], baselines=["a", "b"], value=1),
                             partial) == ("SKIP", "c was not run, b did not finish")
    # two finished runs already out of order: no missing run can mend it (Fu: sigma 3 above sigma 2)
    assert pp.evaluate_check(check(kind="order", runs=["b", "a", "c"], direction="descending"),
                             {"a": RESULTS["a"], "b": RESULTS["b"], "c": None}) == \
        ("FAIL", "final_accuracy: b 0.75 > a 0.8 (not so); c did not finish")
    assert pp.evaluate_check(check(kind="order", runs=["a", "c", "b"], direction="descending"),
                             {"a": RESULTS["a"], "b": RESULTS["b"], "c": None})[0] == "SKIP"  # a > b holds


def test_run_metrics_fill_in_from_the_rounds_and_the_audit():
    summary = {"final_accuracy": 0.5, "final_loss": None, "epsilon_empirical": {"epsilon": 1.2, "low": 0.9, "high": 1.5}}
    rounds = [{"round": 1, "test_loss": 2.0, "epsilon": 0.3, "epsilon_claimed": 0.2},
              {"round": 2, "test_loss": 1.5, "epsilon": 0.6}]
    values = pp.run_metrics(summary, rounds)
    assert values["final_loss"] == 1.5 and values["epsilon"] == 0.6 and values["epsilon_claimed"] == 0.2
    assert (values["epsilon_empirical"], values["epsilon_empirical_low"], values["epsilon_empirical_high"]) == \
        (1.2, 0.9, 1.5)


def test_the_accuracy_within_the_budget_is_the_last_evaluation_the_ledger_allows():
    """Fu et al. stopped on the paper's claim: the run goes on past its accounted budget, and the same
    run stopped on the accounted epsilon would have ended at its last evaluation within it."""
    rounds = [{"round": 1, "epsilon": 1.0, "test_accuracy": 0.5}, {"round": 2, "epsilon": 1.5},
              {"round": 3, "epsilon": 1.99, "test_accuracy": 0.6}, {"round": 4, "epsilon": 2.01, "test_accuracy": 0.7},
              {"round": 5, "epsilon": 2.3, "test_accuracy": 0.8}]
    values = pp.run_metrics({"final_accuracy": 0.8, "epsilon_budget": 2.0, "stop_on": "claimed"}, rounds)
    assert (values["accuracy_within_budget"], values["round_within_budget"]) == (0.6, 3)
    honest = pp.run_metrics({"final_accuracy": 0.6, "epsilon_budget": 2.0}, rounds[:3])  # stopped on its ledger
    assert (honest["accuracy_within_budget"], honest["round_within_budget"]) == (0.6, 3)
    assert "accuracy_within_budget" not in pp.run_metrics({"final_accuracy": 0.8}, rounds)  # no budget
    assert "accuracy_within_budget" not in pp.run_metrics({"epsilon_budget": 2.0}, [{"round": 1, "epsilon": 2.5}])


# --- plan, manifest, rows, rendering ------------------------------------------------------------------

def test_the_plan_orders_the_overrides_and_checks_only(folder):
    spec = pp.load_paper(folder)
    runs = rp.plan(folder, spec, quick=True, sets=["seed=3"], data="/data/x")
    assert [r.name for r in runs] == ["a", "b"]  # quick: its subset
    assert runs[1].overrides == ("training.lr=0.1", "training.rounds=1", "data.path=/data/x", "seed=3")
    assert runs[0].scenario == (folder / "s.yaml").resolve()
    assert [r.name for r in rp.plan(folder, spec, only=["c"])] == ["c"]
    with pytest.raises(DPFLError, match="--only: 'zz' is not a run of toy"):
        rp.plan(folder, spec, only=["zz"])
    with pytest.raises(DPFLError, match="--only: 'c' is not one of toy's quick runs"):
        rp.plan(folder, spec, quick=True, only=["c"])


def test_find_paper_by_name_or_path(folder):
    assert rp.find_paper("toy", root=folder.parent) == folder
    assert rp.find_paper(str(folder), root=folder.parent / "elsewhere") == folder
    with pytest.raises(DPFLError, match=r"paper: no paper 'nope'.*\(papers: toy\)"):
        rp.find_paper("nope", root=folder.parent)


def write_run(run_dir: Path, summary: dict, rounds: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))


def test_rows_markdown_and_csv_from_run_directories(folder, tmp_path):
    spec = pp.load_paper(folder)
    out = tmp_path / "out"
    write_run(out / "a", {"final_accuracy": 0.78, "epsilon": 2.31, "epsilon_claimed": 2.0, "rounds_completed": 40,
                          "stop_reason": "privacy_budget_exhausted", "wall_seconds": 12.5},
              [{"round": 40, "test_accuracy": 0.78, "test_loss": 0.6}])
    write_run(out / "b", {"final_accuracy": 0.5, "stop_reason": "interrupted", "rounds_completed": 3}, [])
    rep = rp.collect(out, spec, quick=False, statuses={"a": "skipped", "b": "timeout"})
    assert [r["run"] for r in rep.rows] == ["a", "b"]  # c neither ran now nor before: not shown
    a, b = rep.rows
    assert (a["final_accuracy"], a["paper_final_accuracy"], a["diff_final_accuracy"]) == (0.78, 0.8, -0.02)
    assert (a["epsilon_accounted"], a["epsilon_claimed"], a["epsilon_empirical"]) == (2.31, 2.0, None)
    assert (a["rounds"], a["stop_reason"], a["status"]) == (40, "privacy_budget_exhausted", "ok")
    assert b["status"] == "timeout" and b["final_accuracy"] is None  # an unfinished run has no result
    assert [(c.id, c.status) for c in rep.claims] == [("a_good", "PASS")]

    md = rp.render_markdown(spec, rep, quick=False, command="dpfl reproduce toy", elapsed_s=3.0,
                            data_here="idx at /d")
    assert md.startswith("## Toy et al. 2099 (`toy`)")
    assert "| run | scenario | final_accuracy | paper | diff | ε accounted | ε claimed | ε empirical | rounds | stop " \
           "| wall s | status |" in md
    assert "| a | s.yaml | 0.7800 | 0.8000 | -0.0200 | 2.310 | 2.000 | - | 40 | privacy_budget_exhausted | 12.5 | ok |" \
        in md
    assert "| b | s.yaml | - | 0.7000 | - | - | - | - | 3 | interrupted | - | timeout |" in md
    assert "- `a`: Table 1" in md and "these runs read `idx at /d`" in md
    assert "| `a_good`: a reaches 75% | **PASS** | final_accuracy: a 0.78 >= 0.75 |" in md
    assert "```\ndpfl reproduce toy\n```" in md and "Wall time: 12.5 s over the 2 runs" in md

    rp.write_csv(rep, out / "reproduction.csv")
    with open(out / "reproduction.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["run", "scenario", "final_accuracy", "paper_final_accuracy", "diff_final_accuracy",
                             "epsilon_accounted", "epsilon_claimed", "epsilon_empirical", "rounds", "stop_reason",
                             "wall_seconds", "status"]
    assert rows[0]["paper_final_accuracy"] == "0.8" and rows[1]["final_accuracy"] == ""


def test_a_run_with_a_budget_shows_its_accuracy_within_it(folder, tmp_path):
    spec = pp.load_paper(folder)
    write_run(tmp_path / "a", {"final_accuracy": 0.8, "epsilon": 2.3, "epsilon_claimed": 2.0, "epsilon_budget": 2.0,
                               "stop_on": "claimed", "rounds_completed": 5, "stop_reason": "privacy_budget_exhausted"},
              [{"round": 3, "epsilon": 1.9, "test_accuracy": 0.7}, {"round": 5, "epsilon": 2.3, "test_accuracy": 0.8}])
    write_run(tmp_path / "b", {"final_accuracy": 0.5, "epsilon": 1.0, "stop_reason": "completed"}, [])
    rep = rp.collect(tmp_path, spec, quick=False)
    assert rep.columns()[-5:] == ["accuracy_within_budget", "rounds", "stop_reason", "wall_seconds", "status"]
    assert [r["accuracy_within_budget"] for r in rep.rows] == [0.7, None]
    md = rp.render_markdown(spec, rep, quick=False, command="dpfl reproduce toy", elapsed_s=1.0)
    assert "| ε empirical | accuracy within ε budget | rounds |" in md and "| 2.000 | - | 0.7000 | 5 |" in md
    assert "Accuracy within ε budget: the test accuracy at the run's last evaluation whose accounted ε" in md


def test_a_damaged_run_directory_is_a_row_that_says_so(folder, tmp_path):
    spec = pp.load_paper(folder)
    write_run(tmp_path / "c", {}, [])
    (tmp_path / "c" / "summary.json").write_text("{not json")
    rep = rp.collect(tmp_path, spec, quick=False)
    assert [(r["run"], r["status"].split(":")[0], r["final_accuracy"]) for r in rep.rows] == [("c", "unreadable", None)]
    assert rep.claims[0].status == "SKIP"


def test_the_plot_draws_here_beside_the_paper(folder, tmp_path):
    spec = pp.load_paper(folder)
    write_run(tmp_path / "a", {"final_accuracy": 0.78, "epsilon": 2.3, "stop_reason": "completed"}, [])
    rep = rp.collect(tmp_path, spec, quick=False)
    assert rp.plot(spec, rep, tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_a_paper_metric_named_like_an_epsilon_column_is_not_shown_twice(folder):
    spec = spec_with(lambda r: r["runs"][0].update(paper={"epsilon_claimed": 2.0}))
    rep = rp.collect(folder / "nothing", spec, quick=False, statuses={"a": "failed: x"})
    assert rep.columns().count("epsilon_claimed") == 1 and "paper_epsilon_claimed" in rep.columns()


def test_the_manifest_resumes_the_same_reproduction_and_refuses_another(folder, tmp_path):
    spec = pp.load_paper(folder)
    out = tmp_path / "out"
    rp.prepare(out, spec, False, rp.plan(folder, spec, only=["a"]))
    rp.prepare(out, spec, False, rp.plan(folder, spec))  # more runs join
    assert set(json.loads((out / rp.MANIFEST).read_text())["runs"]) == {"a", "b", "c"}
    with pytest.raises(DPFLError, match="holds the full reproduction of toy"):
        rp.prepare(out, spec, True, rp.plan(folder, spec, quick=True))
    write_run(out / "a", {"final_accuracy": 0.7, "stop_reason": "completed"}, [])
    with pytest.raises(DPFLError, match="run a in .* was made from another scenario file or other overrides"):
        rp.prepare(out, spec, False, rp.plan(folder, spec, sets=["seed=4"]))
    rp.prepare(out, spec, False, rp.plan(folder, spec, sets=["seed=4"], only=["b"]))  # b never finished
    # the directory's lock is the sweep's, under the reproduction's own manifest
    with sw.SweepLock(out, manifest=rp.MANIFEST, command="reproduce", what="reproduction"):
        with pytest.raises(DPFLError, match="is in use by a reproduction: PID"):
            sw.SweepLock(out, manifest=rp.MANIFEST, command="reproduce", what="reproduction").acquire()
    with pytest.raises(DPFLError, match="holds files that are not a reproduction"):
        sw.SweepLock(folder, manifest=rp.MANIFEST, command="reproduce", what="reproduction").acquire()


def test_run_directories_made_by_hand_are_adopted_only_where_they_are_the_runs(folder, tmp_path):
    """`dpfl reproduce --adopt`: runs made with `dpfl run` (here by hand: the scenario.yaml a run
    writes, its summary) become the reproduction's; a folder of them is refused without the flag, and
    with it wherever a directory is not what its run resolves to, or is no run at all."""
    from dpfl_ray.scenario import load_scenario

    out = tmp_path / "mine"
    for name, lr, acc in (("a", None, 0.78), ("b", 0.1, 0.66)):  # b's set: training.lr=0.1
        sc = load_scenario(folder / "s.yaml", [f"training.lr={lr}"] if lr else [])
        write_run(out / name, {"final_accuracy": acc, "stop_reason": "completed", "rounds_completed": 2}, [])
        (out / name / "scenario.yaml").write_text(sc.to_yaml())
    args = ("reproduce", folder, "--only", "a", "--only", "b", "--out", out)

    res = dpfl_in_process(*args)
    assert res.exit_code == 2 and "holds files that are not a reproduction" in res.stderr, res.output
    assert "add --adopt if it holds this paper's run directories" in res.stderr
    assert not (out / rp.MANIFEST).exists()

    right = (out / "b" / "scenario.yaml").read_text()
    (out / "b" / "scenario.yaml").write_text(right.replace("lr: 0.1", "lr: 0.2"))
    res = dpfl_in_process(*args, "--adopt")
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert "b was not made by run b: its training.lr is 0.2, the run's is 0.1" in res.stderr
    (out / "b" / "scenario.yaml").write_text(right)
    (out / "notes.txt").write_text("mine\n")
    res = dpfl_in_process(*args, "--adopt")
    assert res.exit_code == 2 and "notes.txt is not the directory of a run of this reproduction (a, b)" in res.stderr
    (out / "notes.txt").unlink()
    assert not (out / rp.MANIFEST).exists()  # nothing written by a refusal

    res = dpfl_in_process(*args, "--adopt")  # both finished: adopted, nothing runs, the table is theirs
    assert res.exit_code == 0, res.output
    assert "adopted 2 run directories: a, b" in res.stdout and "2 runs, 2 finished before" in res.stdout
    with open(out / "reproduction.csv") as fh:
        assert [(r["run"], r["final_accuracy"], r["status"]) for r in csv.DictReader(fh)] == \
            [("a", "0.78", "ok"), ("b", "0.66", "ok")]
    assert set(json.loads((out / rp.MANIFEST).read_text())["runs"]) == {"a", "b"}
    again = dpfl_in_process(*args)  # a reproduction now: the same command needs no flag
    assert again.exit_code == 0 and "2 runs, 2 finished before" in again.stdout, again.output


def test_a_run_that_did_not_finish_is_named_and_the_command_exits_1(folder, tmp_path, monkeypatch):
    """The command's verdict on what its trials returned (Tune's part stands in: one run finishes,
    the other's trial reports a failure): the table is written with both rows, the failed run is
    named with the way to retry it, and the exit status is 1."""
    import cli.reproduce

    def trials(out_dir, todo, *args):
        assert [r.name for r in todo] == ["a", "b"]
        write_run(out_dir / "a", {"final_accuracy": 0.78, "stop_reason": "completed", "rounds_completed": 2}, [])
        return {"a": "ok", "b": "failed: ValueError: boom"}

    monkeypatch.setattr(cli.reproduce, "run_on_tune", trials)
    out = tmp_path / "out"
    res = dpfl_in_process("reproduce", folder, "--only", "a", "--only", "b", "--out", out)
    assert res.exit_code == 1, res.output
    assert "1 of 2 runs did not finish (b); run the same command to retry them" in res.stdout
    with open(out / "reproduction.csv") as fh:
        assert [(r["run"], r["status"]) for r in csv.DictReader(fh)] == [("a", "ok"), ("b", "failed: ValueError: boom")]


# --- every shipped paper folder -------------------------------------------------------------------------

@pytest.mark.parametrize("paper", [p.name for p in rp.paper_folders()] or ["(none)"])
def test_every_shipped_paper_folder_passes_a_dry_run(paper):
    if paper == "(none)":
        pytest.skip("no paper folder under scenarios/papers")
    spec = pp.load_paper(rp.PAPERS_DIR / paper)
    assert spec.paper == paper, f"{paper}/paper.yaml says paper: {spec.paper}"
    res = dpfl_in_process("reproduce", paper, "--dry-run")
    assert res.exit_code == 0, res.output
    assert f"ok: {paper}: every run's scenario is valid, full and quick" in res.stdout
    lines = res.stdout.splitlines()
    assert sum(line.startswith("full  ") for line in lines) == len(spec.runs)


def test_list_and_a_bad_paper_name():
    res = dpfl_in_process("reproduce", "--list")
    assert res.exit_code == 0, res.output
    assert all(p.name in res.stdout for p in rp.paper_folders())
    res = dpfl_in_process("reproduce", "no_such_paper")
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "no paper 'no_such_paper'" in res.stderr


@pytest.fixture(scope="module")
def synthetic_idx(tmp_path_factory):
    from tests.e2e.test_reproduce import write_idx

    return write_idx(tmp_path_factory.mktemp("idx"))


@pytest.mark.parametrize("paper", [p.name for p in rp.paper_folders()] or ["(none)"])
def test_every_quick_run_builds_its_federation_and_algorithm_on_a_synthetic_idx_set(paper, synthetic_idx):
    """`--quick --data DIR` without the Debian package, up to the point where Ray starts: the data
    is read and partitioned, and the algorithm accepts the scenario, for every quick run (the e2e
    test runs fu2022's quick runs for real; the others' runs only differ from here in their Ray)."""
    if paper == "(none)":
        pytest.skip("no paper folder under scenarios/papers")
    from dpfl_ray.algorithms import algorithm_class, make_algorithm
    from dpfl_ray.data import build_federation
    from dpfl_ray.scenario import load_scenario

    folder = rp.PAPERS_DIR / paper
    for run in rp.plan(folder, pp.load_paper(folder), quick=True, data=str(synthetic_idx)):
        sc = load_scenario(run.scenario, list(run.overrides))
        assert sc.data.path == str(synthetic_idx.resolve()), run.name
        fed = build_federation(sc)
        assert fed.num_clients == sc.data.num_clients and min(fed.sizes) > 0, run.name
        algorithm_class(sc).check_scenario(sc)
        make_algorithm(sc, fed.weights, sizes=fed.sizes)


def test_a_metric_names_a_key_that_is_not_a_plain_name_in_brackets():
    """Huang et al.'s Fig. 7 categories are summary keys such as 'eps_k=2.75'."""
    values = {"client_accuracy": {"by_group": {"eps_k=2.75": {"mean": 0.61}, "eps_k=8": {"mean": 0.7}}}}
    assert pp.metric(values, "client_accuracy.by_group[eps_k=2.75].mean", "u100") == 0.61
    with pytest.raises(pp.MetricMissing):
        pp.metric(values, "client_accuracy.by_group[eps_k=3].mean", "u100")
    assert pp.evaluate_check(check(kind="at_least", run="a", metric="client_accuracy.by_group[eps_k=8].mean",
                                   value=0.65), {"a": values}) == \
        ("PASS", "client_accuracy.by_group[eps_k=8].mean: a 0.7 >= 0.65")
    for bad in ("client_accuracy.by_group[", "a..b", "[eps_k=1]", "a[x]y"):
        with pytest.raises(ValueError):
            check(kind="at_least", run="a", metric=bad, value=1)


def test_a_dry_run_refuses_the_directory_the_reproduction_would_refuse(tmp_path):
    """`--dry-run --out DIR` said ok where the reproduction refuses DIR: another paper's or mode's
    directory, a finished run there of other overrides."""
    from typer.testing import CliRunner

    from cli.main import app

    out = tmp_path / "wq"
    folder = rp.find_paper("wei2020")
    spec = pp.load_paper(folder)
    rp.prepare(out, spec, True, rp.plan(folder, spec, True, [], None))  # a quick reproduction's directory
    runner = CliRunner()
    ok = runner.invoke(app, ["reproduce", "wei2020", "--quick", "--dry-run", "--out", str(out)])
    assert ok.exit_code == 0, ok.output
    full = runner.invoke(app, ["reproduce", "wei2020", "--dry-run", "--out", str(out)])
    assert full.exit_code == 2 and f"{out} holds the quick reproduction of wei2020" in full.stderr, full.output
