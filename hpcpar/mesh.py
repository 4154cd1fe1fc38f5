"""The device mesh: one Cartesian communicator with named axes pp, dp, cp, tp.

Ranks are laid out pp-major, tp innermost, context parallelism (cp) between dp and tp:
with reorder off, world rank r = ((pp_coord * dp + dp_coord) * cp + cp_coord) * tp + tp_coord.
A tp group is therefore tp consecutive ranks, which launchers place on one node, where tensor
parallelism's frequent all-reduces are cheapest; a cp group (the ring of ring attention, the
all-to-all of Ulysses) comes next. With cp = 1 the layout is the (pp, dp, tp) mesh of before.
The mesh is an argument passed to whoever needs it, never a global.

Every sub-communicator is created in the constructor (collectively, on every
rank), so later `mesh.comm(...)` calls are local look-ups that no rank can skip
into a hang.

The degrees: `resolve_degrees` is the one rule that turns the `[mesh]` section's
degrees (0 = auto) into (dp, tp, pp, cp) for a world size; it is pure, and config
validation calls it on every rank before any collective. `validate_degrees` is
the guard `Mesh` applies to the degrees it is given.
"""

from __future__ import annotations

import enum
import itertools
import os
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from hpcpar.comm import Communicator
from hpcpar.errors import ConfigError, MeshError
from hpcpar.schema import divisors


class Axis(str, enum.Enum):
    """A mesh axis. A str too, so `Axis.DP` and "dp" name the same axis everywhere (keys, arguments,
    config values); code says `Axis.DP`, users and files say "dp"."""

    PP = "pp"
    DP = "dp"
    CP = "cp"
    TP = "tp"

    __str__ = str.__str__
    __format__ = str.__format__


AXES = (Axis.PP, Axis.DP, Axis.CP, Axis.TP)  # Cartesian order: pp outermost, tp innermost


def _positive_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def _shape(degrees: dict) -> str:
    """"dp=2 x tp=1 x pp=2", with "cp=.." after dp only when context parallelism is used (cp != 1)."""
    return " x ".join(f"{k}={v}" for k, v in degrees.items() if k != "cp" or v != 1)


def _axes_named(degrees: dict) -> str:
    """"dp, tp and pp" (or "dp, cp, tp and pp" when cp is shown): the degrees whose product counts."""
    names = [k for k in degrees if k != "cp" or degrees[k] != 1]
    return ", ".join(names[:-1]) + " and " + names[-1]


