# Both targets create or refresh .venv themselves, so a fresh clone needs only `make run` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_PROCESSES ?= 2
# Wheels are installed without compiling every module to bytecode (--no-compile: .venv in 20-22 s
# instead of 46 s on a 2-core machine; most of it was torch's and ray's thousands of modules that no
# run imports). Python compiles what is imported on first use and caches it, unless
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

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/dpfl run scenarios/quickstart.yaml

test: $(STAMP)
	# Two test processes (pytest-xdist) on a 2-core machine: a serial run leaves CPU idle while Ray
	# processes start and tests wait on subprocesses. Each process has its own local Ray
	# (tests/conftest.py); every test is independent of the others' order and process. Three were
	# chosen while most runtime tests started two workers (488 s with two, 490 s with three); since
	# they start one, two and three are within noise (back to back in one checkout: 387 and 376 s
	# with two, 404 and 386 s with three; fresh clones: 7:07 with two, 7:03 with three), and two
	# start one Ray fewer.
	# --dist worksteal: with the default `load` one process was handed most of tests/ray in one chunk
	# and ran it alone for the last ~250 s while the others had finished (10% of the CPU idle);
	# worksteal lets an idle process take queued tests from a busy one.
	# pytest exits 5 when it collects no tests; that is not a failure of the code under test.
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist worksteal tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) runs .pytest_cache
