"""Data formats, padded vocabularies and imported weights through the Trainer, on any mesh.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_data_formats.py (also -n 1, 2, 3).
- The same bytes as text (bytes), as a bin token file and as an HDF5 dataset give bitwise the
  same loss curve (training and validation losses), on the world's default mesh (dp=2 x pp=2 on
  4 ranks) and on one rank, in float64.
- A vocabulary tp does not divide (257) trains like the single-process model (1e-10), and its
  checkpoint, saved on a tp mesh, loads into one process bitwise: global shapes carry no padding.
- A weights-only checkpoint made by `hpcpar ckpt import` loads into any mesh (ZeRO-3 too).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, host

from hpcpar.interop import huggingface, safetensors
from hpcpar.data import prepare
from hpcpar.config.load import load_config
from hpcpar.nn.gpt import GPTConfig
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
STEPS = 4
TINY = ["model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=16", "model.dtype=float64",
        f"train.steps={STEPS}", "train.warmup=1", "train.lr=0.01", "train.micro_batch_size=2", "run.progress=false",
        "data.val_fraction=0.1"]
TEXT = np.random.default_rng(3).integers(0, 256, 30_000).astype(np.uint8).tobytes()


@pytest.fixture(scope="module")
def files():
    """The same bytes as a text file and as prepared bin and hdf5 directories (rank 0 writes)."""
    import tempfile
    where = os.environ.get("HPCPAR_SHARED_TMP") or None  # as conftest.shared_dir: seen by every node
    root = WORLD.bcast(tempfile.mkdtemp(prefix="hpcpar-formats-", dir=where) if RANK == 0 else None, root=0)
    if RANK == 0:
        with open(os.path.join(root, "text.txt"), "wb") as f:
            f.write(TEXT)
        for fmt in ("bin", "hdf5"):
            prepare.prepare([os.path.join(root, "text.txt")], os.path.join(root, fmt), fmt=fmt, progress=False)
    WORLD.barrier()
    yield {"bytes": os.path.join(root, "text.txt"), "bin": os.path.join(root, "bin"),
           "hdf5": os.path.join(root, "hdf5")}
    WORLD.barrier()
    if RANK == 0:
        import shutil
        shutil.rmtree(root, ignore_errors=True)


def curve(fmt: str, corpus: str, comm, extra=()) -> list:
    cfg = load_config(None, TINY + [f"data.format={fmt}", f"data.corpus={corpus}", *extra])
    trainer = Trainer(cfg, comm=comm)
    out = []
    for s in range(STEPS):
        r = trainer.train_step(s)
        out += [r.loss, r.grad_norm]
    return out + [trainer.evaluate(2)]


@pytest.mark.timeout(120)
def test_bin_and_hdf5_give_the_loss_curve_of_the_same_bytes(files):
    for comm in (WORLD, MPI.COMM_SELF):          # the default mesh of the world, and one rank
        extra = ["train.microbatches=2"]
        ref = curve("bytes", files["bytes"], comm, extra)
        for fmt in ("bin", "hdf5"):
            got = curve(fmt, files[fmt], comm, extra)
            collective_assert(got == ref, f"{fmt} on {comm.Get_size()} rank(s): {got} vs bytes {ref}")


@pytest.mark.timeout(120)
@pytest.mark.skipif(SIZE % 2, reason="needs tp=2")
def test_padded_vocabulary_trains_like_one_process_and_checkpoints_without_padding(files, shared_dir):
    vocab = ["model.vocab_size=257"]
    ref_cfg = load_config(None, TINY + vocab + ["mesh.dp=1", "mesh.tp=1", "mesh.pp=1",
                                                f"train.microbatches={SIZE // 2}"])
    reference = Trainer(ref_cfg, comm=MPI.COMM_SELF, tokens=np.frombuffer(TEXT, np.uint8))
    ref = [reference.train_step(s).loss for s in range(STEPS)]
    pp = 2 if SIZE >= 4 else 1
    cfg = load_config(None, TINY + vocab + ["mesh.tp=2", f"mesh.pp={pp}", f"mesh.dp={SIZE // (2 * pp)}",
                                            f"train.microbatches={SIZE // 2 // (SIZE // (2 * pp))}"])
    trainer = Trainer(cfg, comm=WORLD, tokens=np.frombuffer(TEXT, np.uint8))
    got = [trainer.train_step(s).loss for s in range(STEPS)]
    collective_assert(np.allclose(got, ref, rtol=1e-10, atol=0), f"losses {got} vs {ref}")
    path = trainer.save(shared_dir, keep=1)
    params = trainer.global_parameters()
    collective_assert(params["transformer.wte.weight"].shape == (257, 16), "padding in the global tensor")
    one = Trainer(load_config(None, TINY + vocab + ["mesh.dp=1", "mesh.tp=1", "mesh.pp=1"]), comm=MPI.COMM_SELF,
                  tokens=np.frombuffer(TEXT, np.uint8))
    one.load(path)
    loaded = one.global_parameters()
    collective_assert(all(np.array_equal(loaded[n], params[n]) for n in params), "reloaded parameters differ")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 3])
def test_imported_weights_load_on_any_mesh(shared_dir, zero):
    """HF-named random weights -> `ckpt import` -> a Trainer on this world's mesh holds them (with
    zero=3 on dp = world: each rank loads its flat shards of the weights only)."""
    model = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16, dtype="float64")
    rng = np.random.default_rng(9)
    names = huggingface._model_names(model)
    weights = {n: rng.standard_normal(s) for n, s in names.items()}
    if RANK == 0:
        os.makedirs(os.path.join(shared_dir, "hf"))
        hf = {n: (a.T if n.endswith(huggingface.CONV1D) else a) for n, a in weights.items()}
        safetensors.write(os.path.join(shared_dir, "hf", "model.safetensors"), hf)
        huggingface.import_(os.path.join(shared_dir, "hf"), os.path.join(shared_dir, "ckpt"), n_head=2)
    WORLD.barrier()
    layout = ["mesh.tp=2", f"mesh.pp={SIZE // 2}", "mesh.dp=1"] if SIZE % 2 == 0 else []
    if zero:
        layout = [f"mesh.dp={SIZE}", "mesh.pp=1", f"train.zero={zero}"]
    cfg = load_config(None, TINY + layout + [f"train.microbatches={max(SIZE // 2, 1)}"])
    trainer = Trainer(cfg, comm=WORLD, tokens=np.frombuffer(TEXT, np.uint8))
    trainer.load(os.path.join(shared_dir, "ckpt"))
    got = trainer.global_parameters()
    collective_assert(trainer.step == 0 and all(np.array_equal(host(got[n]), weights[n]) for n in weights),
                      "imported weights differ after loading on the mesh")
    result = trainer.train_step(0)                    # a fresh optimizer trains from them
    collective_assert(np.isfinite(result.loss) and not result.skipped, f"step after import: {result}")
