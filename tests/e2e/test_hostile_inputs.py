"""Issue #16's hostile-input sweep through the real ``dpfl`` in a subprocess (no Ray: everything here
fails, or answers, before Ray would start): one ``error:`` line on stderr, exit 2, no traceback,
nothing written. Plus the commands that used to run without bound, and strict JSON on disk."""
import hashlib
import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from dpfl_ray.errors import DPFLError
from dpfl_ray.runs.record import check_writable
from tests.helpers import dpfl_in_process

ROOT = Path(__file__).resolve().parents[2]

TINY = {
    "name": "hostile", "seed": 1,
    "data": {"source": "synthetic", "num_clients": 12, "synthetic_examples": 400, "synthetic_features": 6},
    "model": {"name": "mlp", "hidden": [8]},
    "training": {"rounds": 2, "batch_size": 8, "lr": 0.3},
    "sampling": {"mode": "fixed", "clients_per_round": 6},
    "resources": {"workers": 1, "num_cpus_per_worker": 0.5},
}


def dpfl(*args, cwd=ROOT, limit_bytes=None):
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=str(ROOT))
    env.pop("DPFL_DEBUG", None)

    def limit():  # an address-space limit, like `ulimit -v`
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, preexec_fn=limit if limit_bytes else None)


def assert_one_error_line(res, needle=None):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr, res.stdout)
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    if needle is not None:
        assert needle in lines[0], lines[0]
    return lines[0]


def files_under(path: Path) -> set:
    return {p.relative_to(path) for p in path.rglob("*")}


@pytest.fixture
def tiny(tmp_path):
    raw = dict(TINY, output={"dir": str(tmp_path / "runs")})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("override, needle", [
    ("training.lr=.inf", "training.lr: Input should be a finite number"),
    ("training.lr=1e400", "training.lr: Input should be a finite number"),
    ("training.rounds=true", "training.rounds: Input should be a valid integer"),
    ("training..rounds=2", "empty path segment"),
    ("seed=-1", "seed: Input should be greater than or equal to 0"),
    (f"seed={2**64 + 1}", "seed: Input should be less than or equal to"),
    ("model.hidden=[-5]", "model.hidden.0"),
    ("model.hidden=[0]", "model.hidden.0"),
    ("name=../escaped", "name: must be"),
    ("data.repeat=1", "data.repeat: Input should be a valid boolean"),
])
def test_run_overrides(tiny, tmp_path, override, needle):
    before = files_under(tmp_path)
    res = dpfl_in_process("run", tiny, "--set", override)  # no --out: name=../escaped would pick the folder
    _one_line_in_process(res, needle)
    assert files_under(tmp_path) == before and not (tmp_path / "escaped").exists()


@pytest.mark.parametrize("content, needle", [
    (yaml.safe_dump(TINY).replace("rounds: 2", "rounds: '3'"), "training.rounds: Input should be a valid integer"),
    (yaml.safe_dump(TINY) + "seed: 2\n", "key 'seed' is given twice"),
    ("", "the scenario is empty"),
    (bytes(range(256)) * 8, "not a text (UTF-8) file"),
])
def test_run_scenario_files(tmp_path, content, needle):
    path = tmp_path / "s.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    res = dpfl_in_process("run", path, "--out", tmp_path / "never")
    _one_line_in_process(res, needle)
    assert not (tmp_path / "never").exists()


