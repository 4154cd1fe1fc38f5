"""`hpcpar <verb>`: parse the command line and call library functions.

Nothing here does work a test could not do by calling the library directly.
User errors (`HpcparError`) print one line and exit 2; other exceptions take the
fail-together path (traceback tagged with the rank, then MPI_Abort).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from hpcpar import threads

# Must run before NumPy loads its BLAS: one thread per rank when ranks share cores.
threads.set_default_threads()

from hpcpar.errors import ConfigError, HpcparError, UsageError  # noqa: E402


class _Parser(argparse.ArgumentParser):
    """argparse that raises a UsageError where it would print its usage and exit: under mpiexec
    every rank parses the same command line, and an error must be printed once, not once a rank
    (`failure.report_user_error`). Sub-commands' parsers are of this class too."""

    def error(self, message: str):
        raise UsageError(f"{message} (see: {self.prog} --help)")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="TOML config file (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set model.n_layer=8 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpcpar", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser("train", help="train a GPT (run under mpiexec for several ranks)")
    _add_config_args(p)

    p = verbs.add_parser("sample", help="generate text from a trained checkpoint")
    p.add_argument("checkpoint", help="checkpoint directory (step-NNNNNNN, or a run's checkpoint dir)")
    p.add_argument("--prompt", default="def ", help="text to start from")
    p.add_argument("--tokens", type=int, default=200, help="number of tokens to generate (>= 0)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature, a finite number > 0")
    p.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest tokens (0: from every token)")
    p.add_argument("--seed", type=int, default=0, help="random seed (>= 0)")
    p.add_argument("--tokenizer", help="tokenizer.json to decode with (default: the one recorded in the checkpoint; "
                                       "must match it)")

    p = verbs.add_parser("info", help="MPI library, backend, world size and (given degrees) the mesh")
    p.add_argument("--dp", type=int, default=None)
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--pp", type=int, default=None)
    p.add_argument("--cp", type=int, default=None, help="context-parallel degree")
    p.add_argument("--dp-replicate", type=int, default=None,
                   help="HSDP: dp = dp_replicate x dp_shard (shard groups are reported inside a node or not)")
    p.add_argument("--servers", type=int, default=0,
                   help="parameter-server ranks (the last ones): the mesh is the others, and the parameter range each "
                        "server owns is shown for the model of the --set overrides (built once on rank 0)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="model config for --servers (e.g. model.n_layer=8)")

    p = verbs.add_parser("ckpt", help="inspect, verify, export or import a checkpoint")
    p.add_argument("action", choices=["info", "verify", "export", "import"])
    p.add_argument("path", help="checkpoint directory (step-NNNNNNN) or its parent (uses latest); import: a GPT-2 "
                                "safetensors file or HuggingFace model directory")
    p.add_argument("--out", help="export: the file (.npz, or .safetensors) or directory (safetensors) to write; "
                                 "import: the checkpoint directory to create")
    p.add_argument("--format", choices=["npz", "safetensors"], default="npz",
                   help="export: npz (every tensor, hpcpar names) or safetensors (HuggingFace GPT-2 names)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"],
                   help="export: write the floating-point tensors in this dtype (default: as stored, the master "
                        "weights); bfloat16/float16 round them as a 16-bit run reads them")
    p.add_argument("--n-head", type=int, help="import: attention heads, when no config.json is beside the weights")
    p.add_argument("--tokenizer", help="import: tokenizer.json to record (default: the model directory's)")

    p = verbs.add_parser("job", help="render a Slurm or PBS job script")
    job = p.add_subparsers(dest="job_action", required=True, metavar="ACTION")
    r = job.add_parser("render", help="fill in a job template and print it (or write --out)")
    from hpcpar import jobs
    jobs.add_render_arguments(r)

    p = verbs.add_parser("plot", help="draw loss curves of one or more runs to a PNG")
    p.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl)")
    p.add_argument("--out", default="loss.png", help="image to write, in an existing directory; its suffix names "
                                                      "the format (.png, .pdf, .svg, ...)")

    p = verbs.add_parser("data", help="prepare token files from text (one process)")
    data = p.add_subparsers(dest="data_action", required=True, metavar="ACTION")
    r = data.add_parser("prepare", help="text files -> DIR/tokens.bin (or tokens.h5), tokenizer.json, meta.json")
    r.add_argument("inputs", nargs="+", help="text files or directories (read as data.format=bytes reads them)")
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--tokenizer", choices=["bytes", "bpe", "gpt2"], default="bytes",
                   help="bytes (256 ids), bpe (trained here, needs --vocab-size) or gpt2 (needs --vocab, --merges)")
    r.add_argument("--vocab-size", type=int, default=0, help="bpe: ids of the trained tokenizer (>= 256)")
    r.add_argument("--vocab", help="gpt2: a local vocab.json")
    r.add_argument("--merges", help="gpt2: a local merges.txt")
    r.add_argument("--format", choices=["bin", "hdf5"], default="bin", help="token file format")
    r.add_argument("--token-dtype", choices=["auto", "uint16", "uint32"], default="auto",
                   help="auto: uint16 when the vocabulary fits, else uint32")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = verbs.add_parser("plan", help="choose the mesh and micro-batching for an allocation (cost model)")
    _add_config_args(p)
    p.add_argument("--preset", help="model preset instead of the config's model keys: "
                                    "gpt2-124m, gpt2-1.5b, 7b, 70b, 175b")
    p.add_argument("--ranks", type=int, help="ranks of the allocation (or --nodes and --gpus-per-node)")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--hardware", default="this", help="a100, h100, or this (the figures --calibrate stored)")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: the config's "
                                                     "dp x micro_batch_size x microbatches)")
    p.add_argument("--top", type=int, default=5, help="how many plans to print")
    p.add_argument("--out", help="write the best plan as a config `hpcpar train` runs as is")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (run under mpiexec with the ranks a job will use) and store it")
    p.add_argument("--calibration", help="calibration file (default: $HPCPAR_CALIBRATION or "
                                         "~/.cache/hpcpar/calibration.json)")

    p = verbs.add_parser("eval", help="loss and perplexity of a checkpoint on held-out data (any mesh)")
    p.add_argument("checkpoint", help="checkpoint directory (step-NNNNNNN) or its parent (uses latest)")
    p.add_argument("--data", required=True, help="text or token file or directory (as data.corpus)")
    p.add_argument("--format", choices=["bytes", "bin", "hdf5"], help="data format (default: from the path)")
    p.add_argument("--split", choices=["val", "all"], default="val",
                   help="val: the part training held out (default); all: every token")
    p.add_argument("--max-tokens", type=int, default=0, help="evaluate at most this many tokens (0 = all)")
    p.add_argument("--json", dest="json_out", help="also write the figures to this JSON file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override the checkpoint's config, e.g. --set mesh.tp=2 (repeatable)")
    return parser


