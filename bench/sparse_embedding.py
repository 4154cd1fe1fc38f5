"""Sparse embedding gradients (issue #43): bytes of wte's data-parallel sync per step, dense vs sparse.

    mpiexec -n 4 python bench/sparse_embedding.py [--steps 4] [--rounds 3] [--quick] [--out F]

An untied GPT (model.tie_embeddings = false) with a BPE-sized vocabulary (32,768 and 50,304 ids),
tiny otherwise: n_embd 64, 2 layers, block 256, float32, micro-batches of 2 windows, dp = 4.
Tokens follow a Zipf-Mandelbrot law over the vocabulary (frequency of the r-th id ~ 1 / (r + 2.7)),
the shape of real BPE token counts, so a batch touches a small share of wte's rows.

Per vocabulary and micro-batches per step, two trainers from the same seed, run in lockstep (a step
of each in turn; their losses agree to rounding):
  dense    train.sparse_embedding = "never": wte's gradient all-reduced in the buckets;
  sparse   "auto": wte out of the buckets, sent as (row id, row) pairs when fewer bytes (it always
           is here), parallel/dp/sparse.py.
Measured from the communicators' byte counters (the mean over ranks per step): wte's bytes in the
sparse run (`DDP.embedding_sync`: the counts' all-gather + the ids + the rows); wte's bytes in the
dense run = its gradient bytes minus the sparse run's gradient bytes other than wte's (the other
buckets are the same). Next to them the formulas: dense 2 (n-1)/n V C s; sparse (n-1)/n sum_r k_r
(C s + 8) with the measured touched rows k_r. And the step time of each (best of --rounds
interleaved rounds, each the median of its steps) and of its gradient sync (`DataParallel.wait_s`:
the time `finish_backward` took, the slowest rank's): noisy on a shared machine, the bytes exact.

Parameter servers (`ps`, the same model and data, vocabulary 32,768): 3 workers (dp = 3) and 1
server on the 4 ranks, synchronous, --ps-steps steps per run, "never" (wte pushed and pulled
whole) and "auto" (the rows a batch touches, parallel/ps/wire.py) in interleaved rounds. Per worker
and step: the bytes pushed + pulled in all (the server's counters: bytes in + out / 3) and wte's
part (the sparse run's row messages, `RowRoutes.bytes`; the dense run's = its total minus the
sparse run's other bytes), next to the formulas: dense 2 V C s; sparse 8 (2 + k + k') + k C s
pushed + k' C s pulled, with k the distinct ids of the worker's step and k' of its next step
(the run's last pull is whole, V C s, and its push names no rows), averaged over the run's steps,
and a step before the last alone (`wte_formula_sparse_step`).

Writes bench/results/sparse_embedding.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from hpcpar import environment

environment.set_default_threads()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar.config.load import load_config  # noqa: E402
from hpcpar.data import formats  # noqa: E402
from hpcpar.parallel.dp.sparse import dense_bytes, sparse_bytes  # noqa: E402
from hpcpar.training.run import build  # noqa: E402
from hpcpar.training.trainer import Trainer  # noqa: E402

WORLD = MPI.COMM_WORLD
OUT = Path(__file__).resolve().parent / "results" / "sparse_embedding.json"
C, BLOCK, LAYERS, BATCH = 64, 256, 2, 2


def zipf_tokens(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    """`n` token ids with Zipf-Mandelbrot frequencies over `vocab` ids (id r ~ 1 / (r + 2.7)), shuffled
    id order so the frequent ids are spread over the table."""
    rng = np.random.default_rng(seed)
    p = 1.0 / (np.arange(vocab) + 2.7)
    ids = rng.choice(vocab, size=n, p=p / p.sum())
    return rng.permutation(vocab)[ids].astype(np.uint16 if vocab <= 65535 else np.uint32)


def config(vocab: int, microbatches: int, mode: str, *more: str):
    return load_config(None, [f"model.vocab_size={vocab}", f"model.block_size={BLOCK}", f"model.n_layer={LAYERS}",
                              "model.n_head=4", f"model.n_embd={C}", "model.tie_embeddings=false", "mesh.pp=1",
                              f"mesh.dp={WORLD.size}", f"train.micro_batch_size={BATCH}",
                              f"train.microbatches={microbatches}", "train.steps=1000", "train.warmup=2",
                              f"train.sparse_embedding={mode}", "run.progress=false", "train.seed=5", *more])


def trainer(vocab: int, microbatches: int, mode: str, data) -> Trainer:
    return Trainer(config(vocab, microbatches, mode), comm=WORLD, tokens=data)


def mean_over_ranks(x: float) -> float:
    return float(np.mean(WORLD.allgather(float(x))))


def case(vocab: int, microbatches: int, steps: int, rounds: int) -> dict:
    data = formats.from_tokens(zipf_tokens(vocab, 2_000_000), 0.01)
    runs = {mode: trainer(vocab, microbatches, mode, data) for mode in ("never", "auto")}
    grad = {m: [] for m in runs}
    times = {m: [] for m in runs}
    syncs = {m: [] for m in runs}
    sent, rows, counts, losses = [], [], [], {m: [] for m in runs}
    step = 0
    for _ in range(rounds):
        tick = {m: [] for m in runs}
        wait = {m: [] for m in runs}
        for _ in range(steps):
            for m, t in runs.items():
                WORLD.Barrier()
                t0 = time.perf_counter()
                r = t.train_step(step)
                tick[m].append(time.perf_counter() - t0)
                wait[m].append(max(WORLD.allgather(t.dp.wait_s)))  # the slowest rank's finish_backward
                grad[m].append(r.traffic["grad_bytes_sent"])
                losses[m].append(r.loss)
                if m == "auto":
                    last = t.dp.embedding_sync["last"]
                    sent.append(mean_over_ranks(last["sent"]))
                    rows.append(mean_over_ranks(last["rows"]))
                    counts.append(last["counts"])
                    assert last["sparse"], last
            step += 1
        for m in runs:
            times[m].append(statistics.median(tick[m]))
            syncs[m].append(statistics.median(wait[m]))
    for t in runs.values():
        t.free()
    n, s = WORLD.size, 4
    wte_dense = float(np.mean(np.array(grad["never"]) - (np.array(grad["auto"]) - np.array(sent))))
    formula_sparse = float(np.mean([sparse_bytes(c, C * s, n) for c in counts]))
    return {"vocab": vocab, "microbatches": microbatches, "tokens_per_rank": BATCH * microbatches * BLOCK,
            "rows_touched_per_rank": float(np.mean(rows)), "share_of_rows": float(np.mean(rows)) / vocab,
            "wte_bytes_dense": wte_dense, "wte_bytes_sparse": float(np.mean(sent)),
            "formula_dense": dense_bytes(vocab, C * s, n), "formula_sparse": formula_sparse,
            "ratio_measured": float(np.mean(sent)) / wte_dense,
            "ratio_formula": formula_sparse / dense_bytes(vocab, C * s, n),
            "grad_bytes_dense": float(np.mean(grad["never"])), "grad_bytes_sparse": float(np.mean(grad["auto"])),
            "step_s_dense": min(times["never"]), "step_s_sparse": min(times["auto"]),
            "time_ratio": min(times["auto"]) / min(times["never"]),
            "sync_s_dense": min(syncs["never"]), "sync_s_sparse": min(syncs["auto"]),
            "sync_ratio": min(syncs["auto"]) / min(syncs["never"]),
            "max_loss_rel_diff": float(max(abs(a - b) / abs(b) for a, b in zip(losses["auto"], losses["never"])))}


def ps_run(vocab: int, mode: str, steps: int, data) -> dict:
    """One parameter-server run of `steps` steps (dp = world - 1, one server): per rank its step
    times, and on the workers wte's row bytes and the distinct ids of each step (and of the next)."""
    workers = WORLD.size - 1
    rank = build(config(vocab, 1, mode, f"mesh.dp={workers}", "ps.servers=1", f"train.steps={steps}",
                        "run.eval_every=0"), WORLD, tokens=data)
    worker = isinstance(rank, Trainer)
    times: list = []
    result = rank.train(steps=steps, files=False, progress=False, on_step=lambda r: times.append(r["step_time_s"]),
                        peak_flops=0.0)
    out = {"times": times, "ps": result.summary.get("ps")}
    if worker:
        rows = rank.update.client.rows
        out["row_bytes"] = float(sum(rows.bytes.values())) if rows is not None else 0.0
        out["ids"] = [len(np.unique(np.concatenate([b[0].reshape(-1) for b in rank.microbatches(s)])))
                      for s in range(steps)]
    rank.free()
    return out


