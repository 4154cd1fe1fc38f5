"""Packed documents (issue #43): packed + masked vs padded vs unmasked training, document attention vs
the dense causal kernel, and data-parallel balance of attention work.

    python bench/varlen.py [--steps 60] [--block 1024] [--batch 4] [--quick]

One process, float32, on the default corpus (the standard library's *.py files, byte tokens, one
document per file: long-tailed lengths) unless --corpus names another. First the length
distribution: documents, median, p90, p99, max, and the share of documents and of tokens in
documents shorter than block_size.

1. Training, the three data layouts side by side on one GPT each (same seed, same initial weights,
   same number of steps, AdamW), run in lockstep (a step of each in turn, so the machine's noise
   falls on all three alike):
     packed   data.packing = "documents": the stream's windows, each segment attended alone,
              positions from 0, boundary-crossing targets left out (hpcpar/data/packing.py);
     padded   one document piece per window: every document cut into block_size pieces, a piece
              padded to block_size with token 0 and target -100 (the loss ignores them); pieces in a
              seeded random order, each once per epoch (a padding loader's pass over the documents),
              built here from the document starts;
     stream   data.packing = "none": the same windows as packed, attention across boundaries.
   Each layout trains twice (--data-seeds), on the windows (pieces) of data seeds s and s + 1 from
   the same initial weights: the eval loss is their mean, and its spread over data orders is the
   yardstick of which loss differences mean anything (120 steps of batch 4 are a noisy place; the
   learning rate falls to 0 on a cosine to keep the final weights' noise down).
   Useful tokens/s = tokens with a target in the loss per step (real tokens; boundary targets
   excluded in every layout alike), mean over the steps, / the median time of forward + backward +
   optimizer step (batch building excluded; the median drops steps that other work slowed).
   Beside it, the packed path's cost where masking changes nothing: forward + backward of windows with
   no document start inside, passed with their Documents, over the same batch passed without.
   Eval loss: every model on the same held-out windows of the validation split, packed and masked
   (each document scored alone: the metric of document-level modelling), and next to it on the same
   windows unmasked (the stream's view).
2. Attention: `document_attention` against `causal_attention` on the same [B, T, 3C] input, forward
   and forward + backward, at the corpus's windows and at a synthetic Pareto length distribution.
   FLOPs: 4 D H per (query, key) pair forward, 12 D H forward + backward; dense T (T + 1)/2 pairs per
   row and head, documents sum_i len_i (len_i + 1)/2. The measured time ratio next to the FLOP ratio;
   best of interleaved rounds. Windows with no document start inside go to the dense kernel
   itself, so a case of whole windows measures the noise (its ratio should be 1).
3. Data-parallel balance: a global batch of G packed windows dealt to dp = 4 and 8 ranks as today
   (`corpus.microbatch_sample_ids`: sample-id order), attention work per rank = sum over its windows'
   segments of len (len + 1)/2; max/mean per step (mean and worst over steps), against
   `data.balance = "attention"`'s dealing (`hpcpar.data.balance.by_work`: longest first onto the
   least loaded rank with room, then onto its micro-batches). Tokens are balanced either way
   (every packed window is block_size tokens).
4. Context-parallel balance (ring attention, cp = 2, 4, 8; arithmetic): each step's micro-batch of
   --batch packed windows cut into 2cp chunks, two per rank, as token-zigzag (rank r: chunks r and
   2cp-1-r) and as the work-balanced dealing packed runs use (`hpcpar.parallel.cp.balance`: lightest
   chunk with heaviest); per rank the attention work (unmasked (query, key) pairs: sum over its
   queries of in-segment position + 1, what `ContextParallel.stats` counts) and the score elements
   its ring blocks compute: now a box per row and (my chunk, its chunk) of a block, the smallest
   holding that piece's pairs (`cp.attention._Block`: what the kernels multiply); before, one box
   per block over all rows and chunks. max/mean over the ranks, mean and worst over the
   micro-batches, the share of micro-batches whose layout changed, all ranks' elements over their
   pairs and the busiest rank's elements now (balanced, boxes per piece) over before (zigzag, one
   box). Then timed (--ring-ranks, default 4, under mpiexec; 0: not run): forward + backward of one
   packed ring attention (B = --batch, T, C = --attn-embd, H = --heads, float32) on the first
   --ring-batches Pareto micro-batches the balance re-deals, zigzag vs balanced, best of --rounds
   interleaved rounds, the slowest rank's time.

Prints tables; writes bench/results/varlen.json and bench/results/varlen.png (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcpar import environment

environment.set_default_threads()

import numpy as np  # noqa: E402

from hpcpar.autograd.attention import causal_attention, document_attention  # noqa: E402
from hpcpar.autograd.tensor import Tensor  # noqa: E402
from hpcpar.data import corpus, formats, packing  # noqa: E402
from hpcpar.data.balance import by_work  # noqa: E402
from hpcpar.nn.gpt import GPT, GPTConfig  # noqa: E402
from hpcpar.optim.optimizers import AdamW  # noqa: E402
from hpcpar.parallel.cp.attention import ContextParallel, positions as cp_positions  # noqa: E402
from hpcpar.parallel.cp.balance import balanced_positions, rank_work  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("packed", "padded", "stream")


def say(text: str) -> None:
    print(text, flush=True)


# ---------------------------------------------------------------------------------------------
# Length distribution
# ---------------------------------------------------------------------------------------------
def lengths_of(starts: np.ndarray, n_tokens: int) -> np.ndarray:
    """Document lengths [n] of a stream of `n_tokens` whose documents begin at `starts`."""
    return np.diff(np.append(starts, n_tokens))


def distribution(lengths: np.ndarray, block: int) -> dict:
    return {"documents": int(lengths.size), "tokens": int(lengths.sum()), "median": float(np.median(lengths)),
            "p90": float(np.percentile(lengths, 90)), "p99": float(np.percentile(lengths, 99)),
            "max": int(lengths.max()), "mean": float(lengths.mean()),
            "share_documents_below_block": float((lengths < block).mean()),
            "share_tokens_below_block": float(lengths[lengths < block].sum() / lengths.sum())}


def pareto_starts(n_tokens: int, alpha: float, xm: int, seed: int) -> np.ndarray:
    """Document starts of a synthetic stream of `n_tokens` whose lengths are Pareto(alpha) from xm."""
    rng = np.random.default_rng(seed)
    lengths = np.ceil(xm * (1.0 + rng.pareto(alpha, n_tokens // xm + 1))).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return starts[starts < n_tokens]


def pairs(documents: packing.Documents) -> np.ndarray:
    """Causal (query, key) pairs per window [B]: sum over its segments of len (len + 1)/2."""
    out = np.empty(len(documents.starts), dtype=np.int64)
    for b, st in enumerate(documents.starts):
        seg = np.diff(np.append(st, documents.block_size))
        out[b] = int((seg * (seg + 1) // 2).sum())
    return out


# ---------------------------------------------------------------------------------------------
# 1. Training
# ---------------------------------------------------------------------------------------------
def pieces_of(starts: np.ndarray, n_tokens: int, block: int) -> np.ndarray:
    """Every document cut into block-size pieces: [P, 3] int64 rows (start, length, last piece?)."""
    out = []
    for a, e in zip(starts.tolist(), np.append(starts[1:], n_tokens).tolist()):
        for s in range(a, e, block):
            out.append((s, min(block, e - s), int(s + block >= e)))
    return np.array(out, dtype=np.int64)


def padded_batch(tokens: np.ndarray, pieces: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """One piece per row, padded: x [B, T] (pad 0), y [B, T] (pad and the document's last target -100)."""
    x = np.zeros((len(pieces), block), dtype=np.int64)
    y = np.full((len(pieces), block), packing.IGNORE, dtype=np.int64)
    for b, (s, n, last) in enumerate(pieces.tolist()):
        x[b, :n] = tokens[s:s + n]
        y[b, :n - last] = tokens[s + 1:s + n + 1 - last]   # a last piece's final target is the next document
    return x, y


class Run:
    """One layout's model, optimizer, batches and measurements."""

    def __init__(self, name: str, args, dataset, pieces: np.ndarray, data_seed: int):
        cfg = GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                        n_embd=args.embd, dtype="float32")
        self.name, self.args, self.dataset, self.data_seed = name, args, dataset, data_seed
        self.pieces, self.order = pieces, np.random.default_rng(data_seed).permutation(len(pieces))
        self.model = GPT(cfg, seed=args.seed)
        self.opt = AdamW(self.model.parameters(), lr=args.lr)
        self.losses, self.times, self.useful = [], [], 0

    def batch(self, step: int) -> tuple:
        a = self.args
        if self.name == "padded":
            take = self.order[np.arange(step * a.batch, (step + 1) * a.batch) % len(self.order)]
            return (*padded_batch(self.dataset.train, self.pieces[take], a.block), None)
        if self.name == "packed":
            return packing.get_batch(self.dataset, "train", self.data_seed, step, range(a.batch), a.block,
                                     packing="documents")
        x, y = packing.get_batch(self.dataset, "train", self.data_seed, step, range(a.batch), a.block)
        return x, y, None

    def step(self, step: int) -> None:
        x, y, documents = self.batch(step)
        start = time.perf_counter()
        loss = self.model(x, y, documents=documents)
        loss.backward()
        self.opt.step(self.args.lr * 0.5 * (1 + np.cos(np.pi * step / self.args.steps)))   # cosine to 0
        self.opt.zero_grad()
        self.times.append(time.perf_counter() - start)
        self.losses.append(float(loss.data))
        self.useful += int((y != packing.IGNORE).sum())

    def evaluate(self, batches: int) -> dict:
        """Mean loss per kept target over `batches` validation batches, masked and unmasked."""
        a, out = self.args, {}
        for masked in (True, False):
            total, count = 0.0, 0
            for i in range(batches):
                x, y, documents = packing.get_batch(self.dataset, "val", a.seed, i, range(a.batch), a.block,
                                                    packing="documents")
                if not masked:
                    x, y = packing.get_batch(self.dataset, "val", a.seed, i, range(a.batch), a.block)
                    documents = None
                n = int((y != packing.IGNORE).sum())
                total += float(self.model(x, y, documents=documents).data) * n
                count += n
            out["masked" if masked else "unmasked"] = total / count
        return out


