"""Mixture of experts with expert parallelism on 4 ranks: throughput, all-to-all bytes, load balance.

    mpiexec -n 4 python bench/moe.py [--steps 4] [--rounds 3] [--balance-steps 150]

Three measurements, all on dp = 4 with the experts divided over ep = 4 (one expert per rank):

1. tokens/s of an MoE GPT (E = 4 experts per layer, top_k = 1, unlimited capacity) against the
   dense GPT of the same active parameters (the same model with one 4C-wide MLP per block; the
   MoE model adds only the router, E C per layer, to what a token uses). Float32, `Trainer.train`
   without files, a warm-up step and `--steps` timed steps, the runs alternated `--rounds` times
   and the fastest of each kept; the slowest rank's median step. A third row, the same MoE model
   with every expert on every rank (ep = 1, no dispatch), separates the routing's own cost from
   expert parallelism's (the all-to-alls and the wait for the busiest expert's rank). The ratios
   before issue #45 (dispatch and combine through generic gathers whose gradients were one-hot
   GEMMs, a per-expert Python loop) are kept in the result next to today's; so is the routing's
   max / mean tokens per expert over the MoE run's steps (the busiest expert's rank sets the pace
   at ep = 4: on these random tokens the router drifts within a few steps towards sending a
   layer's tokens to one expert, max / mean up to E = 4). A fourth row, ep = 4 with capacity
   factor 1.25 (Switch Transformer's), bounds the busiest expert at 1.25x the mean and so shows
   what the dispatch itself costs once routing is bounded (its dropped share of assignments beside).
   Two more rows turn on DeepSeek-V3's auxiliary-loss-free balancing (model.moe_expert_bias_rate
   = `--bias-rate`, a per-expert routing bias updated every step against the global batch's
   loads), ep = 4 and ep = 1: each trainer first runs `--bias-warmup` untimed steps (so the bias
   has reacted to the router), then its timed steps each round (the same trainer, training on),
   against a dense twin treated alike (warmed up as long, kept through the rounds); on the default
   corpus; beside them the max / mean tokens per expert over their timed steps (mean of the steps).
   Three more rows hold the routing where initialisation put it (train.lr = 1e-12: the router,
   like every weight, does not move; max / mean tokens per expert about 1.3-1.6 on these tokens):
   MoE at ep = 4 and ep = 1 against a dense twin run alike. They measure what the MoE layer itself
   costs (router, dispatch, grouped expert GEMMs, all-to-alls, combine) at near-balanced routing,
   apart from how this small model's router collapses in training (the rows above).
2. all-to-all bytes per step and rank, measured (`Communicator.sent` of the ep group: the rows
   that leave the rank in the dispatch and combine all-to-all-v's, forward and backward, plus the
   per-expert count exchange) next to the formula for balanced routing:
       4 L m (N k (ep - 1) / ep) C s  +  L m E 8 (ep - 1) / ep
   (L MoE layers, m micro-batches, N = B T tokens per micro-batch, k = top_k, s bytes per element;
   4 = dispatch and combine, each forward and backward; the counts travel once per forward, int64).
   When every rank routes its tokens alike, 1/ep of them stay home on average whatever the load
   of the experts, so the mean over ranks meets the formula; imbalance moves bytes between ranks.
3. load balance: max / mean tokens per expert (the worst MoE layer, over the global batch) after
   `--balance-steps` steps of a small model with E = 8, top_k = 2, with the load-balancing loss
   (alpha = 0.05) and without it (alpha = 0), and with the expert bias (`--bias-rate`) and no aux
   loss, the mean over the last 10 steps.

Results: bench/results/moe.json and a table on stdout. On a machine with fewer cores than ranks,
wall time measures the scheduler as much as the code; the MoE / dense ratio measured in one run
is the meaningful figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = "1"  # 1 thread per rank, before NumPy

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import timed_steps, write_result  # noqa: E402

from hpcpar.config.load import load_config  # noqa: E402
from hpcpar.runtime.topology import Axis  # noqa: E402
from hpcpar.training.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORLD = MPI.COMM_WORLD
TOKENS = np.random.default_rng(0).integers(0, 256, 1 << 16).astype(np.uint8)
# This bench's ratios before issue #45 (commit 1402f7b, the default model options, 4 ranks on 2 cores).
BEFORE = {"ratio_moe_over_dense": 0.53, "ratio_moe_ep1_over_dense": 0.74, "commit": "1402f7b"}
CAPACITY = 1.25  # the fourth row's capacity factor (Switch Transformer's for training)
FROZEN = ["train.lr=1e-12", "train.min_lr=0", "train.warmup=0"]   # the routing stays where init put it
BIAS_RATE = 0.01  # the expert bias rows' model.moe_expert_bias_rate (the best of 1e-3, 1e-2, 5e-2 at lr 3e-3)


def trainer(args, overrides: list[str], tokens: np.ndarray | None = TOKENS) -> Trainer:
    n = WORLD.Get_size()
    cfg = load_config(None, [
        f"model.block_size={args.block}", f"model.n_layer={args.layers}", "model.n_head=4",
        f"model.n_embd={args.embd}", "model.dtype=float32", f"mesh.dp={n}", "mesh.tp=1", "mesh.pp=1",
        f"train.micro_batch_size={args.batch}", f"train.microbatches={args.microbatches}", "train.steps=1000",
        "train.warmup=5", "run.eval_every=0", "run.progress=false"] + overrides)
    return Trainer(cfg, WORLD, tokens=tokens)


def recording_loads(t: Trainer) -> list:
    """The list that each later `t.train_step` appends its step's max / mean tokens per expert to."""
    loads, step = [], t.train_step

    def recorded(s: int):
        result = step(s)
        loads.append(result.moe["moe_load_imbalance"])
        return result
    t.train_step = recorded
    return loads