def ps_case(vocab: int, steps: int, rounds: int) -> dict:
    """Parameter servers: bytes per worker per step, dense ("never") vs rows ("auto"), next to the formula."""
    data = formats.from_tokens(zipf_tokens(vocab, 2_000_000), 0.01)
    runs: dict = {m: [] for m in ("never", "auto")}
    for _ in range(rounds):
        for m in runs:
            runs[m].append(ps_run(vocab, m, steps, data))
    workers, s = WORLD.size - 1, 4
    # The server's counters reach every rank through the summary; the rest is the workers'.
    total = {m: sum(v["bytes_in_per_step"] + v["bytes_out_per_step"] for v in runs[m][0]["ps"]["servers"]) / workers
             for m in runs} if WORLD.rank == 0 else {}
    mine = runs["auto"][0]
    row_bytes = WORLD.gather(mine.get("row_bytes", None), root=0)
    ids = WORLD.gather(mine.get("ids", None), root=0)
    times = {m: min(statistics.median(r["times"]) if r["times"] else 0.0 for r in rs) for m, rs in runs.items()}
    times = {m: max(WORLD.allgather(t)) for m, t in times.items()}   # the slowest rank's
    if WORLD.rank:
        return {}
    wte_sparse = float(np.mean([b for b in row_bytes[:workers]])) / steps
    dense = 2 * vocab * C * s
    formula, between = [], []
    for k in ids[:workers]:   # per worker: every step's pushed rows and the next step's wanted rows
        per = [8 * (2 + k[t] + k[t + 1]) + (k[t] + k[t + 1]) * C * s for t in range(steps - 1)]
        per.append(8 * (2 + k[-1]) + k[-1] * C * s + vocab * C * s)   # last: no next step, the whole table
        formula.append(float(np.mean(per)))
        between.append(float(np.mean(per[:-1])))
    return {"vocab": vocab, "workers": workers, "servers": 1, "steps": steps, "tokens_per_worker": BATCH * BLOCK,
            "rows_touched_per_worker": float(np.mean([np.mean(k) for k in ids[:workers]])),
            "bytes_dense": total["never"], "bytes_sparse": total["auto"],
            "ratio": total["auto"] / total["never"],
            "wte_bytes_sparse": wte_sparse, "wte_bytes_dense": total["never"] - (total["auto"] - wte_sparse),
            "wte_formula_dense": float(dense), "wte_formula_sparse": float(np.mean(formula)),
            "wte_formula_sparse_step": float(np.mean(between)),
            "wte_ratio_measured": wte_sparse / (total["never"] - (total["auto"] - wte_sparse)),
            "wte_ratio_formula": float(np.mean(formula)) / dense,
            "step_s_dense": times["never"], "step_s_sparse": times["auto"],
            "time_ratio": times["auto"] / times["never"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="steps per round and mode")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the best is kept)")
    ap.add_argument("--quick", action="store_true", help="one vocabulary, one round of 2 steps")
    ap.add_argument("--ps-steps", type=int, default=20, help="steps per parameter-server run")
    ap.add_argument("--out", type=Path, default=OUT, help="the JSON to write")
    args = ap.parse_args()
    grid = [(32768, 1)] if args.quick else [(32768, 1), (32768, 4), (50304, 1)]
    steps, rounds = (2, 1) if args.quick else (args.steps, args.rounds)
    rows = [case(v, m, steps, rounds) for v, m in grid]
    ps = ps_case(32768, 3 if args.quick else args.ps_steps, rounds)
    out = args.out
    if WORLD.rank:
        return
    print(f"wte sync bytes per rank per step, dp={WORLD.size}, n_embd={C}, float32, block {BLOCK}, "
          f"micro-batch {BATCH}")
    print(f"{'V':>6} {'tok/rank':>8} {'rows k':>7} {'share':>6} {'dense MB':>9} {'sparse MB':>10} "
          f"{'ratio':>6} {'formula':>7} {'sync x':>6} {'step x':>6}")
    for r in rows:
        print(f"{r['vocab']:>6} {r['tokens_per_rank']:>8} {r['rows_touched_per_rank']:>7.0f} "
              f"{r['share_of_rows']:>6.1%} {r['wte_bytes_dense'] / 1e6:>9.3f} {r['wte_bytes_sparse'] / 1e6:>10.3f} "
              f"{r['ratio_measured']:>6.3f} {r['ratio_formula']:>7.3f} {r['sync_ratio']:>6.2f} {r['time_ratio']:>6.2f}")
    print(f"parameter servers, {ps['workers']} workers + 1 server, V = {ps['vocab']}, {ps['steps']} steps: bytes "
          f"pushed + pulled per worker per step {ps['bytes_dense'] / 1e6:.3f} MB (never) -> "
          f"{ps['bytes_sparse'] / 1e6:.3f} MB (auto), {ps['ratio']:.3f}x; wte {ps['wte_bytes_dense'] / 1e6:.3f} -> "
          f"{ps['wte_bytes_sparse'] / 1e6:.3f} MB ({ps['wte_ratio_measured']:.3f}x, formula "
          f"{ps['wte_ratio_formula']:.3f}x: {ps['wte_formula_dense'] / 1e6:.3f} -> "
          f"{ps['wte_formula_sparse'] / 1e6:.3f} MB; a step before the last "
          f"{ps['wte_formula_sparse_step'] / 1e6:.3f} MB); {ps['rows_touched_per_worker']:.0f} rows per step; "
          f"step time {ps['time_ratio']:.2f}x")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"world": WORLD.size, "n_embd": C, "block_size": BLOCK, "n_layer": LAYERS,
                               "micro_batch_size": BATCH, "dtype": "float32", "steps": steps, "rounds": rounds,
                               "cases": rows, "ps": ps}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