def packed_path_cost(args, dataset) -> float:
    """Forward + backward time of a batch of whole windows (no document start inside) passed with their
    Documents over the same batch passed without: what the packed path costs where masking changes
    nothing (best of interleaved rounds)."""
    cfg = GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd, dtype="float32")
    model = GPT(cfg, seed=args.seed)
    x, y = packing.get_batch(dataset, "train", args.seed, 0, range(args.batch), args.block)
    starts = corpus.window_starts(len(dataset.train), args.seed, 0, range(args.batch), args.block)
    whole = packing.Documents.of_windows(np.zeros(1, dtype=np.int64), starts, args.block)[0]
    best = {}
    for _ in range(args.rounds):
        for name, documents in (("plain", None), ("packed", whole)):
            start = time.perf_counter()
            model(x, y, documents=documents).backward()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
            for param in model.parameters():
                param.grad = None
    return best["packed"] / best["plain"]


def training(args, dataset) -> dict:
    pieces = pieces_of(dataset.train_starts, len(dataset.train), args.block)
    seeds = [args.seed + k for k in range(args.data_seeds)]
    runs = [Run(name, args, dataset, pieces, seed) for seed in seeds for name in VARIANTS]
    for step in range(args.steps):
        for run in runs[step % len(runs):] + runs[:step % len(runs)]:   # rotate who goes first
            run.step(step)
    real = int(pieces[:, 1].sum())
    rows = []
    for name in VARIANTS:
        mine = [run for run in runs if run.name == name]
        evals = [run.evaluate(args.eval_batches) for run in mine]
        # Mean useful tokens per step over the median step time: the median shrugs off the steps other
        # work on this shared machine slowed down.
        step_s = float(np.median(np.concatenate([run.times for run in mine])))
        useful = sum(run.useful for run in mine) / args.steps / len(mine)
        rows.append({"layout": name, "useful_tokens_per_s": useful / step_s, "step_s_median": step_s,
                     "useful_tokens_per_step": useful,
                     "final_train_loss": float(np.mean([np.mean(run.losses[-5:]) for run in mine])),
                     "eval_loss_masked": float(np.mean([e["masked"] for e in evals])),
                     "eval_loss_unmasked": float(np.mean([e["unmasked"] for e in evals])),
                     "eval_loss_masked_per_seed": [e["masked"] for e in evals],
                     "losses": np.mean([run.losses for run in mine], axis=0).tolist()})
    base = rows[0]
    for r in rows:
        r["tokens_per_s_vs_packed"] = r["useful_tokens_per_s"] / base["useful_tokens_per_s"]
    per_seed = np.array([r["eval_loss_masked_per_seed"] for r in rows])          # [layout, seed]
    return {"rows": rows, "pieces": int(len(pieces)), "data_seeds": seeds,
            "packed_path_whole_windows": packed_path_cost(args, dataset),
            "padding_fill": real / (len(pieces) * args.block),   # real tokens / slots over one epoch of pieces
            "eval_windows": args.eval_batches * args.batch,
            # how far one layout's eval loss moves with the data order alone (the widest over layouts)
            "seed_spread": float((per_seed.max(axis=1) - per_seed.min(axis=1)).max())}


