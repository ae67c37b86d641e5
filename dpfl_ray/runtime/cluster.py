"""Facts about a cluster that need no Ray: which one an address names, where its token is, and
where a run's workers landed. Pure (no ``import ray``) so the CLI can use it before Ray is imported
and tests need no cluster; runtime/connect.py does the talking."""
from __future__ import annotations

import ipaddress
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ..errors import DPFLError

# ray://HOST with no port: the Ray Client server's default port.
CLIENT_PORT = 10001
# Set by Ray's job supervisor in the entrypoint's environment (ray/_private/runtime_env/constants.py).
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
# Ray's token sources, in the order of its loader (src/ray/rpc/authentication/authentication_token_loader.cc).
TOKEN_SOURCES = "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token"
TOKEN_FIX = ("copy the head node's ~/.ray/auth_token to this machine, or set RAY_AUTH_TOKEN "
             "(`ray get-auth-token` on the head prints it)")


@dataclass(frozen=True)
class Target:
    """Where ``dpfl run`` executes. ``kind``: ``local`` (a private Ray started here), ``gcs``
    (join a cluster through its GCS, HOST:PORT) or ``client`` (Ray Client, ray://HOST:PORT)."""
    kind: str
    host: str | None = None
    port: int | None = None
    source: str = "--address"
    inside_job: bool = False

    @property
    def address(self) -> str | None:
        """What ray.init receives."""
        if self.kind == "local":
            return None
        hostport = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        return f"ray://{hostport}" if self.kind == "client" else hostport

    @property
    def loopback(self) -> bool:
        return self.kind == "local" or _is_loopback(self.host)


@dataclass(frozen=True)
class Token:
    """An authentication token and where it was found (for messages; the value is never printed)."""
    value: str
    where: str


def resolve_target(address: str | None, environ: Mapping[str, str] | None = None,
                   recorded: Callable[[], str | None] | None = None) -> Target:
    """Parse ``--address``: ``auto``, ``HOST:PORT``, ``ray://HOST[:PORT]`` or ``local``. With no
    address, RAY_ADDRESS names the cluster (that is how a Ray Job's entrypoint finds its own);
    without it the run gets a private local Ray. ``recorded`` returns the address of the last
    ``ray start`` on this machine (only ``auto`` asks for it)."""
    environ = os.environ if environ is None else environ
    inside_job = JOB_CONFIG_ENV in environ
    source = "--address"
    if address is not None and not address.strip():  # e.g. --address "$ADDR" with ADDR unset: not a local run
        raise DPFLError("is empty: give HOST:PORT, ray://HOST:10001, auto or local, or leave it out", field=source)
    if address is None:
        address, source = (environ.get("RAY_ADDRESS") or "").strip(), "RAY_ADDRESS"
        if not address:
            return Target("local", inside_job=inside_job)
    address = address.strip()
    if address == "local":
        return Target("local", inside_job=inside_job)
    if address == "auto":
        # Ray's meaning of auto: RAY_ADDRESS if set, else the cluster `ray start` last started here
        found = (environ.get("RAY_ADDRESS") or "").strip()
        if found and found != "auto":
            return _parse_address(found, "RAY_ADDRESS", inside_job)
        found = recorded() if recorded else None
        if not found:
            raise DPFLError("auto: no Ray cluster was started on this machine with `ray start`; start one "
                            "(`ray start --head`) or give its address HOST:PORT", field=source)
        return _parse_hostport(found, "gcs", f"{source} auto (the last `ray start` here)", inside_job)
    return _parse_address(address, source, inside_job)


def _parse_address(address: str, source: str, inside_job: bool) -> Target:
    scheme, sep, rest = address.partition("://")
    if not sep:
        return _parse_hostport(address, "gcs", source, inside_job)
    if scheme in ("http", "https"):
        raise DPFLError(f"{address} is a dashboard (Jobs API) address; `dpfl run` joins a cluster by its GCS "
                        "address HOST:PORT (6379 by default) or ray://HOST:10001 -- to run as a Ray job use "
                        f"`dpfl submit SCENARIO --address {address}`", field=source)
    if scheme != "ray":
        raise DPFLError(f"{address}: unknown scheme {scheme}://; use HOST:PORT, ray://HOST:10001 or auto", field=source)
    return _parse_hostport(rest.rstrip("/"), "client", source, inside_job, default_port=CLIENT_PORT)


