"""The device mesh: one Cartesian communicator with named axes pp, dp, cp, tp.

Ranks are laid out pp-major, tp innermost, context parallelism (cp) between dp and tp:
with reorder off, world rank r = ((pp_coord * dp + dp_coord) * cp + cp_coord) * tp + tp_coord.
A tp group is therefore tp consecutive ranks, which launchers place on one node, where tensor
parallelism's frequent all-reduces are cheapest; a cp group (the ring of ring attention, the
all-to-all of Ulysses) comes next. With cp = 1 the layout is the (pp, dp, tp) mesh of before.
The mesh is an argument passed to whoever needs it, never a global.

The data-parallel axis is two Cartesian axes, `dp_replicate x dp_shard` (HSDP: shard inside a
node, replicate across nodes), dp_shard inner: the Cartesian order is (pp, dp_replicate,
dp_shard, cp, tp) and dp_coord = replicate_coord * dp_shard + shard_coord, so every rank keeps
its place and its data whatever the split. `Axis.DP` names both together (its size is their
product, its communicator spans both); with dp_replicate = 1 (the default) dp_shard is dp and
every name, message and shape string is the one of the (pp, dp, cp, tp) mesh.

Every sub-communicator is created in the constructor (collectively, on every
rank), so later `mesh.comm(...)` calls are local look-ups that no rank can skip
into a hang.

The axis names, the degree rules (`resolve_degrees`, `validate_degrees`) and `Placement` are
pure and live in `topology`, which loads without MPI.
"""

from __future__ import annotations

import itertools

import numpy as np
from mpi4py import MPI

from hpcpar.runtime.comm import Communicator
from hpcpar.runtime.topology import (
    AXES, CART_AXES, EXPERT_AXES, Axis, Placement, cart_axes_of, check_ep, validate_degrees)


