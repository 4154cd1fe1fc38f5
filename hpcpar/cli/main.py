"""`hpcpar <verb>`: parse the command line and call library functions.

The parser is built from one module per verb (hpcpar/cli/<verb>.py); this module dispatches.

Nothing here does work a test could not do by calling the library directly.
User errors (`HpcparError`) print one line and exit 2; other exceptions take the
fail-together path (traceback tagged with the rank, then MPI_Abort).

MPI is initialised only where it is needed: the one-process verbs started without an MPI launcher
(on a login node, say) never import mpi4py; under a launcher, rank 0 runs them and the other ranks
wait for its exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from types import ModuleType

from hpcpar import environment

# Must run before NumPy loads its BLAS: one thread per rank when ranks share cores.
environment.set_default_threads()

from hpcpar.cli.options import Parser  # noqa: E402
from hpcpar.errors import HpcparError, user_error_text  # noqa: E402

# `hpcpar <verb>` runs hpcpar/cli/<verb>.py: HELP, add_arguments(parser), one_process(args), run(args).
VERBS = ("train", "sample", "info", "ckpt", "job", "plot", "data", "plan", "eval")


def verb_module(verb: str) -> ModuleType:
    return importlib.import_module(f"hpcpar.cli.{verb}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hpcpar", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb in VERBS:
        module = verb_module(verb)
        module.add_arguments(verbs.add_parser(verb, help=module.HELP))
    return parser


def _on_rank_0(module: ModuleType, args: argparse.Namespace) -> int:
    """Run a one-process verb under mpiexec: rank 0 does the work and prints; the other ranks wait
    (sleeping, not spinning on cores rank 0 may need) and end with rank 0's exit status. A user error
    on rank 0 is raised on every rank, so it is reported once, as every rank's (`failure`)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return module.run(args)
    outcome: int | HpcparError = 0
    if world.Get_rank() == 0:
        try:
            outcome = int(module.run(args) or 0)
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
    argv = sys.argv[1:] if argv is None else argv
    launched = environment.under_mpi_launcher()
    failure = None
    if launched:       # before parsing: a usage error is then reported once for every rank
        from hpcpar.runtime import failure
        failure.install()
    try:
        args = build_parser().parse_args(argv)
        module = verb_module(args.verb)
        if module.one_process(args):
            status = _on_rank_0(module, args) if launched else module.run(args)
        else:
            if failure is None:  # one process with MPI of its own (a singleton), as the verb needs
                from hpcpar.runtime import failure
                failure.install()
            status = module.run(args)
    except HpcparError as err:
        if failure is None:
            sys.stderr.write(user_error_text(err, debug=_debug(argv)))
        else:
            failure.report_user_error(err, debug=_debug(argv))
        status = err.exit_status
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
