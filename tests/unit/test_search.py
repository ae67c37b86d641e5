"""Searches (dpfl_ray.runtime.search): random points drawn with Ray Tune's samplers, and Optuna's TPE
asked in batches from the results so far; the same points for the same command (and results), kept
when more are asked for; a sweep directory that records and reads them back. No Ray session, no
subprocess."""
import json

import numpy as np
import pytest
import yaml

from dpfl_ray.errors import DPFLError
from dpfl_ray.runs import sweep as sw
from dpfl_ray.runtime.search import OptunaSearch, RandomSearch, parse_space

from .test_sweep import TINY, _gaussian_rounds, _ledger, fake_run

SPACE = ["training.lr=loguniform(1e-4,1)", "training.local_epochs=randint(1,4)",
         "privacy.clipping.norm=uniform(0.5,2)", "model.name=logistic,mlp"]


def test_the_same_command_draws_the_same_points_and_more_samples_keep_the_first():
    space = parse_space(SPACE)
    five = RandomSearch(space, 5, seed=3).points()
    assert RandomSearch(space, 5, seed=3).points() == five
    assert RandomSearch(space, 9, seed=3).points()[:5] == five
    assert RandomSearch(space, 5, seed=4).points() != five
    assert len(set(five)) == 5 and all(len(p) == 4 for p in five)


def test_each_axis_draws_from_its_own_distribution():
    space = parse_space(SPACE)
    points = RandomSearch(space, 400, seed=0).points()
    lr = np.array([float(p[0]) for p in points])
    epochs = [p[1] for p in points]
    norm = np.array([float(p[2]) for p in points])
    assert lr.min() >= 1e-4 and lr.max() <= 1
    # log-uniform: half the mass below 1e-2 (a uniform draw would put 1% there)
    assert 0.4 < np.mean(lr < 1e-2) < 0.6
    assert set(epochs) == {"1", "2", "3"}  # Tune's randint excludes its upper bound
    assert norm.min() >= 0.5 and norm.max() <= 2 and 0.4 < np.mean(norm < 1.25) < 0.6
    assert {p[3] for p in points} == {"logistic", "mlp"}
    # a drawn number is its --set text: 4 significant digits, read back as the same number
    assert all(len(p[0].replace("0.", "").replace("e-", "").lstrip("0")) <= 6 for p in points)
    assert all(float(p[0]) == float(format(float(p[0]), ".4g")) for p in points)


@pytest.mark.parametrize("item, needle", [
    ("training.lr=loguniform(0,1)", "needs low > 0"),
    ("training.lr=uniform(2,1)", "needs low < high"),
    ("training.lr=uniform(1)", "needs two numbers"),
    ("training.lr=uniform(0,inf)", "needs finite bounds"),
    ("training.local_epochs=randint(1,1.5)", "needs integers"),
    ("training.rounds=randint(1,99999999999999999999999)", "needs bounds within"),
    ("seed=randint(0,5)", "--seeds"),
    ("training.lr=0.1,0.1", "one value twice"),
])
def test_bad_spaces_are_one_line(item, needle):
    with pytest.raises(DPFLError, match=needle.replace("(", r"\(")):
        parse_space([item])


def test_a_space_smaller_than_the_samples_asked_for_is_refused():
    space = parse_space(["model.name=logistic,mlp", "training.local_epochs=randint(1,3)"])
    assert len(RandomSearch(space, 4).points()) == 4
    with pytest.raises(DPFLError, match="fewer than 5"):
        RandomSearch(space, 5).points()


def test_a_search_of_more_runs_than_a_sweep_plans_is_refused_before_it_draws():
    # a billion samples would draw for as long as they are let: refused before the first draw
    space = parse_space(["training.lr=loguniform(1e-3,1)"])
    with pytest.raises(DPFLError, match="1,000,000,000 runs; a sweep plans at most 10,000") as err:
        RandomSearch(space, 10 ** 9).points()
    assert err.value.field == "--num-samples"
    with pytest.raises(DPFLError, match="at most 10,000"):
        OptunaSearch(space, 10 ** 9)


def test_a_grid_without_search_refuses_a_distribution():
    with pytest.raises(DPFLError, match="give --search random"):
        sw.parse_grid(["training.lr=loguniform(1e-3,1)"])


