"""Sweeps: one scenario, a grid of ``--set`` overrides (x seeds), one run directory per
combination, then ``sweep.csv`` and plots of final accuracy and of effective vs claimed epsilon
against each grid axis, with error bars over seeds. The logic behind ``dpfl sweep``.

The runs themselves are Ray Tune trials (runtime/trials.py); nothing here imports Ray. A sweep
directory is resumable: a run whose ``summary.json`` says it finished is skipped, an unfinished one
goes on from its last checkpoint, or, with none, is moved to ``.incomplete/`` and run again
(``set_aside``).
"""
from __future__ import annotations

import csv
import fcntl
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import socket
import tarfile
import time
from pathlib import Path
from typing import Callable, Sequence

from ..errors import DPFLError
# The grid's expansion and the manifest live in load.py (report reads sweeps through it too);
# they stay part of the sweep's API.
from .load import (MANIFEST, MAX_NAME_BYTES, MAX_RUNS, SweepRun, _safe, check_run_count, expand, load_run,  # noqa: F401
                   sweep_run_dirs)
from ..scenario import load_scenario
from .record import DP_SECRET, KEPT_FOR_RESTART, check_writable, holds_only_kept

# The lock files start with the manifest's name: prepare() takes them for part of a sweep directory.
LOCK = MANIFEST + ".lock"
# A summary with any other stop_reason is a run that ended on its own and would end the same again.
UNFINISHED = ("interrupted", "error", None)
CSV_METRICS = ["final_accuracy", "epsilon", "epsilon_claimed", "rounds", "stop_reason", "wall_seconds", "status"]


def split_values(text: str) -> list[str]:
    """'0,0.1,[1,2]' -> ['0', '0.1', '[1,2]']: commas inside brackets or braces stay."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + [cur.strip()]


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """``--grid key=v1,v2`` options -> {key: [v1, v2]}, in the order given."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, eq, values = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise DPFLError(f"{item!r} must look like key.path=value1,value2", field="--grid")
        if key == "seed":
            raise DPFLError("sweep seeds with --seeds 0,1,2, not a grid axis", field="--grid")
        if key in grid:
            raise DPFLError(f"{key} is given twice", field="--grid")
        vals = split_values(values)
        if CALL_OPENED.match(values) and not CALL_LIKE.match(values):
            raise DPFLError(f"{key}={values.strip()}: its parenthesis is not closed (a distribution reads "
                            "uniform(low,high))", field="--grid")
        other = CALL_LIKE.match(values)
        if other and other.group(1) not in DISTRIBUTIONS:
            raise DPFLError(f"{key}={values.strip()}: {other.group(1)} is not a distribution to draw from (those are "
                            f"{', '.join(DISTRIBUTIONS)}, with --search random or optuna)", field="--grid")
        if is_distribution(values):
            raise DPFLError(f"{key}={values.strip()} is a distribution to draw from: give --search random "
                            "--num-samples N", field="--grid")
        if any(v == "" for v in vals):
            raise DPFLError(f"{key} has an empty value ({values!r})", field="--grid")
        seen: dict[str, str] = {}
        for v in vals:  # as the run will read it: 0.1, 0.10 and 1e-1 are one value
            same = seen.setdefault(_as_read(v), v)
            if same != v or vals.count(v) > 1:
                raise DPFLError(f"{key} lists one value twice ({same!r} and {v!r})", field="--grid")
        grid[key] = vals
    return grid


# A random search's axis (runtime/search.py): ``loguniform(1e-3,1)``, ``uniform(a,b)``, ``randint(a,b)``.
DISTRIBUTIONS = ("uniform", "loguniform", "randint")
DISTRIBUTION_SPEC = re.compile(r"^\s*(" + "|".join(DISTRIBUTIONS) + r")\s*\((.*)\)\s*$")
CALL_LIKE = re.compile(r"^\s*([A-Za-z_]\w*)\s*\(.*\)\s*$")  # name(...): a distribution, or a typo of one
CALL_OPENED = re.compile(r"^\s*[A-Za-z_]\w*\s*\(")  # name(..., closed or not