def test_unwritable_out_is_refused_before_ray_starts(tiny, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    res = dpfl_in_process("run", tiny, "--out", blocker / "run")
    _one_line_in_process(res, "--out: cannot create")
    assert "workers ->" not in res.stdout  # the banner printed once Ray is up
    read_only = Path("/sys/dpfl-hostile-test")  # sysfs is read-only, even for root (chmod is not)
    try:
        check_writable(read_only)
    except DPFLError:
        res = dpfl_in_process("run", tiny, "--out", read_only)
        _one_line_in_process(res, "--out: cannot write in /sys")
        assert "workers ->" not in res.stdout and not read_only.exists()


def test_a_model_that_cannot_take_the_data_is_refused_before_ray_starts(tiny, tmp_path):
    """The model itself is built while Ray starts (cli/run.py); whether it fits the data is
    checked before, without torch. The address is dead: had Ray been started (joined) first, the
    error would be about it."""
    res = dpfl_in_process("run", tiny, "--out", tmp_path / "never", "--set", "model.name=cnn", "--address",
                          "127.0.0.1:9")
    _one_line_in_process(res, "model.name: the cnn needs images of at least 16x16")
    assert "workers ->" not in res.stdout and not (tmp_path / "never").exists()


def _run_dir(path: Path, summary, rounds_text: str) -> Path:
    path.mkdir(parents=True)
    (path / "summary.json").write_bytes(summary if isinstance(summary, bytes) else json.dumps(summary).encode())
    (path / "rounds.jsonl").write_text(rounds_text)
    return path


@pytest.mark.parametrize("summary, rounds, needle", [
    (bytes(range(256)), '{"round": 1}\n', "summary.json is not a text (UTF-8) file"),
    ({"name": "x"}, '{"round": 1, "test_accuracy": "0.9"}\n', "rounds.jsonl line 1: test_accuracy must be a number"),
    ({"name": "x", "final_accuracy": "high"}, '{"round": 1}\n', "summary.json: final_accuracy must be a number"),
    ({"name": "x", "epsilon": True}, '{"round": 1}\n', "summary.json: epsilon must be a number"),
    ({"name": "x"}, '{"round": 1, "test_accuracy": 2.5}\n', "rounds.jsonl line 1: test_accuracy must be in [0, 1]"),
    ({"name": "x"}, '{"round": -5}\n', "rounds.jsonl line 1: round must be in [1, inf]"),
])
def test_report_on_broken_runs(tmp_path, summary, rounds, needle):
    run = _run_dir(tmp_path / "run", summary, rounds)
    res = dpfl_in_process("report", run, "--out", tmp_path / "report")
    _one_line_in_process(res, needle)
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("args, limit", [
    (("--dim", "1000000000"), None),
    (("--clients", "100000"), None),
    (("--clients", "2000", "--dim", "100000"), 3 * 2**30),  # 8 GB under a 3 GB address-space limit
])
def test_bench_secagg_refuses_what_cannot_fit(args, limit):
    res = dpfl("bench", "secagg", *args, "--json", limit_bytes=limit)
    assert_one_error_line(res, "GiB is available")


def test_bench_keep_refuses_a_folder_that_holds_files(tmp_path):
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "report.json").write_text('{"earlier": "results"}')
    res = dpfl("bench", "run", "W1", "--keep", keep)
    assert_one_error_line(res, "--keep")
    assert [p.name for p in keep.iterdir()] == ["report.json"]  # nothing ran, nothing was overwritten
    assert (keep / "report.json").read_text() == '{"earlier": "results"}'


def test_any_exception_is_one_line(tmp_path):
    # a report folder that is a file: the plots cannot be written (an OSError deep in matplotlib/csv)
    run = _run_dir(tmp_path / "run", {"name": "x"}, '{"round": 1, "test_accuracy": 0.5}\n')
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    res = dpfl("report", run, "--out", blocker)
    assert_one_error_line(res)


@pytest.mark.parametrize("args, needle", [
    (("epsilon", "--noise-multiplier", "0.01", "--sampling-rate", "0.01", "--rounds", "100", "--delta", "1e-5"),
     "grid"),
    (("epsilon", "--noise-multiplier", "0.01", "--sampling-rate", "1", "--rounds", "1", "--delta", "1e-5"), "grid"),
    (("epsilon", "--noise-multiplier", "0.0001", "--sampling-rate", "0.01", "--rounds", "100", "--delta", "1e-5"),
     "accountant_used=rdp"),
    (("noise", "--epsilon", "1e6", "--sampling-rate", "0.01", "--rounds", "100", "--delta", "1e-5"), "grid"),
    (("noise", "--epsilon", "8", "--sampling-rate", "0.01", "--rounds", "10000000", "--delta", "1e-5"), "rdp"),
    (("noise", "--epsilon", "8", "--sampling-rate", "0.01", "--rounds", "100", "--delta", "0.999999"),
     "smaller z"),
])
def test_privacy_commands_that_ran_without_bound_now_answer(args, needle):
    res = dpfl_in_process("privacy", *args, "--json")
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert needle in data["accountant_note"] + f" accountant_used={data['accountant_used']}"
    assert data["epsilon"] is None or math.isfinite(data["epsilon"])


def test_privacy_table_shows_the_search_cap_as_a_bound():
    res = dpfl_in_process("privacy", "table", "--budgets", "1e9", "--rounds", "1", "--dropout-rates", "0")
    assert res.exit_code == 0, res.stderr
    assert ">= 1e7" in res.stdout and "10,000,000" not in res.stdout


