"""hpcpar vs PyTorch eager on the CPU: the same GPT, the same batches, the same threads.

For each thread count and model shape, trains the same config in both (forward, backward,
gradient clipping, AdamW step; hpcpar through `Trainer.train`, the loop of `hpcpar train`, on one
rank and writing no files), alternating rounds of the two so machine noise hits both alike, and
reports tokens/s and MFU (model FLOPs / this machine's GEMM peak at the same thread count, measured
every round with hpcpar's GEMM, `blas.matmul`) for each and their ratio; the best round of each
counts. Each framework runs in a process of its own (two OpenMP runtimes and two MKLs in one
process slow each other down, and BLAS libraries read their thread count once), started together
and driven in turns by this one: only one computes at a time. Also times a tiny elementwise op,
to show per-op framework overhead. Prints one table and writes bench/results/vs_torch.json.

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
import time
from collections.abc import Callable

SHAPES = "4x128x128x12,4x256x128x16,6x384x256x8"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="n_layer x n_embd x block_size x batch, comma-separated")
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="timed steps per framework per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best round counts")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "vs_torch.json"))
    p.add_argument("--worker", choices=("hpcpar", "torch"), help=argparse.SUPPRESS)  # one framework, one shape
    return p.parse_args(argv)


if __name__ == "__main__":  # imported (bench/mesh_scaling.py), the importer has set the threads
    args = parse()
    if args.worker:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = args.threads
        if args.worker == "torch":  # hpcpar only builds the model and batches here: no MKL of its own
            os.environ["HPCPAR_BLAS"] = "numpy"

import numpy as np  # noqa: E402  (after the thread variables)
from mpi4py import MPI  # noqa: E402

from hpcpar import metrics
from hpcpar.backend import blas
from hpcpar.config.load import load_config
from hpcpar.autograd import ops  # noqa: E402
from hpcpar.nn.gpt import GPT, GPTConfig  # noqa: E402
from hpcpar.autograd.tensor import Tensor  # noqa: E402
from hpcpar.training.trainer import Trainer  # noqa: E402


def torch_model(params: dict, cfg: GPTConfig):
    """nanoGPT's forward on torch tensors named as hpcpar's parameters."""
    import torch  # here, not at the top: hpcpar's worker process never loads PyTorch
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
    import torch
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


def worker() -> None:
    """One framework at one thread count and shape: builds the model and the batches of every round
    (hpcpar's Trainer draws them; PyTorch gets a copy of its initial parameters), answers "ready",
    then for each "run" line on stdin trains the next round's steps and answers with a JSON line
    (seconds; hpcpar adds the GEMM peak measured just before)."""
    threads = int(args.threads)
    n_layer, n_embd, block, batch = shapes(args.shapes)[0]
    total = (args.rounds + 1) * args.steps  # a warm-up round, then the timed ones
    trainer = Trainer(load_config(None, [
        f"model.n_layer={n_layer}", f"model.n_head={args.n_head}", f"model.n_embd={n_embd}",
        f"model.block_size={block}", "model.dtype=float32", "mesh.dp=1", "mesh.tp=1", "mesh.pp=1",
        f"train.micro_batch_size={batch}", "train.microbatches=1", f"train.steps={total}", "train.warmup=0",
        "run.eval_every=0", "run.progress=false"]), MPI.COMM_SELF)
    if args.worker == "torch":
        import torch  # (only here: hpcpar's process never loads PyTorch, its OpenMP or its MKL)
        torch.set_num_threads(threads)
        # Round r trains steps r*steps .. (r+1)*steps - 1 on the batches hpcpar's loop draws for them.
        batches = [trainer.microbatches(s) for s in range(total)]
        step = torch_trainer(trainer.stages[0], max_norm=trainer.cfg.train.grad_clip)

        def run(r: int) -> dict:
            start = time.perf_counter()
            for s in range(r * args.steps, (r + 1) * args.steps):
                step(batches[s])
            return {"seconds": time.perf_counter() - start}
    else:
        def run(r: int) -> dict:
            peak = metrics.measure_gemm_flops("float32", n=1024, seconds=0.3, matmul=blas.matmul)
            start = time.perf_counter()
            trainer.train(steps=args.steps, files=False, progress=False, peak_flops=0.0)
            return {"seconds": time.perf_counter() - start, "peak": peak}
    run(0)  # warm-up: allocator, thread pools, caches
    print(json.dumps({"ready": True, "op_us": op_overhead(args.worker), "blas": blas.name()}), flush=True)
    for r, line in enumerate(sys.stdin, start=1):
        if line.strip() != "run":
            break
        print(json.dumps(run(r)), flush=True)


def op_overhead(framework: str) -> float:
    """Per-op overhead in microseconds: a tiny elementwise multiply with the graph recorded."""
    reps = 20000
    if framework == "hpcpar":
        a = Tensor(np.ones(8, np.float32), requires_grad=True)
        start = time.perf_counter()
        for _ in range(reps):
            ops.mul(a, a)
    else:
        import torch
        a = torch.ones(8, requires_grad=True)
        start = time.perf_counter()
        for _ in range(reps):
            a * a
    return (time.perf_counter() - start) / reps * 1e6


def compare(shape: tuple[int, int, int, int], threads: int) -> dict:
    """One shape at one thread count: both workers started, then `--rounds` alternating rounds."""
    n_layer, n_embd, block, batch = shape
    cmd = [sys.executable, __file__, "--threads", str(threads), "--shapes", "x".join(map(str, shape)),
           "--n-head", str(args.n_head), "--steps", str(args.steps), "--rounds", str(args.rounds), "--worker"]
    procs = {name: subprocess.Popen(cmd + [name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for name in ("hpcpar", "torch")}
    try:
        hello = {name: json.loads(p.stdout.readline()) for name, p in procs.items()}
        rounds: dict = {"hpcpar": [], "torch": []}
        for _ in range(args.rounds):
            for name, p in procs.items():  # in turns: one computes while the other waits on its stdin
                p.stdin.write("run\n")
                p.stdin.flush()
                rounds[name].append(json.loads(p.stdout.readline()))
        for p in procs.values():
            p.stdin.write("quit\n")
            p.stdin.close()
            if p.wait(timeout=60):
                raise SystemExit(f"bench/vs_torch.py: a worker failed ({' '.join(cmd)})")
    finally:
        for p in procs.values():
            p.kill() if p.poll() is None else None
    cfg = GPTConfig(vocab_size=256, block_size=block, n_layer=n_layer, n_head=args.n_head, n_embd=n_embd)
    flops = metrics.flops_per_token(cfg.non_embedding_params(), n_layer, n_embd, block)
    tokens = args.steps * batch * block
    peak = max(r["peak"] for r in rounds["hpcpar"])
    h_tok = tokens / min(r["seconds"] for r in rounds["hpcpar"])
    t_tok = tokens / min(r["seconds"] for r in rounds["torch"])
    return {"n_layer": n_layer, "n_embd": n_embd, "n_head": args.n_head, "block_size": block, "batch": batch,
            "threads": threads, "gemm_peak_gflops": peak / 1e9, "blas": hello["hpcpar"]["blas"],
            "hpcpar": {"tokens_per_s": h_tok, "mfu": h_tok * flops / peak, "op_overhead_us": hello["hpcpar"]["op_us"]},
            "torch": {"tokens_per_s": t_tok, "mfu": t_tok * flops / peak, "op_overhead_us": hello["torch"]["op_us"]},
            "ratio_hpcpar_over_torch": h_tok / t_tok}


def main() -> None:
    if args.worker:
        return worker()
    try:
        import torch  # (the version; the workers import what they run)
    except ImportError:
        sys.exit("bench/vs_torch.py needs PyTorch: pip install torch==2.13.0")
    rows = [compare(shape, int(threads)) for threads in args.threads.split(",") for shape in shapes(args.shapes)]
    result = {"rows": rows, "min_ratio": min(r["ratio_hpcpar_over_torch"] for r in rows),
              "op_overhead": {"hpcpar_us": rows[0]["hpcpar"]["op_overhead_us"],
                              "torch_us": rows[0]["torch"]["op_overhead_us"]},
              "blas": rows[0]["blas"], "torch_version": torch.__version__, "steps": args.steps, "rounds": args.rounds}
    print(f"hpcpar ({result['blas']} GEMMs) vs PyTorch {torch.__version__} eager, tokens/s, best of {args.rounds} "
          f"alternating rounds of {args.steps} steps")
    print(f"{'shape (L x C x T x B)':>22} {'threads':>7} {'hpcpar':>9} {'torch':>9} {'ratio':>6} "
          f"{'MFU hpcpar':>10} {'MFU torch':>9} {'peak GF/s':>9}")
    for r in rows:
        shape = f"{r['n_layer']}x{r['n_embd']}x{r['block_size']}x{r['batch']}"
        print(f"{shape:>22} {r['threads']:>7} {r['hpcpar']['tokens_per_s']:9,.0f} {r['torch']['tokens_per_s']:9,.0f} "
              f"{r['ratio_hpcpar_over_torch']:5.2f}x {r['hpcpar']['mfu']:10.1%} {r['torch']['mfu']:9.1%} "
              f"{r['gemm_peak_gflops']:9.1f}")
    o = result["op_overhead"]
    print(f"lowest ratio {result['min_ratio']:.2f}x; per-op overhead {o['hpcpar_us']:.1f} us (hpcpar) vs "
          f"{o['torch_us']:.1f} us (torch)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
