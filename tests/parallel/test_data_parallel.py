"""Data parallelism across ranks against the single-process run on the same global batch.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_data_parallel.py (also -n 1, 2, 3).
Meshes: dp = world; dp x tp=2 and dp x pp=2 (tied embedding over embedding_comm) when the
world is even and >= 4. Every step here is a small local loop (GPT stages + DataParallel +
AdamW + data.get_batch) so that only data parallelism is under test; pp=2 passes activations
with plain send/recv.
"""

import functools
import time

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, host, optimizer_pieces

from hpcpar import backend
from hpcpar.data import corpus
from hpcpar.runtime.mesh import Mesh
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.optim.optimizers import AdamW, clip_grad_norm
from hpcpar.parallel.dp.sync import make_gradient_sync
from hpcpar.autograd.tensor import Tensor

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
CFG = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16, dtype="float64")
TOKENS = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
SEED, LR, CLIP, MBS, STEPS = 11, 1e-2, 0.4, 2, 5
BUCKET_MB = 0.004  # a few parameters per bucket: many buckets, so ordering and overlap matter




def meshes() -> list:
    out = [pytest.param((SIZE, 1, 1), id=f"dp{SIZE}")]
    if SIZE % 2 == 0 and SIZE >= 4:
        out.append(pytest.param((SIZE // 2, 2, 1), id=f"dp{SIZE // 2}xtp2"))
        out.append(pytest.param((SIZE // 2, 1, 2), id=f"dp{SIZE // 2}xpp2"))
    return out


def make_optimizer(params):
    return AdamW(params, lr=LR, weight_decay=0.1)


@functools.lru_cache(maxsize=None)
def reference(global_batch: int, steps: int = STEPS, clip: float = CLIP):
    """One process, whole model, whole global batch: (losses, norms, params, optimizer state)."""
    model = GPT(CFG, seed=SEED)
    params = model.parameters()
    opt = make_optimizer(params)
    losses, norms = [], []
    for step in range(steps):
        for p in params:
            p.grad = None
        x, y = corpus.get_batch(TOKENS, SEED, step, range(global_batch), CFG.block_size)
        loss = model(x, y)
        loss.backward()
        norms.append(clip_grad_norm(params, clip))
        opt.step(LR)
        losses.append(loss.item())
    named = dict(model.named_parameters())
    state = {n: {k: v.copy() for k, v in opt.state_of(p).items()} for n, p in named.items()}
    return losses, norms, {n: p.data.copy() for n, p in named.items()}, state


class Setup:
    """This rank's stage of the model on a (dp, tp, pp) mesh, with its DataParallel."""

    def __init__(self, degrees, zero=0, compression="none", bucket_mb=BUCKET_MB, n_layer=None):
        dp, tp, pp = degrees
        self.mesh = Mesh(dp=dp, tp=tp, pp=pp, comm=WORLD)
        self.cfg = CFG if n_layer is None else GPTConfig(**{**CFG.__dict__, "n_layer": n_layer})
        stage, stages = self.mesh.rank("pp"), pp
        per = self.cfg.n_layer // stages
        layers = range(stage * per, (stage + 1) * per if stage < stages - 1 else self.cfg.n_layer)
        self.model = GPT(self.cfg, tp_comm=self.mesh.comm("tp"), layers=layers, embed=stage == 0,
                         head=stage == stages - 1, seed=SEED)
        self.named = list(self.model.named_parameters())
        self.dp = make_gradient_sync(self.named, self.mesh, bucket_mb=bucket_mb, compression=compression, zero=zero,
                                     make_optimizer=make_optimizer)

    def backward_microbatch(self, step: int, j: int, m: int) -> float:
        """Forward and backward of micro-batch j (loss scaled by 1/m); the loss on the last stage, else 0."""
        mesh, dpn, d = self.mesh, self.mesh.size("dp"), self.mesh.rank("dp")
        x, y = corpus.get_batch(TOKENS, SEED, step, corpus.microbatch_sample_ids(d, dpn, MBS, j), self.cfg.block_size)
        pp = mesh.comm("pp")
        xp = backend.xp  # the model's arrays: activations and gradients cross stages in them
        scale = xp.asarray(1.0 / m, dtype=np.float64)
        if pp.size == 1:
            loss = self.model(x, y)
            loss.backward(scale)
            return loss.item()
        if self.model.embed:
            h = self.model(x)
            pp.send(h.data, mesh.next_stage, tag=j)
            grad = pp.recv(xp.empty_like(h.data), mesh.next_stage, tag=j)
            h.backward(grad)
            return 0.0
        hin = Tensor(pp.recv(xp.empty((MBS, self.cfg.block_size, self.cfg.n_embd)), mesh.prev_stage, tag=j),
                     requires_grad=True)
        loss = self.model(hin, y)
        loss.backward(scale)
        pp.send(hin.grad, mesh.prev_stage, tag=j)
        return loss.item()

    def train_step(self, step: int, m: int, clip: float = CLIP) -> tuple[float, float]:
        """One step; returns (mean loss over the global batch, gradient norm), same on every rank."""
        self.dp.begin_step(microbatches=m)
        local = sum(self.backward_microbatch(step, j, m) for j in range(m))
        self.dp.finish_backward()
        norm = self.dp.clip_grad_norm(clip)
        self.dp.step(LR)
        reporters = self.mesh.size("dp") * (self.mesh.size("tp") if self.model.head else 0)
        total = WORLD.allreduce(local if self.model.head else 0.0)
        count = WORLD.allreduce(reporters if self.mesh.rank("dp") == 0 and self.mesh.rank("tp") == 0 else 0)
        return total / (count * m), norm

    def close(self) -> None:
        self.mesh.free()


def rel_err(a, b) -> float:
    a, b = host(a), host(b)
    scale = float(np.max(np.abs(b))) or 1.0
    return float(np.max(np.abs(a - b))) / scale


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("degrees", meshes())
def test_training_matches_single_process(degrees, zero, m):
    s = Setup(degrees, zero=zero)
    losses, norms = zip(*[s.train_step(step, m) for step in range(STEPS)])
    ref_losses, ref_norms, ref_params, ref_state = reference(degrees[0] * MBS * m)
    problems = []
    if rel_err(losses, ref_losses) > 1e-10:
        problems.append(f"losses {losses} vs {ref_losses}")
    if rel_err(norms, ref_norms) > 1e-10:
        problems.append(f"norms {norms} vs {ref_norms}")
    for name, p in s.named:
        key = p.tied_to or name
        if rel_err(p.data, p.layout.take(ref_params[key])) > 1e-10:
            problems.append(f"parameter {name}")
    for key, state, layout in optimizer_pieces(s.dp, s.named):
        for k, v in state.items():
            if rel_err(v, layout.take(ref_state[key][k])) > 1e-10:
                problems.append(f"optimizer state {key}/{k}")
    clipped = max(ref_norms) > CLIP  # the comparison covers clipping
    s.close()
    collective_assert(not problems and clipped, f"{degrees} zero={zero} m={m}: {problems[:4]}")


@pytest.mark.parametrize("m", [1, 3])
def test_bucket_reductions_overlap_backward(m):
    """The last layers' buckets are launched before the first layer's gradients exist, and
    with accumulation nothing is launched before the last micro-batch."""
    s = Setup((SIZE, 1, 1), n_layer=3, bucket_mb=0.002)
    s.dp.begin_step(microbatches=m)
    for j in range(m):
        if j == m - 1:
            s.dp.events.append(("last_microbatch", j, time.perf_counter()))
        s.backward_microbatch(0, j, m)
    events = list(s.dp.events)
    s.dp.finish_backward()
    s.close()
    last_mb = [t for kind, _, t in events if kind == "last_microbatch"][0]
    first_layer_done = min(t for kind, name, t in events
                           if kind == "grad_ready" and name.startswith("transformer.h.0."))
    buckets = s.dp.buckets
    late = [b.index for b in buckets
            if all(sl.name.startswith(("transformer.h.2.", "transformer.ln_f.")) for sl in b.assignment.slots)]
    started = {i: t for kind, i, t in events if kind == "bucket_start"}
    problems = []
    if not late or not all(i in started and started[i] < first_layer_done for i in late):
        problems.append(f"last-layer buckets {late} not all started before layer 0's gradients "
                        f"({first_layer_done}): {started}")
    if any(t < last_mb for t in started.values()):
        problems.append("a bucket was launched before the last micro-batch")
    if sorted(started) != list(started):
        problems.append("buckets launched out of order")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("degrees", meshes())
def test_clip_norm_same_float_everywhere_and_matches(degrees, zero):
    s = Setup(degrees, zero=zero)
    s.dp.begin_step(microbatches=2)
    for j in range(2):
        s.backward_microbatch(0, j, 2)
    s.dp.finish_backward()
    norm = s.dp.clip_grad_norm(0.0)  # measure only
    s.close()
    ref_norm = reference(degrees[0] * MBS * 2, steps=1, clip=0.0)[1][0]
    norms = WORLD.allgather(norm)
    collective_assert(len(set(norms)) == 1 and abs(norm - ref_norm) <= 1e-10 * ref_norm,
                      f"norms {norms} vs single process {ref_norm}")


def test_zero_shards_optimizer_state():
    s = Setup((SIZE, 1, 1), zero=1)
    mine = sum(v.size for st in s.dp.optimizer.state_dict()["state"] for v in st.values())
    full = 2 * sum(p.data.size for _, p in s.named)      # exp_avg and exp_avg_sq
    padding = 2 * sum(b.assignment.size - b.assignment.used for b in s.dp.buckets)
    total = WORLD.allreduce(mine)
    s.close()
    collective_assert(total == full and mine <= (full + padding) // SIZE,
                      f"rank state {mine} elements, all ranks {total}, unsharded {full}, dp={SIZE}")


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_compressed_wire_close_to_exact_and_identical_on_replicas(wire, zero):
    exact = Setup((SIZE, 1, 1))
    packed = Setup((SIZE, 1, 1), compression=wire, zero=zero)
    for s in (exact, packed):
        s.dp.begin_step(microbatches=1)
        s.backward_microbatch(0, 0, 1)
        s.dp.finish_backward()
    tol = 2e-3 if wire == "fp16" else 1.6e-2  # 16-bit rounding of each addend and of the sum
    problems = []
    exact_by_name = dict(exact.named)
    if zero:  # this rank's averaged part, as the optimizer's segments see it
        names = {id(p): n for n, p in packed.named}
        for seg in packed.dp.optimizer.params:
            full = host(exact_by_name[names[id(seg.param)]].grad)
            if np.max(np.abs(host(seg.grad) - full.reshape(-1)[seg.lo:seg.hi])) > tol * (np.max(np.abs(full)) + 1e-12):
                problems.append(names[id(seg.param)])
    else:
        for name, p in packed.named:
            grad, ref = host(p.grad), host(exact_by_name[name].grad)
            if np.max(np.abs(grad - ref)) > tol * (np.max(np.abs(ref)) + 1e-12):
                problems.append(name)
            same = WORLD.allgather(grad.tobytes())
            if len(set(same)) != 1:
                problems.append(f"{name} differs between replicas")
    exact.close()
    packed.close()
    collective_assert(not problems, f"{wire} zero={zero}: {problems[:4]}")


# -- through the Trainer (pipeline executor + DataParallel as the training loop uses them) ------

def trainer_config(dp: int, tp: int, pp: int, mbs: int, m: int, zero: int, extra: tuple = ()):
    from hpcpar.config.load import load_config
    return load_config(None, list(extra) + [
        f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}", f"train.micro_batch_size={mbs}",
        f"train.microbatches={m}", f"train.zero={zero}", f"train.bucket_mb={BUCKET_MB}", "train.steps=5",
        "train.warmup=2", f"train.grad_clip={CLIP}", f"train.seed={SEED}", "model.dtype=\"float64\"",
        f"model.n_head={CFG.n_head}", f"model.n_embd={CFG.n_embd}",
        f"model.block_size={CFG.block_size}", "run.eval_every=0", "run.progress=false"])


@functools.lru_cache(maxsize=None)
def trainer_reference(global_mbs: int, m: int, n_layer: int = CFG.n_layer):
    from hpcpar.training.trainer import Trainer
    t = Trainer(trainer_config(1, 1, 1, global_mbs, m, 0, (f"model.n_layer={n_layer}",)), comm=MPI.COMM_SELF,
                tokens=TOKENS)
    results = [t.train_step(step) for step in range(STEPS)]
    out = ([r.loss for r in results], [r.grad_norm for r in results],
           {n: p.data.copy() for n, p in t.named_parameters})  # one process: local = global
    t.mesh.free()
    return out


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("degrees", meshes())
def test_trainer_matches_single_process(degrees, zero, m, extra=(), n_layer=CFG.n_layer):
    from hpcpar.training.trainer import Trainer
    dp, tp, pp = degrees
    t = Trainer(trainer_config(dp, tp, pp, MBS, m, zero, (f"model.n_layer={n_layer}",) + extra),
                comm=WORLD, tokens=TOKENS)
    results = [t.train_step(step) for step in range(STEPS)]
    named = t.named_parameters
    t.mesh.free()
    ref_losses, ref_norms, ref_params = trainer_reference(dp * MBS, m, n_layer)
    problems = []
    if rel_err([r.loss for r in results], ref_losses) > 1e-10:
        problems.append(f"losses {[r.loss for r in results]} vs {ref_losses}")
    if rel_err([r.grad_norm for r in results], ref_norms) > 1e-10:
        problems.append(f"norms {[r.grad_norm for r in results]} vs {ref_norms}")
    problems += [name for name, p in named
                 if rel_err(p.data, p.layout.take(ref_params[p.tied_to or name])) > 1e-10]
    collective_assert(not problems, f"{degrees} zero={zero} m={m}: {problems[:4]}")


@pytest.mark.skipif(SIZE % 2 != 0, reason="needs an even world for pp=2")
def test_trainer_interleaved_pipeline_zero_matches_single_process():
    """Two chunks per pipeline rank: the tied head sits on the last rank's second chunk."""
    test_trainer_matches_single_process((SIZE // 2, 1, 2), 1, 2, ('pipeline.schedule="interleaved"',
                                                                  "pipeline.chunks=2"), n_layer=4)