def test_validate_says_when_the_accountant_will_not_be_plain_pld():
    res = dpfl_in_process("scenarios", "validate", ROOT / "scenarios" / "dp_fedavg_quickstart.yaml", "--no-data",
                          "--set", "privacy.noise_multiplier=0.01", "--set", "training.rounds=2")
    assert res.exit_code == 0 and "note: pld accounts z=0.01" in res.stdout
    res = dpfl_in_process("scenarios", "validate", ROOT / "scenarios" / "dp_fedavg_quickstart.yaml", "--no-data",
                          "--set", "privacy.noise_multiplier=0.0001")
    assert res.exit_code == 0 and "accounting with rdp instead" in res.stdout


def test_report_keeps_the_run_column_readable_at_80_columns(tmp_path):
    runs = []
    for i, name in enumerate(["quickstart", "dp_fedavg_quickstart", "baek2021_mnist_z1_drop30_calibrated"]):
        runs.append(_run_dir(tmp_path / "runs" / f"{name}-20260101-12000{i}",
                             {"name": name, "final_accuracy": 0.8, "rounds_completed": 2, "rounds_planned": 2,
                              "stop_reason": "completed", "wall_seconds": 1.0, "epsilon": 1.5, "delta": 1e-5},
                             '{"round": 1, "test_accuracy": 0.7, "epsilon": 1.0}\n'
                             '{"round": 2, "test_accuracy": 0.8, "epsilon": 1.5}\n'))
    env = dict(os.environ, COLUMNS="80", PYTHONPATH=str(ROOT))  # and stdout is a pipe, not a terminal
    res = subprocess.run([sys.executable, "-m", "cli.main", "report", *map(str, runs), "--out", tmp_path / "rep"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert all(len(line) <= 80 for line in res.stdout.splitlines() if not line.startswith("wrote "))
    for run in runs:
        assert f"runs/{run.name}" in res.stdout  # every run's full label, unsquashed
    assert res.stdout.count("0.8000") == 6 and res.stdout.count("1.500") == 3  # final and best accuracy


def test_json_files_hold_no_nan_or_infinity(tmp_path):
    from dpfl_ray.runs.record import RunRecord

    record = RunRecord(tmp_path / "run")
    record.add_round({"round": 1, "test_loss": float("nan"), "test_accuracy": 0.1, "epsilon": float("inf")})
    record.write_json("summary.json", {"final_loss": float("nan"), "history": [1.0, float("-inf")]})
    record.close()
    line = (tmp_path / "run" / "rounds.jsonl").read_text().strip()
    summary = (tmp_path / "run" / "summary.json").read_text()
    for text in (line, summary):
        assert "NaN" not in text and "Infinity" not in text
        json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    row = json.loads(line)
    assert row["test_loss"] is None and row["non_finite"] == {"test_loss": "nan", "epsilon": "inf"}
    assert json.loads(summary)["non_finite"] == {"final_loss": "nan"} and json.loads(summary)["history"][1] is None


@pytest.mark.parametrize("args", [("--help",), ("scenarios", "list")])
def test_a_reader_that_went_away_gets_no_traceback(args):
    """`dpfl --help | head -1`: the pipe closes under rich's writes. Before, rich's SystemExit met an
    except clause naming an Abort that Typer's vendored click does not have: a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=str(ROOT))
    env.pop("DPFL_DEBUG", None)
    try:
        res = subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env, stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    assert res.stderr.strip() == "", res.stderr[-2000:]



# Nine nested aliases of nine items each (issue 37): a few hundred bytes that expand to 9^9 strings
# in whatever walks the loaded tree; before, `scenarios validate` grew to 24 GB.
ALIAS_BOMB = "\n".join(['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
                       + [f"{c}: &{c} [{','.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
                       + ["description: *i", ""])
# the same bomb as one flow mapping, for a --set value
ALIAS_BOMB_VALUE = "{" + ", ".join(ALIAS_BOMB.splitlines()[:9]) + "}"


# Runs python ARGS as a child under a 2 GiB address-space limit and writes the child's own peak RSS
# (kB) to $RSS_OUT. A launcher of its own, because a child forked from this test process would count
# the test's resident pages (torch, once imported) in its peak until it execs.
_MEASURED = """
import os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable] + sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
with open(os.environ["RSS_OUT"], "w") as out:
    out.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("where", ["file", "--set"])
def test_a_yaml_alias_bomb_is_refused_in_a_small_process(tmp_path, where):
    """The whole `dpfl` process stays under 200 MB (its peak RSS, from wait4); a 2 GiB address-space
    limit makes a regression fail here instead of exhausting the machine. The refusal's own time
    is tests/unit/test_scenario.py's (the process spends about 1.5 s importing)."""
    if where == "file":
        path = tmp_path / "bomb.yaml"
        path.write_text(ALIAS_BOMB)
        args = ["scenarios", "validate", str(path), "--no-data"]
    else:
        args = ["scenarios", "validate", str(ROOT / "scenarios" / "quickstart.yaml"), "--no-data", "--set",
                f"description={ALIAS_BOMB_VALUE}"]
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=str(ROOT), RSS_OUT=str(tmp_path / "rss"))
    env.pop("DPFL_DEBUG", None)
    res = subprocess.run([sys.executable, "-c", _MEASURED, "-m", "cli.main", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    max_rss_kb = int((tmp_path / "rss").read_text())
    line = assert_one_error_line(res, "YAML anchors and aliases (&a) are not allowed")
    assert where == "file" or line.startswith("error: --set description:"), line
    assert max_rss_kb < 200 * 1024, max_rss_kb


def _one_line_in_process(res, needle):
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (res.exit_code, res.stderr)
    assert needle in lines[0] and "Traceback" not in res.stderr + res.stdout, lines[0]


UNBALANCED = ("--set", "data.partition.kind=unbalanced", "--set", "data.repeat=true")
# The second CLI sweep's findings (internal errors, a wrong name, a run out of memory), each now one line.
SECOND_SWEEP = [
    # client sizes an unbalanced partition draws are capped as examples_per_client is (one ran out of memory)
    (("scenarios", "validate", "{tiny}", "--no-data", *UNBALANCED, "--set", "data.partition.size_mean=10000000"),
     "data.num_clients x data.partition.size_mean = 120,000,000 examples; at most 10,000,000"),
    (("scenarios", "validate", "{tiny}", *UNBALANCED, "--set", "data.num_clients=1000", "--set",
      "data.partition.min_size=10000", "--set", "data.partition.size_mean=10000", "--set", "data.partition.size_sigma=3"),
     "data.partition.size_sigma: the lognormal sizes drawn for 1000 clients sum to"),
    (("scenarios", "validate", "{tiny}", *UNBALANCED, "--set", "data.num_clients=10000", "--set",
      "data.partition.size_distribution=zipf", "--set", "data.partition.size_mean=1000", "--set",
      "data.partition.min_size=999"), "data.partition.size_mean: the zipf sizes drawn for 10000 clients sum to"),
    (("scenarios", "validate", "{tiny}", "--no-data", *UNBALANCED, "--set", "data.partition.size_sigma=1e300"),
     "data.partition.size_sigma: Input should be less than or equal to 10"),
    # a std above 0 as a float64 and 0 as the float32 inputs (NaN losses, numpy's warnings on stderr)
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "data.normalize=[0, 1e-320]"),
     "std must be at least 1e-06"),
    # a delay past the clock's range (an OverflowError once the run had started)
    (("scenarios", "validate", "{tiny}", "--no-data", "--set",
      "faults.stragglers={{fraction: 1, latency: {{distribution: fixed, seconds: 1e308}}}}"),
     "faults.stragglers.latency.seconds: Input should be less than or equal to 86400"),
    # a fixed-point scale that encodes no value of magnitude 1: every round aborted, and the run "completed"
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "secagg.enabled=true", "--set", "secagg.scale=1e300"),
     "secagg.scale=1e+300 leaves no value of magnitude 1 inside the ring of 64 bits"),
    # the scenario's field, not the library's parameter
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "training.algorithm=dp_fedavg", "--set",
      "privacy.accountant=rdp", "--set", "privacy.target_epsilon=1e300"),
     "privacy.target_epsilon: epsilon 1e+300 is met even with a noise multiplier below 1e-4"),
    # the unparsable axis, not --num-samples, is named
    (("sweep", "{tiny}", "--dry-run", "--search", "random", "--grid", "training.lr=uniform(a", "--num-samples", "2"),
     "--grid: training.lr=uniform(a: its parenthesis is not closed"),
    # a dry run refuses what the run would
    (("reproduce", "wei2020", "--dry-run", "--quick", "--only", "eps8"), "--only: 'eps8' is not one of wei2020's quick"),
    (("reproduce", "wei2020", "--dry-run", "--out", "{tiny}"), "--out: {tiny} is not a folder"),
    (("privacy", "table", "--rounds", "1,,2"), "rounds: has an empty value ('1,,2')"),
]


