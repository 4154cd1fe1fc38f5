"""`hpcpar <verb>`: parse the command line and call library functions.

Nothing here does work a test could not do by calling the library directly.
User errors (`HpcparError`) print one line and exit 2; other exceptions take the
fail-together path (traceback tagged with the rank, then MPI_Abort).
"""

from __future__ import annotations

import argparse
import sys

from hpcpar import threads

# Must run before NumPy loads its BLAS: one thread per rank when ranks share cores.
threads.set_default_threads()

from hpcpar.errors import HpcparError  # noqa: E402


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="TOML config file (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set model.n_layer=8 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcpar", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser("train", help="train a GPT (run under mpiexec for several ranks)")
    _add_config_args(p)

    p = verbs.add_parser("sample", help="generate text from a trained checkpoint")
    p.add_argument("checkpoint", help="checkpoint directory (step-NNNNNNN, or a run's checkpoint dir)")
    p.add_argument("--prompt", default="def ", help="text to start from")
    p.add_argument("--tokens", type=int, default=200, help="number of bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)

    p = verbs.add_parser("info", help="MPI library, backend, world size and (given degrees) the mesh")
    p.add_argument("--dp", type=int, default=None)
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--pp", type=int, default=None)
    p.add_argument("--cp", type=int, default=None, help="context-parallel degree")
    p.add_argument("--dp-replicate", type=int, default=None,
                   help="HSDP: dp = dp_replicate x dp_shard (shard groups are reported inside a node or not)")

    p = verbs.add_parser("ckpt", help="inspect, verify or export a checkpoint")
    p.add_argument("action", choices=["info", "verify", "export"])
    p.add_argument("path", help="checkpoint directory (step-NNNNNNN) or its parent (uses latest)")
    p.add_argument("--out", help="export: the .npz file to write")

    p = verbs.add_parser("job", help="render a Slurm or PBS job script")
    job = p.add_subparsers(dest="job_action", required=True, metavar="ACTION")
    r = job.add_parser("render", help="fill in a job template and print it (or write --out)")
    from hpcpar import jobs
    jobs.add_render_arguments(r)

    p = verbs.add_parser("plot", help="draw loss curves of one or more runs to a PNG")
    p.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl)")
    p.add_argument("--out", default="loss.png", help="PNG file to write")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.verb == "train":
        from hpcpar import train
        return train.main(args.config, args.overrides)
    if args.verb == "sample":
        from hpcpar import generate
        return generate.main(args.checkpoint, prompt=args.prompt, tokens=args.tokens,
                             temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    if args.verb == "info":
        from hpcpar import mesh
        print(mesh.info_report(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp,
                                     dp_replicate=args.dp_replicate), end="")
        return 0
    if args.verb == "ckpt":
        from hpcpar import checkpoint
        return checkpoint.cli(args.action, args.path, out=args.out)
    if args.verb == "job":
        from hpcpar import jobs
        return jobs.render_cli(args)
    if args.verb == "plot":
        from hpcpar import plot
        return plot.main(args.runs, args.out)
    raise AssertionError(args.verb)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from hpcpar import failure
    failure.install()
    try:
        status = run(args)
    except HpcparError as err:
        failure.report_user_error(err, debug=args.debug)
        status = err.exit_status
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
