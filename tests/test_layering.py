"""The dependency rules of docs/architecture.md, checked on the source: what each layer may import.

Layers, each importing only from itself and the ones before it:
options -> job -> gradients -> observability -> the top-level modules (DataParallel, ..., and the
package of live recovery, lit_dp.fault_tolerance) -> strategies.
The library never imports the recipes' or benchmarks' dependencies; only the Lightning layer
(and the job layer's cluster environment and launcher detection, which reads SLURM, LSF and
MPI jobs through Lightning's environments) imports Lightning; torchft, an optional engine, only
inside the functions that start it; no import circle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "lit_dp"
LAYERS = ["options", "job", "gradients", "observability", "", "strategies"]  # "": the top-level modules
NEVER = {"hydra", "omegaconf", "sklearn", "matplotlib", "lit_dp_recipes", "benchmarks"}
LIGHTNING_ALLOWED = {
    "lit_dp.job.cluster_environment",
    # Imports Lightning's cluster environments inside a function, only when no launcher it can
    # tell without them (Paddle's, torchrun) started the process: init_parallel_env then reads
    # SLURM, LSF and MPI jobs exactly as the Trainer does, and `import lit_dp` stays Lightning-free.
    "lit_dp.job.launcher",
}

# Fronts besides lit_dp itself: lit_dp.fabric names the Fabric strategy, as lightning.fabric does.
FRONTS = {"lit_dp.fabric"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level and TYPE_CHECKING imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


MODULES = {module_name(path): imports_of(path) for path in sorted(LIBRARY.rglob("*.py"))}


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or module in FRONTS:  # the package's front, it may import every layer
        return len(LAYERS)
    if len(parts) == 2 and parts[1] in LAYERS:  # a layer's package: its __init__ belongs to it
        return LAYERS.index(parts[1])
    # A concept's own package at the top (lit_dp.fault_tolerance) is of the top-level modules' layer.
    return LAYERS.index(parts[1]) if len(parts) > 2 and parts[1] in LAYERS else LAYERS.index("")


def internal(imported: str) -> str | None:
    """The lit_dp module ``imported`` names (a package's ``from lit_dp.x import y`` counts as ``lit_dp.x``)."""
    if imported.split(".")[0] != "lit_dp":
        return None
    return imported if imported in MODULES else ".".join(imported.split(".")[:-1])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_imports_only_from_its_layer_and_below(module):
    for imported in sorted(MODULES[module]):
        top = imported.split(".")[0]
        assert top not in NEVER, f"{module} imports {imported}: the library must not need it"
        if top == "lightning" and module not in LIGHTNING_ALLOWED:
            assert module.startswith("lit_dp.strategies"), f"{module} imports {imported}: only the Lightning layer may"
        target = internal(imported)
        if target is not None and target != "lit_dp":
            assert layer_of(target) <= layer_of(module), f"{module} imports {target}, a layer above it"


def test_torchft_is_imported_only_when_fault_tolerance_is_on():
    """torchft is an optional engine (``lit_dp[ft]``): imported inside the functions that start it,
    never when a module is loaded."""
    for path in sorted(LIBRARY.rglob("*.py")):
        tree = ast.parse(path.read_text())
        in_functions = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(function)
        }
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(name.split(".")[0] == "torchft" for name in names):
                assert id(node) in in_functions, f"{module_name(path)} imports torchft when it is loaded"


def test_no_import_circle():
    graph = {
        module: {internal(i) for i in imports if internal(i) not in (None, "lit_dp", module)}
        for module, imports in MODULES.items()
    }
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            assert state.get(target) != "open", f"import circle: {' -> '.join(path + [module, target])}"
            if target not in state:
                visit(target, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_import_lit_dp_loads_torch_and_lit_dp_only():
    loaded = run_python(
        "import lit_dp, sys; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'omegaconf', 'sklearn', 'matplotlib', 'lightning', 'torchft'}))"
    )
    assert loaded.strip() == "[]"


REGISTERED = (
    "from lightning.pytorch.strategies import StrategyRegistry\n"
    "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
    "assert 'paddle_dp_spawn_find_unused_parameters_true' in StrategyRegistry\n"
    "assert 'paddle_dp_notebook' in STRATEGY_REGISTRY\n"
)
FIRST_IMPORTS = [
    "import lit_dp; import lightning.pytorch",
    "import lightning.pytorch; import lit_dp",
    "from lit_dp import PaddleEnvironment",
    "import lit_dp.strategies.monitor",
    "import lit_dp.strategies.fabric",
]


@pytest.mark.slow
def test_the_strategies_register_whatever_is_imported_first():
    # Lightning loads the Lightning layer while its own import finishes: no order may meet a
    # half-initialised lit_dp module. Each order in a fresh interpreter, two at a time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda first: run_python(f"{first}\n{REGISTERED}"), FIRST_IMPORTS))