def is_distribution(value: str) -> bool:
    return DISTRIBUTION_SPEC.match(value) is not None


def _as_read(value: str) -> str:
    """A grid value as a --set reads it, in one canonical spelling."""
    from ..scenario import _parse_value

    try:
        return json.dumps(_parse_value(value), sort_keys=True, default=str)
    except DPFLError:  # refused YAML: validate() reports it for its combination
        return value


def parse_seeds(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        seeds = [int(s) for s in split_values(text)]
    except ValueError:
        raise DPFLError(f"expected integers like 0,1,2 (got {text!r})", field="--seeds") from None
    if len(set(seeds)) < len(seeds):
        raise DPFLError(f"a seed is listed twice ({text!r})", field="--seeds")
    return seeds


def validate(scenario: Path | None, runs: Sequence[SweepRun], build_data: bool = True) -> None:
    """Load every combination's scenario (its own file, else ``scenario``), and build each distinct
    partition, so a bad grid or an impossible partition is one line before anything runs (as
    ``dpfl run`` checks one run)."""
    built = set()
    for run in runs:
        try:
            sc = load_scenario(run.scenario or scenario, list(run.overrides))
            key = json.dumps([sc.data.model_dump(mode="json"), sc.seed], sort_keys=True)
            if build_data and key not in built:
                from ..data import build_federation

                build_federation(sc)
                built.add(key)
        except DPFLError as err:
            where = (f"in run {run.name}" if run.scenario is not None
                     else f"in combination {' '.join(run.overrides) or 'the scenario itself'}")
            raise DPFLError(f"{err} ({where})") from None


def plan(scenario: Path, grid: Sequence[str], seeds: str | None, base_sets: Sequence[str],
         search=None):
    """(axes, seeds, runs) of ``--grid``/``--seeds``/``--set`` as typed, every combination checked
    (:func:`validate`): what ``dpfl sweep`` runs and ``dpfl submit --grid`` sends. ``search``: a
    search (runtime/search.py: RandomSearch, OptunaSearch): its points instead of the grid's combinations."""
    seed_list = parse_seeds(seeds)
    if search is None:
        axes = parse_grid(grid)
        runs = expand(axes, seed_list, base_sets)
    else:
        points = search.points()
        axes = search.axes(points)
        runs = expand(axes, seed_list, base_sets, points)
    validate(scenario, runs)
    return axes, seed_list, runs


def read_manifest(sweep_dir: Path) -> dict:
    """A sweep directory's ``sweep.json``, or {} where there is none (or none that parses: ``prepare``
    then says so)."""
    try:
        old = json.loads((Path(sweep_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}


def runs_by_point(runs: Sequence[SweepRun]) -> dict[tuple[str, ...], list[str]]:
    """{a search's point (its values in the axes' order): the names of its runs, one per seed}."""
    out: dict[tuple[str, ...], list[str]] = {}
    for run in runs:
        out.setdefault(tuple(value for _, value in run.values), []).append(run.name)
    return out


def is_finished(run_dir: Path) -> bool:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("stop_reason") not in UNFINISHED


def _foreign_files(sweep_dir: Path, manifest: str = MANIFEST) -> bool:
    return sweep_dir.is_dir() and any(not p.name.startswith(manifest) for p in sweep_dir.iterdir()) \
        and not (sweep_dir / manifest).is_file()


class SweepLock:
    """Who may write in a sweep directory: one sweep.

    The sweep holds ``flock`` on its lock file (``sweep.json.lock``), which names its PID and host
    for the message a second sweep prints. The kernel releases the lock when the process is gone.
    Where a file system ignores flock, a lock file whose PID is alive on this host counts as held.

    ``manifest``, ``command`` and ``what``: the file that marks the directory as this command's, the
    command's name on its command line, and what the messages call its work (``dpfl reproduce``
    locks its directory the same way, under its own manifest). ``foreign``: None refuses a
    directory that holds files but no manifest; else what to add to that refusal, and "" lets the
    caller check such files itself (``dpfl reproduce --adopt``)."""

    def __init__(self, sweep_dir: Path, manifest: str = MANIFEST, command: str = "sweep", what: str = "sweep",
                 foreign: str | None = None):
        self.dir, self.fd, self.manifest, self.command, self.what = Path(sweep_dir), None, manifest, command, what
        self.path = self.dir / (manifest + ".lock")
        self.foreign = foreign

    def check(self) -> None:
        """What ``acquire`` refuses before it takes the lock (a dry run asks it alone)."""
        check_writable(self.dir)  # a file, or a folder this process cannot write in: one line naming --out
        if self.foreign != "" and _foreign_files(self.dir, self.manifest):
            raise DPFLError(f"{self.dir} already holds files that are not a {self.what}; choose another --out"
                            f"{self.foreign or ''}", field="--out")

    def check_free(self) -> None:
        """What ``acquire`` refuses, the lock included, taking nothing (a dry run)."""
        self.check()
        if _held(self.path, self.command):
            raise DPFLError(self._busy(self.path), field="--out")

    def acquire(self) -> "SweepLock":
        self.check()
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, mine = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), False
        try:
            if not _try_flock(fd) or _pid_alive(_owner(self.path), self.command):
                raise DPFLError(self._busy(self.path), field="--out")
            mine = True
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                      "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        except BaseException:
            if mine:  # the owner's name stays in a lock file this process did not get
                os.ftruncate(fd, 0)
            os.close(fd)
            raise
        self.fd = fd
        return self

    def _busy(self, path: Path) -> str:
        owner = _owner(path) or {}
        who = (f"PID {owner.get('pid')} on {owner.get('host')} since {owner.get('since')}" if owner
               else "another process")
        return f"{self.dir} is in use by a {self.what}: {who}; wait for it, or use another --out"

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # never unlinked: a waiting opener would lock a file nobody else sees
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "SweepLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _held(path: Path, command: str = "sweep") -> bool:
    """Does a live process hold the lock file ``path``? (Taking it for a moment to find out.)"""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        if not _try_flock(fd):
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return _pid_alive(_owner(path), command)
    finally:
        os.close(fd)


def _owner(path: Path) -> dict | None:
    try:
        owner = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _pid_alive(owner: dict | None, command: str = "sweep") -> bool:
    """A ``command`` process (a sweep) named by a lock file still runs here (another host's cannot
    be checked: there the flock is the only word)."""
    if not owner or owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    pid = owner["pid"]
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a recycled PID is some other program
        return command.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def prepare(sweep_dir: Path, scenario: Path, grid: dict, seeds: list[int] | None, base_sets: Sequence[str],
            search=None, write: bool = True) -> None:
    """Create or reopen a sweep directory. Reopening needs the same scenario file and ``--set``s
    (the grid and seeds may grow; a search's ``--num-samples`` too, over the same space and
    ``--search-seed``); ``sweep.json`` records them, and a search's ``points``. ``write=False``:
    only what reopening would refuse (a dry run)."""
    text = scenario.read_bytes()
    manifest = {"scenario": str(scenario), "scenario_sha256": hashlib.sha256(text).hexdigest(),
                "sets": list(base_sets), "grid": grid, "seeds": seeds}
    if search is not None:
        manifest["search"] = search.manifest(search.points())
    old_path = sweep_dir / MANIFEST
    if old_path.is_file():
        try:
            old = json.loads(old_path.read_text())
        except ValueError:
            raise DPFLError(f"{old_path} is not valid JSON", field="--out") from None
        if not isinstance(old, dict):
            raise DPFLError(f"{old_path} is not a sweep's manifest (a JSON object)", field="--out")
        for key, what in (("scenario_sha256", "scenario file"), ("sets", "--set overrides")):
            if old.get(key) != manifest[key]:
                raise DPFLError(f"{sweep_dir} holds a sweep of another {what}; choose another --out", field="--out")
        if ("search" in old or search is not None) and not (search is not None and search.same_space(old.get("search"))):
            theirs = _what_search(old.get("search"))
            ours = _what_search(search.manifest([]) if search is not None else None)
            other = (" of another space, --search-seed, --metric or --max-concurrent" if ours == "an optuna search"
                     else " of another space or --search-seed")
            raise DPFLError(f"{sweep_dir} holds {theirs}{other if theirs == ours else ''}; "
                            f"this is {ours}: choose another --out", field="--out")
        if search is None:
            _check_grows(sweep_dir, old, grid, seeds)
        else:
            held = old["search"].get("points")
            if isinstance(held, list) and len(held) > search.samples:
                raise DPFLError(f"{sweep_dir} holds a search of {len(held)} points: --num-samples {search.samples} "
                                f"would leave {len(held) - search.samples} of them out of sweep.csv and of the choice "
                                f"among its runs; a rerun may ask for more points, not fewer (give --num-samples "
                                f"{len(held)} or more, or choose another --out)", field="--num-samples")
    elif _foreign_files(sweep_dir):
        raise DPFLError(f"{sweep_dir} already holds files that are not a sweep; choose another --out", field="--out")
    if not write:
        return
    sweep_dir.mkdir(parents=True, exist_ok=True)
    # the manifest whole or not at all
    tmp = sweep_dir / f"{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, old_path)
    (sweep_dir / "scenario.yaml").write_bytes(text)


def _check_grows(sweep_dir: Path, old: dict, grid: dict, seeds: list[int] | None) -> None:
    """A grid's sweep directory reopened keeps every run it holds: the same axes in the same order
    (a run's directory is named by them), each with every value it had, and every seed it had; more
    values and seeds may follow. Else sweep.json, sweep.csv and the plots would drop those runs."""
    old_grid, old_seeds = old.get("grid") or {}, old.get("seeds")
    if not (isinstance(old_grid, dict)
            and all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in old_grid.values())
            and (old_seeds is None or (isinstance(old_seeds, list)
                                      and all(isinstance(x, int) and not isinstance(x, bool) for x in old_seeds)))):
        raise DPFLError(f"{sweep_dir / MANIFEST} is not a sweep's manifest (its grid is not lists of values by axis, "
                        "or its seeds not a list of integers); choose another --out", field="--out")
    if list(old_grid) != list(grid):
        raise DPFLError(f"{sweep_dir} holds a sweep over {', '.join(old_grid) or 'no axis'}, this one is over "
                        f"{', '.join(grid) or 'no axis'}: a rerun keeps the axes in their order (choose another --out)",
                        field="--grid")
    for key, values in old_grid.items():
        dropped = [v for v in values if v not in grid[key]]
        if dropped:
            raise DPFLError(f"{sweep_dir} holds runs of {key}={','.join(dropped)}, which this grid leaves out: a rerun "
                            "may add values, not drop them (give them again, or choose another --out)", field="--grid")
    if (old_seeds is None) != (seeds is None) or any(s not in seeds for s in old_seeds or ()):
        held = "no --seeds" if old_seeds is None else "--seeds " + ",".join(map(str, old_seeds))
        raise DPFLError(f"{sweep_dir} holds runs of {held}: a rerun may add seeds, not drop them (give them again, or "
                        "choose another --out)", field="--seeds")


def _what_search(manifest: dict | None) -> str:
    if not manifest:
        return "a grid"
    return "an optuna search" if manifest.get("kind") == "optuna" else "a random search"


RUNNING = ".running"


def hold_run(sweep_dir: Path, name: str, wait_s: float = 0.0) -> int:
    """Taken by the process that runs ``name`` until the run's files are written (it closes the
    descriptor returned) or the process dies (the kernel releases it): while a run of an earlier
    sweep still stops (its sweep was killed), its directory is not touched (``set_aside``).
    ``wait_s``: how long to wait for another holder to let go (a trial started again while the
    process of its attempt that failed is still ending)."""
    path = Path(sweep_dir) / RUNNING / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)  # a node that does not share the sweep's file system
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while not _try_flock(fd):
        if time.monotonic() >= deadline:
            os.close(fd)
            raise DPFLError(f"run {name} is already running (its lock {path} is held)")
        time.sleep(0.5)
    return fd


