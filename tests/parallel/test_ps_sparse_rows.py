"""Parameter servers push and pull only the untied embedding rows a batch touches (issue #43).

Run: mpiexec -n 4 python -m pytest tests/parallel/test_ps_sparse_rows.py (other sizes skip).
float64, untied embeddings (wte's gradient row-sparse), synchronous parameter servers, 4 steps
through `Trainer.train` (`run.build`): with train.sparse_embedding = "auto" the workers holding
wte push its nonzero rows and pull the rows their next step looks up (every row before the end
and before an evaluation), and the run equals the same run with "never" (wte dense in the pieces
and the pull) BIT FOR BIT: losses, gradient norms, validation losses and every global parameter;
and it equals the single-process run to 1e-10. Layouts of 4 ranks: dp=3 + 1 server, dp=2 + 2
servers, tp=2 + 2 servers (each tp rank's vocabulary shard), pp=2 + 2 servers (wte on the first
stage), dp=1 + 3 servers (a server boundary inside wte), packed documents on dp=3 + 1 server.
The vocabulary (1024 ids, of which the data uses 256) is large against a rank's 64 tokens: the
client's counters say the rows went sparse, and the servers' bytes in + out per step are fewer
than "never"'s. SSP and async take the same messages: a run of each ends with the same wte on
every replica after the final (dense) pull, finite.
A preemption stop pulls every row from every server (server 1 learns of it from the pushes).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, training_problems
from test_sparse_embedding import DATA  # the same tokens, long-tailed documents

from hpcpar.config.load import load_config
from hpcpar.training.run import build
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
STEPS = 4
RTOL = 1e-10
BASE = ["model.vocab_size=1024", "model.block_size=16", "model.n_layer=2", "model.n_head=4", "model.n_embd=16",
        "model.dtype=float64", "model.tie_embeddings=false", "train.micro_batch_size=2", f"train.steps={STEPS}",
        "train.warmup=1", "train.lr=0.01", "train.grad_clip=1.0", "train.seed=7", "run.progress=false",
        "run.eval_every=0", "run.eval_batches=2"]

# name -> (overrides, micro-batches per dp rank, dp)
LAYOUTS = {
    "dp3-s1": (["mesh.dp=3", "mesh.pp=1", "ps.servers=1", "model.dropout=0.1"], 2, 3),
    "dp2-s2": (["mesh.dp=2", "mesh.pp=1", "ps.servers=2"], 2, 2),
    "tp2-s2": (["mesh.dp=1", "mesh.tp=2", "mesh.pp=1", "ps.servers=2"], 2, 1),
    "pp2-s2": (["mesh.dp=1", "mesh.pp=2", "ps.servers=2", "pipeline.schedule=1f1b"], 2, 1),
    "dp1-s3": (["mesh.dp=1", "mesh.pp=1", "ps.servers=3"], 2, 1),
}

pytestmark = pytest.mark.skipif(WORLD.size != 4, reason="the layouts of 4 ranks")


def run(overrides: list, packing: str = "none") -> dict:
    """A run of STEPS steps: every rank's records, and on the workers the global parameters and
    wte's row counters (None where the rank holds no wte); the servers' bytes per step."""
    rank = build(load_config(None, BASE + [f"data.packing={packing}"] + overrides), WORLD, tokens=DATA[packing])
    records: list = []
    result = rank.train(steps=STEPS, files=False, progress=False, on_step=records.append, peak_flops=0.0)
    worker = isinstance(rank, Trainer)
    params = rank.global_parameters() if worker else None   # collective over the workers
    rows = rank.update.client.rows if worker else None
    wte = np.array(rows.param.data) if rows else None
    # Whether a server's range begins or ends inside a row of wte (some row only partly in it).
    cut = rows is not None and any(((c > 0) & (c < rows.param.data.shape[1])).any() for _, _, c in rows.runs)
    rank.free()
    ps = result.summary.get("ps") if worker else None
    traffic = sum(s["bytes_in_per_step"] + s["bytes_out_per_step"] for s in ps["servers"]) if ps else None
    return {"records": records, "params": params, "steps": dict(rows.steps) if rows else None, "traffic": traffic,
            "wte": wte, "cut": cut}


_reference_cache: dict = {}


def reference(model: tuple, microbatches: int, packing: str) -> list:
    """(per-step (loss, grad_norm), global parameters) of the one-process run (no server)."""
    key = (model, microbatches, packing)
    if key not in _reference_cache:
        cfg = load_config(None, BASE + [f"data.packing={packing}", "mesh.dp=1", "mesh.pp=1",
                                        f"train.microbatches={microbatches}", *model])
        t = Trainer(cfg, MPI.COMM_SELF, tokens=DATA[packing])
        steps = [(r.loss, r.grad_norm) for r in (t.train_step(s) for s in range(STEPS))]
        _reference_cache[key] = (steps, t.global_parameters())
        t.free()
    return _reference_cache[key]


def bitwise_problems(auto: dict, never: dict) -> list[str]:
    problems = []
    for key in ("loss", "grad_norm", "val_loss"):
        a, b = [r.get(key) for r in auto["records"]], [r.get(key) for r in never["records"]]
        if a != b:
            problems.append(f"rank {WORLD.rank}: {key} {a} (auto) != {b} (never)")
    if auto["params"] is not None:
        problems += [f"rank {WORLD.rank}: {n} differs from the dense run"
                     for n in never["params"] if not np.array_equal(auto["params"][n], never["params"][n])]
    return problems


class _Result:
    def __init__(self, record):
        self.loss, self.grad_norm = record["loss"], record["grad_norm"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("packing, name", [("none", n) for n in LAYOUTS] + [("documents", "dp3-s1")])
def test_sparse_rows_equal_dense_bitwise_and_one_process(name, packing):
    overrides, m, dp = LAYOUTS[name]
    overrides = overrides + [f"train.microbatches={m}"]
    auto = run(overrides, packing)
    never = run(overrides + ["train.sparse_embedding=never"], packing)
    problems = bitwise_problems(auto, never)
    if WORLD.rank == 0:
        model = tuple(o for o in overrides if o.startswith("model."))
        ref_steps, ref_params = reference(model, dp * m, packing)
        problems += training_problems([_Result(r) for r in auto["records"]], ref_steps, auto["params"], ref_params,
                                      RTOL)
    # wte's holders: each pushed sparse every step, pulled sparse but before the end.
    counters = [c for c in WORLD.allgather(auto["steps"]) if c is not None]
    servers = int(next(o for o in overrides if o.startswith("ps.servers=")).split("=")[1])
    if not counters or any(c["push_sparse"] < STEPS or c["push_dense"] or c["pull_sparse"] < STEPS - 1
                           or c["pull_dense"] < 1 for c in counters):
        problems.append(f"the row counters of wte's holders: {counters} ({servers} servers)")
    if name == "dp1-s3" and not any(WORLD.allgather(auto["cut"])):
        problems.append("no server boundary cuts a row of wte: the case this layout is for is gone")
    if any(c is not None for c in WORLD.allgather(never["steps"])):
        problems.append("train.sparse_embedding = never still sent rows")
    if WORLD.rank == 0 and not auto["traffic"] < never["traffic"]:
        problems.append(f"servers' bytes per step: {auto['traffic']} (auto) vs {never['traffic']} (never)")
    collective_assert(not problems, f"{name}/{packing}: " + "; ".join(problems[:3]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["dp3-s1", "pp2-s2"])
def test_an_evaluation_mid_run_sees_the_whole_table(name):
    """run.eval_every = 2: the pulls before steps 2 and 4 (evaluations) bring every row, the
    others the wanted rows only; the validation losses equal the dense run's bitwise."""
    overrides, m, _ = LAYOUTS[name]
    overrides = overrides + [f"train.microbatches={m}", "run.eval_every=2"]
    auto = run(overrides)
    never = run(overrides + ["train.sparse_embedding=never"])
    problems = bitwise_problems(auto, never)
    vals = [r.get("val_loss") for r in auto["records"]]
    if WORLD.rank == 0 and (vals[1] is None or vals[3] is None or not np.isfinite(vals[1])):
        problems.append(f"validation losses {vals}")
    counters = [c for c in WORLD.allgather(auto["steps"]) if c is not None]
    if not counters or any(c["pull_sparse"] != STEPS // 2 or c["pull_dense"] != STEPS // 2 for c in counters):
        problems.append(f"pulls (sparse, dense) per holder: {counters}")
    collective_assert(not problems, f"{name}: " + "; ".join(problems[:3]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [("ps.staleness=2",), ("ps.mode=async",)], ids=["ssp2", "async"])
def test_stale_modes_take_the_same_messages(mode):
    """SSP and async: the rows go sparse, and every replica ends with the servers' whole wte (the
    last pull is dense and waits for every replica), the same on every replica, finite."""
    overrides, m, _ = LAYOUTS["dp3-s1"]
    auto = run(overrides + [f"train.microbatches={m}", *mode])
    problems = []
    tables = [t for t in WORLD.allgather(auto["wte"]) if t is not None]
    if len(tables) != 3 or not all(np.array_equal(t, tables[0]) for t in tables) or not np.isfinite(tables[0]).all():
        problems.append(f"wte differs between the {len(tables)} replicas after the final pull, or is not finite")
    counters = [c for c in WORLD.allgather(auto["steps"]) if c is not None]
    if not counters or any(c["push_sparse"] < STEPS or c["pull_sparse"] < 1 for c in counters):
        problems.append(f"the row counters: {counters}")
    collective_assert(not problems, "; ".join(problems[:3]))


@pytest.mark.timeout(300)
def test_a_preemption_stop_pulls_the_whole_table():
    """A preemption signal (rank 1, after step 1) stops the run after step 2; server 1, which holds
    wte but not the stop step (server 0 picks it), saw the signal in the pushes and pulls every
    row: the workers' parameters at the stop equal the dense run's bitwise."""
    from hpcpar.runtime import preemption

    def signal_after_step_1(record):
        if WORLD.rank == 1 and record["step"] == 1:
            preemption._requested = True
    overrides, m, _ = LAYOUTS["dp2-s2"]
    overrides = overrides + [f"train.microbatches={m}"]
    out = {}
    for mode in ("auto", "never"):
        rank = build(load_config(None, BASE + ["data.packing=none", f"train.sparse_embedding={mode}"] + overrides),
                     WORLD, tokens=DATA["none"])
        try:
            result = rank.train(steps=STEPS, files=False, progress=False, on_step=signal_after_step_1,
                                peak_flops=0.0)
        finally:
            preemption._requested = False
        out[mode] = (result.status, rank.global_parameters() if isinstance(rank, Trainer) else None,
                     rank.step)
        rank.free()
    (status, auto, stop), (_, never, _) = out["auto"], out["never"]
    problems = [] if stop == 3 and status != 0 else [f"rank {WORLD.rank}: stopped at {stop}, status {status}"]
    if auto is not None:
        problems += [f"rank {WORLD.rank}: {n} differs from the dense run at the stop"
                     for n in never if not np.array_equal(auto[n], never[n])]
    collective_assert(not problems, "; ".join(problems[:3]))
