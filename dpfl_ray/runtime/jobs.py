"""Ray Jobs for dpfl: submit a scenario, watch it, bring its run directory back.

Everything goes through Ray's Job Submission SDK at the dashboard address (``http://HEAD:8265``),
the one port a user usually reaches, with the cluster's token found as Ray's loader finds it
(runtime/connect.py). The SDK's own requests carry no timeout; every call here does.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import DPFLError
from .cluster import Token, find_auth_token, missing_token_message, rejected_token_message

# (connect, read) seconds for every HTTP request to the dashboard. requests' read timeout bounds each
# read, not the answer: a server that sends a byte every few seconds is never cut off by it, so every
# request also has a deadline for the whole of it, their sum (an upload, the project's package: UPLOAD_S).
HTTP_TIMEOUT_S = (5.0, 60.0)
UPLOAD_S = 600.0
# The job's entrypoint reads the resolved scenario from here (runtime_env env_vars).
SCENARIO_ENV = "DPFL_SCENARIO_YAML"
# A sweep job's `dpfl sweep` options (JSON list: --grid, --seeds, ...); absent for a single run.
SWEEP_ENV = "DPFL_SWEEP_ARGS"
# Never shipped with a job: the local virtualenv, past runs, history, caches.
EXCLUDES = [".venv", "venv", "runs", ".git", "**/__pycache__", "*.pyc", ".pytest_cache", ".hypothesis",
            ".mypy_cache", ".ruff_cache", "*.egg-info", "build", "dist", "tmp"]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def dashboard_address(address: str | None, environ=None) -> str:
    """``--address`` for the Jobs API, else RAY_API_SERVER_ADDRESS, else an http(s) RAY_ADDRESS."""
    environ = os.environ if environ is None else environ
    for value, source in ((address, "--address"), (environ.get("RAY_API_SERVER_ADDRESS"), "RAY_API_SERVER_ADDRESS"),
                          (environ.get("RAY_ADDRESS"), "RAY_ADDRESS")):
        if not value:
            continue
        value = value.strip().rstrip("/")
        if value.startswith(("http://", "https://")):
            return _checked_url(value, source)
        if source != "RAY_ADDRESS":  # RAY_ADDRESS may name a GCS (HEAD:6379) for `dpfl run`: not ours to judge
            raise DPFLError(f"{value}: jobs go through the dashboard, http://HEAD:8265 (with `ray up`, forward it with "
                            "`ray dashboard cluster.yaml`)", field=source)
    raise DPFLError("give the cluster's dashboard address, --address http://HEAD:8265 (or set RAY_API_SERVER_ADDRESS)",
                    field="--address")


def _checked_url(value: str, source: str) -> str:
    """``value`` if it names a host (and a port that is a number), else the error naming ``source``."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        ok = bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError on a port that is no number
    except ValueError:
        ok = False
    if not ok:
        raise DPFLError(f"{value}: not a dashboard address such as http://HEAD:8265", field=source)
    return value


def submission_id(name: str | None, scenario_name: str, now: float | None = None) -> str:
    """``--name`` as given, else SCENARIO-YYYYmmdd-HHMMSS-xxxx (Ray refuses a reused id)."""
    if name:
        if not _ID.match(name):
            raise DPFLError(f"{name!r}: letters, digits, '-', '_' and '.' only", field="--name")
        return name
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', scenario_name)}-{stamp}-{os.urandom(2).hex()}"


def project_root() -> Path | None:
    """The source checkout this dpfl runs from (it has pyproject.toml next to dpfl_ray/ and cli/)."""
    import dpfl_ray

    root = Path(dpfl_ray.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "cli").is_dir() else None


