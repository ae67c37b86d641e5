"""``dpfl bench run``: a workload through ``dpfl run`` and through the floor, each in its own
process, with whole-process times, where they go, and each process's peak memory.

Training time is the sum of the rounds' ``seconds`` (rounds.jsonl). Where the run's summary.json
carries ``timestamps`` (epoch seconds: ray_init_start, ray_init_end, pool_start, pool_ready,
first_round_start, last_round_end, finish_end) the phases come from them; until then they are
derived from file times and the Ray processes' start times (``"phases_derived": true``). Peak RSS
is each process's VmHWM, read from /proc while the process tree runs.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
ROLES = ("driver", "coordinator", "workers", "ray_system", "floor")


# -- pure parts ---------------------------------------------------------------------------------------
def classify(cmdline: str, is_root: bool, root_role: str = "driver") -> str | None:
    """The role of a process of the run's tree from its command line (Ray renames its worker
    processes ``ray::<Actor>``); None when it tells nothing yet: an idle Ray worker, a process
    that is exiting (empty command line)."""
    if is_root:
        return root_role
    if not cmdline.strip():
        return None
    if cmdline.startswith("ray::"):
        actor = cmdline[5:].split(".")[0].split()[0] if len(cmdline) > 5 else ""
        return {"Coordinator": "coordinator", "ClientWorker": "workers", "IDLE": None}.get(actor, "ray_system")
    argv = cmdline.split()
    if len(argv) > 1 and argv[1].endswith("default_worker.py") or argv[0].endswith("default_worker.py"):
        return None  # a Ray worker process before it hosts an actor
    return "ray_system"


def stats(values) -> dict | None:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return {"median": float(np.median(vals)), "min": min(vals), "max": max(vals), "n": len(vals)}


def parse_rounds(rounds: list[dict]) -> dict:
    """Training time, client updates and the SecAgg share of round time from rounds.jsonl records.

    A client dropped before training did not run a local update; one dropped later did. The
    SecAgg share leaves out the advertise phase, which also holds the local training."""
    train = sum(float(r.get("seconds", 0.0)) for r in rounds)
    updates = sum(int(r.get("sampled", 0)) - int((r.get("dropped_by_phase") or {}).get("training", 0))
                  for r in rounds)
    out = {"rounds": len(rounds), "train_seconds": train, "client_updates": updates,
           "updates_per_second": updates / train if train > 0 else None}
    if any("eval_seconds" in r for r in rounds):  # the coordinator's test-set pass, which the floor does not make
        out["eval_seconds"] = sum(float(r.get("eval_seconds") or 0.0) for r in rounds)
        out["train_seconds_without_eval"] = train - out["eval_seconds"]
    if any("worker_seconds" in r for r in rounds):  # per round, the slowest worker's own compute
        out["worker_seconds"] = sum(float(r.get("worker_seconds") or 0.0) for r in rounds)
    if any("account_seconds" in r for r in rounds):  # the ledger's dp_accounting work, also server-side
        out["account_seconds"] = sum(float(r.get("account_seconds") or 0.0) for r in rounds)
    if any("listing_seconds" in r for r in rounds):  # the waits for releases.jsonl to hold each listing
        out["listing_seconds"] = sum(float(r.get("listing_seconds") or 0.0) for r in rounds)
    secagg = [r["secagg_seconds"] for r in rounds if r.get("secagg_seconds")]
    if secagg:
        protocol = sum(v for s in secagg for k, v in s.items() if k != "advertise")
        out["secagg_seconds"] = protocol
        out["secagg_share"] = protocol / train if train > 0 else None
        out["advertise_seconds"] = sum(s.get("advertise", 0.0) for s in secagg)
    return out


def derive_phases(t_start: float, t_end: float, train_seconds: float, *, timestamps: dict | None = None,
                  ray_start: float | None = None, run_start: float | None = None,
                  last_round_written: float | None = None, finish_end: float | None = None) -> dict:
    """Split a run's whole-process seconds into start-up, training, finishing and tear-down.

    With the run's own ``timestamps`` the split is exact. Otherwise: Ray starts with its first
    system process, the run with scenario.yaml, rounds run back to back and end when the last one
    reaches rounds.jsonl (so up to one driver poll of latency counts as worker start-up), and the
    run finishes with its last file."""
    ts = dict(timestamps or {})
    derived = not ts
    if derived:
        ts = {"ray_init_start": ray_start, "ray_init_end": run_start, "pool_start": run_start,
              "last_round_end": last_round_written, "finish_end": finish_end}
        if last_round_written is not None:
            ts["first_round_start"] = last_round_written - train_seconds
            ts["pool_ready"] = ts["first_round_start"]

    def span(a, b):
        return (b - a) if a is not None and b is not None else None

    phases = {
        "process_seconds": t_end - t_start,
        "imports_and_data_seconds": span(t_start, ts.get("ray_init_start")),
        "ray_startup_seconds": span(ts.get("ray_init_start"), ts.get("ray_init_end")),
        "worker_startup_seconds": span(ts.get("pool_start"), ts.get("pool_ready")),
        "training_span_seconds": span(ts.get("first_round_start"), ts.get("last_round_end")),
        "finish_seconds": span(ts.get("last_round_end"), ts.get("finish_end")),
        "teardown_seconds": span(ts.get("finish_end"), t_end),
        "phases_derived": derived,
    }
    return phases


def summarize(samples: list[dict]) -> dict:
    """median/min/max of every numeric field (nested one level, e.g. peak_rss_bytes.workers)."""
    keys: dict[str, list] = {}
    for s in samples:
        for k, v in s.items():
            if isinstance(v, dict):
                for k2, v2 in v.items():
                    if isinstance(v2, (int, float)) and not isinstance(v2, bool):
                        keys.setdefault(f"{k}.{k2}", []).append(v2)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.setdefault(k, []).append(v)
    return {k: stats(v) for k, v in keys.items()}


def ratios(dpfl: dict, floor: dict) -> dict:
    """dpfl / floor of the medians of training and whole-process time."""
    out = {}
    for name, key in (("train", "train_seconds"), ("process", "process_seconds"),
                      ("train_without_eval", "train_seconds_without_eval")):
        a, b = dpfl.get(key), floor.get(key)
        b = b or (floor.get("train_seconds") if name == "train_without_eval" else None)
        out[name] = a["median"] / b["median"] if a and b and b["median"] > 0 else None
    return out


# -- the process tree ----------------------------------------------------------------------------------
def _vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class TreeSampler(threading.Thread):
    """Polls a process tree: each process's role, start time and peak RSS (VmHWM)."""

    def __init__(self, root_pid: int, root_role: str = "driver", interval: float = 0.1):
        super().__init__(daemon=True)
        self.root_pid, self.root_role, self.interval = root_pid, root_role, interval
        self.procs: dict[int, dict] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.root_pid)
        except psutil.NoSuchProcess:
            return
        while not self._halt.is_set():
            try:
                tree = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            for p in tree:
                self._sample(p, psutil)
            self._halt.wait(self.interval)

    def _sample(self, p, psutil) -> None:
        try:
            info = self.procs.setdefault(p.pid, {"create_time": p.create_time(), "role": None, "peak_rss": 0})
            cmdline = " ".join(p.cmdline())
            role = classify(cmdline, p.pid == self.root_pid, self.root_role)
            if role and info["role"] not in ("coordinator", "workers"):  # an actor's process stays its actor's
                info["role"] = role
            info["command"] = cmdline[:80] or info.get("command", "")
            hwm = _vm_hwm(p.pid)
            info["peak_rss"] = max(info["peak_rss"], hwm if hwm is not None else p.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def peak_rss(self) -> dict:
        out: dict[str, int] = {}
        for info in self.procs.values():
            role = info["role"] or "ray_idle_workers"
            out[role] = max(out.get(role, 0), info["peak_rss"])
        out["worker_processes"] = sum(1 for i in self.procs.values() if i["role"] == "workers")
        return out

    def processes(self) -> list[dict]:
        """Every process seen, for the JSON report: role, peak RSS and the start of its command."""
        return [{"pid": pid, "role": i["role"], "peak_rss_bytes": i["peak_rss"], "command": i.get("command", "")}
                for pid, i in sorted(self.procs.items())]

    def first_start(self, role: str) -> float | None:
        times = [i["create_time"] for i in self.procs.values() if i["role"] == role]
        return min(times) if times else None

    def kill_tree(self) -> None:
        """Ends the processes this run started (Ray's daemons may leave the process group)."""
        import psutil

        for pid, info in self.procs.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == info["create_time"]:
                    p.kill()
            except psutil.Error:
                pass


# How long a stopped bench lets the run it measures stop by itself (a `dpfl run` takes about 3 s).
CHILD_STOP_GRACE_S = 15.0


def _run_tree(cmd: list[str], timeout: float, role: str, log: Path) -> tuple[int, float, float, TreeSampler, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as err:
        t_start = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
        sampler = TreeSampler(proc.pid, role)
        sampler.start()
        try:
            stdout, _ = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            sampler.kill_tree()
            stdout, _ = proc.communicate()
            rc = 124
        except BaseException:  # Ctrl-C or SIGTERM of the bench: the child has a session of its own, no signal reached it
            # SIGTERM first: a `dpfl run` stops as it does for a user (its finished rounds and summary.json
            # on disk, its private Ray stopped); its whole group is killed only if it has not within the grace
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=CHILD_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            raise
        finally:
            t_end = time.time()
            sampler.stop()
            sampler.kill_tree()  # what the run left: a Ray daemon of a crashed driver, an interrupted run's processes
    return rc, t_start, t_end, sampler, stdout


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text().strip().splitlines()[-lines:])
    except OSError:
        return ""


# -- one run of each ------------------------------------------------------------------------------------
def run_dpfl(name: str, overrides: list[str] | None = None, timeout: float = 1200, workdir: Path | None = None,
             address: str | None = None) -> dict:
    """One ``dpfl run`` of workload ``name`` in a subprocess; its times, rates and peak RSS.
    ``address``: a running Ray the run joins (the warm workloads)."""
    from .workloads import scenario

    sc = scenario(name, overrides)
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"dpfl-bench-{name}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    yaml_path, out = workdir / "scenario.yaml", workdir / "run"
    yaml_path.write_text(sc.to_yaml())
    cmd = [sys.executable, "-m", "cli.main", "run", str(yaml_path), "--out", str(out)]
    cmd += ["--address", address] if address else []
    rc, t_start, t_end, sampler, _ = _run_tree(cmd, timeout, "driver", workdir / "dpfl.log")
    sample: dict = {"workload": name, "rc": rc, "run_dir": str(out)}
    if rc != 0:
        sample["error"] = "timed out" if rc == 124 else _tail(workdir / "dpfl.log")
    rounds_file = out / "rounds.jsonl"
    rounds = [json.loads(ln) for ln in rounds_file.read_text().splitlines() if ln.strip()] if rounds_file.exists() else []
    summary_file = out / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    sample.update(parse_rounds(rounds))
    finish = [f.stat().st_mtime for f in out.glob("*") if f.suffix in (".json", ".png", ".pt")] if out.exists() else []
    sample.update(derive_phases(
        t_start, t_end, sample["train_seconds"], timestamps=summary.get("timestamps"),
        ray_start=sampler.first_start("ray_system"),
        run_start=(out / "scenario.yaml").stat().st_mtime if (out / "scenario.yaml").exists() else None,
        last_round_written=rounds_file.stat().st_mtime if rounds else None,
        finish_end=max(finish) if finish else None))
    sample["peak_rss_bytes"] = sampler.peak_rss()
    sample["processes"] = sampler.processes()
    sample["final_accuracy"] = summary.get("final_accuracy")
    return sample


def run_dpfl_sweep(name: str, overrides: list[str] | None = None, timeout: float = 1200,
                   workdir: Path | None = None) -> dict:
    """Workload ``name`` (S8) as one ``dpfl sweep`` over SWEEP_SEEDS seeds in a subprocess, with a
    private Ray: the whole process's time, and the runs' training summed."""
    from .workloads import SWEEP_SEEDS, scenario

    sc = scenario(name, overrides)
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"dpfl-bench-{name}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    yaml_path, out = workdir / "scenario.yaml", workdir / "sweep"
    yaml_path.write_text(sc.to_yaml())
    cmd = [sys.executable, "-m", "cli.main", "sweep", str(yaml_path), "--seeds",
           ",".join(str(i) for i in range(SWEEP_SEEDS)), "--out", str(out)]
    rc, t_start, t_end, sampler, _ = _run_tree(cmd, timeout, "driver", workdir / "dpfl.log")
    sample: dict = {"workload": name, "rc": rc, "run_dir": str(out), "process_seconds": t_end - t_start}
    if rc != 0:
        sample["error"] = "timed out" if rc == 124 else _tail(workdir / "dpfl.log")
    runs = sorted(out.glob("seed=*/rounds.jsonl")) if out.exists() else []
    parsed = [parse_rounds([json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]) for f in runs]
    for key in ("train_seconds", "eval_seconds", "train_seconds_without_eval", "client_updates"):
        if parsed and all(key in p for p in parsed):
            sample[key] = sum(p[key] for p in parsed)
    sample["runs_finished"] = sum(1 for f in runs if (f.parent / "summary.json").exists())
    if sample.get("client_updates"):
        sample["updates_per_second"] = sample["client_updates"] / sample["process_seconds"]
    sample["peak_rss_bytes"] = sampler.peak_rss()
    return sample


def run_floor_sweep(name: str, overrides: list[str] | None = None, timeout: float = 1200,
                    workdir: Path | None = None) -> dict:
    """SWEEP_SEEDS floor processes of ``name``'s base workload, one after another (seed 0, 1, ...)."""
    from .workloads import SWEEP_SEEDS

    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"dpfl-floor-{name}-"))
    parts = [run_floor(name, [*(overrides or []), f"seed={i}"], timeout, workdir / f"seed={i}")
             for i in range(SWEEP_SEEDS)]
    sample: dict = {"workload": name, "rc": max(p["rc"] for p in parts)}
    failed = [p for p in parts if p["rc"] != 0]
    if failed:
        sample["error"] = failed[0].get("error")
        return sample
    for key in ("process_seconds", "train_seconds", "eval_seconds", "train_seconds_without_eval", "client_updates"):
        if all(key in p for p in parts):
            sample[key] = sum(p[key] for p in parts)
    sample["updates_per_second"] = sample["client_updates"] / sample["process_seconds"]
    sample["peak_rss_bytes"] = {"floor": max(p["peak_rss_bytes"]["floor"] for p in parts)}
    return sample


