"""summary.json's final figures: the last evaluated round's, and which round that was when it is not
the last committed one (a run stopped between two evaluations of output.eval_every)."""
from dpfl_ray.runtime.driver import final_figures


def test_the_last_evaluated_round_gives_the_figures_and_is_named_when_it_is_not_the_last():
    rows = [{"round": 1, "test_accuracy": None, "test_loss": None},
            {"round": 2, "test_accuracy": 0.61, "test_loss": 1.2},
            {"round": 3, "test_accuracy": None, "test_loss": None}]
    assert final_figures(rows) == {"final_accuracy": 0.61, "final_loss": 1.2, "final_evaluated_round": 2}
    assert final_figures(rows[:2]) == {"final_accuracy": 0.61, "final_loss": 1.2}  # the last round's own


def test_no_evaluated_round_gives_no_figures():
    assert final_figures([]) == {"final_accuracy": None, "final_loss": None}
    assert final_figures([{"round": 1, "test_accuracy": None, "test_loss": None}]) == \
        {"final_accuracy": None, "final_loss": None}