def install_requirements(root: Path | None = None) -> list[str]:
    """What a node needs to run dpfl: the project's dependencies (from the shipped checkout's
    pyproject.toml, else from the installed package), torch pinned to this machine's version."""
    if root is not None and (root / "pyproject.toml").is_file():
        import tomllib

        reqs = list(tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"])
    else:
        reqs = [r for r in (md.requires("dpfl-ray") or []) if "extra ==" not in r]
    torch = md.version("torch").split("+")[0]
    return [f"torch=={torch}" if re.match(r"^torch\b", r) else r for r in reqs]


def job_runtime_env(scenario_yaml: str, root: Path | None, install: bool = False,
                    sweep_args: list[str] | None = None) -> dict:
    """The job's runtime_env: the checkout ``root`` as working_dir (it lands first on the job's
    PYTHONPATH, so the job runs exactly this code; without a checkout, the two installed packages),
    the resolved scenario as an environment variable (with ``sweep_args``, the `dpfl sweep` options
    of a sweep job too), and with ``install`` the dependencies through pip for nodes that lack them."""
    import importlib.util

    import dpfl_ray

    env: dict = {"env_vars": {SCENARIO_ENV: scenario_yaml}, "excludes": list(EXCLUDES)}
    if sweep_args is not None:
        import json

        env["env_vars"][SWEEP_ENV] = json.dumps(sweep_args)
    if root is not None:
        env["working_dir"] = str(root)
    else:  # an installed dpfl: ship its two packages (cli found, not imported: the runtime sits below it)
        cli_dir = Path(importlib.util.find_spec("cli").origin).parent
        env["py_modules"] = [str(Path(dpfl_ray.__file__).parent), str(cli_dir)]
    if install:
        env["pip"] = {"packages": install_requirements(root), "pip_check": False}
    return env


def entrypoint_command(out: str) -> str:
    """The job runs `dpfl run` through this hidden command, which then packs the run directory
    into the log (dpfl_ray/runs/bundle.py). ``python -m`` resolves the shipped working_dir first."""
    return f"python -m cli.main jobs entrypoint --out {shlex.quote(out)}"


@dataclass(frozen=True)
class JobView:
    """What `dpfl jobs list/status` shows of a job."""
    job_id: str
    status: str
    message: str
    start_time: float | None
    end_time: float | None
    entrypoint: str
    metadata: dict

    @classmethod
    def of(cls, details) -> "JobView":
        sec = lambda ms: ms / 1000 if ms else None  # noqa: E731 - Ray reports milliseconds
        return cls(details.submission_id or details.job_id or "?", str(details.status), details.message or "",
                   sec(details.start_time), sec(details.end_time), details.entrypoint or "", details.metadata or {})


def _not_a_dashboard(where: str, why: str) -> DPFLError:
    """An answer the Jobs SDK cannot read: not JSON (another server), or JSON of another shape (another
    server, or a head on another Ray version)."""
    import ray

    return DPFLError(f"the server at {where} does not answer as Ray {ray.__version__}'s Jobs API does ({why}): is this "
                     "the head's dashboard port (8265 by default), on the same Ray version?")


class Jobs:
    """The Jobs API of one cluster. Every request has a timeout; every failure is one DPFLError."""

    def __init__(self, address: str, token: Token | None = None, timeout_s=HTTP_TIMEOUT_S):
        self.address = address
        self.token = token if token is not None else find_auth_token()
        self._client = self._call(lambda: _client_class()(address, headers=self._headers(), timeout=timeout_s))

    def _headers(self) -> dict:
        # Sent whenever a token exists: a dashboard without authentication ignores it.
        return {"Authorization": f"Bearer {self.token.value}"} if self.token else {}

    def _call(self, fn: Callable, job_id: str | None = None):
        import requests
        from ray.exceptions import AuthenticationError

        where = f"{self.address}"
        try:
            return fn()
        except AuthenticationError as err:
            if self.token is None or "Unauthorized" in str(err).split("\n")[0]:
                raise DPFLError(missing_token_message(where)) from None
            raise DPFLError(rejected_token_message(where, self.token)) from None
        except (requests.exceptions.Timeout, TimeoutError):
            raise DPFLError(f"the Ray dashboard at {where} did not answer in time") from None
        except (requests.exceptions.ConnectionError, ConnectionError):
            raise DPFLError(f"cannot reach the Ray dashboard at {where}: is the head running, and is this its "
                            "dashboard port (8265 by default)?") from None
        except DPFLError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as err:  # the SDK cannot read the answer
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise _not_a_dashboard(where, f"{type(err).__name__}: {first}" if first else type(err).__name__) from None
        except RuntimeError as err:
            text = str(err)
            if job_id and ("404" in text or "does not exist" in text):
                raise DPFLError(f"no job {job_id} on the cluster at {where}") from None
            if "already exists" in text:
                raise DPFLError(f"a job {job_id} exists already on {where}; choose another --name") from None
            raise DPFLError(f"the Jobs API at {where} refused: {text.splitlines()[0][:300]}") from None

    def submit(self, entrypoint: str, runtime_env: dict, job_id: str, metadata: dict) -> str:
        return self._call(lambda: self._client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                                          submission_id=job_id, metadata=metadata), job_id)

    def info(self, job_id: str) -> JobView:
        return JobView.of(self._call(lambda: self._client.get_job_info(job_id), job_id))

    def status(self, job_id: str) -> str:
        return self.info(job_id).status

    def list(self) -> list[JobView]:
        views = [JobView.of(d) for d in self._call(self._client.list_jobs)]
        return sorted(views, key=lambda v: v.start_time or 0)

    def logs(self, job_id: str) -> str:
        logs = self._call(lambda: self._client.get_job_logs(job_id), job_id) or ""
        if not isinstance(logs, str):
            raise _not_a_dashboard(self.address, "logs that are not text")
        return logs

    def stop(self, job_id: str) -> bool:
        self.info(job_id)  # a missing job is an error, not a silent False
        return bool(self._call(lambda: self._client.stop_job(job_id), job_id))

    def follow(self, job_id: str, write: Callable[[str], None], poll_s: float = 1.0) -> str:
        """Stream the job's new log lines to ``write`` until it ends; returns its final status.
        Each poll is two bounded requests; the wait between them returns to Python every 0.1 s."""
        shown = 0
        while True:
            status = self.status(job_id)
            text = self.logs(job_id)
            end = len(text) if status in TERMINAL else text.rfind("\n", shown) + 1
            if end > shown:
                write(text[shown:end])
                shown = end
            if status in TERMINAL:
                return status
            until = time.monotonic() + poll_s
            while time.monotonic() < until:
                time.sleep(0.1)


def _client_class():
    """JobSubmissionClient whose every request carries a timeout (the SDK sets none) and a deadline for the
    whole answer (HTTP_TIMEOUT_S)."""
    import logging

    from ray.job_submission import JobSubmissionClient

    from .connect import call_bounded

    # The SDK narrates its packaging at INFO/WARNING; dpfl says what matters itself.
    logging.getLogger("ray").setLevel(logging.ERROR)

    class TimedJobSubmissionClient(JobSubmissionClient):
        def __init__(self, address, headers, timeout):
            self._dpfl_timeout = timeout  # read by _do_request, which __init__ already calls
            super().__init__(address, headers=headers)

        def _do_request(self, method, endpoint, **kwargs):
            kwargs.setdefault("timeout", self._dpfl_timeout)
            total = UPLOAD_S if kwargs.get("data") is not None else float(sum(self._dpfl_timeout))
            return call_bounded(lambda: JobSubmissionClient._do_request(self, method, endpoint, **kwargs), total,
                                f"a request to the Ray dashboard at {self._address}")

    return TimedJobSubmissionClient