def test_a_searched_sweep_directory_records_its_points_and_is_read_back(tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "sweep"
    search = RandomSearch(parse_space(["training.lr=loguniform(1e-3,1)", "sampling.clients_per_round=2,4,6"]), 4, 1)
    axes, seeds, runs = sw.plan(scenario, [], "0,1", [], search)  # the space is the search's
    assert len(runs) == 8 and [r.seed for r in runs] == [0] * 4 + [1] * 4
    points = search.points()
    assert [tuple(v for _, v in r.values) for r in runs[:4]] == points
    assert runs[0].name == f"training.lr={points[0][0]}__sampling.clients_per_round={points[0][1]}__seed=0"
    assert axes["training.lr"] == [p[0] for p in points]
    sw.prepare(out, scenario, axes, seeds, [], search)
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["search"]["points"] == [list(p) for p in points] and manifest["search"]["seed"] == 1
    for i, run in enumerate(runs[:5]):
        fake_run(out / run.name, 0.5 + 0.01 * i, epsilon=2.0, claimed=2.0, stop="completed", seed=run.seed)
    assert sw.sweep_run_dirs(out) == [out / r.name for r in runs[:5]]  # what `dpfl report` reads
    rows, written = sw.write_outputs(out, axes, runs, drawn=True)
    assert [r["training.lr"] for r in rows[:4]] == [p[0] for p in points]
    assert sorted(p.name for p in written if p.suffix == ".png") == [
        "accuracy_vs_sampling.clients_per_round.png", "accuracy_vs_training.lr.png",
        "epsilon_vs_sampling.clients_per_round.png", "epsilon_vs_training.lr.png"]

    more = RandomSearch(search.space, 6, 1)  # more samples over the same space: the same directory goes on
    sw.prepare(out, scenario, more.axes(more.points()), seeds, [], more)
    # fewer would drop finished runs from sweep.csv and from the choice selection.json books
    with pytest.raises(DPFLError, match=r"^--num-samples: .* holds a search of 6 points: --num-samples 4 would leave 2"):
        sw.prepare(out, scenario, axes, seeds, [], search)
    assert len(sw.read_manifest(out)["search"]["points"]) == 6
    with pytest.raises(DPFLError, match="another space or --search-seed"):
        sw.prepare(out, scenario, axes, seeds, [], RandomSearch(search.space, 4, 2))
    with pytest.raises(DPFLError, match="holds a random search.*this is a grid"):
        sw.prepare(out, scenario, {"training.lr": ["0.1"]}, seeds, [])
    grid_dir = tmp_path / "grid"
    sw.prepare(grid_dir, scenario, {"training.lr": ["0.1"]}, seeds, [])
    with pytest.raises(DPFLError, match="holds a grid.*this is a random search"):
        sw.prepare(grid_dir, scenario, axes, seeds, [], search)


def test_a_random_search_job_ships_the_options_that_draw_the_same_points(tmp_path):
    from cli.submit import _sweep_args

    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    grid = ["training.lr=loguniform(1e-3,1)"]
    args = _sweep_args(scenario, [], grid, None, None, None, ("random", 3, 7))
    assert args == ["--grid", grid[0], "--search", "random", "--num-samples", "3", "--search-seed", "7"]
    assert _sweep_args(scenario, [], ["training.lr=0.1,0.2"], None, None, None) == ["--grid", "training.lr=0.1,0.2"]
    asha = _sweep_args(scenario, [], ["training.lr=0.1,0.2"], None, None, None, scheduler=("asha", None, 3))
    assert asha[2:] == ["--scheduler", "asha", "--reduction-factor", "3"]  # the sweep's own default grace
    asha = _sweep_args(scenario, [], ["training.lr=0.1,0.2"], None, None, None, scheduler=("asha", 2, None))
    assert asha[2:] == ["--scheduler", "asha", "--grace-rounds", "2"]


@pytest.mark.parametrize("args, culprit", [
    (["sweep", "--grid", "training.lr=0.1,0.2", "--grace-rounds", "2"], "--grace-rounds"),
    (["sweep", "--grid", "training.lr=0.1,0.2", "--scheduler", "none", "--reduction-factor", "3"], "--reduction-factor"),
    (["sweep", "--grid", "training.lr=0.1,0.2", "--search-seed", "5"], "--search-seed"),
    (["sweep", "--grid", "training.lr=0.1,0.2", "--scheduler", "hyperband"], "--scheduler"),
    (["submit", "--scheduler", "asha"], "--scheduler"),
    (["submit", "--search-seed", "1"], "--search-seed"),
    (["sweep", "--grid", "training.lr=0.1,0.2", "--metric", "final_loss"], "--metric"),
    (["sweep", "--grid", "training.lr=uniform(0.1,0.2)", "--search", "optuna", "--num-samples", "2", "--metric",
      "epsilon"], "--metric"),
    (["submit", "--metric", "final_loss"], "--metric"),
    (["submit", "--grid", "training.lr=0.1,0.2", "--grace-rounds", "2"], "--grace-rounds"),
])
def test_an_option_that_would_be_ignored_is_refused_in_one_line(tmp_path, args, culprit):
    from tests.helpers import dpfl_in_process

    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    res = dpfl_in_process(args[0], scenario, *args[1:], "--out" if args[0] == "sweep" else "--name",
                          tmp_path / "out" if args[0] == "sweep" else "job")
    assert res.exit_code != 0 and "Traceback" not in res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and culprit in lines[0], res.output
    assert not (tmp_path / "out").exists()


# --- --search optuna: TPE asked in batches, from the results so far ------------------------------

def _peak(point) -> float:
    """A made-up final accuracy that peaks at lr = 1e-2."""
    return 1 - abs(np.log10(float(point[0])) + 2)


def _run_search(search: OptunaSearch, score=_peak) -> list:
    while len(search.asked) < search.samples:
        search.ask([score(p) for p in search.asked])
    return search.asked


def test_optuna_asks_the_same_points_from_the_same_results_and_resumes_from_any_prefix():
    space = parse_space(["training.lr=loguniform(1e-4,1)", "model.name=logistic,mlp"])
    full = _run_search(OptunaSearch(space, 9, seed=2, batch=2))
    assert len(set(full)) == 9 and all(1e-4 <= float(lr) <= 1 for lr, _ in full)
    assert _run_search(OptunaSearch(space, 9, seed=2, batch=2)) == full
    for cut in (2, 6):  # a search stopped after any batch asks the same points from the runs on disk
        resumed = OptunaSearch(space, 9, seed=2, batch=2)
        resumed.adopt(OptunaSearch(space, 9, seed=2, batch=2, asked=full[:cut]).manifest(full[:cut]))
        assert resumed.asked == full[:cut]
        assert _run_search(resumed) == full
    assert _run_search(OptunaSearch(space, 9, seed=3, batch=2)) != full
    for points in (5, [5], [None], [["0.1"]], [["0.1", "mlp", "x"]], [[0.1, "mlp"]]):  # sweep.json edited
        with pytest.raises(DPFLError, match=r"^--out: sweep.json's search points are not lists of 2 values"):
            OptunaSearch(space, 9, seed=2, batch=2).adopt({**OptunaSearch(space, 9, seed=2, batch=2).manifest([]),
                                                           "points": points})
    assert OptunaSearch(space, 4, seed=2, batch=2).ask([]) == full[:2]  # the first batch needs no results


def test_optuna_models_the_results_once_its_random_start_is_over():
    space = parse_space(["training.lr=loguniform(1e-4,1)"])
    best = OptunaSearch(space, 16, seed=0, metric="final_accuracy", batch=2)
    worst = OptunaSearch(space, 16, seed=0, metric="final_loss", batch=2)  # the same numbers, minimised
    assert best.startup() == worst.startup() == 8
    _run_search(best), _run_search(worst)
    assert best.asked[:8] == worst.asked[:8]  # drawn at random, whatever the results

    def distance(points):
        return float(np.mean([abs(np.log10(float(p[0])) + 2) for p in points]))

    # then toward the peak when it is maximised, away from it when minimised
    assert distance(best.asked[8:]) < distance(worst.asked[8:]) - 0.3


def test_optuna_is_told_failed_and_early_stopped_runs_and_refuses_a_space_too_small():
    space = parse_space(["model.name=logistic,mlp,cnn"])
    search = OptunaSearch(space, 3, batch=1)
    search.ask([])
    search.ask([None])  # the first run failed: TPE is told, and asks another point
    search.ask([None, "stopped_early"])
    assert sorted(p[0] for p in search.asked) == ["cnn", "logistic", "mlp"]
    assert search.ask([0.5, None, 0.7]) == []  # every sample asked
    with pytest.raises(DPFLError, match="holds 3 points, fewer than 4") as err:  # before anything runs
        OptunaSearch(space, 4, batch=2)
    assert err.value.field == "--num-samples"
    with pytest.raises(DPFLError, match="holds 6 points"):  # randint excludes its upper bound, as in Tune
        OptunaSearch(parse_space(["model.name=logistic,mlp", "training.local_epochs=randint(1,4)"]), 7)


def test_optuna_results_are_the_runs_metric_averaged_over_seeds(tmp_path):
    space = parse_space(["training.lr=uniform(0.1,0.5)"])
    search = OptunaSearch(space, 4, batch=3, metric="final_loss", asked=[("0.2",), ("0.3",), ("0.4",)])
    runs = sw.expand(search.axes(search.points()), [0, 1], [], search.points())
    values = iter([0.5, 0.7, 0.9, 0.25, 0.1, 0.3])  # seed 0's three runs, then seed 1's
    for run in runs[:5]:
        fake_run(tmp_path / run.name, 0.8, stop="stopped_early" if run.name == runs[4].name else "completed",
                 seed=run.seed, final_loss=next(values))
    # 0.2: both seeds; 0.3: seed 1 was stopped early by ASHA; 0.4: seed 1 never ran
    assert search.results(tmp_path, sw.runs_by_point(runs)) == [pytest.approx(0.375), "stopped_early", None]


@pytest.mark.parametrize("args, culprit", [
    (("grid", None, None, "final_loss"), "--metric"),
    (("random", 3, None, "final_loss"), "--metric"),
    (("optuna", None, None, None), "--num-samples"),
    (("optuna", 3, None, "epsilon"), "--metric"),
])
def test_optuna_options_out_of_place_are_one_line(args, culprit):
    from cli.sweep import make_search

    with pytest.raises(DPFLError) as err:
        make_search(["training.lr=uniform(0.1,0.5)"], *args)
    assert err.value.field == culprit


def test_an_optuna_search_directory_refuses_another_metric_or_batch_and_books_the_adaptive_choice(tmp_path):
    from cli.submit import _sweep_args

    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "sweep"
    search = OptunaSearch(parse_space(["training.lr=uniform(0.1,0.5)"]), 4, batch=2)
    search.ask([])
    axes, seeds, runs = sw.plan(scenario, [], None, [], search)
    assert len(runs) == 2
    sw.prepare(out, scenario, axes, seeds, [], search)
    assert sw.read_manifest(out)["search"] == {"kind": "optuna", "space": search.space, "seed": 0, "samples": 4,
                                               "metric": "final_accuracy", "batch": 2,
                                               "points": [list(p) for p in search.asked]}
    for other in (OptunaSearch(search.space, 4, batch=3), OptunaSearch(search.space, 4, metric="final_loss", batch=2)):
        with pytest.raises(DPFLError, match="--metric or --max-concurrent"):
            sw.prepare(out, scenario, axes, seeds, [], other)
    for count, run in zip((3, 2), runs):
        fake_run(out / run.name, 0.6, epsilon=1.5, claimed=1.5, stop="completed")
        (out / run.name / "ledger.json").write_text(json.dumps(_ledger(_gaussian_rounds(count))))
    sw.write_outputs(out, axes, runs, drawn=True)
    selection = json.loads((out / sw.SELECTION).read_text())
    assert selection["adaptive"] is True and "optuna" in selection["note"]
    assert selection["epsilon_all_runs"] > selection["epsilon_max_single_run"]

    args = _sweep_args(scenario, [], ["training.lr=uniform(0.1,0.5)"], None, 3, None, ("optuna", 4, 5, None))
    assert args == ["--grid", "training.lr=uniform(0.1,0.5)", "--search", "optuna", "--num-samples", "4",
                    "--search-seed", "5", "--metric", "final_accuracy", "--max-concurrent", "3"]