def throughput(args) -> dict:
    """Dense vs MoE (ep = world) tokens/s, and the MoE run's all-to-all bytes per step."""
    n = WORLD.Get_size()
    moe = ["model.moe_experts=4", "model.moe_top_k=1", f"mesh.ep={n}"]
    best: dict = {}
    # The expert-bias trainers live through the rounds: warmed up once, then timed each round; so
    # does their dense twin, "dense_warm" (long-lived trainers step faster than fresh ones here).
    # On the default corpus (text): on random tokens every token looks alike to a trained router
    # (the best model of uniform noise ignores its input), so any bias sends them all to one expert.
    bias = [f"model.moe_expert_bias_rate={args.bias_rate}"]
    biased = {name: trainer(args, overrides, tokens=None) for name, overrides in
              (("dense_warm", []), ("moe_bias", moe + bias), ("moe_ep1_bias", moe[:2] + ["mesh.ep=1"] + bias))}
    warmup = {}
    for name, t in biased.items():
        t.train(steps=args.bias_warmup, files=False, progress=False, peak_flops=0.0)
        warmup[name] = recording_loads(t) if name != "dense_warm" else []
    for _ in range(args.rounds):  # alternate, so that load from elsewhere hits all alike
        for name, t in biased.items():
            loads = warmup[name]
            first = len(loads)
            step_s, _, cpu_s = timed_steps(t, args.steps, lambda: 0.0)
            row = {"step_s": step_s, "cpu_s": cpu_s, "tokens_per_s": t.tokens_per_step / step_s,
                   "params_per_rank": sum(p.data.size for _, p in t.named_parameters),
                   "active_params": t.cfg.model.non_embedding_params(),
                   "warmup_steps": args.bias_warmup}
            if loads:
                row.update(load_imbalance=statistics.mean(loads[first:]), load_imbalance_max=max(loads[first:]),
                           bias_max=float(np.abs(t.expert_bias.bias).max()))
            if name not in best or row["step_s"] < best[name]["step_s"]:
                best[name] = row
        for name, overrides in (("dense", []), ("moe", moe), ("moe_ep1", moe[:2] + ["mesh.ep=1"]),
                                ("moe_cap", moe + [f"model.moe_capacity_factor={CAPACITY}"]),
                                ("dense_frozen", FROZEN), ("moe_frozen", moe + FROZEN),
                                ("moe_ep1_frozen", moe[:2] + ["mesh.ep=1"] + FROZEN)):
            t = trainer(args, overrides)
            ep = t.mesh.comm(Axis.EP)
            before = ep.sent.copy()
            step_s, _, cpu_s = timed_steps(t, args.steps, lambda: 0.0)
            steps = args.steps + 1   # the warm-up step sends too
            sent = {k: (v - before.get(k, 0.0)) / steps for k, v in ep.sent.items()}
            # The routing of one more step (the metrics' load figure): how uneven the experts' work was.
            routing = t.train_step(steps).moe
            load, dropped = routing.get("moe_load_imbalance"), routing.get("moe_dropped_fraction")
            row = {"step_s": step_s, "cpu_s": cpu_s, "tokens_per_s": t.tokens_per_step / step_s,
                   "params_per_rank": sum(p.data.size for _, p in t.named_parameters),
                   "active_params": t.cfg.model.non_embedding_params(),
                   "all_to_all_v_bytes": sent.get("all_to_all_v", 0.0), "count_bytes": sent.get("all_to_all", 0.0),
                   "load_imbalance": load, "dropped_fraction": dropped}
            t.mesh.free()
            if name not in best or row["step_s"] < best[name]["step_s"]:
                best[name] = row
    # Mean over ranks of the measured bytes (each rank's share depends on where its tokens go).
    for key in ("all_to_all_v_bytes", "count_bytes"):
        best["moe"][key] = float(WORLD.allreduce(best["moe"][key])) / n
    tokens = args.batch * args.block
    s, experts, layers = 4, 4, args.layers
    best["formula_all_to_all_v_bytes"] = 4 * layers * args.microbatches * tokens * 1 * (n - 1) / n * args.embd * s
    best["formula_count_bytes"] = layers * args.microbatches * experts * 8 * (n - 1) / n
    best["ratio_moe_over_dense"] = best["moe"]["tokens_per_s"] / best["dense"]["tokens_per_s"]
    best["ratio_moe_ep1_over_dense"] = best["moe_ep1"]["tokens_per_s"] / best["dense"]["tokens_per_s"]
    best["ratio_moe_cap_over_dense"] = best["moe_cap"]["tokens_per_s"] / best["dense"]["tokens_per_s"]
    best["ratio_moe_frozen_over_dense"] = best["moe_frozen"]["tokens_per_s"] / best["dense_frozen"]["tokens_per_s"]
    best["ratio_moe_ep1_frozen_over_dense"] = (best["moe_ep1_frozen"]["tokens_per_s"]
                                               / best["dense_frozen"]["tokens_per_s"])
    best["ratio_moe_bias_over_dense"] = best["moe_bias"]["tokens_per_s"] / best["dense_warm"]["tokens_per_s"]
    best["ratio_moe_ep1_bias_over_dense"] = best["moe_ep1_bias"]["tokens_per_s"] / best["dense_warm"]["tokens_per_s"]
    best["bias_rate"] = args.bias_rate
    for t in biased.values():
        t.mesh.free()
    best["capacity_factor"] = CAPACITY
    best["rounds"] = args.rounds
    if (args.layers, args.embd, args.block, args.batch, args.microbatches) == (4, 128, 128, 4, 2):
        best["before"] = BEFORE  # measured with these options only
    return best