def set_aside(sweep_dir: Path, runs: Sequence[SweepRun], resumable: Callable[[Path], bool] | None = None
              ) -> tuple[list[SweepRun], dict[str, str]]:
    """The runs still to do, and {name: 'skipped'} for the finished ones. An unfinished try's
    directory stays where it is when ``resumable(run_dir)`` says its checkpoint can be continued
    (its trial then resumes it, as ``dpfl run --resume`` would: runtime/trials.earlier_attempt);
    any other is moved to ``.incomplete/NAME.N``, never overwritten, and the run starts afresh. A
    run that some process still runs (``hold_run``) is refused with one line."""
    todo, statuses = [], {}
    for run in runs:
        run_dir = sweep_dir / run.name
        if is_finished(run_dir):
            statuses[run.name] = "skipped"
            continue
        if _held(sweep_dir / RUNNING / f"{run.name}.lock"):
            raise DPFLError(f"run {run.name} of an earlier sweep is still stopping in {sweep_dir}; wait a few "
                            "seconds and run the command again", field="--out")
        if not (resumable is not None and run_dir.exists() and resumable(run_dir)):
            move_aside(sweep_dir, run.name)
        todo.append(run)
    return todo, statuses


def resumed(sweep_dir: Path, todo: Sequence[SweepRun]) -> int:
    """How many of ``todo`` (after :func:`set_aside`) go on from a checkpoint: those whose
    directory was left in place with more in it than what a fresh start keeps (move_aside)."""
    return sum(1 for run in todo if (Path(sweep_dir) / run.name).is_dir()
               and not holds_only_kept(Path(sweep_dir) / run.name))