# ---------------------------------------------------------------------------------------------
# 2. Attention kernels
# ---------------------------------------------------------------------------------------------
def attention_case(label: str, documents: packing.Documents, args) -> dict:
    b, t, c, h = len(documents.starts), documents.block_size, args.attn_embd, args.heads
    qkv = np.random.default_rng(args.seed).standard_normal((b, t, 3 * c)).astype(np.float32)
    grad = np.ones((b, t, c), dtype=np.float32)
    kernels = {"dense": lambda x: causal_attention(x, h),
               "documents": lambda x: document_attention(x, h, documents)}
    best = {(k, m): float("inf") for k in kernels for m in ("forward", "forward_backward")}
    for _ in range(args.rounds):
        for k, attend in kernels.items():
            for mode in ("forward", "forward_backward"):
                x = Tensor(qkv, requires_grad=True)
                start = time.perf_counter()
                y = attend(x)
                if mode == "forward_backward":
                    y.backward(grad)
                best[(k, mode)] = min(best[(k, mode)], time.perf_counter() - start)
    dense_pairs = b * t * (t + 1) // 2
    doc_pairs = int(pairs(documents).sum())
    d = c // h
    out = {"case": label, "B": b, "T": t, "C": c, "H": h, "segments": int(sum(len(s) for s in documents.starts)),
           "distinct_lengths": len(documents.segments()), "flop_ratio": doc_pairs / dense_pairs}
    for mode, per_pair in (("forward", 4), ("forward_backward", 12)):
        out[mode] = {"dense_s": best[("dense", mode)], "documents_s": best[("documents", mode)],
                     "dense_gflop": per_pair * d * h * dense_pairs / 1e9,
                     "documents_gflop": per_pair * d * h * doc_pairs / 1e9,
                     "time_ratio": best[("documents", mode)] / best[("dense", mode)]}
    return out


