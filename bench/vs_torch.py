"""hpcpar vs PyTorch eager on the CPU: the same GPT, the same batches, the same threads.

Trains the same config (default n_layer=4, n_embd=256, T=128, B=16) for the same steps
in both (forward, backward, gradient clipping, AdamW step; hpcpar through `Trainer.train`, the
loop of `hpcpar train`, on one rank and writing no files), interleaving the two so machine
noise hits both alike, and reports tokens/s and MFU (model FLOPs / this machine's measured
GEMM peak at the same thread count) for each and their ratio. Also times a tiny elementwise
op, to show per-op framework overhead. JSON to bench/results/vs_torch.json.

    OMP_NUM_THREADS=1 python bench/vs_torch.py [--threads 1] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed steps per framework per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best round counts")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "vs_torch.json"))
    return p.parse_args(argv)


if __name__ == "__main__":  # imported (bench/mesh_scaling.py), the importer has set the threads
    args = parse()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)

import numpy as np  # noqa: E402  (after the thread variables)
from mpi4py import MPI  # noqa: E402

from hpcpar import config, metrics, ops  # noqa: E402
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


def main() -> None:
    if torch is None:
        sys.exit("bench/vs_torch.py needs PyTorch: pip install torch==2.13.0")
    torch.set_num_threads(args.threads)
    total = (args.rounds + 1) * args.steps  # a warm-up round, then the timed ones
    trainer = Trainer(config.load_config(None, [
        f"model.n_layer={args.n_layer}", f"model.n_head={args.n_head}", f"model.n_embd={args.n_embd}",
        f"model.block_size={args.block_size}", "model.dtype=float32", "mesh.dp=1", "mesh.tp=1", "mesh.pp=1",
        f"train.micro_batch_size={args.batch}", "train.microbatches=1", f"train.steps={total}", "train.warmup=0",
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
        peaks.append(metrics.measure_gemm_flops("float32", n=1024, seconds=0.5))
        h_times.append(hpcpar_steps())
        t_times.append(torch_steps(r))
    tokens_per_round = args.steps * args.batch * cfg.block_size
    h_tok, t_tok = tokens_per_round / min(h_times), tokens_per_round / min(t_times)
    flops = metrics.flops_per_token(cfg.non_embedding_params(), cfg.n_layer, cfg.n_embd, cfg.block_size)
    peak = max(peaks)

    # Per-op overhead: a tiny elementwise multiply with the graph recorded.
    a, ta = Tensor(np.ones(8, np.float32), requires_grad=True), torch.ones(8, requires_grad=True)
    reps = 20000
    start = time.perf_counter()
    for _ in range(reps):
        ops.mul(a, a)
    h_op = (time.perf_counter() - start) / reps
    start = time.perf_counter()
    for _ in range(reps):
        ta * ta
    t_op = (time.perf_counter() - start) / reps

    result = {
        "config": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head,
                   "block_size": cfg.block_size, "batch": args.batch, "steps": args.steps,
                   "threads": args.threads, "dtype": "float32"},
        "gemm_peak_gflops": peak / 1e9,
        "hpcpar": {"tokens_per_s": h_tok, "mfu": h_tok * flops / peak, "op_overhead_us": h_op * 1e6},
        "torch": {"tokens_per_s": t_tok, "mfu": t_tok * flops / peak, "op_overhead_us": t_op * 1e6,
                  "version": torch.__version__},
        "ratio_hpcpar_over_torch": h_tok / t_tok,
    }
    print(f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} T={cfg.block_size} B={args.batch}, "
          f"{args.threads} thread(s), GEMM peak {peak / 1e9:.1f} GFLOP/s")
    print(f"{'':10} {'tokens/s':>10} {'MFU':>7} {'op overhead':>12}")
    for name in ("hpcpar", "torch"):
        r = result[name]
        print(f"{name:10} {r['tokens_per_s']:10,.0f} {r['mfu']:7.1%} {r['op_overhead_us']:9.1f} us")
    print(f"hpcpar / torch = {result['ratio_hpcpar_over_torch']:.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