def move_aside(sweep_dir: Path, name: str, keep: bool = True) -> Path | None:
    """Move run ``name``'s unfinished directory to ``.incomplete/NAME.N`` (never overwriting an
    earlier one); returns where it went, or None when there was none. What the run starts again
    from stays: the rounds it committed before its first checkpoint, which the server may have seen,
    are drawn again as they were (its 'os' secret: runtime/checkpoint.py, run_secret) and released
    again only alike (their digests: runs/record.py, RELEASES). ``keep=False``: for a directory
    about to be replaced whole (:func:`unpack_run`): all of it goes aside but the secret, which is
    deleted (the directory that replaces it brings its own where it still needs one)."""
    run_dir = Path(sweep_dir) / name
    names = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else None
    if not run_dir.exists() or (keep and names and names <= KEPT_FOR_RESTART):
        return None  # nothing but what the run starts again from
    aside = Path(sweep_dir) / ".incomplete"
    aside.mkdir(exist_ok=True)
    # a number no earlier attempt holds (one set aside before may have been deleted since): never into one
    taken = [p.name[len(name) + 1:] for p in aside.iterdir() if p.name.startswith(name + ".")]
    n = max((int(t) for t in taken if t.isdigit()), default=0) + 1
    moved = aside / f"{name}.{n}"
    if keep and names is not None:
        # entry by entry: the release list and the secret never leave the run's directory, so no crash
        # midway can leave it without them (a new run there would then release listed rounds unguarded)
        moved.mkdir()
        for entry in sorted(names - KEPT_FOR_RESTART):
            shutil.move(str(run_dir / entry), str(moved / entry))
        if not names & KEPT_FOR_RESTART:
            run_dir.rmdir()  # nothing kept: no directory, as before any attempt
        return moved
    shutil.move(str(run_dir), str(moved))
    if not keep:  # the directory that replaces it brings its own secret, if it still needs one
        (moved / DP_SECRET).unlink(missing_ok=True)
    return moved