@pytest.mark.parametrize("args, needle", [
    # user text is printed as typed: no emoji for ':x', no markup for '[bold]'
    (("run", "{tiny}", "--address", "foo::bar:x"), "--address: foo::bar:x: give the port too"),
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "[bold]zz[/bold]=1"), "[bold]zz[/bold]: unknown key"),
    # every count that sizes an allocation has a checked limit, named by its field
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "data.num_clients=1000000000", "--set",
      "data.repeat=true"), "data.num_clients: Input should be less than or equal to 1000000"),
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "data.examples_per_client=100000", "--set",
      "data.num_clients=1000"), "data.num_clients x data.examples_per_client = 100,000,000 examples"),
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "model.hidden=[1000000000]"),
     "model.hidden.0: Input should be less than or equal to 16384"),
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "data.synthetic_examples=1000000", "--set",
      "data.synthetic_features=100000"), "data.synthetic_examples x data.synthetic_features"),
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "training.algorithm=dp_fedavg", "--set",
      "privacy.noise_multiplier=1", "--set", "privacy.audit.canaries=1000000000"),
     "privacy.audit.canaries: Input should be less than or equal to 10000"),
    # a budget the first round already passes: before Ray starts (the address is dead), naming the
    # cost of one round and the accountant that answered
    (("run", "{tiny}", "--address", "127.0.0.1:9", "--set", "training.algorithm=dp_fedavg", "--set",
      "privacy.noise_multiplier=1", "--set", "privacy.target_epsilon=0.5", "--set", "sampling.mode=poisson",
      "--set", "sampling.rate=0.5"),
     "privacy.target_epsilon: 0.5 is below what one round costs: with noise_multiplier 1 one round costs epsilon"),
    # grids: a value too long for a directory name, and one value spelled three ways
    (("sweep", "{tiny}", "--grid", "description=" + "x" * 300 + ",b", "--dry-run"),
     "file names hold 240 here"),
    (("sweep", "{tiny}", "--grid", "training.lr=0.1,0.10,1e-1", "--dry-run"),
     "training.lr lists one value twice ('0.1' and '0.10')"),
    # a random search's axis without --search random, and a run directory that is not there
    (("sweep", "{tiny}", "--grid", "training.lr=loguniform(1e-3,1)", "--dry-run"),
     "is a distribution to draw from: give --search random"),
    (("run", "--resume", "{tmp}/gone"), "{tmp}/gone: no such run directory"),
    (("audit", "{tmp}/gone"), "{tmp}/gone: no such run directory"),
    # a noise multiplier past dp_accounting's arithmetic; a threshold no cohort of 6 can use (it was cut to 6);
    # an empty category list; an empty --address (it started a private Ray)
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "training.algorithm=dp_fedavg", "--set",
      "privacy.noise_multiplier=1e308"), "privacy.noise_multiplier: Input should be less than or equal to 1000000"),
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "training.algorithm=dp_fedavg", "--set",
      "privacy.noise_multiplier=1e-300"), "privacy.noise_multiplier: Input should be greater than or equal to 0.000000001"),
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "training.algorithm=nbafl", "--set",
      "privacy.nbafl.epsilon=1e300", "--set", "privacy.accountant=rdp"),
     "privacy.nbafl.epsilon: gives a noise multiplier of 4.84e-300, outside [1e-09, 1e+06]"),
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "secagg.enabled=true", "--set", "secagg.threshold=100"),
     "secagg.threshold=100 exceeds the most clients a round can have (6, sampling.clients_per_round)"),
    (("scenarios", "validate", "{tiny}", "--no-data", "--set", "training.algorithm=huang2020", "--set",
      "privacy.huang2020={{category_budgets: []}}"), "privacy.huang2020.category_budgets: List should have at least 1"),
    (("run", "{tiny}", "--address", ""), "--address: is empty: give HOST:PORT"),
] + SECOND_SWEEP)
def test_minor_findings_are_one_line(tiny, tmp_path, args, needle):
    before = files_under(tmp_path)
    res = dpfl_in_process(*(a.format(tiny=tiny, tmp=tmp_path) for a in args))
    _one_line_in_process(res, needle.format(tmp=tmp_path, tiny=tiny))
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("args, needle", [
    # a search or grid too large to plan is refused before it draws or expands anything
    (("sweep", "{tiny}", "--grid", "training.lr=loguniform(1e-3,1)", "--search", "random", "--num-samples",
      "1000000000", "--dry-run"), "--num-samples: 1,000,000,000 runs; a sweep plans at most 10,000"),
    (("sweep", "{tiny}", "--grid", "training.rounds=randint(1,99999999999999999999999)", "--search", "random",
      "--num-samples", "2", "--dry-run"), "needs bounds within +-2^53"),
    (("sweep", "{tiny}", "--grid", "training.lr=0.1", "--out", "{tiny}"), "--out: cannot create"),
    (("sweep", "{tiny}", "--grid", "training.lr=0.1", "--out", "{tmp}", "--dry-run"),
     "already holds files that are not a sweep"),
    (("sweep", "{tiny}", "--grid", "training.lr=normal(0,1)", "--dry-run"), "normal is not a distribution"),
    # reproduce's dry run refuses what the reproduction would: a folder of other files, data not a folder
    (("reproduce", "wei2020", "--quick", "--dry-run", "--out", "{tmp}"),
     "already holds files that are not a reproduction"),
    (("reproduce", "wei2020", "--quick", "--dry-run", "--data", "{tmp}/nowhere"), "/nowhere is not a folder"),
    # an option the command would leave unused, and a table of a thousand compositions
    (("privacy", "epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.01", "--rounds", "10", "--delta",
      "1e-5", "--nbafl-epsilon", "3"), "nbafl_epsilon: is for --mechanism nbafl"),
    (("privacy", "table", "--dropout-rates", "0", "--rounds", ",".join(str(i) for i in range(1, 31))),
     "rounds: 30 values; a table shows at most 20"),
    (("privacy", "table", "--rounds", "1,10", "--budgets", ",".join(str(i) for i in range(1, 40))),
     "budgets: 39 values; a table shows at most 20"),
    (("privacy", "table", "--rounds", "1,10", "--budgets", "1,2,3,4,5,6,7,8,9,10", "--dropout-rates",
      "0,0.1,0.2,0.3,0.4,0.5"), "dropout_rates: 6 dropout rates x (2 round counts + 10 budgets) = 72 entries"),
    # past dp_accounting's arithmetic (an internal OverflowError), and a cohort of nobody
    (("privacy", "epsilon", "--noise-multiplier", "1e308", "--sampling-rate", "0.5", "--rounds", "2", "--delta",
      "1e-5"), "noise_multiplier: must be at most 1e+06"),
    (("privacy", "table", "--noise-multiplier", "1e300", "--rounds", "1,10"), "noise_multiplier: must be at most"),
    # and below its division by zero (an internal ZeroDivisionError under pld)
    (("privacy", "epsilon", "--noise-multiplier", "1e-300", "--sampling-rate", "0.01", "--rounds", "10", "--delta",
      "1e-5"), "noise_multiplier: must be at least 1e-09"),
    (("privacy", "epsilon", "--rounds", "10", "--delta", "1e-5", "--accountant", "rdp", "--mechanism", "nbafl",
      "--nbafl-epsilon", "1e300"), "nbafl_epsilon: 1e+300 gives NbAFL a noise multiplier of"),
    (("privacy", "epsilon", "--rounds", "10", "--delta", "1e-5", "--accountant", "rdp", "--mechanism", "nbafl",
      "--nbafl-epsilon", "1e-300"), "nbafl_epsilon: 1e-300 gives NbAFL a noise multiplier of"),
    (("privacy", "epsilon", "--rounds", "10", "--delta", "1e-5", "--accountant", "rdp", "--mechanism", "nbafl",
      "--nbafl-epsilon", "1", "--clients", "99999999999999999999"), "clients: must be at most 10,000,000"),
    (("privacy", "epsilon", "--rounds", "10", "--delta", "1e-5", "--noise-multiplier", "1", "--clients-per-round",
      "0", "--num-clients", "10"), "clients_per_round: must be >= 1, got 0"),
    # options the mechanism never reads, and more uploads than rounds
    (("privacy", "epsilon", "--rounds", "10", "--delta", "1e-5", "--accountant", "rdp", "--mechanism", "nbafl",
      "--nbafl-epsilon", "6", "--sampling-rate", "0.1"), "sampling_rate: nbafl derives its noise from --nbafl-epsilon"),
    (("privacy", "epsilon", "--rounds", "10", "--delta", "1e-5", "--noise-multiplier", "1", "--sampling-rate", "0.1",
      "--threat-model", "broadcast"), "threat_model: is for --mechanism nbafl; dp_fedavg would leave it unused"),
    (("privacy", "epsilon", "--rounds", "10", "--delta", "1e-5", "--accountant", "rdp", "--mechanism", "nbafl",
      "--nbafl-epsilon", "6", "--exposures", "999999999999999"), "exposures: must be at most --rounds (10)"),
    # a name of no run fails a dry run too; nbafl's noise is no multiplier
    (("reproduce", "geyer2017", "--only", "bogus", "--dry-run"), "--only: 'bogus' is not a run of geyer2017"),
    # a folder --adopt does not take keeps no lock file of the reproduction's
    (("reproduce", "geyer2017", "--quick", "--out", "{tmp}", "--adopt"), "is not the directory of a run of this"),
    (("privacy", "noise", "--epsilon", "1", "--sampling-rate", "0.01", "--rounds", "10", "--delta", "1e-5",
      "--mechanism", "nbafl"), "mechanism: `dpfl privacy noise` is for dp_fedavg and baek"),
    # the benchmarks' options name themselves
    (("bench", "run", "W1", "--keep", "{tiny}"), "--keep: cannot create"),
    (("bench", "local", "--data", "{tiny}", "--model", "logistic"), "--data: "),
    (("bench", "local", "--data", "random", "--examples", "100000000"), "--examples: 100000000 examples per client"),
    (("bench", "local", "--data", "random", "--model", "logistic", "--clients", "100000000", "--examples", "1"),
     "--clients: 100,000,000 clients x 1 examples: at most 1,000,000"),
])
def test_the_other_commands_findings_are_one_line(tiny, tmp_path, args, needle):
    before = files_under(tmp_path)
    res = dpfl_in_process(*(a.format(tiny=tiny, tmp=tmp_path) for a in args))
    _one_line_in_process(res, needle)
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("x_shape, labels, needle", [
    ((100,), [0] * 100, "x_train (100,) and y_train (100,) are not N images"),
    ((100, 1, 28, 28), [0] * 7, "x_train (100, 1, 28, 28) and y_train (7,) are not N images"),
    ((100, 1, 28, 28), [50] * 100, "labels 50..50, the benchmark's models have classes 0..9"),
])
def test_bench_local_refuses_data_its_models_cannot_take(tmp_path, x_shape, labels, needle):
    """They were internal errors (IndexError in torch), or, for 7 labels of 100 images, a timing."""
    path = tmp_path / "bad.npz"
    np.savez(path, x_train=np.zeros(x_shape, np.float32), y_train=np.array(labels, np.int64))
    res = dpfl_in_process("bench", "local", "--data", path, "--model", "logistic", "--repeats", "1")
    _one_line_in_process(res, needle)