def _output_file(path: str | None, option: str) -> None:
    """An output file the command writes at its end must be creatable: checked before the work, so a
    typo in the directory does not cost the whole run (None: not asked for)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{option} {path!r} is a directory; give a file name inside it")
    if not os.path.isdir(folder):
        raise ConfigError(f"{option} {path!r}: directory {folder!r} does not exist; create it first or give a path "
                          "in an existing directory")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{option} {path!r}: directory {folder!r} is not writable; give a path in a writable "
                          "directory")


# Verbs that do their work on one process. Under mpiexec rank 0 alone runs them (`_on_rank_0`).
def _single_process(args: argparse.Namespace) -> bool:
    return args.verb in ("sample", "ckpt", "job", "plot", "data") or (args.verb == "plan" and not args.calibrate)


def _on_rank_0(args: argparse.Namespace) -> int:
    """Run a single-process verb under mpiexec: rank 0 does the work and prints; the other ranks wait
    (sleeping, not spinning on cores rank 0 may need) and end with rank 0's exit status. A user error
    on rank 0 is raised on every rank, so it is reported once, as every rank's (`failure`)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return run(args)
    outcome: int | HpcparError = 0
    if world.Get_rank() == 0:
        try:
            outcome = int(run(args) or 0)
        except HpcparError as err:
            outcome = err
    done = world.Ibarrier()
    while not done.Test():
        time.sleep(0.01)
    shared = world.bcast(outcome if isinstance(outcome, int) else (str(outcome), outcome.exit_status), root=0)
    if isinstance(outcome, HpcparError):
        raise outcome                  # rank 0: its own error, with its traceback for --debug
    if isinstance(shared, tuple):
        err = HpcparError(shared[0])
        err.exit_status = shared[1]
        raise err
    return shared