def pack_run(run_dir: Path) -> bytes:
    """A run directory as one gzipped tar (its name inside), for a trial on another node to send
    back to the sweep's (:func:`unpack_run`)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(run_dir, arcname=Path(run_dir).name)
    return buf.getvalue()


def unpack_run(sweep_dir: Path, name: str, blob: bytes) -> bool:
    """Write run ``name`` from :func:`pack_run`'s ``blob`` into ``sweep_dir``; False when the same
    run is there already (the nodes share the file system: its summary.json has the same bytes).
    An unfinished directory in the way is moved to ``.incomplete/``; the new one appears whole
    (written beside it, then renamed)."""
    sweep_dir = Path(sweep_dir)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        members = tar.getmembers()
        if any(m.name != name and not m.name.startswith(name + "/") for m in members):
            raise DPFLError(f"the files sent back for run {name} are not that run's directory")
        summary = next((m for m in members if m.name == f"{name}/summary.json" and m.isfile()), None)
        theirs = tar.extractfile(summary).read() if summary is not None else None
        ours = sweep_dir / name / "summary.json"
        if theirs is not None and ours.is_file() and ours.read_bytes() == theirs:
            return False
        incoming = sweep_dir / ".incoming"
        shutil.rmtree(incoming / name, ignore_errors=True)
        incoming.mkdir(parents=True, exist_ok=True)
        tar.extractall(incoming, filter="data")
    move_aside(sweep_dir, name, keep=False)
    os.replace(incoming / name, sweep_dir / name)
    return True


def collect(sweep_dir: Path, runs: Sequence[SweepRun], statuses: dict[str, str] | None = None) -> list[dict]:
    """One row per run: its grid values, seed, and what its run directory says (None where it says nothing)."""
    rows = []
    for run in runs:
        row = {"run": run.name, **dict(run.values), "seed": run.seed}
        row.update({k: None for k in CSV_METRICS})
        run_dir = sweep_dir / run.name
        status = (statuses or {}).get(run.name)
        if (run_dir / "summary.json").is_file():
            r = load_run(run_dir)
            s, last = r.summary, (r.rounds[-1] if r.rounds else {})
            row.update(final_accuracy=s.get("final_accuracy"), epsilon=s.get("epsilon", last.get("epsilon")),
                       epsilon_claimed=s.get("epsilon_claimed", last.get("epsilon_claimed")),
                       rounds=s.get("rounds_completed", len(r.rounds)), stop_reason=s.get("stop_reason"),
                       wall_seconds=s.get("wall_seconds"))
            row["seed"] = s.get("seed", run.seed) if run.seed is None else run.seed
            if status in (None, "skipped"):
                status = "ok" if is_finished(run_dir) else "unfinished"
        row["status"] = status or "not run"
        rows.append(row)
    return rows


def write_csv(rows: list[dict], grid_keys: Sequence[str], path: Path) -> Path:
    fields = ["run", *grid_keys, "seed", *CSV_METRICS]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in fields})
    return path


def write_outputs(sweep_dir: Path, grid: dict[str, list[str]], runs: Sequence[SweepRun],
                  statuses: dict[str, str] | None = None, drawn: bool = False) -> tuple[list[dict], list[Path]]:
    """``sweep.csv``, the per-axis plots and, for private runs, ``selection.json``
    (:func:`selection_privacy`); returns the rows and the files written. ``drawn``: the runs are a
    random search's points, plotted as one cloud per axis (no other axis holds still)."""
    rows = collect(sweep_dir, runs, statuses)
    written = [write_csv(rows, list(grid), sweep_dir / "sweep.csv")]
    for axis in grid:
        written += plot_axis(rows, {axis: grid[axis]} if drawn else grid, axis, sweep_dir, drawn=drawn)
    selection = selection_privacy(sweep_dir, rows)
    if selection is not None:
        path = sweep_dir / SELECTION
        path.write_text(json.dumps(selection, indent=2) + "\n")
        written.append(path)
    return rows, written


