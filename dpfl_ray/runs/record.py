"""RunRecord: the files a run leaves for a person to open.

``scenario.yaml`` (resolved), ``rounds.jsonl`` (appended and flushed each round, so an
interrupted run keeps what it did), ``summary.json``, ``model.pt`` and ``accuracy.png``.

Every JSON file is strict JSON: a NaN or infinite number (a diverged loss, an epsilon without a
guarantee) is written as ``null`` and the object that held it gets ``"non_finite": {key: "nan" |
"inf" | "-inf"}`` saying which and why it is null.
"""
from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ..errors import DPFLError


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("dpfl-ray", "ray", "torch", "numpy", "dp-accounting", "cryptography"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def client_accuracy_summary(accuracy: dict[int, float], groups: dict[int, str] | None = None) -> dict:
    """Per-client accuracies (client id -> accuracy of its own model) summarised for rounds.jsonl
    and summary.json: count, mean, min, median, max over clients, the same per group (e.g. Huang
    et al.'s budget categories, Fig. 7) when ``groups`` labels the clients, and every client's
    figure under ``per_client`` (JSON keys are strings)."""
    def stats(values: list[float]) -> dict:
        v = np.asarray(values, dtype=np.float64)
        return {"clients": int(v.size), "mean": float(v.mean()), "min": float(v.min()),
                "median": float(np.median(v)), "max": float(v.max())}

    if not accuracy:
        return {"clients": 0}
    ids = sorted(accuracy)
    out = stats([accuracy[c] for c in ids])
    if groups:
        by: dict[str, list[float]] = {}
        for c in ids:
            by.setdefault(groups.get(c, "unlabelled"), []).append(accuracy[c])
        out["by_group"] = {label: stats(values) for label, values in sorted(by.items(), key=_group_order)}
    out["per_client"] = {str(c): float(accuracy[c]) for c in ids}
    return out


def _group_order(item):
    """Groups labelled ``name=number`` sort by the number, others by name."""
    label = item[0]
    try:
        return (0, float(label.rsplit("=", 1)[-1]), label)
    except ValueError:
        return (1, 0.0, label)


def default_run_dir(base: str, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(base) / name / stamp
    n = 1
    while path.exists():
        path = Path(base) / name / f"{stamp}-{n}"
        n += 1
    return path


def sanitise(obj):
    """``obj`` with every NaN / infinite float replaced by None, and a ``non_finite`` entry in each
    dict that had one (``{"test_loss": "nan"}``), so ``json.dumps(allow_nan=False)`` accepts it."""
    if isinstance(obj, dict):
        out, reasons = {}, {}
        for key, value in obj.items():
            if isinstance(value, (float, np.floating)) and not math.isfinite(value):
                out[key], reasons[str(key)] = None, "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            else:
                out[key] = sanitise(value)
        if reasons:
            previous = out.get("non_finite")
            out["non_finite"] = {**previous, **reasons} if isinstance(previous, dict) else reasons
        return out
    if isinstance(obj, (list, tuple)):
        return [None if isinstance(v, (float, np.floating)) and not math.isfinite(v) else sanitise(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return sanitise(obj.tolist())
    return obj


def dumps(obj, **kwargs) -> str:
    """Strict JSON (no NaN / Infinity tokens): see :func:`sanitise`."""
    return json.dumps(sanitise(obj), allow_nan=False, default=_jsonable, **kwargs)


def check_writable(path: str | Path, field: str = "--out") -> None:
    """Raise a DPFLError unless ``path`` can be created (or is a folder we can write in).

    Probes the nearest existing ancestor with a temporary file that is removed at once, so a
    read-only or full file system is found before a run starts and nothing is left behind.
    """
    path = Path(path)
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise DPFLError(f"cannot create {path}: {ancestor} is not a folder", field=field)
    try:
        fd, probe = tempfile.mkstemp(prefix=".dpfl-write-check-", dir=ancestor)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise DPFLError(f"cannot write in {ancestor} ({err.strerror or err})", field=field) from None


# privacy.randomness: os -- the run's secret root of DP randomness while the run can go on
# (runtime/checkpoint.py, run_secret); never packed into a bundle that leaves the cluster
DP_SECRET = "dp_secret"
# the rounds the run released, appended before each release is made: the scenario's SHA-256 and
# its digests (privacy/reruns.py) of the model sent out, the survivors and the calibrating clients,
# each listed before the server could see it, then whether it released and the epsilon after it as
# the round commits. A run that starts again (a resume, a sweep's restart) releases a round listed
# here again only alike.
RELEASES = "releases.jsonl"
# what a directory may hold for a run to start in it anew: what an earlier attempt left to go on from
KEPT_FOR_RESTART = frozenset({DP_SECRET, RELEASES})


def _is_release_line(entry) -> bool:
    """A line :meth:`RunRecord.add_release` writes: round and scenario, then any of the digests,
    whether the round released, and the epsilon after it (``non_finite``: see :func:`sanitise`)."""
    if not (isinstance(entry, dict) and type(entry.get("round")) is int and entry["round"] > 0
            and isinstance(entry.get("scenario_sha256"), str)):
        return False
    for k, v in entry.items():
        if k in ("model", "survivors", "calibration"):
            ok = isinstance(v, str)
        elif k == "released":
            ok = isinstance(v, bool)
        elif k == "epsilon":
            ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
        else:
            ok = k in ("round", "scenario_sha256", "non_finite")
        if not ok:
            return False
    return True


def holds_only_kept(path: Path) -> bool:
    """Is ``path`` a directory holding nothing but what a fresh start of its run keeps (or nothing)?"""
    return path.is_dir() and all(p.name in KEPT_FOR_RESTART for p in path.iterdir())


def may_have_released(entry: dict) -> bool:
    """Could the server have seen this listed round released (its attempt did not say otherwise)?"""
    return entry.get("released") is not False


def read_releases(path: str | Path, scenario_sha256: str | None = None, field: str = "--resume") -> dict[int, dict]:
    """Round number -> what :data:`RELEASES` lists of it, its lines merged (a field's first value
    wins: the attempt the server saw first), but for an attempt that said it released nothing: the
    next attempt's listing of the round replaces it (:func:`_supersedes`). A last line cut short
    (a driver killed mid-write) is left out; any other damage is one DPFLError naming ``field``,
    as is a line of another scenario than ``scenario_sha256`` (a new run's: that run's DP
    randomness is not this one's; a resumed run's scenario is checked against its checkpoint)."""
    file = Path(path) / RELEASES
    try:
        lines = file.read_text(encoding="utf-8").splitlines() if file.exists() else []
    except (OSError, UnicodeDecodeError) as err:
        raise DPFLError(f"cannot read {file} ({err}); it lists the rounds the run released", field=field)
    out: dict[int, dict] = {}
    for i, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            entry = None
        if not _is_release_line(entry):
            raise DPFLError(f"{file} line {i + 1} is not a released round's digests (damaged)", field=field)
        if scenario_sha256 is not None and entry["scenario_sha256"] != scenario_sha256:
            raise DPFLError(f"{file} lists rounds released by a run of another scenario; a run of this one would "
                            f"draw that run's DP randomness again: remove it and {DP_SECRET}, or choose another "
                            "--out", field=field)
        merged = out.setdefault(entry["round"], {})
        if _supersedes(merged, entry):
            merged.clear()
        for k, v in entry.items():
            merged.setdefault(k, v)
    return out


def _supersedes(listed: dict, line: dict) -> bool:
    """Does ``line`` begin a new attempt's listing of a round ``listed`` says released nothing?"""
    return listed.get("released") is False and any(k in line for k in ("model", "survivors", "calibration"))


def lists_a_release(path: str | Path) -> bool:
    """Does the run's list hold a round the server may have seen (an unreadable list: assume so)?"""
    try:
        return any(may_have_released(v) for v in read_releases(path).values())
    except DPFLError:
        return True


class ReleaseList:
    """The :data:`RELEASES` file of one run directory, appended to: what is listed of a round
    already (by an earlier attempt, which this one matched) is not listed again."""

    def __init__(self, path: str | Path):
        self.file = Path(path) / RELEASES
        data = self.file.read_bytes() if self.file.exists() else b""
        if data and not data.endswith(b"\n"):  # a line cut short by a killed driver: never glued to the next
            with open(self.file, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
        self.listed = read_releases(path)
        self._named = False  # the file's name is synced (its folder) once per process, before a release

    def add(self, event: dict) -> None:
        listed = self.listed.setdefault(event["round"], {})
        if _supersedes(listed, event):
            listed.clear()
        new = {k: v for k, v in event.items() if k not in ("event", "round", "scenario_sha256") and k not in listed}
        if not new:
            return
        with open(self.file, "a", encoding="utf-8") as f:
            f.write(dumps({"round": event["round"], "scenario_sha256": event["scenario_sha256"], **new}) + "\n")
            f.flush()
            os.fsync(f.fileno())  # the release goes ahead once this returns: the line survives a crash of the host
        if not self._named:  # and so does the file's name
            fd = os.open(self.file.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._named = True
        listed.update(new)


class RunRecord:
    @staticmethod
    def check_new(path: str | Path) -> None:
        """A directory a new run may start in: none, an empty one, or one that holds nothing but what
        an earlier attempt of the same run left for it (runs/sweep.py, move_aside): the secret to draw
        from again, and the list of the rounds it released."""
        path = Path(path)
        if path.exists() and not holds_only_kept(path):
            raise DPFLError(f"{path} already holds files; choose another --out", field="--out")
        check_writable(path)

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.check_new(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.rounds: list[dict] = []
        self._releases: ReleaseList | None = None
        self._rounds_file = open(self.path / "rounds.jsonl", "w")

    @classmethod
    def reopen(cls, path: str | Path, rounds: int) -> "RunRecord":
        """A run directory to continue after its first ``rounds`` rounds (``dpfl run --resume``):
        rows past them -- written after the checkpoint -- are dropped (their releases stay listed in
        :data:`RELEASES`)."""
        self = cls.__new__(cls)
        self.path = Path(path)
        self.rounds = cls.committed_rows(self.path, rounds)
        self._releases = None
        tmp = self.path / "rounds.jsonl.tmp"
        tmp.write_text("".join(json.dumps(row) + "\n" for row in self.rounds))
        os.replace(tmp, self.path / "rounds.jsonl")
        self._rounds_file = open(self.path / "rounds.jsonl", "a")
        return self

    @staticmethod
    def committed_rows(path: str | Path, rounds: int) -> list[dict]:
        """The first ``rounds`` rows of a run's rounds.jsonl, each whole and in order; a DPFLError
        naming the line otherwise. Rows past them may be cut short (a driver killed mid-write)."""
        file = Path(path) / "rounds.jsonl"
        try:
            lines = file.read_text(encoding="utf-8").splitlines() if file.exists() else []
        except (OSError, UnicodeDecodeError) as err:
            raise DPFLError(f"cannot read {file} ({err})", field="--resume") from None
        if len(lines) < rounds:
            raise DPFLError(f"{file} has {len(lines)} rows, the checkpoint {rounds}", field="--resume")
        rows = []
        for i, line in enumerate(lines[:rounds]):
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or row.get("round") != i + 1:
                raise DPFLError(f"{file} line {i + 1} is not round {i + 1}'s row (damaged or cut short); the "
                                f"checkpoint covers {rounds} rounds", field="--resume")
            rows.append(row)
        return rows

    def write_scenario(self, yaml_text: str) -> None:
        (self.path / "scenario.yaml").write_text(yaml_text)

    def add_round(self, record: dict) -> None:
        """Append a row to rounds.jsonl; it counts as written (``rounds``) once it is on its way to disk."""
        self._rounds_file.write(dumps(record) + "\n")
        self._rounds_file.flush()
        self.rounds.append(record)

    def add_release(self, event: dict) -> None:
        """Append what the coordinator lists of a release to :data:`RELEASES`, on its way to disk
        before the release is made; what an earlier attempt listed of the round already (which this
        one matched) is not listed again (:class:`ReleaseList`)."""
        if self._releases is None:
            self._releases = ReleaseList(self.path)
        self._releases.add(event)

    def write_json(self, name: str, obj) -> None:
        """Atomically: a reader (or a run killed mid-write) sees the old file or the new, never half."""
        text = dumps(obj, indent=2) + "\n"
        _atomic(self.path / name, lambda tmp: tmp.write_text(text))

    def write_model_file(self, data: bytes) -> None:
        """model.pt from its bytes (training.models.model_file), made by whichever process has torch loaded."""
        _atomic(self.path / "model.pt", lambda tmp: tmp.write_bytes(data))

    def plot_accuracy(self) -> None:
        rows = [r for r in self.rounds if r.get("test_accuracy") is not None]
        if not rows:
            return
        plt = plotting_library()
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["round"] for r in rows], [r["test_accuracy"] for r in rows], marker=".")
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy")
        ax.set_title(self.path.parent.name if self.path.parent.name != "runs" else self.path.name)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.path / "accuracy.png", dpi=100)
        plt.close(fig)

    def plot_privacy(self) -> None:
        """Accuracy against epsilon spent so far (the nominal epsilon where rounds are not covered)."""
        rows = [r for r in self.rounds if r.get("test_accuracy") is not None
                and (r.get("epsilon") is not None or r.get("epsilon_nominal") is not None)]
        if not rows:
            return
        plt = plotting_library()
        fig, ax = plt.subplots(figsize=(6, 4))
        eps = [r["epsilon"] if r.get("epsilon") is not None else r["epsilon_nominal"] for r in rows]
        nominal = any(r.get("epsilon") is None for r in rows)
        ax.plot(eps, [r["test_accuracy"] for r in rows], marker=".")
        ax.set_xlabel("epsilon" + (" (nominal: rounds not covered by DP)" if nominal else ""))
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.path / "privacy.png", dpi=100)
        plt.close(fig)

    def close(self) -> None:
        if not self._rounds_file.closed:
            self._rounds_file.close()


def _atomic(path: Path, write) -> None:
    """``write(tmp)`` then rename over ``path`` (same directory, so the rename is atomic)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_PLOTTING_IMPORT = threading.Lock()


def plotting_library():
    """matplotlib's pyplot on the Agg backend (files only, no display), imported on first use:
    0.35 s that only commands which draw should pay (`dpfl run` loads it in a thread while Ray
    starts). One thread imports it at a time: a second one, importing the same package meanwhile,
    could see a partly initialised module."""
    with _PLOTTING_IMPORT:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    return plt


def _jsonable(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)
