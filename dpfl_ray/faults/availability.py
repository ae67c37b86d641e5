"""Availability traces (docs/faults.md): which device is offline in which round, read from a CSV
``client_id,round,available`` in the spirit of FedScale's device traces (Lai et al. 2022)."""
from __future__ import annotations

import csv
from pathlib import Path

from ..errors import DPFLError

TRACE_HEADER = ("client_id", "round", "available")
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def load_trace(path: str | Path, num_clients: int | None = None) -> frozenset[tuple[int, int]]:
    """The (round, client_id) pairs a CSV trace marks unavailable; rounds count from 1, as in
    rounds.jsonl, and a pair the trace does not list is available (after FedScale's device traces)."""
    path = Path(path)

    def bad(lineno: int, message: str) -> DPFLError:
        return DPFLError(f"{path} line {lineno}: {message}", field="faults.availability.trace")

    if not path.is_file():
        raise DPFLError(f"no trace file at {path}", field="faults.availability.trace")
    seen: dict[tuple[int, int], int] = {}
    unavailable = set()
    with open(path, newline="") as fh:
        rows = [(i, r) for i, r in enumerate(csv.reader(fh), 1) if r and not r[0].lstrip().startswith("#")]
    if not rows or tuple(c.strip().lower() for c in rows[0][1]) != TRACE_HEADER:
        raise bad(rows[0][0] if rows else 1, f"expected the header {','.join(TRACE_HEADER)}")
    for lineno, row in rows[1:]:
        if len(row) != 3:
            raise bad(lineno, f"expected 3 fields {','.join(TRACE_HEADER)}, got {len(row)}")
        client, round_no, avail = (c.strip() for c in row)
        if not client.isdigit():
            raise bad(lineno, f"client_id must be an integer >= 0 (got {client!r})")
        if not round_no.isdigit() or int(round_no) < 1:
            raise bad(lineno, f"round must be an integer >= 1 (got {round_no!r})")
        if avail.lower() not in _TRUE + _FALSE:
            raise bad(lineno, f"available must be 0/1/true/false (got {avail!r})")
        key = (int(round_no), int(client))
        if num_clients is not None and key[1] >= num_clients:
            raise bad(lineno, f"client {key[1]} does not exist (data.num_clients={num_clients})")
        if key in seen:
            raise bad(lineno, f"client {key[1]} round {key[0]} is listed twice (first on line {seen[key]})")
        seen[key] = lineno
        if avail.lower() in _FALSE:
            unavailable.add(key)
    return frozenset(unavailable)