class Mesh:
    """A (pp, dp, cp, tp) Cartesian mesh over `comm` (default MPI.COMM_WORLD), dp split into
    dp_replicate x dp_shard (Cartesian axes pp, dp_replicate, dp_shard, cp, tp).

    `dp * cp * tp * pp` must equal the number of ranks of `comm` and `dp_replicate` divide dp;
    otherwise MeshError is raised on every rank before any collective call. `comm(axes)` serves
    every set of axes (e.g. `(Axis.DP, Axis.CP)`, the group weights replicated over cp are
    reduced on; `(Axis.DP_SHARD, Axis.CP)`, the group ZeRO shards over). `degrees` and `coords`
    hold the four degrees pp, dp, cp, tp (dp's coordinate is replicate * dp_shard + shard);
    `size`/`rank` also answer for `Axis.DP_REPLICATE` and `Axis.DP_SHARD`.

    Expert parallelism (`ep`, dividing dp_shard x cp): of the dp_shard x cp ranks of one (pp,
    dp_replicate, tp) position, numbered i = shard_coord * cp + cp_coord, rank i has ep coordinate
    i % ep (consecutive ranks form an ep group, the closest ones, for the all-to-all) and
    expert-shard coordinate i // ep. `comm(Axis.EP)` is its ep group, `comm(Axis.EDP_SHARD)` the
    ranks of dp_shard x cp with its ep coordinate, `comm(Axis.EDP)` those over all of dp x cp (the
    expert-data-parallel group, where expert gradients are averaged). With ep = 1 these are this
    rank alone, the shard group and the dp x cp group.
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, comm: MPI.Comm | None = None, cp: int = 1,
                 dp_replicate: int = 1, ep: int = 1):
        base = MPI.COMM_WORLD if comm is None else comm
        validate_degrees(dp, tp, pp, base.Get_size(), cp, dp_replicate)
        check_ep(ep, dp // dp_replicate, cp)
        self.degrees = {Axis.PP: int(pp), Axis.DP: int(dp), Axis.CP: int(cp), Axis.TP: int(tp)}
        replicate = int(dp_replicate)
        self._cart_degrees = {Axis.PP: int(pp), Axis.DP_REPLICATE: replicate, Axis.DP_SHARD: int(dp) // replicate,
                              Axis.CP: int(cp), Axis.TP: int(tp)}
        self.cart: MPI.Cartcomm = base.Create_cart([self._cart_degrees[a] for a in CART_AXES],
                                                   periods=[False] * len(CART_AXES), reorder=False)
        self._cart_coords = dict(zip(CART_AXES, self.cart.Get_coords(self.cart.Get_rank())))
        self.coords: dict[str, int] = {
            Axis.PP: self._cart_coords[Axis.PP],
            Axis.DP: self._cart_coords[Axis.DP_REPLICATE] * self._cart_degrees[Axis.DP_SHARD]
            + self._cart_coords[Axis.DP_SHARD],
            Axis.CP: self._cart_coords[Axis.CP], Axis.TP: self._cart_coords[Axis.TP]}
        self.world = Communicator(self.cart, "world")
        # Without HSDP (dp_replicate = 1) the replicate axis has size 1 and is left out of every key:
        # the groups (and their names) are those of the (pp, dp, cp, tp) mesh.
        self._used = tuple(a for a in CART_AXES if a != Axis.DP_REPLICATE or replicate > 1)
        self._comms: dict[tuple[str, ...], Communicator] = {self._used: self.world}
        for r in range(1, len(self._used)):
            for key in itertools.combinations(self._used, r):
                sub = self.cart.Sub([a in key for a in CART_AXES])
                self._comms[key] = Communicator(sub, self._name(key))
        self._comms[()] = Communicator(self._alone(), "dp_replicate")
        self._make_expert_comms(int(ep))
        stage, stages = self.coords[Axis.PP], self.degrees[Axis.PP]
        self.prev_stage: int | None = stage - 1 if stage > 0 else None
        self.next_stage: int | None = stage + 1 if stage < stages - 1 else None
        self.embedding_comm: Communicator | None = self._make_embedding_comm()
        self.node_comm = Communicator(self.cart.Split_type(MPI.COMM_TYPE_SHARED, key=self.cart.Get_rank()),
                                      "node")
        self._placement = self._gather_placement()

    def _alone(self) -> MPI.Comm:
        """A communicator of this rank alone (collective over the mesh). `Cart.Sub` keeping no
        dimension would be the textbook way, but Debian's MPICH 4.0.2 returns MPI_COMM_NULL from
        it on every rank but one, and the one left then hangs: a split by rank is the same group."""
        return self.cart.Split(self.cart.Get_rank(), 0)

    def _name(self, key: tuple[str, ...]) -> str:
        """"dp+cp" for (dp_replicate, dp_shard, cp), or for (dp_shard, cp) when dp_replicate is 1."""
        both = Axis.DP_SHARD in key and (Axis.DP_REPLICATE in key or self._cart_degrees[Axis.DP_REPLICATE] == 1)
        names = []
        for a in key:
            if both and a in (Axis.DP_REPLICATE, Axis.DP_SHARD):
                if Axis.DP not in names:
                    names.append(Axis.DP)
            else:
                names.append(a)
        return "+".join(names)

    def _make_expert_comms(self, ep: int) -> None:
        """The ep, edp_shard and edp groups (see the class doc): `Cart.Split`s, collective."""
        c = self._cart_coords
        if ep == 1:
            self._comms[(Axis.EP,)] = Communicator(self._alone(), "ep")
            self._comms[(Axis.EDP_SHARD,)] = self.comm((Axis.DP_SHARD, Axis.CP))
            self._comms[(Axis.EDP,)] = self.comm((Axis.DP, Axis.CP))
            return
        inner = c[Axis.DP_SHARD] * self._cart_degrees[Axis.CP] + c[Axis.CP]
        position = (c[Axis.PP] * self._cart_degrees[Axis.DP_REPLICATE] + c[Axis.DP_REPLICATE]) \
            * self._cart_degrees[Axis.TP] + c[Axis.TP]
        n_inner = self._cart_degrees[Axis.DP_SHARD] * self._cart_degrees[Axis.CP]
        # (color, key) per group: the ranks sharing the color form it, ordered by the key.
        groups = {(Axis.EP,): (position * (n_inner // ep) + inner // ep, inner % ep),
                  (Axis.EDP_SHARD,): (position * ep + inner % ep, inner // ep),
                  (Axis.EDP,): ((c[Axis.PP] * self._cart_degrees[Axis.TP] + c[Axis.TP]) * ep + inner % ep,
                                c[Axis.DP_REPLICATE] * (n_inner // ep) + inner // ep)}
        for key, (color, order) in groups.items():
            self._comms[key] = Communicator(self.cart.Split(color, key=order), key[0])

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

        def groups_along(axis: int) -> tuple[tuple[int, ...], ...]:
            """Groups of ranks that differ only in Cartesian dim `axis`."""
            found: dict[tuple[int, ...], list[int]] = {}
            for r in range(n):
                coords = self.cart.Get_coords(r)
                found.setdefault(tuple(coords[:axis] + coords[axis + 1:]), []).append(r)
            return tuple(tuple(g) for _, g in sorted(found.items()))

        tp_groups = groups_along(CART_AXES.index(Axis.TP))
        shard_groups = groups_along(CART_AXES.index(Axis.DP_SHARD))

        def inside(groups):
            return tuple(len({nodes[r] for r in g}) == 1 for g in groups)
        return Placement(hostnames, nodes, tp_groups, inside(tp_groups), shard_groups, inside(shard_groups))

    def size(self, axis: str) -> int:
        """Degree of `axis` ("pp", "dp", "cp", "tp", "dp_replicate", "dp_shard", "ep", "edp" or
        "edp_shard"), or of a set of axes."""
        if axis in EXPERT_AXES:
            return self.comm(axis).size
        if not isinstance(axis, str):
            return self.comm(axis).size
        key = cart_axes_of(axis)
        return self.degrees[Axis.DP] if axis == Axis.DP else self._cart_degrees[key[0]]

    def rank(self, axis: str) -> int:
        """This rank's coordinate along `axis` (its rank in that axis's communicator); along "dp"
        it is replicate * dp_shard + shard."""
        if axis in EXPERT_AXES:
            return self.comm(axis).rank
        if not isinstance(axis, str):
            return self.comm(axis).rank
        key = cart_axes_of(axis)
        return self.coords[Axis.DP] if axis == Axis.DP else self._cart_coords[key[0]]

    def comm(self, axes: str | tuple[str, ...]) -> Communicator:
        """The Communicator along one axis ("tp") or several (("dp", "tp") -> named "dp+tp"); the
        expert groups by their own names ("ep", "edp", "edp_shard")."""
        if axes in EXPERT_AXES:
            return self._comms[(Axis(axes),)]
        return self._comms[tuple(a for a in cart_axes_of(axes) if a in self._used)]

    def placement(self) -> Placement:
        """Host names, nodes, and whether each tp (and dp_shard) group lies inside one node
        (gathered at creation)."""
        return self._placement

    def _shown_axes(self) -> tuple[str, ...]:
        """The axes reports show: all but cp when it is 1 (the familiar pp x dp x tp mesh)."""
        return tuple(a for a in AXES if a != Axis.CP or self.degrees[a] > 1)

    def shape_str(self) -> str:
        """"pp=2 x dp=2 x tp=1" ("pp=1 x dp=1 x cp=2 x tp=2" with context parallelism; "dp=4
        (dp_replicate=2 x dp_shard=2)" with HSDP)."""
        def text(a):
            shown = f"{a}={self.degrees[a]}"
            if a == Axis.DP and self._cart_degrees[Axis.DP_REPLICATE] > 1:
                shown += (f" (dp_replicate={self._cart_degrees[Axis.DP_REPLICATE]} x "
                          f"dp_shard={self._cart_degrees[Axis.DP_SHARD]})")
            return shown
        return " x ".join(text(a) for a in self._shown_axes())

    def rank_table(self) -> str:
        """One line per mesh rank: its coordinates and host (with HSDP also dp_replicate, dp_shard)."""
        hosts, shown = self._placement.hostnames, list(self._shown_axes())
        if self._cart_degrees[Axis.DP_REPLICATE] > 1:
            shown[shown.index(Axis.DP) + 1:shown.index(Axis.DP) + 1] = [Axis.DP_REPLICATE, Axis.DP_SHARD]
        widths = {a: max(4, len(a)) for a in shown}
        lines = [f"{'rank':>6} " + " ".join(f"{a:>{widths[a]}}" for a in shown) + "  host"]
        shard = self._cart_degrees[Axis.DP_SHARD]
        for r in range(self.cart.Get_size()):
            coords = dict(zip(CART_AXES, self.cart.Get_coords(r)))
            coords[Axis.DP] = coords[Axis.DP_REPLICATE] * shard + coords[Axis.DP_SHARD]
            lines.append(f"{r:>6} " + " ".join(f"{coords[a]:>{widths[a]}}" for a in shown) + f"  {hosts[r]}")
        return "\n".join(lines)

    def communicators(self) -> list[Communicator]:
        """Every distinct communicator of this mesh (the world first, the embedding group and the
        node group included): for totals of `Communicator.sent`."""
        out: list[Communicator] = []
        for c in [self.world, *self._comms.values(), self.embedding_comm, self.node_comm]:
            if c is not None and all(c is not o for o in out):
                out.append(c)
        return out

    def free(self) -> None:
        """Release every communicator this mesh created (collective)."""
        freed: list = []
        for key, c in self._comms.items():
            if key != self._used and all(c is not o for o in freed):  # ep = 1: expert groups are aliases
                c.free()
                freed.append(c)
        for c in (self.embedding_comm, self.node_comm):
            if c is not None:
                c.free()
        self.cart.Free()

    def __repr__(self) -> str:
        return f"Mesh({self.shape_str()}, coords={self.coords})"
