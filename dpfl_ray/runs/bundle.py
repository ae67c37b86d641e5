"""A run directory as lines of a Ray Job's log, and back (docs/cluster.md, 'How the files travel').

A job's files are written on the cluster, in a working directory Ray deletes later. The one channel
that reaches the user through the dashboard address, with token authentication, is the job's log.
So the job's entrypoint ends by printing its run directory as a tar.gz, base64-encoded in numbered
lines between a header and a trailer, both carrying the archive's SHA-256; ``dpfl jobs fetch``
reads the log back through the same Jobs API and unpacks the last complete block.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import DPFLError
from .record import DP_SECRET

BEGIN = "DPFL-RUNDIR-BEGIN"
DATA = "DPFL-RUNDIR"
END = "DPFL-RUNDIR-END"
TOO_LARGE = "DPFL-RUNDIR-TOO-LARGE"
VERSION = 1
# Bound on the compressed run directory: the whole log comes back in one HTTP reply.
MAX_BYTES = 32 * 1024 * 1024
LINE_CHARS = 4096


@dataclass(frozen=True)
class Bundle:
    name: str
    data: bytes
    files: list[str]


def pack(run_dir: str | Path) -> tuple[bytes, list[str]]:
    """The run directory's files as a gzip'd tar, paths relative to it (sorted: same files, same order).
    An unfinished 'os' run's secret (``dp_secret``) stays on the cluster: the bundle is written into the
    job's log, which anyone with the dashboard reads; the run resumes there."""
    root = Path(run_dir)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != DP_SECRET)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel in files:
            tar.add(root / rel, arcname=rel, recursive=False)
    return buf.getvalue(), files


def bundle_lines(run_dir: str | Path, name: str, max_bytes: int = MAX_BYTES) -> list[str]:
    """The log lines that carry ``run_dir``: a JSON header, the base64 chunks, a trailer. Over
    ``max_bytes`` only a TOO_LARGE line is written (fetch says so, with the path on the cluster)."""
    data, files = pack(run_dir)
    digest = hashlib.sha256(data).hexdigest()
    if len(data) > max_bytes:
        return [f"{TOO_LARGE} " + json.dumps({"bytes": len(data), "limit": max_bytes, "path": str(run_dir)})]
    text = base64.b64encode(data).decode("ascii")
    chunks = [text[i:i + LINE_CHARS] for i in range(0, len(text), LINE_CHARS)]
    header = {"version": VERSION, "name": name, "bytes": len(data), "sha256": digest, "chunks": len(chunks),
              "files": files, "path": str(run_dir)}
    return ([f"{BEGIN} " + json.dumps(header)] + [f"{DATA} {i} {c}" for i, c in enumerate(chunks)]
            + [f"{END} {digest}"])


def find_bundle(log: str) -> Bundle:
    """The last complete, intact block in ``log``; a one-line DPFLError says why there is none."""
    lines = [ln.rstrip("\r") for ln in log.splitlines()]
    starts = [i for i, ln in enumerate(lines) if ln.startswith(BEGIN + " ")]
    too_large = [ln for ln in lines if ln.startswith(TOO_LARGE + " ")]
    if not starts:
        if too_large:
            info = json.loads(too_large[-1][len(TOO_LARGE) + 1:])
            raise DPFLError(f"the run directory ({info['bytes']} bytes compressed) is over the {info['limit']} bytes "
                            f"a job's log carries; it stays on the cluster at {info['path']}")
        raise DPFLError("the job's log holds no run directory (did its entrypoint finish? jobs submitted with "
                        "`dpfl submit` pack it at the end)")
    errors = []
    for start in reversed(starts):
        try:
            return _decode(lines, start)
        except ValueError as err:
            errors.append(str(err))
    raise DPFLError(f"the run directory in the job's log is damaged: {errors[0]}")


def _decode(lines: list[str], start: int) -> Bundle:
    header = json.loads(lines[start][len(BEGIN) + 1:])
    if header.get("version") != VERSION:
        raise ValueError(f"format version {header.get('version')}, this dpfl reads {VERSION}")
    chunks = []
    for ln in lines[start + 1:start + 1 + header["chunks"]]:
        tag, _, rest = ln.partition(" ")
        index, _, chunk = rest.partition(" ")
        if tag != DATA or index != str(len(chunks)):
            raise ValueError(f"chunk {len(chunks)} of {header['chunks']} is missing")
        chunks.append(chunk)
    trailer = lines[start + 1 + header["chunks"]] if start + 1 + header["chunks"] < len(lines) else ""
    if len(chunks) != header["chunks"] or trailer != f"{END} {header['sha256']}":
        raise ValueError(f"{len(chunks)} of {header['chunks']} chunks, and no trailer")
    data = base64.b64decode("".join(chunks), validate=True)
    if len(data) != header["bytes"] or hashlib.sha256(data).hexdigest() != header["sha256"]:
        raise ValueError("the checksum does not match")
    return Bundle(header["name"], data, list(header.get("files", [])))


def unpack(bundle: Bundle, dest: str | Path) -> list[Path]:
    """Extract into ``dest`` (made if needed). Tar's 'data' filter refuses absolute paths, '..' and
    links that leave ``dest``: the archive came over the network."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(bundle.data), mode="r:gz") as tar:
        try:
            tar.extractall(dest, filter="data")
        except tarfile.FilterError as err:
            raise DPFLError(f"refused to unpack the job's run directory: {err}") from None
        names = [m.name for m in tar.getmembers() if m.isfile()]
    return [dest / n for n in names]


def without_bundle(log: str) -> str:
    """The log as a person reads it: each block shrunk to one line."""
    out = []
    for ln in log.splitlines(keepends=True):
        if ln.startswith(BEGIN + " "):
            try:
                header = json.loads(ln[len(BEGIN) + 1:])
                out.append(f"[run directory packed into this log: {len(header.get('files', []))} files, "
                           f"{header.get('bytes')} bytes; `dpfl jobs fetch` brings it back]\n")
            except ValueError:
                out.append("[run directory packed into this log]\n")
        elif not (ln.startswith(DATA + " ") or ln.startswith(END + " ")):
            out.append(ln)
    return "".join(out)
