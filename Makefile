# Both targets create or refresh .venv themselves, so a fresh clone needs only `make run` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_PROCESSES ?= 3
# Wheels are installed without compiling every module to bytecode (--no-compile: most of torch's and
# ray's thousands of modules are never imported). Python compiles what is imported on first use and caches it, unless
# PYTHONDONTWRITEBYTECODE is set (as in some shells and CI images): then every process would compile
# torch again, so it is unset for these recipes.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: this exact version resolves to the local CPU wheel, anything else pulls CUDA.
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e '.[test]'
	touch $(STAMP)

# Once per new .venv, before its first test session: one small private run (secure aggregation, DP,
# a private Ray) imports, and so compiles and caches, what every kind of process of the suite imports:
# the driver, Ray's daemons and workers, dp_accounting, cryptography; and Ray Tune, for the sweeps.
# Without it the three test processes and the first Ray workers each compile torch and ray at the
# same time (about 11 s of CPU each). A failed warm-up is not a failed suite: the tests say what is wrong.
WARM := $(VENV)/.warm
$(WARM): $(STAMP)
	# the two side by side: the run waits on Ray's start for much of its time. torch._dynamo (and
	# sympy under it) is what torch.func.grad imports, in every worker of a record-level DP run.
	$(BIN)/python -c "import pytest, xdist, psutil, hypothesis, ray.tune, torch._dynamo, sklearn.datasets, optuna, tensorboardX" \
		> /dev/null 2>&1 & \
	$(BIN)/python -m cli.main run scenarios/baek2021_ci_z1_drop30_calibrated.yaml --set training.rounds=1 \
		--out $(VENV)/warm-up-run > /dev/null 2>&1 || echo "warm-up run failed (the tests will say why)"; \
	wait
	rm -rf $(VENV)/warm-up-run
	touch $(WARM)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/dpfl run scenarios/quickstart.yaml

test: $(WARM)
	# Three test processes (pytest-xdist) on a 2-core machine: much of the suite waits on Ray's start,
	# on subprocesses and on deadlines, not on CPU, so a third process fills that time; a fourth gains
	# little and loads the machine enough to strain the tests' signal bounds (benchmarks/RESULTS.md).
	# Each process has its own local Ray (tests/conftest.py).
	# --dist worksteal: an idle process takes queued tests from a busy one instead of waiting.
	# pytest exits 5 when it collects no tests; that is not a failure of the code under test.
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist worksteal tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) runs .pytest_cache