@pytest.mark.parametrize("args", [("run", "{tiny}", "--out", ""), ("sweep", "{tiny}", "--out", " "),
                                  ("reproduce", "geyer2017", "--quick", "--out", ""), ("report", "{run}", "--out", ""),
                                  ("bench", "run", "W1", "--keep", "")])
def test_an_empty_output_folder_is_refused_not_read_as_the_current_one(tiny, tmp_path, args):
    """A usage error, so through the real `dpfl`, whose entry point makes it one line; run in an
    empty folder, which it must leave empty."""
    run = _run_dir(tmp_path / "run", {"name": "x", "final_accuracy": 0.5}, '{"round": 1, "test_accuracy": 0.5}\n')
    (cwd := tmp_path / "cwd").mkdir()
    assert_one_error_line(dpfl(*(a.format(tiny=tiny, run=run) for a in args), cwd=cwd), "is empty: give a folder")
    assert not any(cwd.iterdir())


def test_report_refuses_to_write_into_a_run_it_reports(tmp_path):
    run = _run_dir(tmp_path / "run", {"name": "x", "final_accuracy": 0.5}, '{"round": 1, "test_accuracy": 0.5}\n')
    before = {p: p.read_bytes() for p in run.iterdir()}
    res = dpfl_in_process("report", run, "--out", run)
    _one_line_in_process(res, "is one of the run directories reported")
    assert {p: p.read_bytes() for p in run.iterdir()} == before
    # nor into another run's directory, whose accuracy.png the report's would replace
    other = _run_dir(tmp_path / "other", {"name": "y", "final_accuracy": 0.6}, '{"round": 1, "test_accuracy": 0.6}\n')
    (other / "accuracy.png").write_bytes(b"the run's own plot")
    before = {p: p.read_bytes() for p in other.iterdir()}
    res = dpfl_in_process("report", run, "--out", other)
    _one_line_in_process(res, "holds a run's or a sweep's files (summary.json, rounds.jsonl)")
    assert {p: p.read_bytes() for p in other.iterdir()} == before


