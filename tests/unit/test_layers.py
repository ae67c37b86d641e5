"""The package's wings and the direction of their imports (README, "Layout").

Every import between the project's modules, at module level or inside a function, is an edge.
There is no circle, and no edge goes up the layers:

    cli -> runtime -> runs / faults / algorithms -> training / privacy / secagg / data -> root

(a module may import its own layer and every layer below it). ``benchmarks`` measures the package
from outside, beside ``cli``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {
    "cli": 4, "benchmarks": 4,
    "dpfl_ray.runtime": 3,
    "dpfl_ray.runs": 2, "dpfl_ray.faults": 2, "dpfl_ray.algorithms": 2,
    "dpfl_ray.training": 1, "dpfl_ray.privacy": 1, "dpfl_ray.secagg": 1, "dpfl_ray.data": 1,
    "dpfl_ray": 0,
}
ROOT_MODULES = {"__init__", "scenario", "errors", "rng", "defaults"}
# scenario.py asks each algorithm and the fault plan whether they can run a scenario, lazily at
# validation: the one sanctioned call up the layers (README, "Layout").
ALLOWED_UP = {("dpfl_ray.scenario", "dpfl_ray.algorithms"), ("dpfl_ray.scenario", "dpfl_ray.faults.plan")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    best = max((w for w in LAYERS if module == w or module.startswith(w + ".")), key=len)
    return LAYERS[best]


def project_modules() -> dict[str, Path]:
    files = [p for top in ("dpfl_ray", "cli", "benchmarks") for p in (ROOT / top).rglob("*.py")]
    return {module_name(p): p for p in files}


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports (a name imported from a package counts as its module
    when it is one)."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != this)
    return out


GRAPH = {name: imports(path, project_modules()) for name, path in project_modules().items()}


def test_the_package_root_keeps_only_what_every_wing_uses():
    loose = {p.stem for p in (ROOT / "dpfl_ray").glob("*.py")}
    assert loose <= ROOT_MODULES, sorted(loose - ROOT_MODULES)
    for wing in (p for p in (ROOT / "dpfl_ray").iterdir() if p.is_dir() and not p.name.startswith("_")):
        doc = ast.get_docstring(ast.parse((wing / "__init__.py").read_text()))
        assert doc, f"{wing.name}/__init__.py needs a docstring that says what lives there"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_goes_up_the_layers(module):
    up = sorted(t for t in GRAPH[module] if layer(t) > layer(module) and (module, t) not in ALLOWED_UP)
    assert not up, f"{module} (layer {layer(module)}) imports {up}"


def test_no_import_circles():
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


def _imports_ray(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == "ray" or n.startswith("ray.") for n in names):
            return True
    return False


def test_only_the_runtime_imports_ray():
    # README, "Layout": dpfl_ray/runtime/ is the only code that imports Ray
    outside = sorted(name for name, path in project_modules().items()
                     if not name.startswith("dpfl_ray.runtime") and _imports_ray(path))
    assert outside == [], outside
