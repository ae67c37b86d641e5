"""Evaluation cut into fixed row ranges, without torch (the coordinator imports this, not models).

Evaluation runs in fixed row ranges of the split, whoever evaluates them: the pool shares them out
(runtime.resources.deal), each range is one forward pass (models.shard_sums), and the sums are added
in range order here, so the figures are the same for any pool size, and the same as
models.evaluate() in one process.
"""
from __future__ import annotations

EVAL_SHARD_ROWS = 500


def eval_shards(n: int, rows: int = EVAL_SHARD_ROWS) -> list[tuple[int, int]]:
    """The row ranges [lo, hi) that evaluation of ``n`` examples is cut into."""
    return [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]


def combine_shards(sums: list[tuple[int, float]], n: int) -> tuple[float, float]:
    """Accuracy and mean loss from per-range sums, added in range order."""
    correct, loss = 0, 0.0
    for c, l in sums:
        correct, loss = correct + c, loss + l
    return correct / n, loss / n
