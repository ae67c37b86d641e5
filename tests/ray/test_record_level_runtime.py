"""Record-level DP end to end on a real local Ray (Huang et al. 2020, Fu et al. 2022): each client's
ledger holds what its own DP-SGD / DPAGD ran, checked against direct dp_accounting calls; clients
whose budget is spent withdraw as `exhausted` and the run stops when all have; the algorithm's
state survives a checkpoint round trip; `privacy.randomness: os` reaches the workers."""
import json
import time

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import RdpAccountant

from dpfl_ray.algorithms import make_algorithm
from dpfl_ray.algorithms.huang2020_core import round_dp_events
from dpfl_ray.data import build_federation
from dpfl_ray.runs.record import RunRecord
from dpfl_ray.runtime.checkpoint import read_checkpoint
from dpfl_ray.runtime.driver import run_scenario
from tests.helpers import tiny_scenario

FU = {"algorithm": "adap_dpfl", "rounds": 12}


def _run(sc, path):
    """The run's federation, summary, rows and ledger (None for a run without one)."""
    fed = build_federation(sc)
    summary = run_scenario(sc, fed, RunRecord(path))
    rows = [json.loads(line) for line in (path / "rounds.jsonl").read_text().splitlines()]
    ledger = path / "ledger.json"
    return fed, summary, rows, json.loads(ledger.read_text()) if ledger.exists() else None


UNEQUAL = {"kind": "unbalanced", "size_mean": 18, "size_sigma": 0.6, "min_size": 8}


def _fu(budget=1.0, sigma=4.0, beta=0.9, partition=UNEQUAL):
    """Unequal sizes: the lot rate L/n, and so the round each client's budget runs out, differ. A test
    that spends no budget takes equal sizes (``{"kind": "iid"}``): with Fu's noise decay every round's
    event is new, and dp_accounting computes the RDP of a sampled Gaussian for each distinct lot rate
    (~0.5 s each near L/n = 1/2): one a round instead of one per client."""
    return tiny_scenario(training=FU, data={"validation_fraction": 0.1, "partition": partition},
                         sampling={"mode": "fixed", "clients_per_round": 20},
                         privacy={"noise_multiplier": sigma, "accountant": "rdp", "clipping": {"norm": 1.0},
                                  "adap_dpfl": {"epsilon": budget, "lot_size": 8, "lr": 0.01, "alpha": 1.0,
                                                "beta": beta}})


def test_fu_ledgers_are_dp_accounting_and_spent_clients_withdraw(ray_session, tmp_path):
    sc = _fu()
    fed, summary, rows, ledger = _run(sc, tmp_path / "fu")
    # every client's epsilon is a fresh RdpAccountant over the rounds it reached the server in,
    # each round PoissonSampled(L/n, two Gaussians of the round's sigma) -- eq. 6's norm query too
    sigma_of = {r["round"]: r["noise_multiplier"] for r in rows if r.get("noise_multiplier")}
    clients = ledger["clients"]["clients"]
    assert clients, ledger["clients"]
    for c, entry in clients.items():
        n = int(fed.sizes[int(c)])
        acc = RdpAccountant()
        for t in entry["rounds"]:
            g = dp_accounting.GaussianDpEvent(sigma_of[t])
            acc.compose(dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(min(1.0, 8 / n), dp_accounting.ComposedDpEvent([g, g])), 1))
        assert ledger["per_client_epsilon"][c] == pytest.approx(acc.get_epsilon(sc.privacy.delta), rel=1e-6)
        assert ledger["per_client_epsilon"][c] <= 1.0  # the budget: a client stops before it would pass it
    assert summary["epsilon"] == pytest.approx(max(ledger["per_client_epsilon"].values()))
    assert summary["record_level"] and summary["epsilon_claimed"] < summary["epsilon"]
    exhausted = [r for r in rows if "exhausted" in r["dropped"]]
    assert exhausted and all(r["dropped"]["exhausted"] == {"training": len(r["dropped_clients"]["exhausted"])}
                             for r in exhausted)
    assert summary["stop_reason"] in ("privacy_budget_exhausted", "completed")


