"""The layer rule of docs/architecture.md, checked on the source: imports point down only.

    foundation (errors, schema, layout, data, datasets, tokenizer, ...) -> backend, GPU kernels, watchdog, failure
      -> comm, mesh -> autograd (tensor, ops) -> mappings and nn
      -> parallel (schedules, pipeline, data parallel, optimizer, checkpoints)
      -> config, train, generate, evaluate, huggingface -> cli

A module may import from its own layer or any layer below. The Communicator is the only door
to MPI: no module outside comm.py and mesh.py touches a Communicator's raw mpi4py object.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "hpcpar"

LAYERS = [
    {"hpcpar", "errors", "schema", "layout", "threads", "metrics", "trace", "preemption", "data", "jobs", "plot",
     "nn.init", "tokenizer", "datasets", "prepare", "safetensors_file"},
    {"backend", "precision", "blas", "kernels", "cpu_kernels", "kernel_pool", "jit_kernels", "jit_attention", "jit_pool",
     "watchdog", "failure"},
    {"comm", "mesh"},
    {"tensor", "ops"},
    {"parallel.mappings", "parallel.context", "nn", "nn.module", "nn.layers", "nn.gpt", "nn.tensor_parallel",
     "nn.context_parallel", "nn.moe"},
    {"parallel", "parallel.schedule", "parallel.pipeline", "parallel.buckets", "parallel.compression",
     "parallel.powersgd", "parallel.compression_state", "parallel.zero", "parallel.fsdp", "parallel.clipping",
     "parallel.data_parallel", "parallel.experts", "parallel.parameter_server", "optim", "loss_scale", "checkpoint"},
    {"config", "train", "generate", "evaluate", "huggingface", "plan"},
    {"cli", "__main__"},
]
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "hpcpar"
        out[name] = path
    return out


def _imports(path: pathlib.Path) -> set[str]:
    """hpcpar modules imported anywhere in the file (functions included), without the prefix."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hpcpar":
            if node.module == "hpcpar":
                found |= {alias.name for alias in node.names}
            else:
                found.add(node.module.removeprefix("hpcpar."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("hpcpar.") for a in node.names if a.name.split(".")[0] == "hpcpar"}
    return found


def test_every_module_has_a_layer():
    missing = sorted(set(_modules()) - set(LAYER_OF))
    assert not missing, f"modules without a layer in this test (and docs/architecture.md): {missing}"


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_point_down(module):
    upward = sorted(dep for dep in _imports(_modules()[module])
                    if dep in LAYER_OF and LAYER_OF[dep] > LAYER_OF[module])
    assert not upward, f"hpcpar.{module} (layer {LAYER_OF[module]}) imports from higher layers: {upward}"


def test_comm_imports_no_autograd():
    deps = _imports(_modules()["comm"])
    assert not {d for d in deps if d in ("tensor", "ops") or d.startswith(("nn", "parallel"))}, deps


DP_PIECES = ("parallel.buckets", "parallel.compression", "parallel.powersgd", "parallel.compression_state",
             "parallel.zero", "parallel.fsdp", "parallel.clipping", "parallel.data_parallel", "parallel.experts")


@pytest.mark.parametrize("module", DP_PIECES)
def test_data_parallel_pieces_know_no_model_or_run(module):
    """Gradient sync works on any objects with .data/.grad: no nn, autograd, config or train
    (layout: the pure shard <-> global maps its checkpoint state is described with)."""
    allowed = {"backend", "comm", "mesh", "optim", "errors", "layout", *DP_PIECES}
    extra = sorted(_imports(_modules()[module]) - allowed)
    assert not extra, f"hpcpar.{module} imports {extra}"


def test_only_comm_and_mesh_touch_the_raw_mpi_communicator():
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
                 for name, path in _modules().items() if name not in ("comm", "mesh")
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"\.mpi\b", line.replace("get_config().mpi", ""))]  # h5py's build flag is fine
    assert not offenders, "use the Communicator's methods instead:\n" + "\n".join(offenders)


def test_model_code_loads_without_mpi():
    """nn/ (and the autograd under it) never imports mpi4py, so models run in any process."""
    import subprocess
    import sys
    code = "import sys, hpcpar.nn, hpcpar.ops; print('mpi4py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent, env={"PYTHONPATH": str(PACKAGE.parent), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False", out.stdout + out.stderr
