"""The layer rule of docs/architecture.md, checked on the source: a module's folder is its layer,
and imports point down only.

    foundation (hpcpar, errors, layout, state, schema, metrics; launch/)
      -> backend/, data/ -> runtime/ -> autograd/
      -> nn/, optim/, parallel/mappings, parallel/tp/, parallel/cp/
      -> parallel/pp/, parallel/dp/, parallel/ps/, checkpoint/
      -> config/ -> planner/ -> training/, interop/ -> cli/

A module may import from its own layer or any layer below. Only runtime/ imports mpi4py at module
level, and the Communicator is the only door to MPI: no module outside runtime/comm.py and
runtime/mesh.py touches a Communicator's raw mpi4py object.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "hpcpar"

# Each layer: the module names or folder prefixes ("x." = every module under hpcpar/x/) it holds.
LAYERS = [
    ("hpcpar", "errors", "environment", "layout", "state", "schema", "metrics", "launch", "launch."),
    ("backend", "backend.", "data", "data."),
    ("runtime", "runtime."),
    ("autograd", "autograd."),
    ("nn", "nn.", "optim", "optim.", "parallel", "parallel.mappings", "parallel.tp", "parallel.tp.",
     "parallel.cp", "parallel.cp."),
    ("parallel.pp", "parallel.pp.", "parallel.dp", "parallel.dp.", "parallel.ps", "parallel.ps.",
     "checkpoint", "checkpoint."),
    ("config", "config."),
    ("planner", "planner."),
    ("training", "training.", "interop", "interop."),
    ("cli", "cli.", "__main__"),
]


def layer_of(module: str) -> int | None:
    """The layer of `module` (dotted, without "hpcpar."): the longest entry that names it or a folder above it."""
    best, found = -1, None
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or (entry.endswith(".") and module.startswith(entry))) and len(entry) > best:
                best, found = len(entry), i
    return found


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "hpcpar"
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: pathlib.Path) -> set[str]:
    """hpcpar modules imported anywhere in the file (functions included), without the prefix."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hpcpar":
            base = node.module.removeprefix("hpcpar").removeprefix(".")
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                found.add(full if full in MODULES else (base or "hpcpar"))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("hpcpar.") for a in node.names if a.name.split(".")[0] == "hpcpar"}
    return found


def _top_level_imports(path: pathlib.Path) -> set[str]:
    """Top-level modules imported at module level (not inside a function)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        stmts = [node]
        if isinstance(node, (ast.Try, ast.If)):
            stmts = [*node.body, *getattr(node, "orelse", []),
                     *[s for h in getattr(node, "handlers", []) for s in h.body]]
        for s in stmts:
            if isinstance(s, ast.Import):
                found |= {a.name.split(".")[0] for a in s.names}
            elif isinstance(s, ast.ImportFrom) and s.module and s.level == 0:
                found.add(s.module.split(".")[0])
    return found


# Step one of the layout change moved these modules whole; each is split by concern next, and this set
# empties as they are.
AWAITING_SPLIT: set[str] = set()


def test_every_module_has_a_layer():
    missing = sorted(name for name in MODULES if layer_of(name) is None)
    assert not missing, f"modules without a layer in this test (and docs/architecture.md): {missing}"


def test_the_root_stays_small():
    """The package's root holds at most 8 modules: everything else lives in the folder of its layer."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 8, root


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_over_700_lines_or_function_over_80(module):
    if module in AWAITING_SPLIT:
        pytest.skip("awaiting its split")
    path = MODULES[module]
    lines = path.read_text().count("\n")
    assert lines <= 700, f"{path.relative_to(PACKAGE.parent)} has {lines} lines: split it by concern"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert not long, f"{path.relative_to(PACKAGE.parent)}: functions over 80 lines: {long}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    if module in AWAITING_SPLIT:
        pytest.skip("awaiting its split")
    upward = sorted(dep for dep in _imports(MODULES[module])
                    if layer_of(dep) is not None and layer_of(dep) > layer_of(module))
    assert not upward, f"hpcpar.{module} (layer {layer_of(module)}) imports from higher layers: {upward}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_runtime_imports_mpi4py_at_module_level(module):
    """Importing any module outside runtime/ must not load MPI by itself (login nodes, pure tools)."""
    if module == "runtime" or module.startswith("runtime.") or module in AWAITING_SPLIT:
        return
    assert "mpi4py" not in _top_level_imports(MODULES[module]), f"hpcpar.{module} imports mpi4py at module level"