SELECTION = "selection.json"
SELECTION_NOTE = ("each run's epsilon covers that run alone. Choosing among the runs on anything their "
                  "training data decides (for example the most accurate) releases what all of them "
                  "learned: epsilon_all_runs is what dp_accounting gives for the ledgers of every private run "
                  "that released a round composed, finished or not (unfinished counts those that stopped "
                  "before their last round), a bound for any such choice. Papernot & Steinke 2022 (Hyperparameter "
                  "tuning with Renyi DP) bound a tuning run over a random number of runs more tightly; "
                  "that bound is not applied here.")
ADAPTIVE_NOTE = ("An optuna search chose each point from the results of the runs before it, so every run after its "
                 "first batch depends on the earlier runs' data too: epsilon_all_runs, not a run's own epsilon, "
                 "covers any run of it.")


def selection_privacy(sweep_dir: Path, rows: list[dict]) -> dict | None:
    """What choosing among a sweep's private runs costs: the run-level ledgers of every run that
    released a round, finished or not (an interrupted or timed-out run's rounds were released too),
    composed in one ledger of their accountant (dp_accounting), epsilon at their delta. None if no
    such run is private; ``epsilon_all_runs`` None, with ``why``, where the ledgers cannot be composed
    here. A try set aside in ``.incomplete/`` is not counted: the run that starts again releases its
    rounds again only as they were (``move_aside``)."""
    ledgers, unfinished, unreadable = [], 0, []
    for row in rows:
        path = Path(sweep_dir) / row["run"] / "ledger.json"
        if not path.is_file():
            continue
        try:
            ledger = json.loads(path.read_text())
        except (OSError, ValueError):
            ledger = None
        if not isinstance(ledger, dict):
            unreadable.append(path)
            continue
        if "rounds" in ledger and not ledger["rounds"]:
            continue  # nothing released
        ledgers.append(ledger)
        unfinished += row.get("status") != "ok"
    if not ledgers and not unreadable:
        return None
    adaptive = (read_manifest(sweep_dir).get("search") or {}).get("kind") == "optuna"
    out = {"runs": len(ledgers) + len(unreadable), "unfinished": unfinished,
           "epsilon_max_single_run": max(((lg.get("epsilon") or 0.0) for lg in ledgers), default=None),
           "adaptive": adaptive, "note": SELECTION_NOTE + (" " + ADAPTIVE_NOTE if adaptive else "")}
    if unreadable:
        return {**out, "epsilon_all_runs": None, "why": f"{unreadable[0]} is not a ledger (a JSON object)"}
    if any("rounds" not in lg for lg in ledgers):
        return {**out, "epsilon_all_runs": None,
                "why": "record-level runs keep one ledger per client; composing them across runs is not built"}
    kinds = {(lg.get("accountant"), lg.get("delta")) for lg in ledgers}
    if len(kinds) > 1:
        return {**out, "epsilon_all_runs": None, "why": "the runs use different accountants or deltas"}
    from ..privacy.ledger import PrivacyLedger

    accountant, delta = kinds.pop()
    rounds = [{**r, "round": i + 1} for i, r in enumerate(r for lg in ledgers for r in lg["rounds"])]
    try:
        composed = PrivacyLedger.from_dict({"accountant": accountant, "delta": delta, "rounds": rounds})
    except DPFLError as err:  # e.g. a ledger.json this version cannot read: the sweep's other files still get written
        return {**out, "epsilon_all_runs": None, "why": f"the runs' ledgers cannot be composed here: {err}"}
    return {**out, "accountant": accountant, "delta": delta, "epsilon_all_runs": composed.epsilon()}


