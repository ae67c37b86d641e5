"""What a worker process loads. Each worker of a private run used to import dp_accounting (and scipy
under it) only to check its scenario again: about 0.5 s of CPU per worker process. The ledger is
kept by the coordinator, which does need them."""
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np

from dpfl_ray.algorithms import make_algorithm
from dpfl_ray.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]

# What ClientWorker.__init__ does with its scenario, then what each round hands it: a ClientSpec
# (Baek's and NbAFL's carry their ClientNoise, whose classes live in the algorithm's module).
WORKER = ("import pickle, sys; import dpfl_ray.runtime.workers; from dpfl_ray.scenario import Scenario; "
          "cases = pickle.loads(sys.stdin.buffer.read()); "
          "[Scenario.model_validate(raw, context={'read_files': False}) for raw, _ in cases]; "
          "print(sorted(m for m in ('dp_accounting', 'scipy') if m in sys.modules))")


PRIVATE = ["dp_fedavg_quickstart.yaml", "baek2021_ci_z1_drop30_calibrated.yaml", "baek2021_ci_z1_drop30_layered.yaml",
           "wei2020_ci.yaml"]


def test_a_private_runs_worker_loads_no_accounting_library():
    cases = []
    for name in PRIVATE:
        sc = load_scenario(ROOT / "scenarios" / name)
        alg = make_algorithm(sc, np.ones(sc.data.num_clients))
        sampled = list(range(min(10, sc.data.num_clients)))
        assert alg.begin_round(1, sampled) is None
        spec = alg.client_spec()
        cases.append((sc.model_dump(mode="json"), spec))
    assert any(spec.noise is not None for _, spec in cases)  # a ClientNoise crosses too
    res = subprocess.run([sys.executable, "-c", WORKER], input=pickle.dumps(cases), cwd=ROOT, capture_output=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    assert res.stdout.decode().strip().splitlines()[-1] == "[]"