class RunningRay:
    """A Ray head started once (``ray start --head --block`` in a session of its own, on 127.0.0.1)
    for the warm workloads, and stopped with every process it started."""

    def __init__(self, workdir: Path):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(workdir / "ray_head.log", "w")
        ray_cli = Path(sys.executable).with_name("ray")
        self.proc = subprocess.Popen(
            [str(ray_cli), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={self.port}",
             f"--num-cpus={os.cpu_count()}", "--include-dashboard=false", "--disable-usage-stats"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.sampler = TreeSampler(self.proc.pid, "ray_system")
        self.sampler.start()
        try:
            self._wait_ready()
        except BaseException:  # Ctrl-C or SIGTERM while it starts: the caller holds no head to stop
            self.stop(grace=2.0)
            raise

    def _wait_ready(self, timeout: float = 120.0) -> None:
        import socket

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start --head exited ({self.proc.returncode}); see {self._log.name}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
            except OSError:
                time.sleep(0.2)
                continue
            if self._node_alive():  # the GCS answers before the raylet has registered
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ray start --head did not answer within {timeout:.0f} s")

    def _node_alive(self) -> bool:
        """Whether the head's raylet has registered with its GCS: before that, a driver joining it
        finds no node on this machine."""
        from dpfl_ray.errors import DPFLError
        from dpfl_ray.runtime.cluster import Target, find_auth_token
        from dpfl_ray.runtime.connect import probe_gcs

        try:
            return bool(probe_gcs(Target("gcs", "127.0.0.1", self.port), find_auth_token(), timeout_s=2.0)[1])
        except DPFLError:
            return False

    def stop(self, grace: float = 20.0) -> None:
        """``ray start --block`` stops its daemons on SIGTERM; after ``grace`` s they are killed."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        self.sampler.stop()
        self.sampler.kill_tree()
        self._log.close()
        # `ray start` wrote this head's address down for `ray.init()` and `--address auto`; a
        # killed head leaves it behind (unlike `ray stop`), and a later plain `ray.init()` then
        # tries to join the dead head
        from dpfl_ray.runtime.cluster import recorded_address, recorded_address_file

        recorded = recorded_address()
        if recorded and recorded.rsplit(":", 1)[-1] == str(self.port):
            recorded_address_file().unlink(missing_ok=True)


def run_floor(name: str, overrides: list[str] | None = None, timeout: float = 1200, workdir: Path | None = None) -> dict:
    """The floor of workload ``name`` in a subprocess (benchmarks/floor.py)."""
    from .workloads import base_and_mode

    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"dpfl-floor-{name}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.floor", base_and_mode(name)[0], "--json"]
    for o in overrides or []:
        cmd += ["--set", o]
    rc, t_start, t_end, sampler, stdout = _run_tree(cmd, timeout, "floor", workdir / "floor.log")
    sample: dict = {"workload": name, "rc": rc, "process_seconds": t_end - t_start}
    if rc != 0:
        sample["error"] = "timed out" if rc == 124 else _tail(workdir / "floor.log")
        return sample
    out = json.loads(stdout.strip().splitlines()[-1])
    steps, updates = out["sgd_steps"], out["client_updates"]
    if "eval_seconds" in out:  # the floor evaluates after the rounds dpfl evaluates
        sample.update(eval_seconds=out["eval_seconds"], train_seconds_without_eval=out["train_seconds_without_eval"])
    sample.update(train_seconds=out["train_seconds"], setup_seconds=out["setup_seconds"], sgd_steps=steps,
                  client_updates=updates, updates_per_second=updates / out["train_seconds"],
                  peak_rss_bytes={"floor": max(out["peak_rss_bytes"], sampler.peak_rss().get("floor", 0))},
                  first_round_loss=out["round_mean_loss"][0], last_round_loss=out["round_mean_loss"][-1])
    return sample


def measure(names: list[str], repeat: int = 1, overrides: list[str] | None = None, timeout: float = 1200,
            floor: bool = True, workdir: Path | None = None, on_sample=None) -> dict:
    """Each workload ``repeat`` times through dpfl and the floor, alternating; medians and ratios."""
    from dpfl_ray.errors import DPFLError

    from .workloads import scenario

    if repeat < 1:
        raise DPFLError("must be at least 1", field="--repeat")
    for n in names:
        scenario(n, overrides)  # an unknown name or a bad override fails before anything runs
    if workdir is not None:
        from dpfl_ray.runs.record import check_writable

        check_writable(workdir, field="--keep")
    if workdir is not None and Path(workdir).exists() and any(Path(workdir).iterdir()):
        # its runs' folders would refuse their `--out`, and report.json would be overwritten
        raise DPFLError(f"{workdir} already holds files; choose an empty or new folder", field="--keep")
    from .workloads import base_and_mode

    base = Path(workdir or tempfile.mkdtemp(prefix="dpfl-bench-"))
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "repeat": repeat,
                    "overrides": overrides or [], "workloads": {}}
    head = None  # started for the first warm workload, stopped after the last one
    warm = [i for i, n in enumerate(names) if base_and_mode(n)[1] == "warm"]
    try:
        for i, n in enumerate(names):
            mode = base_and_mode(n)[1]
            if mode == "warm" and head is None:
                head = RunningRay(base / "ray-head")
            if mode == "warm":
                dpfl_fn = lambda *a: run_dpfl(*a, address=head.address)  # noqa: E731
            else:
                dpfl_fn = run_dpfl_sweep if mode == "sweep" else run_dpfl
            floor_fn = run_floor_sweep if mode == "sweep" else run_floor
            runs: dict[str, list[dict]] = {"dpfl": [], "floor": []}
            for r in range(repeat):
                kinds = [("dpfl", dpfl_fn)] + ([("floor", floor_fn)] if floor else [])
                for kind, fn in kinds:
                    s = fn(n, overrides, timeout, base / f"{n}-{kind}-{r}")
                    runs[kind].append(s)
                    if on_sample:
                        on_sample(kind, s)
            entry = {k: {"samples": v, "stats": summarize([s for s in v if s.get("rc") == 0])}
                     for k, v in runs.items() if v}
            if floor:
                entry["ratio"] = ratios(entry["dpfl"]["stats"], entry["floor"]["stats"])
            report["workloads"][n] = entry
            if head is not None and i == warm[-1]:  # its daemons would load the machine under the rest
                head.stop()
                head = None
    except BaseException:  # Ctrl-C or SIGTERM (cli/bench.py): no time for a graceful stop
        if head is not None:
            head.stop(grace=2.0)
            head = None
        raise
    finally:
        if head is not None:
            head.stop()
    if workdir:
        (base / "report.json").write_text(json.dumps(report, indent=1))
    return report


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's processor field."""
    import platform

    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def speed_probe() -> dict:
    """Seconds one thread of this host takes for two fixed pieces of work, best of five: a Python
    loop of 2,000,000 additions, and torch multiplying two 256x256 float32 matrices 200 times.
    Hosts of one model name can differ severalfold (benchmarks/RESULTS.md): where two reports'
    probes differ, their ratios come from different hosts."""
    import timeit

    import torch

    def best(work) -> float:
        return round(min(timeit.repeat(work, number=1, repeat=5)), 4)

    def loop():
        total = 0
        for i in range(2_000_000):
            total += i

    a = torch.rand(256, 256, generator=torch.Generator().manual_seed(0))

    def products():
        for _ in range(200):
            torch.mm(a, a)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"python_loop_s": best(loop), "torch_matmul_s": best(products)}
    finally:
        torch.set_num_threads(threads)


def machine() -> dict:
    import platform

    import torch

    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "processor": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(), "probe": speed_probe(), "load_average_1m": os.getloadavg()[0]}
