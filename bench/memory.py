"""Memory per rank, measured: model-state bytes per parameter under ZeRO 0/1/2/3, and a model that
plain data parallelism refuses under a memory limit training under ZeRO-3 on the same ranks.

    mpiexec -n 4 python bench/memory.py [--section model_state] [--layers 4] [--embd 128]

Sections (each its own function, `SECTIONS`; `--section` picks some, default all; every section
adds its table to stdout and its entry to bench/results/memory.json, which keeps the entries of
sections not run):

model_state   On a dp = world mesh (N ranks, float32, AdamW), for zero = 0, 1, 2, 3: the bytes of
              every NumPy allocation live on a rank after two training steps (tracemalloc, NumPy's
              domain: real allocations, not a count of what the objects say they hold) minus those
              live before the Trainer was built, per parameter of the model, the busiest rank's,
              next to the ZeRO paper's fp32 Adam formulas (arXiv 1910.02054, 4 bytes per value):

                  zero 0   4 + 4 + 8       = 16      weights, gradients, two moments
                  zero 1   4 + 4 + 8/N               moments sharded
                  zero 2   4 + (4 + 8)/N             gradients sharded too
                  zero 3   16/N + one gathered unit  everything sharded; a unit's parameters
                                                     are gathered around its use

              For zero 3 the largest unit is then gathered through the real gather path and its
              bytes added (the "+ one unit" term, measured). Each figure must be within 10 % of
              its formula (exit status 1 otherwise); padding to a multiple of N is in the
              measurement, not in the formula.
              Then the fit demonstration: a per-rank limit under which the config's memory
              estimate (`config.validate(..., available_memory_bytes)`, the check `hpcpar train`
              makes before any collective) accepts a base model with plain DP (zero 0) but
              refuses a model with >= 3x its parameters; the big model is accepted with zero=3
              and trains `--steps` steps on the same ranks, its measured peak (tracemalloc, all
              allocations of the step) under the limit.

Prints tables; writes bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar import config  # noqa: E402
from hpcpar.errors import ConfigError  # noqa: E402
from hpcpar.train import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
TOKENS = np.random.default_rng(0).integers(0, 256, 1 << 16).astype(np.uint8)
MiB = 1 << 20


def numpy_bytes() -> int:
    """Bytes of every NumPy array allocation live now (tracemalloc must be tracing)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def train_config(args, zero: int, embd: int, extra: tuple = ()) -> config.Config:
    return config.load_config(None, [
        f"model.n_layer={args.layers}", f"model.n_embd={embd}", f"model.n_head={args.heads}",
        f"model.block_size={args.block}", "model.dtype=float32", f"mesh.dp={SIZE}", "mesh.tp=1", "mesh.pp=1",
        f"train.micro_batch_size={args.batch}", "train.microbatches=1", f"train.bucket_mb={args.bucket_mb}",
        f"train.zero={zero}", "train.steps=100", "run.eval_every=0", "run.progress=false", *extra])


# -- model state --------------------------------------------------------------------------------

FORMULAS = {0: "4 + 4 + 8", 1: "4 + 4 + 8/N", 2: "4 + 12/N", 3: "16/N + unit"}


def formula_bytes(zero: int, n: int) -> float:
    """Bytes per parameter by the ZeRO paper's fp32 Adam accounting (without the gathered unit)."""
    return {0: 16.0, 1: 8.0 + 8.0 / n, 2: 4.0 + 12.0 / n, 3: 16.0 / n}[zero]


