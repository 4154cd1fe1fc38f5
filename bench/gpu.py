"""hpcpar on a GPU (CuPy + cuBLAS) against plain cuBLAS and PyTorch eager on the same GPU.

1. GEMM: y = x W^T, x [M, K], W [N, K] (nn.Linear layout), through hpcpar's Linear
   (`linear`, forward) and through `cupy.matmul` on the same arrays, in fp32, tf32 and fp16;
   bf16 through cuBLAS alone (hpcpar has no 16-bit storage yet). TFLOP/s and the ratio.
2. GPT-124M (n_layer 12, n_head 12, n_embd 768, vocab 50304, T 1024): one training step
   (forward, backward, AdamW) on random tokens, hpcpar vs PyTorch eager (nanoGPT's model, the same
   parameters and AdamW settings), in fp32 and tf32: tokens/s, MFU against the measured GEMM
   peak of that precision, and hpcpar / PyTorch.

Each precision runs in its own process (CuPy reads CUPY_TF32 when it loads); in it hpcpar's steps
are timed, then PyTorch's, each the median of CUDA-event-timed repeats after warm-up. Results:
bench/results/gpu.json, with the GPU named; docs/benchmarks-gpu.md shows them.

    python bench/gpu.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PRECISIONS = ("fp32", "tf32", "fp16")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gemm-size", type=int, default=8192, help="M = N = K of the GEMM")
    p.add_argument("--batch", type=int, default=8, help="GPT-124M sequences per step")
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--steps", type=int, default=10, help="timed steps per framework")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "gpu.json"))
    p.add_argument("--worker", choices=PRECISIONS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.gemm_size, args.batch, args.block_size, args.n_layer, args.steps = 2048, 2, 256, 2, 3
    return args


def _median_ms(cp, fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` timed with CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def _bf16_cublas_tflops(cp, n: int) -> float | None:
    """A bf16 x bf16 -> bf16 GEMM (fp32 accumulate) through cublasGemmEx; None if unavailable."""
    import numpy as np
    from cupy.cuda import cublas
    try:
        a, b, c = (cp.asarray(cp.random.standard_normal((n, n), dtype=cp.float32)).view(cp.uint32) for _ in range(3))
        a, b, c = ((x >> 16).astype(cp.uint16) for x in (a, b, c))  # bf16 bits: the top half of fp32
        one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
        handle = cp.cuda.device.get_cublas_handle()
        cuda_r_16bf, compute_32f, tensor_op = 14, 68, 99  # CUDA_R_16BF, CUBLAS_COMPUTE_32F, GEMM_DEFAULT_TENSOR_OP

        def gemm():
            cublas.gemmEx(handle, 0, 0, n, n, n, one.ctypes.data, a.data.ptr, cuda_r_16bf, n, b.data.ptr,
                          cuda_r_16bf, n, zero.ctypes.data, c.data.ptr, cuda_r_16bf, n, compute_32f, tensor_op)
        return 2 * n ** 3 / _median_ms(cp, gemm) / 1e9
    except Exception as err:  # noqa: BLE001 - reported, not fatal
        print(f"bf16 cuBLAS GEMM unavailable: {err}", file=sys.stderr)
        return None


def gemm_rates(cp, precision: str, n: int) -> dict:
    """TFLOP/s of y = x W^T through hpcpar's Linear and through cupy.matmul (same arrays)."""
    from hpcpar.autograd.linear import linear
    from hpcpar.autograd.tensor import Tensor
    dtype = cp.float16 if precision == "fp16" else cp.float32
    x = cp.random.standard_normal((n, n), dtype=cp.float32).astype(dtype)
    w = cp.random.standard_normal((n, n), dtype=cp.float32).astype(dtype)
    xt, wt = Tensor(x), Tensor(w)
    flops = 2.0 * n ** 3
    hpcpar_ms = _median_ms(cp, lambda: linear(xt, wt))
    cublas_ms = _median_ms(cp, lambda: cp.matmul(x, w.T))
    # The results must agree (same cuBLAS call underneath, or the check shows it is not).
    ref = cp.matmul(x, w.T).astype(cp.float32)
    err = float(cp.linalg.norm(linear(xt, wt).data.astype(cp.float32) - ref) / cp.linalg.norm(ref))
    out = {"hpcpar_tflops": flops / hpcpar_ms / 1e9, "cublas_tflops": flops / cublas_ms / 1e9,
           "rel_diff": err}
    out["ratio"] = out["hpcpar_tflops"] / out["cublas_tflops"]
    return out


