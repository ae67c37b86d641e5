"""``dpfl bench``: measured costs, each next to a baseline timed in the same process."""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .common import console, err_console, fail, folder_option, interrupt, user_errors

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
    return _VECTOR_COPIES * clients * dim * (8 if bits > 32 else 4) + clients * partners * _BYTES_PER_PAIR


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
    bits: int = typer.Option(32, "--bits", help="the ring Z_2^bits: 8-32, or 64"),
    noise: str = typer.Option("none", "--noise", help="none | skellam | discrete_gaussian: the clients' vectors "
                              "are model updates carrying integer noise in Z_2^bits (distributed DP, "
                              "docs/distributed_dp.md), timed beside the continuous Gaussian in 32-bit fixed point"),
    seed: int = typer.Option(0, "--seed", min=0),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Time one secure aggregation (real keys, real masks) and the same sum in plain NumPy; with
    --noise, the whole distributed-DP round (encode, secure sum, decode) at --bits beside the
    continuous Gaussian at 32 bits."""
    import numpy as np

    from dpfl_ray.secagg import PHASES, secure_sum
    from dpfl_ray.secagg.config import BITS

    if protocol not in ("secagg", "secagg+"):
        fail(f"--protocol: {protocol!r} is not secagg or secagg+")
    if phase not in PHASES:
        fail(f"--phase: {phase!r} is not one of {', '.join(PHASES)}")
    if not 0 <= dropout < 1:
        fail(f"--dropout: {dropout} is outside [0, 1)")
    if clients < 2 or dim < 1:
        fail("--clients must be >= 2 and --dim >= 1")
    if bits not in BITS:
        fail(f"--bits: {bits} is not 8-32 or 64")
    if noise not in ("none", "skellam", "discrete_gaussian"):
        fail(f"--noise: {noise!r} is not none, skellam or discrete_gaussian")
    if noise != "none" and bits > 32:
        fail(f"--bits: integer noise needs a ring of 8-32 bits, got {bits}")
    need, available = _memory_need(clients, dim, bits, protocol), _available_memory()
    if available is not None and need > available:
        fail(f"--clients/--dim: {clients:,} clients x {dim:,} (uint{bits}, {protocol}) need about "
             f"{need / 2**30:,.1f} GiB, but {max(available, 0) / 2**30:,.1f} GiB is available")
    rng = np.random.default_rng(seed)
    drops = {int(u): phase for u in rng.choice(clients, size=int(round(dropout * clients)), replace=False)}
    if noise != "none":
        _distributed_dp_round(noise, bits, clients, dim, drops, protocol, seed, as_json)
        return
    dtype = np.uint32 if bits <= 32 else np.uint64
    vectors = [rng.integers(0, (1 << bits) - 1, size=dim, dtype=dtype, endpoint=True) for _ in range(clients)]
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


def _distributed_dp_round(noise: str, bits: int, clients: int, dim: int, drops: dict, protocol: str, seed: int,
                          as_json: bool) -> None:
    """One distributed-DP round of unit-norm updates at z = 1 (noise std 2C on the sum, C = 1): each
    client rotates, scales, rounds and noises its update into Z_2^bits (issue #36), SecAgg sums the
    words in that ring, the server decodes; beside it the continuous Gaussian's round, each client's
    share N(0, (2C)^2 / clients) in 32-bit fixed point (scale 2^16). Both time the same steps."""
    import hashlib
    import math

    import numpy as np

    from dpfl_ray.algorithms.baek import ROUNDING_BETA
    from dpfl_ray.privacy.discrete import draw
    from dpfl_ray.privacy.discrete_rdp import plan_ring, rounded_l2_bound
    from dpfl_ray.secagg import decode, encode, secure_sum
    from dpfl_ray.secagg.config import word_dtype
    from dpfl_ray.secagg.ring import conditional_round, decode_sum, rotate, rotation_signs, to_ring

    rng = np.random.default_rng(seed)
    updates = rng.standard_normal((clients, dim))
    updates /= np.linalg.norm(updates, axis=1, keepdims=True)
    std = 2.0  # 2Cz on the sum, C = 1, z = 1
    plan = plan_ring(noise, bits, clients, dim, 1.0, std, 2.0, 1e-4, ROUNDING_BETA)
    rotation_seed = hashlib.sha256(f"bench|{seed}".encode()).digest()
    signs = rotation_signs(rotation_seed, dim)
    bound = rounded_l2_bound(plan.scale, plan.event.dim, ROUNDING_BETA)
    rows = []

    def one(label: str, ring_bits: int, encode_one, decode_sum) -> None:
        start = time.perf_counter()
        words = [encode_one(u) for u in updates]
        encode_s = time.perf_counter() - start
        start = time.perf_counter()
        result = secure_sum(words, bits=ring_bits, protocol=protocol, dropouts=drops, graph_seed=seed)
        secagg_s = time.perf_counter() - start
        start = time.perf_counter()
        released = decode_sum(result.sum)
        decode_s = time.perf_counter() - start
        error = released - updates[list(result.survivors)].sum(axis=0)
        live = [b for u, b in result.bytes_per_client.items() if u in result.survivors]
        rows.append({"noise": label, "bits": ring_bits, "survivors": len(result.survivors),
                     "encode_seconds": round(encode_s, 3), "secagg_seconds": round(secagg_s, 3),
                     "decode_seconds": round(decode_s, 4), "total_seconds": round(encode_s + secagg_s + decode_s, 3),
                     "bytes_per_surviving_client": int(np.mean(live)) if live else 0,
                     "noise_std_per_coordinate": round(float(np.std(error)), 4)})

    def integer_words(u):
        ints = conditional_round(rotate(u * plan.scale, signs), rng, bound)
        return to_ring(ints + draw(noise, rng, plan.local_variance, ints.size), bits).astype(word_dtype(bits))

    one(noise, bits, integer_words, lambda total: decode_sum(total, bits, plan.scale, rotation_seed, dim))
    share_std = std / math.sqrt(clients)
    one("gaussian", 32, lambda u: encode(u + rng.normal(0.0, share_std, dim), bits=32, scale=2.0 ** 16,
                                          n_summands=clients, rng=rng).data,
        lambda total: decode(total, bits=32, scale=2.0 ** 16))
    report = {"protocol": protocol, "clients": clients, "dim": dim, "padded_dim": plan.event.dim,
              "dropped": len(drops), "ring_scale": plan.scale, "wrap_bound": plan.wrap_probability, "rows": rows}
    if as_json:
        print(json.dumps(report))
        return
    table = Table("noise", "bits", "encode s", "secure sum s", "decode s", "total s", "B per surviving client",
                  "noise std / coord", title=f"distributed DP, {protocol}: {clients} clients x {dim} "
                                             f"(padded {plan.event.dim}), {len(drops)} dropped, z = 1")
    for r in rows:
        table.add_row(r["noise"], str(r["bits"]), f"{r['encode_seconds']:.3f}", f"{r['secagg_seconds']:.3f}",
                      f"{r['decode_seconds']:.4f}", f"{r['total_seconds']:.3f}", f"{r['bytes_per_surviving_client']:,}",
                      f"{r['noise_std_per_coordinate']:.4f}")
    console.print(table)
    a, b = rows
    console.print(f"{a['noise']} at {a['bits']} bits: {a['total_seconds'] / max(b['total_seconds'], 1e-9):.2f}x the "
                  f"time and {a['bytes_per_surviving_client'] / max(b['bytes_per_surviving_client'], 1):.2f}x the bytes "
                  f"of the continuous Gaussian at 32 bits; planned noise std on the sum 2 x sqrt(survivors / "
                  f"clients) = {std * math.sqrt(a['survivors'] / clients):.4f}", highlight=False)


# -- workloads against the compute floor (issue 14) -------------------------------------------------------
def _fmt(stat: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    """'median [min-max]' of a stats entry, or '-'."""
    if not stat:
        return "-"
    med, lo, hi = (stat[k] * scale for k in ("median", "min", "max"))
    if stat["n"] == 1 or lo == hi:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


@app.command("workloads")
def list_workloads() -> None:
    """List the fixed workloads of `dpfl bench run`."""
    from benchmarks.workloads import VARIANTS, WORKLOADS

    table = Table("workload", "what")
    for name, w in WORKLOADS.items():
        table.add_row(name, w["description"])
    for name, (_, _, what) in VARIANTS.items():
        table.add_row(name, what)
    console.print(table)


@app.command("run")
@user_errors
def run_workloads(
    workloads: list[str] = typer.Argument(None, help="workload names (default: W1 W2); see `dpfl bench workloads`"),
    repeat: int = typer.Option(1, "--repeat", help="runs of each; reports the median, min and max"),
    set_: list[str] = typer.Option([], "--set", help="override a scenario field of every workload (repeatable)"),
    timeout: float = typer.Option(1200.0, "--timeout", min=1, help="seconds allowed to each subprocess"),
    floor: bool = typer.Option(True, "--floor/--no-floor", help="also time the 1-thread PyTorch floor"),
    keep: Optional[Path] = typer.Option(None, "--keep", parser=folder_option, help="keep the runs' directories and report.json under this folder"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Run workloads through `dpfl run` and through the compute floor, each in its own process:
    training and whole-process time (Ray start-up, worker start-up and tear-down apart), client
    updates per second, peak RSS of every process, and the ratio dpfl/floor."""
    from benchmarks.harness import measure

    names = list(workloads) if workloads else ["W1", "W2"]

    def progress(kind: str, s: dict) -> None:
        if not as_json:
            state = "ok" if s.get("rc") == 0 else f"FAILED ({s.get('error', s.get('rc'))})"
            console.print(f"  {s['workload']} {kind}: train {s.get('train_seconds', 0):.2f}s, process "
                          f"{s.get('process_seconds', 0):.2f}s {state}", highlight=False)

    previous = signal.signal(signal.SIGTERM, interrupt)  # as Ctrl-C: the runs in flight and a Ray head are stopped
    try:
        report = measure(names, repeat, set_, timeout, floor, keep, on_sample=progress)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if as_json:
        print(json.dumps(report))
        return
    _print_report(report)


_ROWS = (  # (label, stats key, scale, digits)
    ("training s", "train_seconds", 1, 2), ("  of which evaluation s", "eval_seconds", 1, 2),
    ("  of which accounting s", "account_seconds", 1, 2),
    ("  of which release listing s", "listing_seconds", 1, 2),
    ("  of which slowest worker s", "worker_seconds", 1, 2),
    ("whole process s", "process_seconds", 1, 2),
    ("  imports + data s", "imports_and_data_seconds", 1, 2), ("  Ray start-up s", "ray_startup_seconds", 1, 2),
    ("  worker start-up s", "worker_startup_seconds", 1, 2), ("  finish (files, plots) s", "finish_seconds", 1, 2),
    ("  tear-down s", "teardown_seconds", 1, 2), ("client updates / s", "updates_per_second", 1, 0),
    ("SecAgg share of round time %", "secagg_share", 100, 0),
    ("peak RSS driver MB", "peak_rss_bytes.driver", 1e-6, 0),
    ("peak RSS coordinator MB", "peak_rss_bytes.coordinator", 1e-6, 0),
    ("peak RSS worker (max) MB", "peak_rss_bytes.workers", 1e-6, 0),
    ("peak RSS Ray daemons (max) MB", "peak_rss_bytes.ray_system", 1e-6, 0),
)


def _print_report(report: dict) -> None:
    """One column per workload: dpfl's numbers, the floor's, and their ratios."""
    from rich.markup import escape

    names = list(report["workloads"])
    derived = any(s.get("phases_derived") for w in report["workloads"].values() for s in w["dpfl"]["samples"])
    table = Table("", *names, title=escape(f"dpfl bench: median [min-max] of {report['repeat']}"),
                  caption="start-up phases derived from file times" if derived else None)
    stats = {n: w["dpfl"]["stats"] for n, w in report["workloads"].items()}
    floors = {n: w.get("floor", {}).get("stats", {}) for n, w in report["workloads"].items()}
    for label, key, scale, digits in _ROWS:
        if any(stats[n].get(key) for n in names):
            table.add_row(label, *(escape(_fmt(stats[n].get(key), scale, digits)) for n in names))
    if any(floors.values()):
        table.add_section()
        for label, key, scale, digits in (("floor: training s", "train_seconds", 1, 2),
                                          ("floor: whole process s", "process_seconds", 1, 2),
                                          ("floor: peak RSS MB", "peak_rss_bytes.floor", 1e-6, 0)):
            table.add_row(label, *(escape(_fmt(floors[n].get(key), scale, digits)) for n in names))
        table.add_section()
        for label, key in (("dpfl / floor: training", "train"), ("  training without evaluation", "train_without_eval"),
                           ("dpfl / floor: whole process", "process")):
            vals = [report["workloads"][n].get("ratio", {}).get(key) for n in names]
            if key == "train_without_eval" and not any(vals):
                continue
            table.add_row(f"[bold]{label}", *(f"[bold]{v:.2f}" if v else "-" for v in vals))
    console.print(table)
    for name, w in report["workloads"].items():
        for s in w["dpfl"]["samples"] + w.get("floor", {}).get("samples", []):
            if s.get("rc") != 0:
                err_console.print(f"[bold red]{name}: a run failed:[/] {escape(str(s.get('error')))}")
    m = report["machine"]
    probe = m.get("probe") or {}
    speed = (f"; one thread: a 2e6-step Python loop {probe['python_loop_s']:.3f} s, 200 256x256 products "
             f"{probe['torch_matmul_s']:.3f} s" if probe else "")
    console.print(f"{report['date']}, {m['host']} ({m.get('cpu_model', m.get('processor'))}): {m['cpus']} CPUs, "
                  f"torch {m['torch']}, load average {m['load_average_1m']:.1f} at the start{speed}", highlight=False)


@app.command("local")
@user_errors
def local_paths(
    model: str = typer.Option("cnn", "--model", help="cnn | mlp | logistic"),
    clients: int = typer.Option(5, "--clients", help="clients trained per call (K)"),
    examples: int = typer.Option(50, "--examples", help="examples per client"),
    batch_size: int = typer.Option(10, "--batch-size"),
    epochs: int = typer.Option(1, "--epochs"),
    repeats: int = typer.Option(10, "--repeats"),
    data: str = typer.Option("mnist5k", "--data", help="mnist5k | random | PATH.npz"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Time K clients' local updates one after another and as one batched computation (the stacked
    network, and vmap for comparison), in this process with one thread.
    W1-like: --examples 50 --batch-size 10 --clients 5; W2-like: --examples 5 --batch-size 5 --clients 50."""
    import torch

    from benchmarks.microbatch import time_paths

    if model not in ("cnn", "mlp", "logistic"):
        fail(f"--model: {model!r} is not cnn, mlp or logistic")
    if min(clients, examples, batch_size, epochs, repeats) < 1:
        fail("--clients, --examples, --batch-size, --epochs and --repeats must be >= 1")
    torch.set_num_threads(1)
    r = time_paths(model, clients, examples, batch_size, epochs, repeats, data=data)
    if as_json:
        print(json.dumps(r))
        return
    table = Table("path", "median ms", "min ms", "max |diff| to sequential",
                  title=f"{model}: {clients} clients x {examples} examples, B={batch_size}, E={epochs}, 1 thread")
    for name in ("sequential", "batched", "batched_vmap", "batched_vmap_own_pool"):
        table.add_row(name, f"{r['seconds_median'][name] * 1e3:.1f}", f"{r['seconds_min'][name] * 1e3:.1f}",
                      f"{r['max_abs_diff_to_sequential'][name]:.1e}")
    console.print(table)
    console.print(f"batched / sequential: {r['ratio_batched_to_sequential']:.2f} (median of {repeats})")