def test_a_budget_the_first_round_passes_names_the_accountant_that_answered(tiny):
    res = dpfl_in_process("scenarios", "validate", tiny, "--no-data", "--set", "training.algorithm=dp_fedavg",
                          "--set", "privacy.noise_multiplier=0.0001", "--set", "privacy.target_epsilon=1",
                          "--set", "sampling.mode=poisson", "--set", "sampling.rate=0.5")
    _one_line_in_process(res, "(rdp accountant)")  # pld cannot take z=1e-4: rdp answers, and is named


@pytest.mark.parametrize("summary", ['{"name": "x", "epsilon": Infinity, "delta": 1e-05}',
                                     '{"name": "x", "epsilon": null, "delta": 1e-05, "non_finite": {"epsilon": "inf"}}'])
def test_report_shows_an_infinite_epsilon_as_inf(tmp_path, summary):
    """No guarantee is not the same as not private: "inf", not the "-" of a run without a ledger."""
    run = _run_dir(tmp_path / "run", summary.encode(), '{"round": 1, "test_accuracy": 0.5}\n')
    res = dpfl_in_process("report", run, "--out", tmp_path / "report")
    assert res.exit_code == 0, res.stderr
    cells = [ln.split() for ln in res.stdout.splitlines()]
    # one run in a narrow console is a card of "header value" lines; a wide one a table row
    assert ["epsilon", "inf"] in cells or any("inf" in c and "0.5000" in c for c in cells), res.stdout