def gpt_step_rates(cp, precision: str, args) -> dict:
    """Tokens/s of a GPT training step, hpcpar vs PyTorch eager, on one GPU."""
    import numpy as np

    from hpcpar import metrics
    from hpcpar.nn.gpt import GPT, GPTConfig
    from hpcpar.optim.optimizers import AdamW
    cfg = GPTConfig(vocab_size=50304, block_size=args.block_size, n_layer=args.n_layer, n_head=12, n_embd=768,
                    dtype="float32")
    model = GPT(cfg, seed=0)
    params = model.parameters()
    opt = AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size)))
    y = cp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size)))

    def hpcpar_step():
        for p in params:
            p.grad = None
        model(x, y).backward()
        opt.step()

    result = {"hpcpar_step_ms": _median_ms(cp, hpcpar_step, repeats=args.steps, warmup=2)}
    tokens = args.batch * cfg.block_size
    result["hpcpar_tokens_per_s"] = tokens / result["hpcpar_step_ms"] * 1e3
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        sys.path.insert(0, HERE)
        from vs_torch import torch_model  # nanoGPT's forward on named torch tensors
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        tparams = {n: torch.tensor(cp.asnumpy(p.data), device="cuda", requires_grad=True)
                   for n, p in model.named_parameters()}
        decay = [t for n, t in tparams.items() if not (n.endswith(".bias") or ".ln_" in n or "ln_f" in n)]
        rest = [t for t in tparams.values() if all(t is not d for d in decay)]
        topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-4, betas=(0.9, 0.95))
        loss_fn = torch_model(tparams, cfg)
        tx, ty = (torch.as_tensor(cp.asnumpy(a), device="cuda") for a in (x, y))

        def torch_step():
            topt.zero_grad(set_to_none=True)
            loss_fn(tx, ty).backward()
            topt.step()
        result["torch_step_ms"] = _median_ms(cp, torch_step, repeats=args.steps, warmup=2)
        result["torch_tokens_per_s"] = tokens / result["torch_step_ms"] * 1e3
        result["ratio"] = result["hpcpar_tokens_per_s"] / result["torch_tokens_per_s"]
    result["flops_per_token"] = metrics.flops_per_token(cfg.non_embedding_params(), cfg.n_layer, cfg.n_embd,
                                                        cfg.block_size)
    return result


def worker(args) -> dict:
    """Everything for one precision, in this process (CUPY_TF32 was set by the parent)."""
    os.environ.setdefault("HPCPAR_BACKEND", "cupy")
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    out = {"precision": args.worker, "gpu": props["name"].decode(), "cupy": cp.__version__,
           "gemm": gemm_rates(cp, args.worker, args.gemm_size)}
    if args.worker == "fp32":
        out["gemm"]["bf16_cublas_tflops"] = _bf16_cublas_tflops(cp, args.gemm_size)
    if args.worker in ("fp32", "tf32"):
        gpt = gpt_step_rates(cp, args.worker, args)
        peak = out["gemm"]["cublas_tflops"] * 1e12
        gpt["hpcpar_mfu"] = gpt["hpcpar_tokens_per_s"] * gpt["flops_per_token"] / peak
        if "torch_tokens_per_s" in gpt:
            gpt["torch_mfu"] = gpt["torch_tokens_per_s"] * gpt["flops_per_token"] / peak
        out["gpt124m"] = gpt
    return out


def main() -> int:
    args = parse()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # noqa: BLE001
        print(f"bench/gpu.py needs CuPy and a CUDA GPU ({err})", file=sys.stderr)
        return 2
    results = {"config": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
               "time": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": {}}
    for precision in PRECISIONS:
        env = dict(os.environ, CUPY_TF32="1" if precision == "tf32" else "0", HPCPAR_BACKEND="cupy")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", precision] + sys.argv[1:]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(done.stdout + done.stderr, file=sys.stderr)
            return done.returncode
        results["runs"][precision] = json.loads(done.stdout.strip().splitlines()[-1])
    gpu = results["runs"]["fp32"]["gpu"]
    results["gpu"] = gpu
    print(f"GPU: {gpu}")
    print(f"{'GEMM ' + str(args.gemm_size) + '^3':<16}{'hpcpar TFLOP/s':>16}{'cuBLAS TFLOP/s':>16}{'ratio':>8}")
    for precision, run in results["runs"].items():
        g = run["gemm"]
        print(f"{precision:<16}{g['hpcpar_tflops']:>16.1f}{g['cublas_tflops']:>16.1f}{g['ratio']:>8.2f}")
    bf16 = results["runs"]["fp32"]["gemm"].get("bf16_cublas_tflops")
    print(f"{'bf16':<16}{'n/a':>16}{bf16 if bf16 is None else round(bf16, 1):>16}")
    print(f"\nGPT-124M step (B={args.batch}, T={args.block_size}, {args.n_layer} layers)")
    print(f"{'precision':<12}{'hpcpar tok/s':>14}{'MFU':>7}{'torch tok/s':>14}{'MFU':>7}{'ratio':>8}")
    for precision in ("fp32", "tf32"):
        g = results["runs"][precision]["gpt124m"]
        print(f"{precision:<12}{g['hpcpar_tokens_per_s']:>14,.0f}{g['hpcpar_mfu']:>7.1%}"
              f"{g.get('torch_tokens_per_s', float('nan')):>14,.0f}{g.get('torch_mfu', float('nan')):>7.1%}"
              f"{g.get('ratio', float('nan')):>8.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
