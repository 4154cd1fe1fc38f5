"""`hpcpar eval` of a packed run (`training/evaluate.py`): each document scored alone, on any mesh.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_packed_eval.py (other sizes skip).
float64, a model trained 2 steps on packed documents of long-tailed lengths, then `evaluate` over
37 held-out windows (the last global batch padded) with their document starts: on dp=4, dp=2 x
tp=2, pp=2 x dp=2, cp=2 x dp=2 (ring: columns dealt by attention work), cp=4 Ulysses, cp=2 x tp=2
with sequence parallelism and ZeRO-3, the loss equals the one-process
evaluation to 1e-10, and that one equals the mean over every window's segments run alone as
sequences of their own (the boundary targets left out), so the packed figure is the documents'.
"""

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert

from hpcpar.config.load import load_config
from hpcpar.data import formats, packing
from hpcpar.training.evaluate import evaluate
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
BASE = ["model.vocab_size=256", "model.block_size=16", "model.n_layer=2", "model.n_head=4", "model.n_embd=16",
        "model.dtype=float64", "train.micro_batch_size=2", "train.steps=2", "train.warmup=1", "train.lr=0.01",
        "train.seed=3", "run.progress=false", "data.packing=documents"]
_rng = np.random.default_rng(1)
TOKENS = _rng.integers(0, 256, 12_000).astype(np.uint16)
# Long-tailed document lengths (Pareto, capped so that the held-out tail holds many documents).
LENGTHS = np.minimum(np.ceil(_rng.pareto(1.2, 3000) * 5), 120).astype(np.int64)
STARTS = np.concatenate([[0], np.cumsum(LENGTHS)])
DATA = formats.from_tokens(TOKENS, 0.1, STARTS[STARTS < len(TOKENS)])
MAX_TOKENS = 37 * 16   # 37 windows: the last global batch of 8 holds 3 padding windows

LAYOUTS = {
    "dp4": ["mesh.dp=4", "mesh.pp=1", "train.microbatches=1"],
    "dp2-tp2": ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "train.microbatches=2"],
    "pp2-dp2": ["mesh.dp=2", "mesh.pp=2", "train.microbatches=2"],
    "cp2-dp2-ring": ["mesh.dp=2", "mesh.cp=2", "mesh.pp=1", "train.microbatches=2"],
    "cp4-ulysses": ["mesh.cp=4", "mesh.cp_impl=ulysses", "mesh.pp=1", "train.microbatches=4"],
    "cp2-tp2-sp-ring": ["mesh.cp=2", "mesh.tp=2", "mesh.pp=1", "mesh.sequence_parallel=true", "train.microbatches=4"],
    "dp4-zero3": ["mesh.dp=4", "mesh.pp=1", "train.zero=3", "train.microbatches=1"],
}


def trained(overrides: list, comm) -> Trainer:
    t = Trainer(load_config(None, BASE + overrides), comm=comm, tokens=DATA)
    for s in range(2):
        t.train_step(s)
    return t


def segments_alone(t: Trainer) -> float:
    """Mean loss over the kept targets of the held-out windows, every segment run as a sequence of
    its own (one process)."""
    tokens, starts, block = DATA.val, DATA.val_starts, 16
    total, kept = 0.0, 0
    for w in range(MAX_TOKENS // block):
        x, y = tokens[w * block:(w + 1) * block].astype(np.int64), tokens[w * block + 1:(w + 1) * block + 1].astype(
            np.int64)
        documents, crossing = packing.Documents.of_windows(starts, np.array([w * block]), block)
        y = np.where(crossing[0], packing.IGNORE, y)
        bounds = list(documents.starts[0]) + [block]
        for a, e in zip(bounds[:-1], bounds[1:]):
            n = int(np.count_nonzero(y[a:e] != packing.IGNORE))
            if n:
                (loss,) = t.forward_losses([(x[None, a:e], y[None, a:e])])
                total, kept = total + float(loss) * n, kept + n
    return total / kept


_reference: dict = {}


def reference() -> tuple[float, float, float]:
    """(packed evaluation, segments alone, plain-stream evaluation) of the one-process run."""
    if not _reference:
        t = trained(["mesh.dp=1", "mesh.tp=1", "mesh.pp=1", "train.microbatches=4"], MPI.COMM_SELF)
        _reference["all"] = (evaluate(t, DATA.val, MAX_TOKENS, DATA.val_starts)["loss"], segments_alone(t),
                             evaluate(t, DATA.val, MAX_TOKENS)["loss"])
        t.mesh.free()
    return _reference["all"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_evaluation_matches_one_process(name):
    packed, alone, plain = reference()
    t = trained(LAYOUTS[name], WORLD)
    got = evaluate(t, DATA.val, MAX_TOKENS, DATA.val_starts)["loss"]
    t.mesh.free()
    collective_assert(abs(got - packed) <= 1e-10 * abs(packed) and abs(packed - alone) <= 1e-10 * abs(alone)
                      and abs(packed - plain) > 1e-6,
                      f"{name}: packed eval {got!r}, one process {packed!r}, segments alone {alone!r}, plain {plain!r}")
