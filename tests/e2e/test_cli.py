"""The real ``dpfl`` command in a subprocess: a happy path and every kind of user mistake."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def dpfl(*args, cwd=ROOT):
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


TINY = {
    "name": "tiny-e2e", "seed": 1,
    "data": {"source": "synthetic", "num_clients": 12, "synthetic_examples": 400, "synthetic_features": 6},
    "model": {"name": "logistic"},
    "training": {"rounds": 3, "batch_size": 8, "lr": 0.3},
    "sampling": {"mode": "fixed", "clients_per_round": 6},
    "resources": {"workers": 1, "num_cpus_per_worker": 0.5},
}


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def test_run_writes_the_run_directory_and_its_driver_loads_no_torch(tiny, tmp_path):
    """A private run end to end. The first worker builds the initial model and makes model.pt's
    bytes, which are those any process makes for the same model; the `dpfl run` process itself
    never imports torch (-X importtime: every import of the driver, on its stderr)."""
    import torch

    from dpfl_ray.training.models import model_file

    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "cli.main", "run", str(tiny), "--out", str(out),
                          "--set", "faults.dropout.model=tail", "--set", "faults.dropout.rate=0.5"], cwd=ROOT,
                         env=dict(os.environ, COLUMNS="200"), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "completed: 3 rounds" in res.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert "matplotlib" in imported and "torch" not in imported
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [(r["round"], r["sampled"], r["survived"]) for r in rounds] == [(1, 6, 3), (2, 6, 3), (3, 6, 3)]
    for key in ("test_accuracy", "test_loss", "seconds"):
        assert all(isinstance(r[key], float) for r in rounds)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["rounds_completed"] == 3 and summary["seed"] == 1
    assert summary["final_accuracy"] == rounds[-1]["test_accuracy"] and summary["versions"]["torch"]
    resolved = yaml.safe_load((out / "scenario.yaml").read_text())
    assert resolved["faults"]["dropout"] == {"model": "tail", "rate": 0.5, "phase": "upload"}
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    state = torch.load(out / "model.pt")
    assert (out / "model.pt").read_bytes() == model_file(state)
    # an existing run directory is never overwritten
    again = dpfl("run", tiny, "--out", out)
    assert again.returncode == 2 and "already holds files" in again.stderr


@pytest.mark.parametrize("override, field", [
    ("data.sorce=mnist5k", "data.sorce: unknown key"),
    ("training.rounds=lots", "training.rounds"),
    ("data.examples_per_client=1000", "data.examples_per_client"),
    ("data.partition.kind=shards", None),  # fine on its own ...
])
def test_user_mistakes_are_one_line(tiny, tmp_path, override, field):
    out = tmp_path / "never"
    if field is None:
        res = dpfl("run", tiny, "--out", out, "--set", override, "--set", "data.partition.shards_per_client=100")
        field = "data.partition.shards_per_client"  # ... impossible with 100 shards per client
    else:
        res = dpfl("run", tiny, "--out", out, "--set", override)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and field in lines[0], res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not out.exists()


def test_missing_and_malformed_files(tmp_path):
    res = dpfl("run", tmp_path / "nope.yaml")
    assert res.returncode == 2 and "no scenario file" in res.stderr and "Traceback" not in res.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: {rounds: [\n")
    res = dpfl("scenarios", "validate", bad)
    assert res.returncode == 2 and "not valid YAML" in res.stderr


def test_scenarios_list_and_validate(tiny):
    res = dpfl("scenarios", "list")
    assert res.returncode == 0 and "quickstart.yaml" in res.stdout
    res = dpfl("scenarios", "validate", ROOT / "scenarios" / "quickstart.yaml")
    assert res.returncode == 0 and "100 clients, sizes 40-40" in res.stdout
    res = dpfl("scenarios", "validate", tiny, "--set", "model.name=transformer")
    assert res.returncode == 2 and "model.name" in res.stderr


@pytest.mark.parametrize("args, needle", [
    (("run",), "give a scenario file, or --resume RUN_DIR"),
    (("run", "x.yaml", "--bogus"), "No such option"),
    (("privacy", "epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.01", "--rounds", "abc",
      "--delta", "1e-5"), "--rounds"),
])
def test_malformed_command_lines_are_one_line(args, needle):
    res = dpfl(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_the_command_line_loads_no_accounting_or_training_library():
    """Every dpfl command imports cli.main to list its commands; dp_accounting, torch, ray and
    matplotlib load only in the commands that use them (they cost ~3 s before)."""
    code = ("import sys, cli.main; "
            "print(sorted(m for m in ('torch', 'dp_accounting', 'ray', 'matplotlib') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def _parent_fork_hooks(path: str) -> bool:
    """Whether the module at ``path`` calls os.register_at_fork with a hook run in the parent."""
    source = Path(path).read_text(errors="replace")
    if "register_at_fork" not in source:
        return False
    return any(isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) ==
               "register_at_fork" and {k.arg for k in node.keywords} & {"before", "after_in_parent"}
               for node in ast.walk(ast.parse(source)))


def test_the_plotting_thread_registers_no_fork_hook_while_ray_starts():
    """`dpfl run` imports matplotlib in a thread while ray.init forks Ray's processes (each fork
    runs the parent's at-fork hooks before and after it). No module that thread loads for the first
    time may register a parent-side hook: one registered between a fork's two halves runs only its
    second, as concurrent.futures' lock release did ("Exception ignored ... release unlocked lock"
    on stderr). Checked on the installed matplotlib, by its source."""
    code = ("import importlib, json, sys; from cli.run import PARENT_FORK_HOOK_MODULES; "
            "[importlib.import_module(m) for m in PARENT_FORK_HOOK_MODULES]; "
            "before = set(sys.modules); "
            "from dpfl_ray.runs.record import plotting_library; plotting_library(); "
            "print(json.dumps(sorted({getattr(m, '__file__', None) or '' for n, m in list(sys.modules.items()) "
            "if n not in before})))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    loaded = [f for f in json.loads(res.stdout.strip().splitlines()[-1]) if f.endswith(".py") and Path(f).is_file()]
    assert any("/matplotlib/" in f for f in loaded)
    assert [f for f in loaded if _parent_fork_hooks(f)] == []
    # the probe finds the hook that caused it when the module is not imported first
    import concurrent.futures.thread

    assert _parent_fork_hooks(concurrent.futures.thread.__file__)


@pytest.mark.parametrize("scenario, loaded", [("quickstart.yaml", []),
                                               ("dp_fedavg_quickstart.yaml", ["dp_accounting", "scipy"])])
def test_only_a_private_run_loads_dp_accounting(tmp_path, scenario, loaded):
    """A non-private `dpfl run` checks its scenario and loads the driver and coordinator code
    without dp_accounting (and scipy under it): 0.8 s before Ray starts, which every `make run`
    paid for a check that answers None. A private run needs it, which shows the probe works."""
    code = ("import sys; from pathlib import Path; from cli.run import _prepare; "
            "import dpfl_ray.runtime.driver, dpfl_ray.runtime.coordinator; "
            f"_prepare(Path('scenarios/{scenario}'), [], Path(sys.argv[1]), None, None, []); "
            "print(sorted(m for m in ('dp_accounting', 'scipy') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == str(loaded)
    assert not (tmp_path / "run").exists()  # the checks write nothing
