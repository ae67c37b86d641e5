"""A driver that joins a Ray whose every node runs on this machine (`dpfl run --address`, the
session Ray here) lets its workers import the package where it lies, with no runtime_env: nothing
is packed and uploaded, and Ray need not start workers set up for one."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = '''
import json, sys
import ray
from dpfl_ray.runtime.connect import connect

connect(sys.argv[1])


@ray.remote(num_cpus=0)
def where():
    import sys
    import dpfl_ray
    return {"file": dpfl_ray.__file__, "runtime_env": ray.get_runtime_context().runtime_env, "path": sys.path}


print("WHERE " + json.dumps(ray.get(where.remote(), timeout=120)))
ray.shutdown()
'''


def test_workers_of_a_driver_joined_on_this_machine_import_the_package_in_place(ray_address, tmp_path):
    script = tmp_path / "join.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PYTHONPATH"))}
    # run from elsewhere: the workers cannot find the package through the driver's working directory
    r = subprocess.run([sys.executable, str(script), ray_address], cwd=tmp_path, capture_output=True, text=True,
                       timeout=180, env={**env, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("WHERE ")]
    seen = json.loads(line[len("WHERE "):])
    assert Path(seen["file"]) == ROOT / "dpfl_ray" / "__init__.py"  # not a copy unpacked by Ray
    assert not seen["runtime_env"].get("py_modules")
    assert str(ROOT) in seen["path"]