# ---------------------------------------------------------------------------------------------
# 3. Data-parallel balance
# ---------------------------------------------------------------------------------------------
def balance(label: str, doc_starts: np.ndarray, n_tokens: int, args) -> dict:
    g, out = args.global_batch, {"case": label, "global_batch": args.global_batch, "steps": args.balance_steps}
    works = [pairs(packing.Documents.of_windows(
        doc_starts, corpus.window_starts(n_tokens, args.seed, step, range(g), args.block), args.block)[0])
        for step in range(args.balance_steps)]
    # Over all these windows: the attention FLOPs of document attention / the dense kernel's, and the share
    # of windows with a document start inside.
    every = np.concatenate(works)
    dense = args.block * (args.block + 1) // 2
    out["flop_ratio_all_windows"] = float(every.mean() / dense)
    out["share_windows_cut"] = float((every < dense).mean())
    for dp in (4, 8):
        per, micro = g // dp, 2
        today, dealt = [], []
        for w in works:
            ranks = [sum(w[i] for j in range(micro) for i in corpus.microbatch_sample_ids(d, dp, per // micro, j))
                     for d in range(dp)]
            today.append(max(ranks) / np.mean(ranks))
            load = w[by_work(w, dp, micro, per // micro).reshape(dp, -1)].sum(axis=1)  # data.balance=attention
            dealt.append(load.max() / load.mean())
        out[f"dp{dp}"] = {"today_mean": float(np.mean(today)), "today_worst": float(np.max(today)),
                          "greedy_mean": float(np.mean(dealt)), "greedy_worst": float(np.max(dealt))}
    return out


# ---------------------------------------------------------------------------------------------
# 4. Context-parallel balance
# ---------------------------------------------------------------------------------------------
def box_work(documents: packing.Documents, held: list, shared: bool = False) -> np.ndarray:
    """int64 [cp]: score elements each rank's ring blocks compute with positions `held`: per source
    rank, row of the micro-batch and (my chunk, its chunk), the smallest box holding the piece's
    unmasked pairs (the ring's kernel, `cp.attention._Block`); or (`shared`) one box per source
    rank holding the pairs of every row and chunk, times B (what the ring computed before)."""
    first = np.arange(documents.block_size) - documents.positions()          # [B, T] segment starts
    out = np.zeros(len(held), dtype=np.int64)
    for r, q in enumerate(held):
        for k in held:
            allowed = (q[:, None] >= k[None, :]) & (k[None, None, :] >= first[:, q][:, :, None])   # [B, Tq, Tk]
            if shared:
                pieces = [allowed.any(axis=0)]
            else:
                half = len(q) // 2                                               # a rank's two chunks
                pieces = [c for row in allowed for a in np.split(row, [half], axis=0)
                          for c in np.split(a, [half], axis=1)]
            for piece in pieces:
                rows, cols = np.flatnonzero(piece.any(axis=1)), np.flatnonzero(piece.any(axis=0))
                if rows.size:
                    out[r] += (rows[-1] - rows[0] + 1) * (cols[-1] - cols[0] + 1) * (len(allowed) if shared else 1)
    return out


def cp_balance(label: str, doc_starts: np.ndarray, n_tokens: int, args) -> dict:
    """Part 4 (the module doc) on `args.cp_steps` micro-batches of `args.batch` windows."""
    out = {"case": label, "micro_batch": args.batch, "micro_batches": args.cp_steps}
    batches = [packing.Documents.of_windows(doc_starts, corpus.window_starts(n_tokens, args.seed, step,
                                                                             range(args.batch), args.block),
                                            args.block)[0] for step in range(args.cp_steps)]
    for cp in (2, 4, 8):
        zigzag = [cp_positions("zigzag", args.block, cp, r) for r in range(cp)]
        ratios: dict = {f"{layout}_{what}": [] for layout in ("zigzag", "balanced")
                        for what in ("work", "box", "shared_box")}
        totals: dict = {}                         # (layout, what) -> sum over micro-batches: all ranks, busiest
        changed = 0
        for documents in batches:
            balanced = balanced_positions(documents, cp)
            changed += any(not np.array_equal(a, b) for a, b in zip(balanced, zigzag))
            for layout, held in (("zigzag", zigzag), ("balanced", balanced)):
                for what, per_rank in (("work", rank_work(documents, held)), ("box", box_work(documents, held)),
                                       ("shared_box", box_work(documents, held, shared=True))):
                    ratios[f"{layout}_{what}"].append(float(per_rank.max() / per_rank.mean()))
                    total = totals.setdefault((layout, what), np.zeros(2, dtype=np.int64))
                    total += (per_rank.sum(), per_rank.max())
        out[f"cp{cp}"] = {"changed": changed / len(batches),
                          "box_over_pairs": float(totals["balanced", "box"][0] / totals["balanced", "work"][0]),
                          "shared_box_over_pairs": float(totals["zigzag", "shared_box"][0]
                                                         / totals["zigzag", "work"][0]),
                          "busiest_now_over_before": float(totals["balanced", "box"][1]
                                                           / totals["zigzag", "shared_box"][1]),
                          **{f"{k}_mean": float(np.mean(v)) for k, v in ratios.items()},
                          **{f"{k}_worst": float(np.max(v)) for k, v in ratios.items()}}
    return out



class _TokenZigzag(ContextParallel):
    """The ring on token-zigzag (rank r: chunks r and 2cp-1-r) whatever the documents: the layout
    before work balancing; its blocks are still masked, and cut into boxes, by the documents."""

    def held(self, t: int, documents=None) -> list:
        return super().held(t, None)


def ring_timing_worker(path_in: str, path_out: str) -> None:
    """One rank of part 4's timing (under mpiexec): `path_in` (npz) holds the document starts, the
    micro-batches' window starts [n, B] and the sizes; rank 0 writes the JSON to `path_out`."""
    from mpi4py import MPI

    from hpcpar.runtime.comm import Communicator

    job = np.load(path_in)
    p = json.loads(str(job["params"]))
    t, h, c = p["block"], p["heads"], p["embd"]
    world = MPI.COMM_WORLD
    comm = Communicator(world.Dup(), "varlen-ring-timing")
    rng = np.random.default_rng(p["seed"])
    cases = []                        # (micro-batch, layout, ContextParallel, documents, qkv, grad) each
    for i, windows in enumerate(job["windows"]):
        documents = packing.Documents.of_windows(job["doc_starts"], windows, t)[0]
        qkv = rng.standard_normal((len(windows), t, 3 * c)).astype(np.float32)
        grad = rng.standard_normal((len(windows), t, c)).astype(np.float32)
        for layout, kind in (("zigzag", _TokenZigzag), ("balanced", ContextParallel)):
            cp = kind(comm, "ring")       # one each: its plan stays cached, as over a model's layers
            cols = cp.positions(t, documents)
            cases.append((i, layout, cp, documents, qkv[:, cols], grad[:, cols]))
    best = {(i, layout): float("inf") for i, layout, *_ in cases}
    elements = {}
    load = [os.getloadavg()[0]]
    for r in range(p["rounds"] + 1):                   # round 0 builds the plans: not timed
        for i, layout, cp, documents, qkv, grad in (cases if r % 2 else cases[::-1]):
            cp.reset_stats()
            x = Tensor(qkv, requires_grad=True)
            world.Barrier()
            start = time.perf_counter()
            cp.attention(x, h, documents=documents).backward(grad)
            took = world.allreduce(time.perf_counter() - start, MPI.MAX)     # the ring ends with its last rank
            if r:
                best[i, layout] = min(best[i, layout], took)
            per_rank = np.array(world.allgather(cp.stats["elements"]))
            elements[i, layout] = float(per_rank.max() / per_rank.mean())
    load.append(os.getloadavg()[0])
    comm.free()
    if world.Get_rank() == 0:
        rows = [{"micro_batch": i, "zigzag_s": best[i, "zigzag"], "balanced_s": best[i, "balanced"],
                 "time_ratio": best[i, "balanced"] / best[i, "zigzag"],
                 "zigzag_elements_max_over_mean": elements[i, "zigzag"],
                 "balanced_elements_max_over_mean": elements[i, "balanced"]} for i in range(len(job["windows"]))]
        Path(path_out).write_text(json.dumps({
            **p, "ranks": world.Get_size(), "cores": os.cpu_count(), "load_average": load, "rows": rows,
            "time_ratio": sum(r["balanced_s"] for r in rows) / sum(r["zigzag_s"] for r in rows)}))


def ring_timing(label: str, doc_starts: np.ndarray, n_tokens: int, args) -> dict:
    """Part 4's timing: forward + backward of packed ring attention on `args.ring_ranks` ranks
    (mpiexec), token-zigzag vs the work-balanced layout, on the first `args.ring_batches`
    micro-batches the balance re-deals; best of `args.rounds` interleaved rounds."""
    cp, windows = args.ring_ranks, []
    zigzag = [cp_positions("zigzag", args.block, cp, r) for r in range(cp)]
    for step in range(10 * args.cp_steps):
        w = corpus.window_starts(n_tokens, args.seed, step, range(args.batch), args.block)
        held = balanced_positions(packing.Documents.of_windows(doc_starts, w, args.block)[0], cp)
        if any(not np.array_equal(a, b) for a, b in zip(held, zigzag)):
            windows.append(w)
        if len(windows) == args.ring_batches:
            break
    params = {"case": label, "block": args.block, "batch": args.batch, "heads": args.heads,
              "embd": args.attn_embd, "rounds": args.rounds, "seed": args.seed}
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.npz", Path(tmp) / "out.json"
        np.savez(job, doc_starts=doc_starts, windows=np.array(windows), params=json.dumps(params))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        subprocess.run([str(Path(sys.executable).parent / "mpiexec"), "-n", str(cp), sys.executable, __file__,
                        "--ring-timing-worker", str(job), str(out)], check=True, timeout=900, env=env)
        return json.loads(out.read_text())

# ---------------------------------------------------------------------------------------------
def plot(result: dict, lengths: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed (pip install 'hpcpar[bench]'): no plot")
        return
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.8))
    k = 5
    for r in result["training"]["rows"]:
        smooth = np.convolve(r["losses"], np.ones(k) / k, mode="valid")
        left.plot(np.arange(k - 1, len(r["losses"])), smooth, label=f"{r['layout']} (eval {r['eval_loss_masked']:.3f})")
    left.set_xlabel("step")
    left.set_ylabel(f"training loss (nats / byte), running mean of {k}")
    left.set_title(f"T = {result['meta']['block']}: own training targets; eval = masked val windows")
    left.legend()
    left.grid(alpha=0.3)
    bins = np.logspace(0, np.log10(max(lengths[n].max() for n in lengths)), 40)
    for name, ls in lengths.items():
        middle.hist(ls, bins=bins, weights=ls / ls.sum(), alpha=0.5, label=name)
    middle.axvline(result["meta"]["block"], color="k", ls="--", label="block_size")
    middle.set_xscale("log")
    middle.set_xlabel("document length (tokens)")
    middle.set_ylabel("share of tokens")
    middle.set_title("length distributions")
    middle.legend()
    cases = result["attention"]
    xs = np.arange(len(cases))
    right.bar(xs - 0.27, [c["flop_ratio"] for c in cases], 0.27, label="FLOP ratio")
    right.bar(xs, [c["forward"]["time_ratio"] for c in cases], 0.27, label="time ratio, forward")
    right.bar(xs + 0.27, [c["forward_backward"]["time_ratio"] for c in cases], 0.27, label="time ratio, fwd + bwd")
    right.set_xticks(xs, [c["case"] for c in cases])
    right.axhline(1.0, color="k", lw=0.8)
    right.set_ylabel("document attention / dense causal")
    right.set_title("attention: time vs FLOPs")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    say(f"wrote {path}")


def main() -> None:
    if sys.argv[1:2] == ["--ring-timing-worker"]:       # one rank of part 4's timing (mpiexec)
        ring_timing_worker(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="", help="data.corpus (default: the standard library's *.py files)")
    parser.add_argument("--block", type=int, default=1024, help="block_size T")
    parser.add_argument("--batch", type=int, default=4, help="windows per step")
    parser.add_argument("--steps", type=int, default=120, help="training steps of each layout")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--data-seeds", type=int, default=2, help="training runs per layout (data orders)")
    parser.add_argument("--eval-batches", type=int, default=8, help="validation batches of B windows")
    parser.add_argument("--attn-embd", type=int, default=128, help="C of the attention timings")
    parser.add_argument("--attn-batch", type=int, default=8, help="windows B of the attention timings")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved attention rounds (best kept)")
    parser.add_argument("--pareto-alpha", type=float, default=1.2)
    parser.add_argument("--pareto-xm", type=int, default=32, help="the Pareto's smallest length")
    parser.add_argument("--global-batch", type=int, default=32, help="windows per step in the balance part")
    parser.add_argument("--balance-steps", type=int, default=200)
    parser.add_argument("--cp-steps", type=int, default=100, help="micro-batches in the cp balance part")
    parser.add_argument("--ring-ranks", type=int, default=4, help="ranks of the ring timing (0: none)")
    parser.add_argument("--ring-batches", type=int, default=8, help="re-dealt micro-batches the ring timing runs")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke test: T 256, 6 steps, one round")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "varlen.json"))
    args = parser.parse_args()
    if args.quick:
        args.block, args.steps, args.rounds, args.eval_batches, args.balance_steps = 256, 6, 1, 1, 20
        args.cp_steps, args.ring_batches = 10, 2
    started = time.perf_counter()

    tokens, starts = corpus.load_documents(args.corpus)
    dataset = formats.from_tokens(tokens, 0.05, starts, corpus.corpus_description(args.corpus, tokens))
    synthetic_tokens = len(dataset.train)
    synthetic = pareto_starts(synthetic_tokens, args.pareto_alpha, args.pareto_xm, args.seed)
    lengths = {"corpus": lengths_of(starts, len(tokens)),
               f"Pareto a={args.pareto_alpha:g}": lengths_of(synthetic, synthetic_tokens)}
    dists = {name: distribution(ls, args.block) for name, ls in lengths.items()}
    say(f"{dataset.description}; T = {args.block}")
    say(f"{'lengths':<14} {'docs':>7} {'median':>8} {'p90':>8} {'p99':>9} {'max':>8} {'docs<T':>7} {'tokens<T':>9}")
    for name, d in dists.items():
        say(f"{name:<14} {d['documents']:>7} {d['median']:>8.0f} {d['p90']:>8.0f} {d['p99']:>9.0f} {d['max']:>8} "
            f"{d['share_documents_below_block']:>7.1%} {d['share_tokens_below_block']:>9.2%}")

    say(f"\n1. training: {args.steps} steps of B = {args.batch} windows, GPT {args.layers}x{args.embd}, float32")
    train = training(args, dataset)
    say(f"{'layout':<8} {'useful tok/s':>12} {'vs packed':>9} {'useful/step':>11} {'train loss':>10} "
        f"{'eval masked':>11} {'eval unmasked':>13}")
    for r in train["rows"]:
        say(f"{r['layout']:<8} {r['useful_tokens_per_s']:>12,.0f} {r['tokens_per_s_vs_packed']:>9.2f} "
            f"{r['useful_tokens_per_step']:>11,.0f} {r['final_train_loss']:>10.3f} {r['eval_loss_masked']:>11.3f} "
            f"{r['eval_loss_unmasked']:>13.3f}")
    say(f"eval loss spread over data seeds {train['data_seeds']}: up to {train['seed_spread']:.3f}")
    say(f"packed path on whole windows: {train['packed_path_whole_windows']:.2f}x the plain forward + backward")
    say(f"padding: {train['pieces']} pieces, {train['padding_fill']:.1%} of their slots real tokens")

    say(f"\n2. attention, B = {args.attn_batch}, T = {args.block}, C = {args.attn_embd}, H = {args.heads}")
    attention = []
    for label, doc_starts, n in (("corpus", dataset.train_starts, len(dataset.train)),
                                 (f"Pareto a={args.pareto_alpha:g}", synthetic, synthetic_tokens)):
        windows = corpus.window_starts(n, args.seed, 0, range(args.attn_batch), args.block)
        attention.append(attention_case(label, packing.Documents.of_windows(doc_starts, windows, args.block)[0],
                                        args))
    for c in attention:
        for mode in ("forward", "forward_backward"):
            m = c[mode]
            say(f"{c['case']:<14} {mode:<16} dense {m['dense_s'] * 1e3:7.1f} ms  documents "
                f"{m['documents_s'] * 1e3:7.1f} ms  time ratio {m['time_ratio']:.2f}  FLOP ratio "
                f"{c['flop_ratio']:.2f}  ({c['segments']} segments, {c['distinct_lengths']} lengths)")

    say(f"\n3. dp balance of attention work, global batch {args.global_batch} windows, {args.balance_steps} steps")
    bal = [balance("corpus", dataset.train_starts, len(dataset.train), args),
           balance(f"Pareto a={args.pareto_alpha:g}", synthetic, synthetic_tokens, args)]
    for b in bal:
        say(f"{b['case']:<14} {b['share_windows_cut']:.1%} of the windows hold a document start; attention FLOPs "
            f"of all the windows {b['flop_ratio_all_windows']:.2f}x dense")
        for dp in (4, 8):
            r = b[f"dp{dp}"]
            say(f"{b['case']:<14} dp={dp}: max/mean today {r['today_mean']:.2f} (worst {r['today_worst']:.2f}), "
                f"balanced {r['greedy_mean']:.2f} (worst {r['greedy_worst']:.2f})")

    say(f"\n4. cp balance of ring attention, micro-batches of {args.batch} windows, {args.cp_steps} steps; "
        "max/mean per rank: zigzag -> work-balanced")
    cp_bal = [cp_balance("corpus", dataset.train_starts, len(dataset.train), args),
              cp_balance(f"Pareto a={args.pareto_alpha:g}", synthetic, synthetic_tokens, args)]
    for b in cp_bal:
        for cp in (2, 4, 8):
            r = b[f"cp{cp}"]
            say(f"{b['case']:<14} cp={cp}: work {r['zigzag_work_mean']:.3f} -> {r['balanced_work_mean']:.3f} "
                f"(worst {r['zigzag_work_worst']:.3f} -> {r['balanced_work_worst']:.3f}); computed boxes "
                f"{r['zigzag_box_mean']:.3f} -> {r['balanced_box_mean']:.3f} (one box per block before: "
                f"{r['zigzag_shared_box_mean']:.3f} -> {r['balanced_shared_box_mean']:.3f}); elements / pairs "
                f"{r['shared_box_over_pairs']:.2f} before, {r['box_over_pairs']:.2f} now; busiest rank's elements "
                f"{r['busiest_now_over_before']:.2f}x before's; {r['changed']:.0%} of micro-batches re-dealt")
    ring = None
    if args.ring_ranks:
        ring = ring_timing(f"Pareto a={args.pareto_alpha:g}", synthetic, synthetic_tokens, args)
        say(f"{ring['case']}: ring attention forward + backward on {ring['ranks']} ranks ({ring['cores']} cores, "
            f"load average {ring['load_average'][0]:.1f} -> {ring['load_average'][1]:.1f}), B = {ring['batch']}, "
            f"T = {ring['block']}, C = {ring['embd']}, H = {ring['heads']}, best of {ring['rounds']} rounds:")
        for r in ring["rows"]:
            say(f"  micro-batch {r['micro_batch']}: zigzag {r['zigzag_s'] * 1e3:6.1f} ms, balanced "
                f"{r['balanced_s'] * 1e3:6.1f} ms ({r['time_ratio']:.2f}x); elements max/mean "
                f"{r['zigzag_elements_max_over_mean']:.3f} -> {r['balanced_elements_max_over_mean']:.3f}")
        say(f"  all: balanced / zigzag time {ring['time_ratio']:.3f}")
    total = time.perf_counter() - started
    say(f"total {total:.0f} s")

    result = {"meta": {"corpus": dataset.description, "block": args.block, "batch": args.batch,
                       "steps": args.steps, "layers": args.layers, "heads": args.heads, "embd": args.embd,
                       "lr": args.lr, "attn_embd": args.attn_embd, "rounds": args.rounds,
                       "pareto_alpha": args.pareto_alpha, "pareto_xm": args.pareto_xm, "seed": args.seed,
                       "quick": args.quick, "wall_s": total},
              "lengths": dists, "training": train, "attention": attention, "balance": bal, "cp_balance": cp_bal,
              **({"ring_timing": ring} if ring else {})}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    say(f"wrote {out}")
    plot(result, lengths, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