def _fits_message(degrees: dict, world: int) -> str:
    """A suggestion that fits `world`: keep tp, pp (and cp) when they divide it, fill dp."""
    tp, pp, cp = degrees["tp"], degrees["pp"], degrees.get("cp", 1)
    if _positive_int(tp) and _positive_int(pp) and _positive_int(cp) and world % (tp * pp * cp) == 0:
        return "e.g. " + _shape({"dp": world // (tp * pp * cp), "cp": cp, "tp": tp, "pp": pp})
    return f"e.g. dp={world} x tp=1 x pp=1"


def validate_degrees(dp: int, tp: int, pp: int, world: int, cp: int = 1) -> None:
    """Raise MeshError unless dp, tp, pp, cp are positive integers whose product is `world`.

    The guard of explicitly given degrees (`Mesh`); degrees a user may leave to "auto" go
    through `resolve_degrees` first, which reports in the config's terms.
    """
    degrees = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
    shape, axes = _shape(degrees), _axes_named(degrees)
    bad = [k for k, v in degrees.items() if not _positive_int(v)]
    if bad:
        raise MeshError(f"mesh {shape}: {', '.join(bad)} must be a positive integer; the product of {axes} "
                        f"must equal the number of ranks ({world}), {_fits_message(degrees, world)}")
    product = dp * tp * pp * cp
    if product != world:
        raise MeshError(f"mesh {shape} = {product} ranks, but the world has {world} ranks; the product of "
                        f"{axes} must equal the number of ranks ({_fits_message(degrees, world)})")


def resolve_degrees(world: int, dp: int = 0, tp: int = 0, pp: int = 0, cp: int = 0) -> tuple[int, int, int, int]:
    """(dp, tp, pp, cp) for `world` ranks, filling in the degrees given as 0 (auto): the `[mesh]` rule.

    Rule: tp = 1 and cp = 1 when auto; pp = 2 when auto, the world is even and >= 4, and dp, tp and
    cp are all auto, else 1; dp = world // (tp * pp * cp) when auto. So 4 ranks give dp=2 x pp=2
    and one rank 1x1x1. Pure (no MPI), so config validation calls it on every rank before any
    collective. Raises ConfigError for a negative degree, MeshError when tp * pp * cp does not
    divide the world (dp auto) or when the degrees do not multiply to `world`.
    """
    if world < 1:
        raise MeshError(f"world size must be >= 1, got {world}")
    given = {Axis.DP: dp, Axis.TP: tp, Axis.PP: pp, Axis.CP: cp}
    for axis, value in given.items():
        if value < 0:
            raise ConfigError(f"mesh.{axis}={value} is invalid: use a positive degree or 0 (auto)")
    tp, cp = tp or 1, cp or 1
    if not pp:
        everything_auto = dp == 0 and given[Axis.TP] == 0 and given[Axis.CP] == 0
        pp = 2 if world >= 4 and world % 2 == 0 and everything_auto else 1
    if not dp:
        if world % (tp * pp * cp):
            what = _shape({"cp": cp, "tp": tp, "pp": pp})
            size = f"{'cp * ' if cp != 1 else ''}tp * pp"
            raise MeshError(f"mesh {what} = {tp * pp * cp} does not divide the world size {world}; "
                            f"choose {size} in {{{', '.join(map(str, divisors(world)))}}} or launch a multiple "
                            f"of {tp * pp * cp} ranks")
        dp = world // (tp * pp * cp)
    if dp * tp * pp * cp != world:
        resolved = {Axis.DP: dp, Axis.CP: cp, Axis.TP: tp, Axis.PP: pp}
        shown = ", ".join(f"{axis}={resolved[axis]}{'' if given[axis] else ' (auto)'}" for axis in resolved
                          if axis != Axis.CP or cp != 1)
        raise MeshError(f"mesh {shown}: product {dp * tp * pp * cp} != world size {world}; choose degrees "
                        f"whose product is {world}, or set some to 0 (auto)")
    return dp, tp, pp, cp


def _axes_key(axes: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Axis names in Cartesian order, checked: "tp" -> ("tp",); ("tp", "dp") -> ("dp", "tp")."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    unknown = [a for a in names if a not in AXES]
    if unknown or not names or len(set(names)) != len(names):
        raise MeshError(f"unknown or repeated mesh axes {list(names)}; the axes are pp, dp, cp and tp")
    return tuple(a for a in AXES if a in names)


@dataclass(frozen=True)
class Placement:
    """Where the ranks run and whether every tp group lies inside one node.

    Attributes:
        hostnames: processor name of each mesh rank (index = rank in the mesh's world).
        nodes: node index of each mesh rank (ranks that share memory share a node).
        tp_groups: the mesh ranks of each tp group.
        tp_in_one_node: per tp group, whether all its ranks are on one node.
    """

    hostnames: tuple[str, ...]
    nodes: tuple[int, ...]
    tp_groups: tuple[tuple[int, ...], ...]
    tp_in_one_node: tuple[bool, ...]

    @property
    def ok(self) -> bool:
        """True when every tp group is inside one node."""
        return all(self.tp_in_one_node)

    def report(self) -> str:
        lines = [f"placement: {len(set(self.nodes))} node(s); every tp group inside one node: "
                 f"{'yes' if self.ok else 'NO'}"]
        for group, inside in zip(self.tp_groups, self.tp_in_one_node):
            hosts = sorted({self.hostnames[r] for r in group})
            lines.append(f"  tp group ranks {list(group)}: {'one node' if inside else 'SPANS NODES'} "
                         f"({', '.join(hosts)})")
        return "\n".join(lines)


class Mesh:
    """A (pp, dp, cp, tp) Cartesian mesh over `comm` (default MPI.COMM_WORLD).

    `dp * cp * tp * pp` must equal the number of ranks of `comm`; otherwise MeshError
    is raised on every rank before any collective call. `comm(axes)` serves every set of
    axes (e.g. `(Axis.DP, Axis.CP)`, the group weights replicated over cp are reduced on).
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, comm: MPI.Comm | None = None, cp: int = 1):
        base = MPI.COMM_WORLD if comm is None else comm
        validate_degrees(dp, tp, pp, base.Get_size(), cp)
        self.degrees = {Axis.PP: int(pp), Axis.DP: int(dp), Axis.CP: int(cp), Axis.TP: int(tp)}
        self.cart: MPI.Cartcomm = base.Create_cart([self.degrees[a] for a in AXES],
                                                   periods=[False] * len(AXES), reorder=False)
        self.coords: dict[str, int] = dict(zip(AXES, self.cart.Get_coords(self.cart.Get_rank())))
        self.world = Communicator(self.cart, "world")
        self._comms: dict[tuple[str, ...], Communicator] = {AXES: self.world}
        for r in range(1, len(AXES)):
            for key in itertools.combinations(AXES, r):
                sub = self.cart.Sub([a in key for a in AXES])
                self._comms[key] = Communicator(sub, "+".join(key))
        stage, stages = self.coords[Axis.PP], self.degrees[Axis.PP]
        self.prev_stage: int | None = stage - 1 if stage > 0 else None
        self.next_stage: int | None = stage + 1 if stage < stages - 1 else None
        self.embedding_comm: Communicator | None = self._make_embedding_comm()
        self.node_comm = Communicator(self.cart.Split_type(MPI.COMM_TYPE_SHARED, key=self.cart.Get_rank()),
                                      "node")
        self._placement = self._gather_placement()

    def _make_embedding_comm(self) -> Communicator | None:
        """The first and last stage of this rank's (dp, cp, tp) position (tied embedding gradients)."""
        stages = self.degrees[Axis.PP]
        if stages == 1:
            return None
        ends = self.coords[Axis.PP] in (0, stages - 1)
        position = ((self.coords[Axis.DP] * self.degrees[Axis.CP] + self.coords[Axis.CP]) * self.degrees[Axis.TP]
                    + self.coords[Axis.TP])
        color = position if ends else MPI.UNDEFINED
        split = self.cart.Split(color, key=self.coords[Axis.PP])  # collective: middle stages get COMM_NULL
        return Communicator(split, "embedding") if ends else None

    def _gather_placement(self) -> Placement:
        # Node index = world rank of the node's first rank; host names as fixed-width bytes
        # (buffer collectives only: nothing here is pickled).
        n = self.cart.Get_size()
        leader = np.array([self.cart.Get_rank() if self.node_comm.rank == 0 else 0], dtype=np.int64)
        self.node_comm.mpi.Bcast([leader, MPI.INT64_T], root=0)
        leaders = np.empty(n, dtype=np.int64)
        self.cart.Allgather([leader, MPI.INT64_T], [leaders, MPI.INT64_T])
        width = MPI.MAX_PROCESSOR_NAME
        name = np.zeros(width, dtype=np.uint8)
        encoded = MPI.Get_processor_name().encode()[:width]
        name[:len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
        names = np.empty((n, width), dtype=np.uint8)
        self.cart.Allgather([name, MPI.BYTE], [names, MPI.BYTE])
        hostnames = tuple(bytes(row).rstrip(b"\0").decode(errors="replace") for row in names)
        node_ids = {leader_rank: i for i, leader_rank in enumerate(sorted(set(leaders.tolist())))}
        nodes = tuple(node_ids[int(x)] for x in leaders)
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(n):
            groups.setdefault(tuple(self.cart.Get_coords(r)[:-1]), []).append(r)  # all but tp
        tp_groups = tuple(tuple(g) for _, g in sorted(groups.items()))
        inside = tuple(len({nodes[r] for r in g}) == 1 for g in tp_groups)
        return Placement(hostnames, nodes, tp_groups, inside)

    def size(self, axis: str) -> int:
        """Degree of `axis` ("pp", "dp", "cp" or "tp")."""
        return self.degrees[_axes_key(axis)[0]] if isinstance(axis, str) else self.comm(axis).size

    def rank(self, axis: str) -> int:
        """This rank's coordinate along `axis` (its rank in that axis's communicator)."""
        return self.coords[_axes_key(axis)[0]] if isinstance(axis, str) else self.comm(axis).rank

    def comm(self, axes: str | tuple[str, ...]) -> Communicator:
        """The Communicator along one axis ("tp") or several (("dp", "tp") -> named "dp+tp")."""
        return self._comms[_axes_key(axes)]

    def placement(self) -> Placement:
        """Host names, nodes, and whether each tp group lies inside one node (gathered at creation)."""
        return self._placement

    def _shown_axes(self) -> tuple[str, ...]:
        """The axes reports show: all but cp when it is 1 (the familiar pp x dp x tp mesh)."""
        return tuple(a for a in AXES if a != Axis.CP or self.degrees[a] > 1)

    def shape_str(self) -> str:
        """"pp=2 x dp=2 x tp=1" ("pp=1 x dp=1 x cp=2 x tp=2" with context parallelism)."""
        return " x ".join(f"{a}={self.degrees[a]}" for a in self._shown_axes())

    def rank_table(self) -> str:
        """One line per mesh rank: its coordinates and host."""
        hosts, shown = self._placement.hostnames, self._shown_axes()
        lines = [f"{'rank':>6} " + " ".join(f"{a:>4}" for a in shown) + "  host"]
        for r in range(self.cart.Get_size()):
            coords = dict(zip(AXES, self.cart.Get_coords(r)))
            lines.append(f"{r:>6} " + " ".join(f"{coords[a]:>4}" for a in shown) + f"  {hosts[r]}")
        return "\n".join(lines)

    def free(self) -> None:
        """Release every communicator this mesh created (collective)."""
        for key, c in self._comms.items():
            if key != AXES:
                c.free()
        for c in (self.embedding_comm, self.node_comm):
            if c is not None:
                c.free()
        self.cart.Free()

    def __repr__(self) -> str:
        return f"Mesh({self.shape_str()}, coords={self.coords})"


def info_report(dp: int | None = None, tp: int | None = None, pp: int | None = None,
                cp: int | None = None) -> str:
    """The text of `hpcpar info` (collective). Rank 0 gets it; other ranks get "".

    Always: MPI library, mpi4py, backend, world size, threads per rank. With any
    degree given: the mesh shape, each rank's coordinates and the placement report; tp, pp and
    cp left out are 1, and dp left out fills the world. Degrees that do not fit raise MeshError
    on every rank.
    """
    import mpi4py

    from hpcpar import backend

    world = MPI.COMM_WORLD
    mesh = None
    if (dp, tp, pp, cp) != (None, None, None, None):
        tp, pp, cp = (1 if tp is None else tp), (1 if pp is None else pp), (1 if cp is None else cp)
        if dp is None:  # dp fills the world, by the [mesh] rule for dp = 0 (auto)
            for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
                if not _positive_int(value):
                    raise MeshError(f"mesh {name}={value}: {name} must be a positive integer (dp fills the "
                                    f"rest of the {world.Get_size()} ranks)")
            dp = resolve_degrees(world.Get_size(), 0, tp, pp, cp)[0]
        mesh = Mesh(dp, tp, pp, comm=world, cp=cp)
    lines = [
        f"MPI library: {MPI.Get_library_version().splitlines()[0].strip()} "
        f"(MPI {'.'.join(map(str, MPI.Get_version()))})",
        f"mpi4py: {mpi4py.__version__}",
        f"backend: {backend.name()} {backend.xp.__version__}",
        f"world size: {world.Get_size()}",
        f"threads per rank: {os.environ.get('OMP_NUM_THREADS', 'unset')} (OMP_NUM_THREADS)",
    ]
    if mesh is not None:
        lines += [f"mesh: {mesh.shape_str()}", mesh.rank_table(), mesh.placement().report()]
        mesh.free()
    return "\n".join(lines) + "\n" if world.Get_rank() == 0 else ""