def test_fu_as_published_stops_on_the_claim_and_its_ledger_books_more(ray_session, tmp_path):
    """stop_on: claimed is the paper's own stop (eq. 10, gradient only): every client ends within the
    budget by its claim, while the ledger, which counts the norm query too, passes it. With
    optimizer_state: client, each client's Adam moments come back to it round after round: the
    checkpoint holds as many Adam steps for a client as it uploaded lots."""
    sc = _fu()
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"rounds": 30}), "privacy": sc.privacy.model_copy(
        update={"adap_dpfl": sc.privacy.adap_dpfl.model_copy(update={"stop_on": "claimed",
                                                                      "optimizer_state": "client"})}),
        "output": sc.output.model_copy(update={"eval_every": 100})})
    fed, summary, rows, ledger = _run(sc, tmp_path / "fu_claimed")
    assert summary["stop_on"] == "claimed" and summary["stop_reason"] == "privacy_budget_exhausted"
    # no round was evaluated (eval_every 100): the budget's stop evaluates the final model itself
    assert all(r["test_accuracy"] is None for r in rows)
    assert summary["final_evaluated_round"] == summary["rounds_completed"] == len(rows)
    assert 0 <= summary["final_accuracy"] <= 1 and summary["final_loss"] > 0
    assert summary["epsilon_claimed"] <= 1.0 < summary["epsilon"]
    assert any("exhausted" in r["dropped"] for r in rows)
    assert max(ledger["per_client_epsilon"].values()) == pytest.approx(summary["epsilon"])
    kept = read_checkpoint(tmp_path / "fu_claimed")["algorithm"]["adam_states"]
    assert {c: s["step"] for c, s in kept.items()} == {c: len(e["rounds"]) for c, e in ledger["clients"]["clients"].items()}


def test_fu_with_a_server_adam_steps_once_a_round_and_checkpoints_its_moments(ray_session, tmp_path):
    """optimizer_state: server: the clients release their noisy gradients, the server's one Adam steps
    on their mean every round that has a survivor, and its moments live in the checkpoint."""
    sc = _fu(budget=50.0, beta=None, partition={"kind": "iid"})
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"rounds": 3}), "privacy": sc.privacy.model_copy(
        update={"adap_dpfl": sc.privacy.adap_dpfl.model_copy(update={"optimizer_state": "server"})})})
    _, summary, rows, _ = _run(sc, tmp_path / "fu_server")
    assert summary["optimizer_state"] == "server" and summary["rounds_completed"] == 3
    assert [r["survived"] for r in rows] == [20, 20, 20]
    state = read_checkpoint(tmp_path / "fu_server")["algorithm"]
    assert state["server_adam"]["step"] == 3 and not state["adam_states"]


def test_the_validation_split_is_evaluated_every_round_only_for_an_algorithm_that_reads_it(ray_session, tmp_path):
    """Fu's noise decay (beta set) reads the validation loss after every round; with a constant
    sigma nothing does, and the split is evaluated with the test split, every eval_every rounds."""
    for beta, every_round in ((0.9, True), (None, False)):
        sc = _fu(budget=50.0, beta=beta, partition={"kind": "iid"})
        sc = sc.model_copy(update={"training": sc.training.model_copy(update={"rounds": 3}),
                                   "output": sc.output.model_copy(update={"eval_every": 2})})
        _, _, rows, _ = _run(sc, tmp_path / f"beta_{beta}")
        with_loss = [r["round"] for r in rows if "validation_loss" in r]
        assert with_loss == ([1, 2, 3] if every_round else [2, 3]), (beta, with_loss)
        assert all(r["validation_loss"] > 0 for r in rows if "validation_loss" in r)