def measure_model_state(args, zero: int) -> dict:
    """One zero stage: model-state bytes of this rank after two steps (and a gathered unit)."""
    tracemalloc.start()
    before = numpy_bytes()
    trainer = Trainer(train_config(args, zero, args.embd), WORLD, tokens=TOKENS)
    for step in range(2):
        trainer.train_step(step)
    after = numpy_bytes()
    params = sum(int(np.prod(p.layout.local_shape)) for _, p in trainer.named_parameters)
    unit_bytes, unit_params = 0, 0
    units = trainer.dp.unit_hooks
    if units is not None:  # the "+ one gathered unit" term: the largest unit through the real gather path
        unit = max(units.units.values(), key=lambda u: sum(f.size for f in u.flats))
        units._acquire(unit)
        unit_bytes = numpy_bytes() - after
        unit_params = sum(f.size for f in unit.flats)
        units._release(unit)
    held = trainer.dp.model_state_bytes()
    trainer.mesh.free()
    del trainer
    tracemalloc.stop()
    return {"zero": zero, "params": params, "state_bytes": after - before, "unit_bytes": unit_bytes,
            "unit_params": unit_params, "held_by_objects": held}


def model_state(args) -> dict:
    """The model_state section (see the module doc); every rank returns the same dict."""
    rows = []
    for zero in (0, 1, 2, 3):
        mine = measure_model_state(args, zero)
        every = WORLD.allgather(mine)
        busiest = max(every, key=lambda r: r["state_bytes"] + r["unit_bytes"])
        n, p = SIZE, busiest["params"]
        measured = busiest["state_bytes"] / p
        expected = formula_bytes(zero, n)
        unit = busiest["unit_bytes"] / p
        expected_unit = 4.0 * busiest["unit_params"] / p  # one gathered unit, per parameter of the model
        total, total_expected = measured + unit, expected + expected_unit
        rows.append({**busiest, "n": n, "bytes_per_param": measured, "unit_bytes_per_param": unit,
                     "measured": total, "formula": FORMULAS[zero], "formula_bytes_per_param": total_expected,
                     "error": total / total_expected - 1.0, "per_rank": [r["state_bytes"] for r in every]})
    fit = fit_demonstration(args)
    return {"model": {"layers": args.layers, "embd": args.embd, "heads": args.heads, "block": args.block,
                      "batch": args.batch, "dtype": "float32", "optimizer": "adamw"},
            "rows": rows, "within_10_percent": all(abs(r["error"]) <= 0.10 for r in rows), "fit": fit}


def fit_demonstration(args) -> dict:
    """A limit that plain DP (zero 0) cannot train the big model under but zero 3 can."""
    small, big = args.embd, args.big_embd
    estimate = {}
    for name, zero, embd in (("small_zero0", 0, small), ("big_zero0", 0, big), ("big_zero3", 3, big)):
        cfg = config.validate(train_config(args, zero, embd), SIZE)
        estimate[name] = config.estimate_memory(cfg, SIZE, 1, 1, 1)
    # The limit: 10 % above what the config estimates for the big model under zero 3 (the estimate
    # is within a few per cent of the measured peak), far below what plain DP needs for it.
    limit = int(max(estimate["small_zero0"], estimate["big_zero3"]) * 1.10)
    accepted, refused = {}, {}
    for name, zero, embd in (("small_zero0", 0, small), ("big_zero0", 0, big), ("big_zero3", 3, big)):
        try:
            config.validate(train_config(args, zero, embd), SIZE, available_memory_bytes=limit)
            accepted[name] = True
        except ConfigError as err:
            accepted[name], refused[name] = False, str(err)
    params = {}
    for name, embd in (("small", small), ("big", big)):
        params[name] = config.validate(train_config(args, 0, embd), SIZE).model.num_params()
    # The big model under zero 3, as `hpcpar train` would build it with this limit: it trains.
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    trainer = Trainer(train_config(args, 3, big), WORLD, tokens=TOKENS, available_memory_bytes=limit)
    tracemalloc.reset_peak()
    losses, started = [], time.perf_counter()
    for step in range(args.steps):
        losses.append(trainer.train_step(step).loss)
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] - base
    trainer.mesh.free()
    del trainer
    tracemalloc.stop()
    peaks = WORLD.allgather(peak)
    return {"limit_bytes": limit, "estimates": estimate, "accepted": accepted, "refused": refused,
            "params": params, "param_ratio": params["big"] / params["small"], "big_zero3_losses": losses,
            "big_zero3_peak_bytes": max(peaks), "big_zero3_peak_under_limit": max(peaks) <= limit,
            "big_zero3_step_s": elapsed / max(args.steps, 1)}


