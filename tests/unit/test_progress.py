"""The live line of `dpfl run` (README: round i/T, ETA, test accuracy, epsilon, survivors), fed the
coordinator's events as the driver passes them on, and rendered as a terminal shows it."""
import io

from rich.console import Console

import cli.run as run_cli


def _line(monkeypatch, events, total=10) -> str:
    console = Console(file=io.StringIO(), width=200, force_terminal=False, color_system=None)
    monkeypatch.setattr(run_cli, "console", console)
    progress = run_cli._progress()
    task = progress.add_task("rounds", total=total, status="starting workers")
    on_event = run_cli._on_event(progress, task)
    for ev in events:
        on_event(ev)
    with console.capture() as captured:
        console.print(progress.make_tasks_table(progress.tasks))
    return " ".join(captured.get().split())  # the count is right-aligned, the bar is blank without a terminal


def test_the_line_shows_round_eta_accuracy_survivors_and_epsilon(monkeypatch):
    events = [{"event": "start", "workers": 2},
              {"event": "round", "round": 3, "test_accuracy": 0.8125, "test_loss": 0.5, "survived": 9, "sampled": 10,
               "epsilon": 1.23456, "epsilon_claimed": 1.0}]
    line = _line(monkeypatch, events)
    assert line.startswith("round 3/10") and "ETA" in line, line
    assert line.endswith("acc 0.8125 loss 0.5000 survived 9/10 eps 1.235 (claimed 1.000)"), line


def test_a_round_between_evaluations_shows_the_last_evaluated_round(monkeypatch):
    events = [{"event": "round", "round": 4, "test_accuracy": 0.5, "test_loss": 1.0, "survived": 5, "sampled": 5},
              {"event": "round", "round": 5, "test_accuracy": None, "survived": 4, "sampled": 5,
               "epsilon": None, "epsilon_nominal": 2.0}]
    line = _line(monkeypatch, events)
    assert line.startswith("round 5/10"), line
    assert line.endswith("acc 0.5000 loss 1.0000 (round 4) survived 4/5 eps n/a (nominal 2.000)"), line


def test_before_the_first_round_the_line_says_how_many_workers(monkeypatch):
    line = _line(monkeypatch, [{"event": "start", "workers": 3}])
    assert line.startswith("round 0/10") and line.endswith("3 workers"), line