def test_a_validation_split_from_the_test_split_is_what_eq9_reads(ray_session, tmp_path):
    """data.validation_from: test: every training example is a client's, eq. 9 reads the loss on the
    held-out part of the test split, and test accuracy is the final model's on the rest."""
    from dpfl_ray.training.models import build_model, evaluate

    sc = _fu(budget=50.0, beta=0.9, partition={"kind": "iid"})
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"rounds": 2}),
                               "data": sc.data.model_copy(update={"validation_from": "test",
                                                                  "validation_fraction": 0.3}),
                               "output": sc.output.model_copy(update={"eval_every": 1})})
    fed, summary, rows, _ = _run(sc, tmp_path / "valtest")
    assert int(fed.sizes.sum()) == len(fed.dataset.y_train) and len(fed.validation) == 0
    x_val, y_val = fed.validation_split()
    assert len(y_val) and len(fed.dataset.y_test)
    model = build_model(sc.model, fed.dataset.input_shape, fed.dataset.num_classes, sc.seed)
    model.load_state_dict(torch.load(tmp_path / "valtest" / "model.pt"))
    assert rows[-1]["validation_loss"] == pytest.approx(evaluate(model, x_val, y_val)[1], rel=1e-5)
    acc, loss = evaluate(model, fed.dataset.x_test, fed.dataset.y_test)
    assert (rows[-1]["test_accuracy"], rows[-1]["test_loss"]) == pytest.approx((acc, loss), rel=1e-5)
    assert summary["final_accuracy"] == pytest.approx(acc)


def test_a_checkpoint_read_while_rounds_run_is_the_state_of_one_committed_round(ray_session):
    """The driver reads checkpoints while the coordinator's next round runs. Fu's noise decay makes
    every round's event new, so a ledger copied from the live algorithm mid-round would hold the next
    round (or fail: 'dictionary changed size during iteration'). Every checkpoint's algorithm ledgers
    cover exactly its committed rounds."""
    import ray

    from dpfl_ray.runtime.coordinator import make_coordinator
    from dpfl_ray.runtime.driver import put_federation

    sc = _fu(budget=50.0, beta=0.999, partition={"kind": "iid"})
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"rounds": 8}),
                               "output": sc.output.model_copy(update={"eval_every": 100})})
    coord = make_coordinator(sc, put_federation(build_federation(sc)))
    run_ref = coord.run.remote()
    seen, events = set(), 0
    while not ray.wait([run_ref], timeout=0)[0]:
        # as the driver does: asking for the events after those read says they are written, which
        # lets each round's listed releases go ahead (Coordinator._await_listings)
        events += len(ray.get(coord.events.remote(events), timeout=120))
        state = ray.get(coord.checkpoint.remote(), timeout=120)
        ledgers = state["algorithm"]["ledgers"]["clients"]
        assert all(max(entry["rounds"], default=-1) < state["round"] for entry in ledgers.values()), state["round"]
        booked = sum(sum(entry["counts"].values()) for entry in ledgers.values())
        assert booked == 20 * state["round"], (booked, state["round"])  # every client trains every round
        assert len(state["algorithm"]["validation_losses"]) == state["round"]
        seen.add(state["round"])
        time.sleep(0.05)  # many reads a round, without starving the round's own thread of the lock
    assert ray.get(run_ref, timeout=120)["stop_reason"] == "completed"
    assert len(seen) >= 3, seen  # the reads fell between several different rounds