def test_comm_imports_no_autograd():
    deps = _imports(MODULES["runtime.comm"])
    assert not {d for d in deps if d.startswith(("autograd", "nn", "parallel"))}, deps


DP_ALLOWED = ("backend", "runtime.", "optim.", "errors", "layout", "state", "parallel.dp")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("parallel.dp")))
def test_data_parallel_pieces_know_no_model_or_run(module):
    """Gradient sync works on any objects with .data/.grad: no nn, autograd, config or training
    (layout: the pure shard <-> global maps its checkpoint state is described with; state: the
    Checkpointable protocol it answers)."""
    extra = sorted(d for d in _imports(MODULES[module]) if not d.startswith(DP_ALLOWED))
    assert not extra, f"hpcpar.{module} imports {extra}"


def test_only_comm_and_mesh_touch_the_raw_mpi_communicator():
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
                 for name, path in MODULES.items() if name not in ("runtime.comm", "runtime.mesh")
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"\.mpi\b", line.replace("get_config().mpi", ""))]  # h5py's build flag is fine
    assert not offenders, "use the Communicator's methods instead:\n" + "\n".join(offenders)


def test_model_code_loads_without_mpi():
    """nn/ (and the autograd under it) never imports mpi4py, so models run in any process."""
    code = "import sys, hpcpar.nn, hpcpar.autograd.ops; print('mpi4py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent, env={"PYTHONPATH": str(PACKAGE.parent), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_every_module_imports_first():
    """Each module imports as the first hpcpar module of a process (an import cycle between two modules
    shows only when one of them is imported first). A missing optional extra (numba) is no failure."""
    code = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "hpcpar" or m.startswith("hpcpar.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:  # an optional extra (numba for jit/, ...) is not an import cycle
        if (err.name or "hpcpar").split(".")[0] == "hpcpar":
            failed.append(f"{name}: {type(err).__name__}: {err}")
    except Exception as err:
        failed.append(f"{name}: {type(err).__name__}: {err}")
print("\\n".join(failed))
"""
    names = [f"hpcpar.{m}" if m != "hpcpar" else m for m in MODULES if m != "__main__"]
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "", out.stdout


# Pure code: what config validation, the planner with a preset, job rendering, the checkpoint tools,
# plot, data prepare and sample run on (login nodes, where MPI_Init may fail) imports no mpi4py, even
# transitively.
PURE = ("parallel.pp.schedules", "parallel.pp.simulate", "parallel.pp.stages", "parallel.ps.ownership",
        "environment", "runtime.topology", "runtime.solo", "runtime.agreement", "config.load", "config.validate", "config.memory",
        "planner.hardware", "planner.predict", "planner.search", "launch.jobs", "checkpoint.tools",
        "checkpoint.load", "checkpoint.save", "checkpoint.parts", "state", "training.plot", "training.generate", "interop.huggingface",
        "data.prepare", "nn.gpt", "nn.moe", "autograd.ops", "cli.main",
        *(f"cli.{verb}" for verb in ("train", "sample", "info", "ckpt", "job", "plot", "data", "plan", "eval")))


def test_pure_modules_import_without_mpi4py():
    code = "import importlib, sys; sys.modules['mpi4py'] = None\n" \
           "for name in sys.argv[1:]: importlib.import_module(name)\n" \
           "print(sorted(m for m in sys.modules if m.startswith('mpi4py') and sys.modules[m] is not None))"
    out = subprocess.run([sys.executable, "-c", code, *(f"hpcpar.{m}" for m in PURE)], capture_output=True,
                         text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