def test_audit_bootstrap_is_bounded(tmp_path):
    """Checked by the option itself, before the run directory is read (a usage error: the real
    `dpfl`, whose entry point makes it one line)."""
    assert_one_error_line(dpfl("audit", tmp_path, "--bootstrap", "1000000000"), "'--bootstrap'")


def test_a_set_that_only_the_grid_completes_is_a_sweep_not_an_error(tiny):
    """Integer noise needs a ring of 8-32 bits, and the grid gives each combination its width: the
    --set alone is not a scenario, every combination is. A grid value that is not is named."""
    sets = [a for kv in ("training.algorithm=baek", "secagg.enabled=true", "privacy.noise_multiplier=1",
                         "sampling.mode=poisson", "sampling.rate=0.25", "sampling.clients_per_round=null",
                         "privacy.accountant=rdp", "privacy.distributed_noise=skellam") for a in ("--set", kv)]
    res = dpfl_in_process("sweep", tiny, *sets, "--grid", "secagg.bits=16,20", "--dry-run")
    assert res.exit_code == 0, res.stderr
    assert "secagg.bits=16" in res.stdout and "ok: 2 combinations" in res.stdout
    res = dpfl_in_process("sweep", tiny, *sets, "--grid", "secagg.bits=16,64", "--dry-run")
    _one_line_in_process(res, "in combination")
    assert "secagg.bits=64" in res.stderr