def _check_job_run(o) -> None:
    """What `hpcpar job render` can check of the run its script starts (`jobs.JobOptions` o), so that
    a mistake does not wait in the queue first: the overrides' keys and types, and when the config
    file is here too (the job runs in the directory it is submitted from), every value and the mesh
    on the job's nodes x ranks_per_node ranks. Raises the one-line error `hpcpar train` would."""
    from hpcpar import config
    path = o.config if os.path.isfile(o.config) else None
    cfg = config.load_config(path, list(o.overrides))
    if path is not None:
        config.validate(cfg, o.nodes * o.ranks_per_node)


def run(args: argparse.Namespace) -> int:
    """Do what `args` asks on this process (a user error raises `HpcparError`)."""
    _output_file(getattr(args, "json_out", None), "--json")
    if args.verb in ("plot", "plan") or (args.verb == "ckpt" and args.action == "export" and args.format == "npz"):
        _output_file(args.out, "--out")
    if args.verb == "train":
        from hpcpar import train
        return train.main(args.config, args.overrides)
    if args.verb == "sample":
        from hpcpar import generate
        return generate.main(args.checkpoint, prompt=args.prompt, tokens=args.tokens,
                             temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                             tokenizer_file=args.tokenizer)
    if args.verb == "info":
        from hpcpar import mesh
        print(mesh.info_report(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp,
                                     dp_replicate=args.dp_replicate, servers=args.servers), end="")
        if args.servers:
            print(_server_ranges(args.servers, args.overrides), end="")
        return 0
    if args.verb == "ckpt":
        if args.action == "import" or (args.action == "export" and args.format == "safetensors"):
            from hpcpar import huggingface
            return huggingface.cli(args.action, args.path, args.out, args.n_head, args.tokenizer, args.dtype)
        from hpcpar import checkpoint
        return checkpoint.cli(args.action, args.path, out=args.out, dtype=args.dtype)
    if args.verb == "job":
        from hpcpar import jobs
        return jobs.render_cli(args, check=_check_job_run)
    if args.verb == "plot":
        from hpcpar import plot
        return plot.main(args.runs, args.out)
    if args.verb == "data":
        from hpcpar import prepare
        return prepare.cli(args)
    if args.verb == "plan":
        from hpcpar import plan
        return plan.cli(args)
    if args.verb == "eval":
        from hpcpar import evaluate
        return evaluate.main(args.checkpoint, args.data, fmt=args.format, split=args.split,
                             max_tokens=args.max_tokens, overrides=args.overrides, json_out=args.json_out)
    raise AssertionError(args.verb)


def _server_ranges(servers: int, overrides: list[str]) -> str:
    """`hpcpar info --servers S`: which range of the model's flat parameters each server owns
    (rank 0 builds the model of `overrides` once, as the servers do; "" elsewhere)."""
    from mpi4py import MPI

    from hpcpar import backend, config
    from hpcpar.mesh import Mesh
    from hpcpar.parallel import pipeline
    from hpcpar.parallel.parameter_server import ownership_report

    world = MPI.COMM_WORLD
    if world.Get_rank() != 0:
        return ""
    cfg = config.load_config(None, overrides)
    alone = Mesh(comm=MPI.COMM_SELF)
    shapes = {n: tuple(p.layout.global_shape) for s in pipeline.build_stages(cfg.model, alone, chunks=1, seed=0)
              for n, p in s.named_parameters() if not p.tied_to}
    alone.free()
    return ownership_report(shapes, servers, world.Get_size() - servers, backend.xp.dtype(cfg.model.dtype).itemsize)


def _debug(argv: list[str]) -> bool:
    """`--debug` given where it belongs, before the verb (`hpcpar --debug train`); after the verb it
    is an unrecognized argument like any other."""
    for arg in argv:
        if arg == "--debug":
            return True
        if not arg.startswith("-"):
            return False
    return False


def main(argv: list[str] | None = None) -> int:
    from hpcpar import failure
    failure.install()
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
        status = _on_rank_0(args) if _single_process(args) else run(args)
    except HpcparError as err:
        failure.report_user_error(err, debug=_debug(argv))
        status = err.exit_status
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
