"""hpcpar vs PyTorch eager on the CPU: the same GPT, the same batches, the same threads.

For each model shape and each thread count, trains the same config in both (forward, backward,
gradient clipping, AdamW step; hpcpar through `Trainer.train`, the loop of `hpcpar train`, on one
rank and writing no files), alternating rounds of the two so machine noise hits both alike, and
reports tokens/s and MFU (model FLOPs / this machine's GEMM peak at the same thread count, measured
every round with hpcpar's GEMM, `blas.matmul`) for each and their ratio; the best round of each
counts. Also times a tiny elementwise op, to show per-op framework overhead. Each thread count runs
in a process of its own (BLAS libraries read their thread count once); the parent prints one table
and writes bench/results/vs_torch.json.

    python bench/vs_torch.py [--shapes 4x128x128x12,4x256x128x16,6x384x256x8] [--threads 1,2]
                             [--steps 5] [--rounds 3]

A shape is n_layer x n_embd x block_size x batch (n_head 4, float32, vocabulary 256).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

SHAPES = "4x128x128x12,4x256x128x16,6x384x256x8"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="n_layer x n_embd x block_size x batch, comma-separated")
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated (one process each)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per framework per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best round counts")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "vs_torch.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one thread count, in this process
    return p.parse_args(argv)


if __name__ == "__main__":  # imported (bench/mesh_scaling.py), the importer has set the threads
    args = parse()
    if args.worker:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = args.threads

import numpy as np  # noqa: E402  (after the thread variables)
from mpi4py import MPI  # noqa: E402

from hpcpar import blas, config, metrics, ops  # noqa: E402
from hpcpar.nn import GPT, GPTConfig  # noqa: E402
from hpcpar.tensor import Tensor  # noqa: E402
from hpcpar.train import Trainer  # noqa: E402

try:
    import torch
except ImportError:
    torch = None


def torch_model(params: dict, cfg: GPTConfig):
    """nanoGPT's forward on torch tensors named as hpcpar's parameters."""
    F = torch.nn.functional

    def loss_fn(x, y):
        p = params
        b, t = x.shape
        h = p["transformer.wte.weight"][x] + p["transformer.wpe.weight"][:t]
        for i in range(cfg.n_layer):
            pre = f"transformer.h.{i}."
            a = F.layer_norm(h, (cfg.n_embd,), p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], 1e-5)
            q, k, v = F.linear(a, p[pre + "attn.c_attn.weight"], p[pre + "attn.c_attn.bias"]).split(cfg.n_embd, 2)
            shape = (b, t, cfg.n_head, cfg.n_embd // cfg.n_head)
            q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, cfg.n_embd)
            h = h + F.linear(att, p[pre + "attn.c_proj.weight"], p[pre + "attn.c_proj.bias"])
            m = F.layer_norm(h, (cfg.n_embd,), p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], 1e-5)
            m = F.gelu(F.linear(m, p[pre + "mlp.c_fc.weight"], p[pre + "mlp.c_fc.bias"]), approximate="tanh")
            h = h + F.linear(m, p[pre + "mlp.c_proj.weight"], p[pre + "mlp.c_proj.bias"])
        h = F.layer_norm(h, (cfg.n_embd,), p["transformer.ln_f.weight"], p["transformer.ln_f.bias"], 1e-5)
        logits = F.linear(h, p["transformer.wte.weight"])
        return F.cross_entropy(logits.view(-1, cfg.vocab_size), y.view(-1))
    return loss_fn


def torch_trainer(model: GPT, lr: float = 1e-4, max_norm: float = 1.0) -> Callable[[list], None]:
    """PyTorch twin of `model` (a copy of its parameters) with AdamW set up as hpcpar's.

    Returns `step(batches)`: one optimizer step over micro-batches [(x, y), ...] (int64 NumPy
    [B, T] each), gradients accumulated as the mean loss over the micro-batches and their global
    norm clipped to `max_norm` (0: no clipping), as `Trainer.train_step` does.
    """
    cfg = model.config
    tparams = {n: torch.tensor(p.data.copy(), requires_grad=True) for n, p in model.named_parameters()}
    decay = [p for n, p in tparams.items() if not n.endswith("bias") and ".ln_" not in n and "ln_f" not in n]
    no_decay = [p for p in tparams.values() if all(p is not q for q in decay)]
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), foreach=False)
    tloss = torch_model(tparams, cfg)

    def step(batches: list) -> None:
        topt.zero_grad(set_to_none=True)
        for x, y in batches:
            loss = tloss(torch.from_numpy(x), torch.from_numpy(y))
            (loss / len(batches) if len(batches) > 1 else loss).backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(list(tparams.values()), max_norm, foreach=False)
        topt.step()
    return step


def shapes(text: str) -> list[tuple[int, int, int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


def compare(n_layer: int, n_embd: int, block: int, batch: int, threads: int) -> dict:
    """One shape at this process's thread count: hpcpar and PyTorch alternating, best round each."""
    total = (args.rounds + 1) * args.steps  # a warm-up round, then the timed ones
    trainer = Trainer(config.load_config(None, [
        f"model.n_layer={n_layer}", f"model.n_head={args.n_head}", f"model.n_embd={n_embd}",
        f"model.block_size={block}", "model.dtype=float32", "mesh.dp=1", "mesh.tp=1", "mesh.pp=1",
        f"train.micro_batch_size={batch}", "train.microbatches=1", f"train.steps={total}", "train.warmup=0",
        "run.eval_every=0", "run.progress=false"]), MPI.COMM_SELF)
    cfg = trainer.cfg.model
    # Round r of each framework trains steps r*steps .. (r+1)*steps - 1: PyTorch gets the batches
    # hpcpar's loop draws for those steps, made before the clock starts.
    batches = [trainer.microbatches(s) for s in range(total)]
    torch_step = torch_trainer(trainer.stages[0], max_norm=trainer.cfg.train.grad_clip)

    def hpcpar_steps() -> float:
        start = time.perf_counter()
        trainer.train(steps=args.steps, files=False, progress=False, peak_flops=0.0)
        return time.perf_counter() - start

    def torch_steps(r: int) -> float:
        start = time.perf_counter()
        for step in range(r * args.steps, (r + 1) * args.steps):
            torch_step(batches[step])
        return time.perf_counter() - start

    hpcpar_steps(), torch_steps(0)  # warm-up: allocator, thread pools
    # The GEMM peak is measured inside every round too (best of all), so a machine that is
    # busy during some rounds lowers the peak no more than it lowers the two frameworks.
    h_times, t_times, peaks = [], [], []
    for r in range(1, args.rounds + 1):
        peaks.append(metrics.measure_gemm_flops("float32", n=1024, seconds=0.3, matmul=blas.matmul))
        h_times.append(hpcpar_steps())
        t_times.append(torch_steps(r))
    trainer.free()
    tokens_per_round = args.steps * batch * block
    h_tok, t_tok = tokens_per_round / min(h_times), tokens_per_round / min(t_times)
    flops = metrics.flops_per_token(cfg.non_embedding_params(), cfg.n_layer, cfg.n_embd, cfg.block_size)
    peak = max(peaks)
    return {"n_layer": n_layer, "n_embd": n_embd, "n_head": args.n_head, "block_size": block, "batch": batch,
            "threads": threads, "gemm_peak_gflops": peak / 1e9,
            "hpcpar": {"tokens_per_s": h_tok, "mfu": h_tok * flops / peak},
            "torch": {"tokens_per_s": t_tok, "mfu": t_tok * flops / peak},
            "ratio_hpcpar_over_torch": h_tok / t_tok}