def test_huang_spends_within_each_budget(ray_session, tmp_path):
    sc = tiny_scenario(training={"algorithm": "huang2020", "rounds": 3},
                       sampling={"mode": "fixed", "clients_per_round": 20},
                       privacy={"accountant": "rdp", "delta": 1e-3, "clipping": {"norm": 0.05},
                                "huang2020": {"category_budgets": [0.05, 0.1, 0.2, 0.4],
                                              "step_sizes": [0.5, 2.0]}},
                       output={"client_accuracy": True})
    fed, summary, rows, ledger = _run(sc, tmp_path / "huang")
    alg = make_algorithm(sc, fed.weights, sizes=fed.sizes)
    spent = {int(c): v for c, v in ledger["budget_spent"].items()}
    assert spent and all(v <= alg.budget_of[c] + 1e-12 for c, v in spent.items())
    assert summary["epsilon_claimed"] == pytest.approx(max(spent.values()))
    # each round a client trained in books the bound on any path DPAGD could take with eps_k / T, not
    # the path its picks took (huang2020_core.round_dp_events): dp_accounting over those events
    for c, entry in ledger["clients"]["clients"].items():
        acc = RdpAccountant()
        for event, count in round_dp_events(alg.config, alg.budget_of[int(c)] / 3):
            acc.compose(event, count * len(entry["rounds"]))
        assert ledger["per_client_epsilon"][c] == pytest.approx(acc.get_epsilon(1e-3), rel=1e-6)
    assert len(rows) == 3 and all(r["sampled"] == 20 for r in rows)
    # Fig. 7: each surviving user's own model in the last round, grouped by its budget category
    assert all("client_accuracy" not in r for r in rows[:-1])
    per_client = rows[-1]["client_accuracy"]["per_client"]
    assert len(per_client) == rows[-1]["survived"] > 0
    by_group = summary["client_accuracy"]["by_group"]
    assert list(by_group) == [f"eps_k={b:g}" for b in (0.05, 0.1, 0.2, 0.4)
                              if any(alg.budget_of[int(c)] == b for c in per_client)]
    for label, stats in by_group.items():
        mine = [a for c, a in per_client.items() if f"eps_k={alg.budget_of[int(c)]:g}" == label]
        assert stats["clients"] == len(mine) and stats["mean"] == pytest.approx(sum(mine) / len(mine))
    assert "per_client" not in summary["client_accuracy"]


def test_a_lone_clients_own_model_is_the_next_global_model(ray_session, tmp_path):
    # FedAvg with one client per round and server_lr 1 moves the global model to that client's own
    # model, so the client's accuracy is the run's final accuracy, evaluated the same way
    sc = tiny_scenario(training={"rounds": 2}, sampling={"mode": "fixed", "clients_per_round": 1},
                       output={"client_accuracy": True})
    _, summary, rows, _ = _run(sc, tmp_path / "lone")
    ((_, acc),) = rows[-1]["client_accuracy"]["per_client"].items()
    assert acc == pytest.approx(summary["final_accuracy"], abs=1e-9)
    assert summary["client_accuracy"]["clients"] == 1 and "by_group" not in summary["client_accuracy"]


def test_algorithm_state_round_trips_through_a_checkpoint():
    sc = _fu()
    fed = build_federation(sc)
    a = make_algorithm(sc, fed.weights, sizes=fed.sizes)
    a.clips, a.sigma, a.validation_losses = {3: 0.7}, 1.5, [2.0, 1.9]
    a.ledgers.record(3, dp_accounting.GaussianDpEvent(2.0), 2)
    b = make_algorithm(sc, fed.weights, sizes=fed.sizes)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.clips, b.sigma, b.validation_losses) == ({3: 0.7}, 1.5, [2.0, 1.9])
    assert b.ledgers.epsilon(3) == a.ledgers.epsilon(3)


def test_two_os_runs_of_one_seed_train_different_models(ray_session, tmp_path):
    """``privacy.randomness: os`` reaches the workers' local procedure (DPAGD's noise and arg-max)."""
    sc = tiny_scenario(training={"algorithm": "huang2020", "rounds": 1},
                       sampling={"mode": "fixed", "clients_per_round": 2},
                       privacy={"accountant": "rdp", "delta": 1e-3, "clipping": {"norm": 0.05}, "randomness": "os",
                                "huang2020": {"category_budgets": [0.2], "step_sizes": [0.5, 2.0]}})
    runs = [_run(sc, tmp_path / d) for d in ("a", "b")]
    assert [summary["randomness"] for _, summary, _, _ in runs] == ["os", "os"]
    # a budget for several DPAGD iterations: a run whose clients all rejected every step would leave
    # the model as it started whatever the randomness (at a tenth of it a client takes 0 or 1 steps)
    assert all(rows[0]["dpagd_steps_mean"] >= 1 for _, _, rows, _ in runs), [rows for _, _, rows, _ in runs]
    a, b = (torch.load(tmp_path / d / "model.pt") for d in ("a", "b"))
    assert any(not torch.equal(a[k], b[k]) for k in a)