def balance(args, alpha: float, rate: float = 0.0) -> dict:
    """max / mean tokens per expert over `--balance-steps` steps of a small model, E = 8, top_k = 2,
    aux loss weight `alpha`, expert bias rate `rate`."""
    n = WORLD.Get_size()
    t = trainer(argparse.Namespace(**{**vars(args), "layers": 2, "embd": 64, "block": 64, "batch": 4,
                                      "microbatches": 1}),
                ["model.moe_experts=8", "model.moe_top_k=2", f"mesh.ep={n}", f"model.moe_aux_loss={alpha}",
                 f"model.moe_expert_bias_rate={rate}", "train.lr=0.003"])
    records: list = []
    t.train(steps=args.balance_steps, files=False, progress=False, on_step=records.append, peak_flops=0.0)
    t.mesh.free()
    last = records[-10:]
    return {"alpha": alpha, "bias_rate": rate, "steps": len(records),
            "imbalance_first": records[0]["moe_load_imbalance"],
            "imbalance_last10": statistics.mean(r["moe_load_imbalance"] for r in last),
            "aux_loss_last10": statistics.mean(r["moe_aux_loss"] for r in last),
            "loss_last10": statistics.mean(r["loss"] for r in last),
            "curve": [r["moe_load_imbalance"] for r in records]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe.json"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--balance-steps", type=int, default=150)
    parser.add_argument("--bias-rate", type=float, default=BIAS_RATE)
    parser.add_argument("--bias-warmup", type=int, default=60)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    speed = throughput(args)
    balanced = [balance(args, alpha) for alpha in (0.05, 0.0)] + [balance(args, 0.0, args.bias_rate)]
    if WORLD.Get_rank() != 0:
        return 0
    n = WORLD.Get_size()
    d, m, m1 = speed["dense"], speed["moe"], speed["moe_ep1"]
    print(f"\n# MoE (E=4, top_k=1, ep={n}) vs dense GPT of the same active parameters, dp={n}, "
          f"{args.layers}x{args.embd} float32, micro-batch {args.batch}x{args.block} x {args.microbatches}")
    print(f"{'model':<10} {'tokens/s':>10} {'step ms':>8} {'params/rank':>12} {'active':>10}")
    for name, r in (("dense", d), (f"moe ep={n}", m), ("moe ep=1", m1), (f"cap {CAPACITY}", speed["moe_cap"]),
                    ("dense warm", speed["dense_warm"]), (f"bias ep={n}", speed["moe_bias"]),
                    ("bias ep=1", speed["moe_ep1_bias"]), ("dense lr~0", speed["dense_frozen"]),
                    (f"lr~0 ep={n}", speed["moe_frozen"]), ("lr~0 ep=1", speed["moe_ep1_frozen"])):
        print(f"{name:<10} {r['tokens_per_s']:>10.0f} {1e3 * r['step_s']:>8.1f} {r['params_per_rank']:>12,} "
              f"{r['active_params']:>10,}")
    print(f"MoE / dense tokens/s: {speed['ratio_moe_over_dense']:.2f}x with ep={n}, "
          f"{speed['ratio_moe_ep1_over_dense']:.2f}x with ep=1"
          + (f" (before issue #45: {BEFORE['ratio_moe_over_dense']:.2f}x, {BEFORE['ratio_moe_ep1_over_dense']:.2f}x)"
             if "before" in speed else "") + f"; max/mean tokens per expert {m['load_imbalance']:.2f}; "
          f"ep={n} with capacity factor {CAPACITY}: {speed['ratio_moe_cap_over_dense']:.2f}x "
          f"({speed['moe_cap']['dropped_fraction']:.1%} of assignments dropped)")
    b4, b1 = speed["moe_bias"], speed["moe_ep1_bias"]
    print(f"expert bias (rate {args.bias_rate}, after {args.bias_warmup} untimed steps): "
          f"{speed['ratio_moe_bias_over_dense']:.2f}x with ep={n} (max/mean tokens per expert over the timed "
          f"steps {b4['load_imbalance']:.2f}), {speed['ratio_moe_ep1_bias_over_dense']:.2f}x with ep=1 "
          f"({b1['load_imbalance']:.2f})")
    f4, f1 = speed["moe_frozen"], speed["moe_ep1_frozen"]
    print(f"routing frozen at initialisation (lr 1e-12): {speed['ratio_moe_frozen_over_dense']:.2f}x with ep={n} "
          f"(max/mean tokens per expert {f4['load_imbalance']:.2f}), {speed['ratio_moe_ep1_frozen_over_dense']:.2f}x "
          f"with ep=1 ({f1['load_imbalance']:.2f})")
    print(f"all-to-all-v bytes per step and rank: measured {m['all_to_all_v_bytes'] / 2**20:.3f} MiB, formula "
          f"(balanced routing) {speed['formula_all_to_all_v_bytes'] / 2**20:.3f} MiB; count exchange "
          f"{m['count_bytes']:.0f} B vs {speed['formula_count_bytes']:.0f} B")
    for b in balanced:
        print(f"load balance alpha={b['alpha']}, expert bias rate {b['bias_rate']}: max/mean tokens per expert "
              f"{b['imbalance_first']:.2f} at step 0, "
              f"{b['imbalance_last10']:.2f} over the last 10 of {b['steps']} steps (loss {b['loss_last10']:.3f})")
    write_result(args.out, started, "slowest rank's median step; bytes: Communicator.sent of the ep group, mean "
                 "over ranks; load: max/mean tokens per expert of the worst MoE layer over the global batch",
                 ranks=n, throughput=speed, balance=balanced)
    return 0


if __name__ == "__main__":
    sys.exit(main())