def selection_line(sweep_dir: Path) -> str | None:
    """``selection.json`` in one sentence (``dpfl sweep`` prints it beside its table, ``dpfl report``
    under the sweep's runs), or None where the sweep has none."""
    try:
        sel = json.loads((Path(sweep_dir) / SELECTION).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(sel, dict):
        return None
    runs = f"{sel.get('runs')} private runs" + (f" ({sel['unfinished']} of them unfinished)"
                                                if sel.get("unfinished") else "")
    eps, delta = sel.get("epsilon_all_runs"), sel.get("delta")
    if not isinstance(eps, (int, float)) or not isinstance(delta, (int, float)):
        return f"choosing among these {runs} is not accounted here: {sel.get('why')}"
    if sel.get("adaptive"):
        return (f"optuna chose each point from the runs before it: any of these {runs}, and choosing among "
                f"them, is covered by epsilon {eps:.4g} at delta {delta:g}, their ledgers composed, not by its "
                f"row's epsilon ({SELECTION})")
    return (f"each row's epsilon covers its run alone; choosing among these {runs} (say, the most accurate) is "
            f"covered by epsilon {eps:.4g} at delta {delta:g}, their ledgers composed ({SELECTION})")


# --- plots --------------------------------------------------------------------------------------

def _stats(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over seeds (0 for a single seed)."""
    import numpy as np

    a = np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def axis_series(rows: list[dict], grid: dict[str, list[str]], axis: str, metric: str) -> dict[str, list]:
    """{label of the other axes' values: [(axis value, mean, sd, n), ...]} over the seeds."""
    others = [k for k in grid if k != axis]
    series: dict[str, list] = {}
    for combo in itertools.product(*(grid[k] for k in others)):
        label = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(others, combo)) or "all"
        pts = []
        for x in grid[axis]:
            vals = [r[metric] for r in rows if r.get(axis) == x and r.get(metric) is not None
                    and all(r.get(k) == v for k, v in zip(others, combo))]
            if vals:
                pts.append((x, *_stats(vals), len(vals)))
        if pts:
            series[label] = pts
    return series


def plot_axis(rows: list[dict], grid: dict[str, list[str]], axis: str, out_dir: Path, drawn: bool = False) -> list[Path]:
    """``accuracy_vs_<axis>.png`` and, where runs record one, ``epsilon_vs_<axis>.png``: one line
    per combination of the other axes, mean over seeds with +-1 sd error bars. ``drawn``: a random
    search's values, as points without lines (mean and sd over the runs that drew the value), on a
    log scale where they span more than two decades."""
    from .record import plotting_library

    plt = plotting_library()
    try:
        pos = {v: float(v) for v in grid[axis]}
        ticks = None
    except ValueError:  # categorical axis: evenly spaced, labelled
        pos = {v: float(i) for i, v in enumerate(grid[axis])}
        ticks = list(grid[axis])
    n_seeds = len({r.get("seed") for r in rows})
    written = []
    for metric, name, ylabel in (("final_accuracy", "accuracy", "final test accuracy"), ("epsilon", "epsilon", "epsilon")):
        main = axis_series(rows, grid, axis, metric)
        claimed = axis_series(rows, grid, axis, "epsilon_claimed") if metric == "epsilon" else {}
        if not main and not claimed:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, label in enumerate(list(main) + [k for k in claimed if k not in main]):
            for series, style, suffix in ((main, "-o", " (effective)" if claimed else ""), (claimed, "--x", " (claimed)")):
                if label in series:
                    pts = series[label]
                    ax.errorbar([pos[p[0]] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts],
                                fmt=style.lstrip("-") if drawn else style, color=f"C{i % 10}", capsize=3,
                                label=label + suffix)
        if ticks:
            ax.set_xticks(range(len(ticks)), ticks)
        elif drawn and min(pos.values()) > 0 and max(pos.values()) > 100 * min(pos.values()):
            ax.set_xscale("log")
        ax.set_xlabel(axis)
        several = any(p[3] > 1 for pts in main.values() for p in pts)
        ax.set_ylabel(ylabel + (" (mean +- sd over the runs that drew a value)" if drawn and several
                                else f" (mean +- sd over {n_seeds} seeds)" if n_seeds > 1 and not drawn else ""))
        ax.set_title(f"{ylabel} against {axis}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{name}_vs_{_safe(axis)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
