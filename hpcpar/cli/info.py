"""`hpcpar info`: the MPI library, backend, world size and (given degrees) the mesh, on every rank."""

from __future__ import annotations

import argparse
import os

from hpcpar.errors import MeshError

HELP = "MPI library, backend, world size and (given degrees) the mesh"


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def one_process(args: argparse.Namespace) -> bool:
    return False


def run(args: argparse.Namespace) -> int:
    print(report(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, dp_replicate=args.dp_replicate,
                 servers=args.servers), end="")
    if args.servers:
        print(server_ranges(args.servers, args.overrides), end="")
    return 0


def _mesh_of(world, dp, tp, pp, cp, dp_replicate, servers: int):
    """The mesh the degrees ask for over the first world.size - servers ranks (None where none was asked
    for, or on a server rank). Degrees that do not fit raise MeshError on every rank."""
    from mpi4py import MPI

    from hpcpar.runtime.mesh import Mesh
    from hpcpar.runtime.topology import is_positive_int, resolve_degrees, validate_degrees
    workers = world.Get_size() - servers
    if servers and (dp, tp, pp, cp, dp_replicate) == (None, None, None, None, None):
        dp = workers
    if (dp, tp, pp, cp, dp_replicate) == (None, None, None, None, None):
        return None
    tp, pp, cp = (1 if tp is None else tp), (1 if pp is None else pp), (1 if cp is None else cp)
    if dp is None:  # dp fills the world, by the [mesh] rule for dp = 0 (auto)
        for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
            if not is_positive_int(value):
                raise MeshError(f"mesh {name}={value}: {name} must be a positive integer (dp fills the "
                                f"rest of the {world.Get_size()} ranks)")
        dp = resolve_degrees(workers, 0, tp, pp, cp)[0]
    validate_degrees(dp, tp, pp, workers, cp, 1 if dp_replicate is None else dp_replicate)
    comm = world.Split(0 if world.Get_rank() < workers else MPI.UNDEFINED, world.Get_rank()) if servers else world
    if comm == MPI.COMM_NULL:
        return None
    return Mesh(dp, tp, pp, comm=comm, cp=cp, dp_replicate=1 if dp_replicate is None else dp_replicate)


def report(dp: int | None = None, tp: int | None = None, pp: int | None = None,
           cp: int | None = None, dp_replicate: int | None = None, servers: int = 0) -> str:
    """The text of `hpcpar info` (collective). Rank 0 gets it; other ranks get "".

    Always: MPI library, mpi4py, backend, world size, threads per rank. With any
    degree given: the mesh shape, each rank's coordinates and the placement report (tp groups
    and dp_shard groups: inside one node or not); tp, pp, cp and dp_replicate left out are 1, and
    dp left out fills the world (with `servers` parameter-server ranks, the world less them: the
    mesh is its first ranks). Degrees that do not fit raise MeshError on every rank.
    """
    import mpi4py
    from mpi4py import MPI

    from hpcpar import backend
    from hpcpar.backend import blas
    from hpcpar.backend.cpu import blocks

    world = MPI.COMM_WORLD
    workers = world.Get_size() - servers
    if not 0 <= servers < world.Get_size():
        raise MeshError(f"--servers {servers} must leave at least one worker among the {world.Get_size()} ranks")
    mesh = _mesh_of(world, dp, tp, pp, cp, dp_replicate, servers)
    lines = [
        f"MPI library: {MPI.Get_library_version().splitlines()[0].strip()} "
        f"(MPI {'.'.join(map(str, MPI.Get_version()))})",
        f"mpi4py: {mpi4py.__version__}",
        f"backend: {backend.name()} {backend.xp.__version__}",
        f"world size: {world.Get_size()}",
        f"threads per rank: {os.environ.get('OMP_NUM_THREADS', 'unset')} (OMP_NUM_THREADS)",
        f"CPU kernels: {blocks.jit_name()} loops, {blas.name()} GEMMs (the `fast` and `mkl` extras: numba, mkl)",
    ]
    if mesh is not None:
        lines += [f"mesh: {mesh.shape_str()}" + (f" on ranks 0..{workers - 1}" if servers else ""), mesh.rank_table(),
                  mesh.placement().report()]
        mesh.free()
    return "\n".join(lines) + "\n" if world.Get_rank() == 0 else ""


def server_ranges(servers: int, overrides: list[str]) -> str:
    """`hpcpar info --servers S`: which range of the model's flat parameters each server owns
    (rank 0 builds the model of `overrides` once, as the servers do; "" elsewhere)."""
    from mpi4py import MPI

    from hpcpar import backend
    from hpcpar.config.load import load_config
    from hpcpar.parallel.pp.stages import build_stages
    from hpcpar.parallel.ps.ownership import ownership_report
    from hpcpar.runtime.mesh import Mesh

    world = MPI.COMM_WORLD
    if world.Get_rank() != 0:
        return ""
    cfg = load_config(None, overrides)
    alone = Mesh(comm=MPI.COMM_SELF)
    shapes = {n: tuple(p.layout.global_shape) for s in build_stages(cfg.model, alone, chunks=1, seed=0)
              for n, p in s.named_parameters() if not p.tied_to}
    alone.free()
    return ownership_report(shapes, servers, world.Get_size() - servers, backend.xp.dtype(cfg.model.dtype).itemsize)