def test_audit_and_a_reopened_sweep_name_a_malformed_file(tiny, tmp_path):
    """A run's summary.json whose epsilon is text, and a sweep.json whose grid is not lists of values:
    each was an internal error."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "audit.json").write_text("{}")
    (run / "summary.json").write_text('{"epsilon": "abc"}')
    _one_line_in_process(dpfl_in_process("audit", run), "summary.json: epsilon must be a number or null, got 'abc'")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for grid in ({"training.lr": 5}, {"training.lr": [1, 2]}):  # values a sweep writes are text
        manifest = json.dumps({"scenario": str(tiny), "sets": [], "grid": grid, "seeds": None,
                               "scenario_sha256": hashlib.sha256(tiny.read_bytes()).hexdigest()})
        (sweep / "sweep.json").write_text(manifest)
        res = dpfl_in_process("sweep", tiny, "--grid", "training.lr=0.1", "--out", sweep, "--address", "127.0.0.1:9")
        _one_line_in_process(res, "sweep.json is not a sweep's manifest (its grid is not lists of values by axis")
        assert (sweep / "sweep.json").read_text() == manifest and files_under(sweep) <= {Path("sweep.json"),
                                                                                           Path("sweep.json.lock")}


def test_audit_of_an_audited_run_that_released_no_round_says_so(tmp_path):
    """It asked "was the run audited (privacy.audit)?" of a run that was."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "scenario.yaml").write_text(yaml.safe_dump(dict(TINY, privacy={"audit": {"canaries": 10}})))
    (run / "summary.json").write_text("{}")
    _one_line_in_process(dpfl_in_process("audit", run), "was audited (privacy.audit) but released no round")
    (run / "scenario.yaml").write_text("seed: 2021-13-45\n")  # YAML's own ValueError (month 13): not known
    _one_line_in_process(dpfl_in_process("audit", run), "audit.json not found: was the run audited")