def op_overhead() -> dict:
    """Per-op overhead: a tiny elementwise multiply with the graph recorded, in both."""
    a, ta = Tensor(np.ones(8, np.float32), requires_grad=True), torch.ones(8, requires_grad=True)
    reps = 20000
    start = time.perf_counter()
    for _ in range(reps):
        ops.mul(a, a)
    h_op = (time.perf_counter() - start) / reps
    start = time.perf_counter()
    for _ in range(reps):
        ta * ta
    return {"hpcpar_us": h_op * 1e6, "torch_us": (time.perf_counter() - start) / reps * 1e6}


def worker() -> None:
    """This process's thread count: every shape, then the per-op overhead; JSON to --out."""
    threads = int(args.threads)
    torch.set_num_threads(threads)
    rows = [compare(*shape, threads) for shape in shapes(args.shapes)]
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "op_overhead": op_overhead(), "blas": blas.name()}, f)


def main() -> None:
    if torch is None:
        sys.exit("bench/vs_torch.py needs PyTorch: pip install torch==2.13.0")
    if args.worker:
        return worker()
    rows, overhead, gemm = [], None, None
    for threads in (int(t) for t in args.threads.split(",")):
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, __file__, "--worker", "--threads", str(threads), "--shapes", args.shapes,
                   "--n-head", str(args.n_head), "--steps", str(args.steps), "--rounds", str(args.rounds),
                   "--out", tmp.name]
            subprocess.run(cmd, check=True)
            with open(tmp.name) as f:
                part = json.load(f)
        rows += part["rows"]
        overhead = overhead or part["op_overhead"]
        gemm = part["blas"]
    result = {"rows": rows, "min_ratio": min(r["ratio_hpcpar_over_torch"] for r in rows), "op_overhead": overhead,
              "blas": gemm, "torch_version": torch.__version__, "steps": args.steps, "rounds": args.rounds}
    print(f"hpcpar ({gemm} GEMMs) vs PyTorch {torch.__version__} eager, tokens/s, best of {args.rounds} "
          f"alternating rounds of {args.steps} steps")
    print(f"{'shape (L x C x T x B)':>22} {'threads':>7} {'hpcpar':>9} {'torch':>9} {'ratio':>6} "
          f"{'MFU hpcpar':>10} {'MFU torch':>9} {'peak GF/s':>9}")
    for r in rows:
        shape = f"{r['n_layer']}x{r['n_embd']}x{r['block_size']}x{r['batch']}"
        print(f"{shape:>22} {r['threads']:>7} {r['hpcpar']['tokens_per_s']:9,.0f} {r['torch']['tokens_per_s']:9,.0f} "
              f"{r['ratio_hpcpar_over_torch']:5.2f}x {r['hpcpar']['mfu']:10.1%} {r['torch']['mfu']:9.1%} "
              f"{r['gemm_peak_gflops']:9.1f}")
    print(f"lowest ratio {result['min_ratio']:.2f}x; per-op overhead {overhead['hpcpar_us']:.1f} us (hpcpar) vs "
          f"{overhead['torch_us']:.1f} us (torch)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