def _parse_hostport(text: str, kind: str, source: str, inside_job: bool, default_port: int | None = None) -> Target:
    host, port = text, None
    if text.startswith("["):  # [IPv6]:PORT
        host, _, tail = text[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else None
    elif text.count(":") == 1:
        host, port = text.split(":")
    if port is None and default_port is None:
        raise DPFLError(f"{text}: give the port too, HOST:PORT (the GCS port, 6379 by default)", field=source)
    try:
        port = default_port if port is None else int(port)
    except ValueError:
        raise DPFLError(f"{text}: the port must be a number", field=source) from None
    if not host or not 0 < port < 65536:
        raise DPFLError(f"{text}: expected HOST:PORT with a port in 1..65535", field=source)
    return Target(kind, host, port, source, inside_job)


def _is_loopback(host: str | None) -> bool:
    if host in (None, "localhost"):
        return host is not None
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def stay_on_loopback(target: Target, environ=None) -> None:
    """A private Ray, or a cluster reached on 127.0.0.1, stays on the loopback interface: without
    this Ray swaps 127.0.0.1 for the machine's routable IP, where a head started with
    ``--node-ip-address=127.0.0.1`` does not listen. Ray reads it at import, so call this before
    the first ``import ray``."""
    environ = os.environ if environ is None else environ
    if target.loopback:
        environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def find_auth_token(environ: Mapping[str, str] | None = None, home: Path | None = None) -> Token | None:
    """The token Ray's own loader would use: RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH
    names (first line), else ~/.ray/auth_token; None when there is none. A RAY_AUTH_TOKEN_PATH that
    cannot be read is a one-line error here (Ray aborts the process on it)."""
    environ = os.environ if environ is None else environ
    value = (environ.get("RAY_AUTH_TOKEN") or "").strip()
    if value:
        return Token(value, "RAY_AUTH_TOKEN")
    path = environ.get("RAY_AUTH_TOKEN_PATH") or ""
    if path:
        value = _first_line(Path(path))
        if not value:
            raise DPFLError(f"RAY_AUTH_TOKEN_PATH={path} cannot be read or is empty; point it at the cluster's "
                            "token file or unset it", field="RAY_AUTH_TOKEN_PATH")
        return Token(value, f"RAY_AUTH_TOKEN_PATH={path}")
    default = (home or Path(environ.get("HOME") or Path.home())) / ".ray" / "auth_token"
    value = _first_line(default)
    return Token(value, str(default)) if value else None


def _first_line(path: Path) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


def missing_token_message(where: str) -> str:
    return f"the Ray cluster at {where} requires an authentication token and none was found ({TOKEN_SOURCES}): {TOKEN_FIX}"


def rejected_token_message(where: str, token: Token) -> str:
    return f"the Ray cluster at {where} rejected the token from {token.where}: {TOKEN_FIX}"


def recorded_address_file(environ: Mapping[str, str] | None = None) -> Path:
    """Where ``ray start`` writes down its GCS address on this machine (what Ray's ``auto`` reads),
    located the way ray/_common/utils.py does, without importing Ray."""
    environ = os.environ if environ is None else environ
    base = environ.get("RAY_TMPDIR") or (environ.get("TMPDIR") if sys.platform.startswith("linux") else None) or "/tmp"
    return Path(base) / "ray" / "ray_current_cluster"


def recorded_address(environ: Mapping[str, str] | None = None) -> str | None:
    """The GCS address the last ``ray start`` on this machine wrote down (:func:`recorded_address_file`)."""
    return _first_line(recorded_address_file(environ)) or None


def placement_summary(pool: list[dict | None], num_cpus_per_worker: float, num_gpus_per_worker: float) -> dict:
    """What summary.json records about the workers' placement (issue #11, 'Across nodes'): per
    node, how many workers ran there and which GPU ids they were given. ``pool`` is the start
    event's list of ClientWorker.info() (None for a worker that never answered)."""
    known = [p for p in pool if p]
    by_node: dict[str, dict] = {}
    for node, count in sorted(Counter(p["node"] for p in known).items()):
        ids = sorted({g for p in known if p["node"] == node for g in p.get("gpu_ids", [])})
        by_node[node] = {"workers": count, "gpu_ids": ids}
    return {"workers": len(pool), "num_cpus_per_worker": num_cpus_per_worker,
            "num_gpus_per_worker": num_gpus_per_worker, "nodes": by_node,
            "unreported": len(pool) - len(known)}