def print_model_state(d: dict) -> None:
    m, n = d["model"], d["rows"][0]["n"]
    print(f"\n# model state per parameter on {n} ranks (dp={n}), GPT {m['layers']}x{m['embd']} float32 AdamW, "
          f"{d['rows'][0]['params'] / 1e6:.2f}M params (tracemalloc: NumPy allocations after 2 steps, busiest rank)")
    print(f"{'zero':>4} {'formula':>14} {'bytes/param':>12} {'measured':>9} {'unit':>6} {'error':>7}")
    for r in d["rows"]:
        print(f"{r['zero']:>4} {r['formula']:>14} {r['formula_bytes_per_param']:>12.2f} {r['measured']:>9.2f} "
              f"{r['unit_bytes_per_param']:>6.2f} {r['error']:>+7.1%}")
    f = d["fit"]
    print(f"\n# under a limit of {f['limit_bytes'] / MiB:.1f} MiB per rank (config estimate): "
          f"{f['params']['small'] / 1e6:.2f}M params with zero=0 "
          f"{'accepted' if f['accepted']['small_zero0'] else 'REFUSED'}; "
          f"{f['params']['big'] / 1e6:.2f}M params ({f['param_ratio']:.1f}x) with zero=0 "
          f"{'accepted' if f['accepted']['big_zero0'] else 'refused'}, with zero=3 "
          f"{'accepted' if f['accepted']['big_zero3'] else 'REFUSED'}")
    print(f"  zero=3 trained {len(f['big_zero3_losses'])} steps (loss {f['big_zero3_losses'][0]:.3f} -> "
          f"{f['big_zero3_losses'][-1]:.3f}); measured peak {f['big_zero3_peak_bytes'] / MiB:.1f} MiB per rank "
          f"({'under' if f['big_zero3_peak_under_limit'] else 'OVER'} the limit; estimated "
          f"{f['estimates']['big_zero3'] / MiB:.1f}), zero=0 would need {f['estimates']['big_zero0'] / MiB:.1f} MiB")
    if "big_zero0" in f["refused"]:
        print(f"  zero=0: {f['refused']['big_zero0']}")


# -- sections and the shared writer -------------------------------------------------------------

# name -> (run(args) -> dict, print(dict), passed(dict) -> bool). A section runs on every rank.
SECTIONS = {
    "model_state": (model_state, print_model_state,
                    lambda d: d["within_10_percent"] and d["fit"]["param_ratio"] >= 3
                    and not d["fit"]["accepted"]["big_zero0"] and d["fit"]["accepted"]["big_zero3"]
                    and d["fit"]["big_zero3_peak_under_limit"]),
}


def write_results(out: Path, results: dict, meta: dict) -> None:
    """Merge this run's sections into the JSON at `out` (sections not run keep their entries)."""
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update(results)
    data.setdefault("meta", {}).update(meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", action="append", choices=sorted(SECTIONS),
                        help="run only this section (repeatable; default: all)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128, help="model width of the measurements and the base model")
    parser.add_argument("--big-embd", type=int, default=256, help="width of the model plain DP refuses")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch per rank (small: model state dominates)")
    parser.add_argument("--bucket-mb", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=3, help="training steps of the zero=3 fit demonstration")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    args = parser.parse_args(argv)
    results, ok = {}, True
    started = time.perf_counter()
    for name in args.section or list(SECTIONS):
        run, show, passed = SECTIONS[name]
        results[name] = run(args)
        ok &= bool(passed(results[name]))
        if RANK == 0:
            show(results[name])
    if RANK == 0:
        meta = {"ranks": SIZE, "cores": os.cpu_count(), "load_average": os.getloadavg(),
                "wall_s": time.perf_counter() - started}
        write_results(Path(args.out), results, meta)
        print(f"wrote {args.out}{'' if ok else ' (a check FAILED)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
