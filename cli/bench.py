"""``dpfl bench``: measured costs, each next to a baseline timed in the same process."""
from __future__ import annotations

import json
import time

import typer
from rich.table import Table

from .common import console, fail, user_errors

app = typer.Typer(help="Benchmarks (each reported next to a baseline measured in the same run).",
                  no_args_is_help=True)

# Measured on `bench secagg` runs of 20-80 clients: ~210 B of shares per client pair on the wire,
# held as Python objects several times that size; the vectors exist ~5 times (inputs, ring copies,
# masked inputs, the server's sum and the plain baseline's stack).
_BYTES_PER_PAIR = 1024
_VECTOR_COPIES = 5


def _memory_need(clients: int, dim: int, bits: int, protocol: str) -> int:
    """Bytes one ``secure_sum`` of this size holds at its peak (an estimate that errs high)."""
    from dpfl_ray.secagg.graph import secagg_plus_degree

    partners = clients - 1 if protocol == "secagg" else min(clients - 1, secagg_plus_degree(clients))
    return _VECTOR_COPIES * clients * dim * (bits // 8) + clients * partners * _BYTES_PER_PAIR


def _available_memory() -> int | None:
    """The least of: free memory, the address-space limit (ulimit -v) left, the cgroup's limit left."""
    import resource

    limits = []
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            used = next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmSize:"))
            limits.append(soft - used)
        cgroup = open("/sys/fs/cgroup/memory.max").read().strip()
        if cgroup != "max":
            limits.append(int(cgroup) - int(open("/sys/fs/cgroup/memory.current").read()))
    except (OSError, ValueError, StopIteration):
        pass  # not Linux, or no cgroup v2: check what could be read
    return min(limits) if limits else None


@app.command()
@user_errors
def secagg(
    clients: int = typer.Option(100, "--clients", help="clients in the round"),
    dim: int = typer.Option(100_000, "--dim", help="vector length"),
    dropout: float = typer.Option(0.3, "--dropout", help="fraction of clients that drop"),
    phase: str = typer.Option("masked_input", "--phase", help="advertise | share | masked_input | unmask"),
    protocol: str = typer.Option("secagg", "--protocol", help="secagg | secagg+"),
    bits: int = typer.Option(32, "--bits", help="32 or 64"),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Time one secure aggregation (real keys, real masks) and the same sum in plain NumPy."""
    import numpy as np

    from dpfl_ray.secagg import PHASES, secure_sum

    if protocol not in ("secagg", "secagg+"):
        fail(f"--protocol: {protocol!r} is not secagg or secagg+")
    if phase not in PHASES:
        fail(f"--phase: {phase!r} is not one of {', '.join(PHASES)}")
    if not 0 <= dropout < 1:
        fail(f"--dropout: {dropout} is outside [0, 1)")
    if clients < 2 or dim < 1:
        fail("--clients must be >= 2 and --dim >= 1")
    if bits not in (32, 64):
        fail(f"--bits: {bits} is not 32 or 64")
    need, available = _memory_need(clients, dim, bits, protocol), _available_memory()
    if available is not None and need > available:
        fail(f"--clients/--dim: {clients:,} clients x {dim:,} (uint{bits}, {protocol}) need about "
             f"{need / 2**30:,.1f} GiB, but {max(available, 0) / 2**30:,.1f} GiB is available")
    rng = np.random.default_rng(seed)
    dtype = np.uint32 if bits == 32 else np.uint64
    vectors = [rng.integers(0, np.iinfo(dtype).max, size=dim, dtype=dtype, endpoint=True) for _ in range(clients)]
    drops = {int(u): phase for u in rng.choice(clients, size=int(round(dropout * clients)), replace=False)}
    start = time.perf_counter()
    result = secure_sum(vectors, bits=bits, protocol=protocol, dropouts=drops, graph_seed=seed)
    secure_seconds = time.perf_counter() - start
    included = result.survivors
    start = time.perf_counter()
    plain = np.sum(np.stack([vectors[u] for u in included]), axis=0, dtype=dtype)
    plain_seconds = time.perf_counter() - start
    if not np.array_equal(plain, result.sum):
        fail("secure sum differs from the plain sum: this is a bug", code=1)
    live = [b for u, b in result.bytes_per_client.items() if u in included]
    report = {
        "protocol": protocol, "clients": clients, "dim": dim, "bits": bits, "dropout": dropout, "phase": phase,
        "survivors": len(included), "exact": True,
        "secagg_seconds": round(secure_seconds, 3), "plain_numpy_seconds": round(plain_seconds, 5),
        "ratio_to_plain": round(secure_seconds / max(plain_seconds, 1e-9), 1),
        "seconds_by_phase": {k: round(v, 3) for k, v in result.seconds_by_phase.items()},
        "bytes_per_surviving_client": int(np.mean(live)) if live else 0,
        "server_bytes_received": result.server_bytes_received, "server_bytes_sent": result.server_bytes_sent,
        "plain_bytes_per_client": dim * bits // 8,
    }
    if as_json:
        print(json.dumps(report))
        return
    table = Table("phase", "seconds", title=f"{protocol}: {clients} clients x {dim} (uint{bits}), "
                                           f"{len(drops)} drop at {phase}")
    for k, v in report["seconds_by_phase"].items():
        table.add_row(k, f"{v:.3f}")
    table.add_row("[bold]total secure sum", f"[bold]{secure_seconds:.3f}")
    table.add_row("plain NumPy sum (baseline)", f"{plain_seconds:.4f}")
    console.print(table)
    console.print(f"exact: yes; {len(included)} inputs summed; {report['ratio_to_plain']}x the plain sum's time; "
                  f"{report['bytes_per_surviving_client']:,} B sent per surviving client "
                  f"(plain upload {report['plain_bytes_per_client']:,} B); server received "
                  f"{report['server_bytes_received']:,} B")
