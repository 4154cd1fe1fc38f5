"""Helpers for tests that run on every rank (importable from the tests in this folder)."""

import json
import os

import numpy as np
from mpi4py import MPI

from hpcpar import backend
from hpcpar.checkpoint.format import INDEX

WORLD = MPI.COMM_WORLD


def collective_assert(ok: bool, what: str) -> None:
    """Every rank reaches the same verdict (no rank left waiting in a later collective)."""
    failed = [(r, m) for r, m in enumerate(WORLD.allgather(None if ok else what)) if m]
    assert not failed, f"failed on ranks {[r for r, _ in failed]}: {failed[0][1]}"


def host(a) -> np.ndarray:
    """`a` (a NumPy or CuPy array, or anything np.asarray takes) as a NumPy array: the explicit
    copy to host where an array of the model's backend meets NumPy (CuPy refuses implicit ones)."""
    return backend.to_host(a)


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| (host copies; b = 0 counts as 1e-300)."""
    a, b = host(a), host(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def one_process_losses(overrides: list, steps: int, tokens) -> list:
    """The losses of steps 0 .. steps-1 of the config `overrides` on this rank alone (the
    single-process model the parallel runs are held to). Not collective."""
    from hpcpar.config.load import load_config
    from hpcpar.training.trainer import Trainer
    ref = Trainer(load_config(None, list(overrides)), MPI.COMM_SELF, tokens=tokens)
    losses = [ref.train_step(step).loss for step in range(steps)]
    ref.free()
    return losses


def run_and_free(trainer, steps: int) -> tuple[list, dict, int]:
    """`trainer.train_step` for steps 0 .. steps-1, then its global parameters and dp degree;
    the trainer's mesh is freed. Collective."""
    results = [trainer.train_step(step) for step in range(steps)]
    params = trainer.global_parameters()
    dp = trainer.mesh.size("dp")
    trainer.mesh.free()
    return results, params, dp


def training_problems(results, reference_steps, params: dict, reference_params: dict, rtol: float) -> list[str]:
    """What differs between a parallel run and the single-process reference: per step the loss and
    gradient norm (`results`: StepResults; `reference_steps`: (loss, grad_norm) pairs), then every
    global parameter (`Trainer.global_parameters()` of each). Empty when all agree to `rtol`."""
    problems = []
    for s, (r, (loss, norm)) in enumerate(zip(results, reference_steps)):
        if rel_err(r.loss, loss) > rtol or rel_err(r.grad_norm, norm) > rtol:
            problems.append(f"step {s}: loss {r.loss!r} vs {loss!r}, grad norm {r.grad_norm!r} vs {norm!r}")
    if set(params) != set(reference_params):
        problems.append(f"parameter names differ: {sorted(set(params) ^ set(reference_params))}")
    for key in sorted(set(params) & set(reference_params)):
        if rel_err(params[key], reference_params[key]) > rtol:
            problems.append(f"{key}: relative error {rel_err(params[key], reference_params[key]):.2e}")
    return problems


def optimizer_pieces(dp, named) -> list[tuple[str, dict, object]]:
    """(checkpoint name of the parameter, {state name: local array}, Layout) of every piece of
    optimizer state this rank holds: whole parameters (`named`: its (name, Parameter) pairs), or
    under ZeRO the segments, flat ranges of them. Compare with `layout.take(global state)`."""
    if hasattr(dp, "segments"):
        return [(seg.param.tied_to or seg.name, dp.optimizer.state_of(seg), seg.layout) for seg in dp.segments]
    return [(p.tied_to or name, dp.optimizer.state_of(p), p.layout) for name, p in named]


def stored(path: str) -> dict:
    """Every global tensor of a checkpoint, through index.h5 (each rank reads it)."""
    import h5py
    out = {}
    with h5py.File(os.path.join(path, INDEX), "r", locking=False) as f:
        f.visititems(lambda n, obj: out.__setitem__(n, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def one_step_trace(trainer, directory: str) -> list | None:
    """Run step 0 of `trainer` (built with pipeline.trace = true), write every rank's timeline to
    `directory`/trace.json and return its Chrome trace events on rank 0 (None elsewhere). Collective."""
    trainer.train_step(0)
    path = os.path.join(directory, "trace.json")
    trainer.tracer.write_chrome_trace(path, trainer.mesh.world)
    if WORLD.Get_rank() != 0:
        return None
    with open(path) as f:
        return json.load(f)["traceEvents"]
