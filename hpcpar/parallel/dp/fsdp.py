"""ZeRO-3 / FSDP: parameters sharded too, gathered unit by unit around forward and backward.

ZeRO-3 (arXiv 1910.02054, stage 3; PyTorch FSDP) keeps on each of the n ranks of the shard
group (dp x cp, or with HSDP dp_shard x cp) only 1/n of the parameters, their gradients and
their optimizer state. The model is cut into *units* (the embedding, each transformer block, the
head: `GPT.fsdp_units()`); a unit's parameters live as one flat buffer, padded to a multiple of
n, of which a rank keeps only its shard (`FlatParameter.shard`, the master copy the optimizer
updates). Tensor parallelism is untouched: a tp rank's parameters are its tp shards, and ZeRO-3
shards those flat over the shard group.

    pre-forward (unit u)    issue the non-blocking all-gathers of u (unless prefetched) and of
                            the next `prefetch` units (prefetch; those not yet in flight),
                            then wait for u's, gathered into a fresh buffer: every `p.data` a
                            view of it
    post-forward            free the gathered buffer (`reshard_after_forward`; otherwise keep it
                            until u's backward: ZeRO-2's parameter memory, one gather fewer);
                            after the last unit, when the backward follows at once (no
                            pipeline), issue the gathers of the backward's first units
    pre-backward            (an identity op on u's output calls it when u's output gradient
                            arrives) gather u again, prefetch the `prefetch` units before it,
                            give u's flat parameters a zeroed full gradient buffer (every
                            `p.grad` a view)
    u's backward done       (every parameter of u has had its grad hook in this pass) free the
                            gathered buffer; on the last micro-batch the flat gradient is
                            reduce-scattered (average) into this rank's gradient shard as soon as
                            the reductions before it have been launched (in a fixed order, so all
                            ranks issue identical collectives), and the full buffer is freed once
                            that completes; HSDP then averages the shard over the replicas

A unit may use a flat parameter of another unit: without pipeline stages the LM head is the
embedding's `wte`, so the head gathers the embedding's flat too. Gathers are reference counted
per flat parameter. Tied copies across pipeline stages (`wte` on the first stage, the head's
`lm_head.weight` on the last) are flat parameters of their own, of equal size on both stages, so
their shards line up: their gradient shards are summed over `tied_comm` after the reductions.

Nothing here references a gathered buffer once it is freed; the ops that consume parameters read
`p.data` when their backward runs (`linear`, `embedding`, `Tensor.view_of_leaf`), so the
memory really goes. A freed parameter's `.data` is a read-only NaN of its shape (one element of
memory): a use outside its unit shows up as NaN, not as stale values. A block under full
activation recomputation (`recompute`) runs inside its unit: its no-graph forward between
pre- and post-forward, its re-run inside the recompute op's backward, after pre-backward has
gathered the unit again, so recomputation costs no extra gather.

An untied embedding (`Parameter.sparse_grad`, `sparse_embedding = "auto"`, a shard group of more
than one rank) is a flat parameter of its own, padded to n R rows (R = ceil(V/n)) so that rank r's
shard is rows [r R, (r + 1) R): its gradient goes to the owners of its rows as (row id, row) pairs
when fewer bytes than the reduce-scatter, else by the reduce-scatter (`sparse.reduce_to_owners`,
blocking, in the flats' fixed launch order); the gathers stay dense.

A padded vocabulary (wte's rows past V under tp, `Layout.split_padded`) is part of the flat
buffer like any element: zero from the start, it gets zero gradient and so stays zero; the
segments' layouts do not cover it, so checkpoints never store it and loads zero-fill it.

The optimizer sees segments (`segments.Segment`): the piece of each parameter inside this rank's
shard, views of the shard and of the gradient shard; checkpoints save them with the layout
`param.layout.flat_range(lo, hi)`. `events` logs (kind, unit, time) for the overlap test.

`FSDP` is the gradient sync strategy (`sync.GradientSync`) of ZeRO stage 3: `ShardedUnits` for
the parameters and gradients, an optimizer over the segments. The model's chunks call its
`unit_hooks` (the `ShardedUnits`) around each unit.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from hpcpar import backend
from hpcpar.runtime.comm import Communicator
from hpcpar.runtime.topology import Axis
from hpcpar.errors import ConfigError
from hpcpar.optim.optimizers import AdamW
from hpcpar.parallel.dp.buckets import Slot
from hpcpar.parallel.dp.data_parallel import DataParallel, distinct_nbytes
from hpcpar.parallel.dp.segments import ShardedState, segments_of
from hpcpar.parallel.dp.sparse import reduce_to_owners


class FlatParameter:
    """Parameters of one unit (or one tied weight) as one flat buffer sharded over `comm`.

    Attributes:
        index: position in the runtime's list (creation = forward order).
        names, params, slots: the parameters (`Slot(name, index, offset, numel)` in the flat).
        size: elements, padded to a multiple of `comm.size`; `shard_size = size / comm.size`.
        shard: `[shard_size]`, this rank's elements [lo, hi) of the flat parameters (master data).
        grad_shard: `[shard_size]`, the averaged gradient of the shard after the step's reduction.
        gathered: the whole flat `[size]` while gathered, else None (with n = 1 always the shard).
        grad: the whole flat gradient `[size]` during backward, else None.
        segments: the parameters' pieces inside the shard (the optimizer's "parameters").
        tied: a tied copy's flat (summed over the embedding group after the reduction).
        rows: a row-sparse parameter's flat (`sparse_grad`, alone in it): the mode ("auto") its
            gradient goes to the owners of its rows in, padded to n ceil(V/n) rows; None otherwise.
        steps, last: with `rows`, the steps sent as pairs or dense and the last one's figures.
    """

    def __init__(self, index: int, named: list[tuple[str, Any]], comm: Communicator,
                 replicate: Communicator | None, tied: bool = False, rows: str | None = None):
        self.index, self.comm, self.tied, self.rows = index, comm, tied, rows
        self.steps, self.last = {"sparse": 0, "dense": 0}, {}
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        dtypes = {str(p.data.dtype) for p in self.params}
        if len(dtypes) != 1:
            raise ConfigError(f"ZeRO-3 unit {self.names} mixes dtypes {sorted(dtypes)}; a unit is one flat buffer")
        self.dtype = dtypes.pop()
        self.xp = xp = backend.array_module(*(p.data for p in self.params))
        self.slots, offset = [], 0
        for i, (n, p) in enumerate(named):
            self.slots.append(Slot(n, i, offset, int(p.data.size)))
            offset += int(p.data.size)
        self.numel = offset
        # A row-sparse flat pads whole rows, so that the shards are the owners' rows.
        width = offset // max(1, self.params[0].shape[0]) if rows else 1
        self.size = -(-offset // (comm.size * width)) * comm.size * width
        self.shard_size = self.size // comm.size
        self.lo, self.hi = comm.rank * self.shard_size, (comm.rank + 1) * self.shard_size
        full = xp.zeros(self.size, dtype=self.dtype)
        for s, p in zip(self.slots, self.params):
            full[s.offset:s.offset + s.numel] = p.data.reshape(-1)
        self.shard = full[self.lo:self.hi].copy() if comm.size > 1 else full
        self.grad_shard = xp.zeros(self.shard_size, dtype=self.dtype)
        self.segments = segments_of(self.slots, self.params, self.lo, self.hi, self.shard)
        for seg in self.segments:
            seg.grad = self.grad_shard[seg.part_lo:seg.part_lo + (seg.hi - seg.lo)]
        self._placeholders = [xp.broadcast_to(xp.asarray(float("nan"), dtype=self.dtype), p.shape)
                              for p in self.params]
        self.gathered = None
        self.grad = None
        self.users = 0          # units holding it gathered
        self._gathering = None  # all-gather in flight
        self._reducing = None   # reduce-scatter in flight
        self.counts = [0] * len(self.params)  # gradient contributions this step, per parameter
        self.launched = False
        if comm.size == 1:
            self._point_at(self.shard)  # one rank: the parameters are views of the shard for good
        else:
            self._release()
            del full

    # -- parameters ---------------------------------------------------------------------------
    def _point_at(self, flat) -> None:
        for s, p in zip(self.slots, self.params):
            p.data = flat[s.offset:s.offset + s.numel].reshape(p.shape)
        self.gathered = flat

    def _release(self) -> None:
        for p, placeholder in zip(self.params, self._placeholders):
            p.data = placeholder
        self.gathered = None

    def start_gather(self) -> bool:
        """Issue the non-blocking all-gather into a fresh buffer (no-op when gathered or in
        flight). True when a gather was issued."""
        if self.gathered is not None or self._gathering is not None:
            return False
        out = self.xp.empty(self.size, dtype=self.dtype)
        self._gathering = self.comm.iall_gather(self.shard, dim=0, out=out)
        return True

    def finish_gather(self) -> None:
        """Wait for the gather (issuing it first if needed); the parameters become views of it."""
        if self.gathered is None:
            self.start_gather()
            handle, self._gathering = self._gathering, None
            self._point_at(handle.wait())

    def acquire(self) -> None:
        self.finish_gather()
        self.users += 1

    def release(self) -> None:
        """One user fewer; the last one frees the gathered buffer (one rank: nothing to free)."""
        self.users -= 1
        if self.users == 0 and self.comm.size > 1:
            self._release()

    def drop_prefetch(self) -> None:
        """Complete and free a prefetched gather nobody used (end of a pass)."""
        if self._gathering is not None:
            handle, self._gathering = self._gathering, None
            handle.wait()
        if self.users == 0 and self.gathered is not None and self.comm.size > 1:
            self._release()

    # -- gradients ----------------------------------------------------------------------------
    def ensure_grad(self) -> None:
        """A zeroed full gradient buffer, every `p.grad` its view (once per step)."""
        if self.grad is None:
            self.grad = self.xp.zeros(self.size, dtype=self.dtype)
            for s, p in zip(self.slots, self.params):
                p.grad = self.grad[s.offset:s.offset + s.numel].reshape(p.shape)

    def start_reduce(self) -> None:
        """Reduce-scatter (average) the full gradient into `grad_shard`, non-blocking; a row-sparse
        flat's rows to their owners (blocking: `reduce_to_owners`)."""
        self.ensure_grad()  # zeros for a flat no gradient reached
        self.launched = True
        if self.rows is None:
            self._reducing = self.comm.ireduce_scatter(self.grad, dim=0, op="avg", out=self.grad_shard)
            return
        p = self.params[0]
        self.last = reduce_to_owners(self.grad, p.shape[0], self.numel // max(1, p.shape[0]), self.comm, self.rows,
                                     self.grad_shard)
        self.steps["sparse" if self.last["sparse"] else "dense"] += 1
        self._reducing = _DONE

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter, average over the replicas (HSDP), free the full buffer."""
        if self._reducing is None:
            return
        handle, self._reducing = self._reducing, None
        handle.wait()
        if self.replicate is not None:
            self.replicate.iall_reduce(self.grad_shard, op="avg").wait()  # in place
        for p in self.params:
            p.grad = None
        self.grad = None


class _Done:
    """A reduction already complete (a row-sparse flat's, `start_reduce`)."""

    @staticmethod
    def wait() -> None:
        return None


_DONE = _Done()


class Unit:
    """A piece of the model gathered as one: `flats` it needs gathered (its own and borrowed),
    `own` the parameters whose grad hooks end its backward."""

    def __init__(self, name: str, chunk: int, flats: list[FlatParameter], own: list):
        self.name, self.chunk, self.flats, self.own = name, chunk, flats, own
        self.next: Unit | None = None   # in forward order, same chunk
        self.prev: Unit | None = None
        self.held = 0     # forwards whose gathered parameters are kept for their backward
        self.hooked = 0   # own parameters whose grad hook fired in the current backward pass


class ShardedUnits:
    """ZeRO-3 for one rank's model chunks: the flat parameters, the unit hooks, the reductions.

    Args:
        units: (chunk index, unit name, [(global name, Parameter)]) in forward order, chunk by
            chunk (`GPT.fsdp_units()` of each chunk). A parameter belongs to the first unit that
            lists it; later units listing it borrow its flat parameter.
        comm: the shard group (dp x cp, or dp_shard x cp).
        replicate: HSDP's replica group (dp_replicate), or None.
        tied: names of tied weights (`wte` and its copies): each becomes a flat of its own.
        tied_comm: the embedding group the tied flats' gradient shards are summed over, or None.
        reshard_after_forward: free a unit's parameters after its forward (gather again for
            backward); False keeps them from forward to backward.
        prefetch: how many units' gathers are issued ahead of the one computing (forward and
            backward; 0: none, each unit gathered when it is needed; `train.prefetch_units`).
        backward_follows: a chunk's backward starts right after its forward (no pipeline): the
            end of the forward issues the gathers of the backward's first units.
        sparse: "auto": a row-sparse parameter (`sparse_grad`) is a flat of its own whose rows go
            to their owners (`FlatParameter.rows`; with n > 1); "never": it is not.

    The model calls `pre_forward(name)`, `post_forward(name, backward)` and (from an identity op
    on the unit's output) `pre_backward(name)`; every parameter's grad hook calls `on_grad`.
    Per step: `begin_step(microbatches)`, the passes, `finish_backward()`.

    Attributes:
        flats: the FlatParameters, creation (forward) order.
        segments: every flat's segments, for the optimizer.
        events: (kind, unit or flat, time.perf_counter()): "gather" (a gather issued for a unit:
            its prefetch or its own), "forward_begin"/"forward_end", "backward_begin" (parameters
            ready), "backward_end", "reduce_start" (flat index). Cleared by `begin_step`.
        gather_wait_s: seconds spent waiting for gathers since `begin_step`.
    """

    MAX_IN_FLIGHT = 2  # reduce-scatters launched from hooks and not yet waited, at most
    # `prefetch`, the units whose gathers are issued ahead of the one computing: a non-blocking
    # all-gather ends only once every rank of the group has issued it, so the depth is how far (in
    # units) one rank may run ahead of the slowest before it waits. With ranks sharing cores (4 on
    # 2, bench/zero.py) they drift by more than one unit: prefetching one unit ahead hid 10-15 % of
    # the all-gather wait, two about 50 %, three about 60 %, four no more than three (hence the
    # default 3). Driving MPI's progress between a unit's ops (a probe every few autograd ops) hid
    # nothing more: the gathers were waiting for late ranks, not for progress. Memory: up to
    # 1 + prefetch units gathered (config/memory.py).

    def __init__(self, units: Iterable[tuple[int, str, list]], comm: Communicator,
                 replicate: Communicator | None = None, tied: Iterable[str] = (),
                 tied_comm: Communicator | None = None, reshard_after_forward: bool = True,
                 prefetch: int = 3, backward_follows: bool = False, sparse: str = "never"):
        self.comm, self.replicate, self.tied_comm = comm, replicate, tied_comm
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.backward_follows = backward_follows
        tied = set(tied)
        self.flats: list[FlatParameter] = []
        self.units: dict[str, Unit] = {}
        flat_of: dict[int, FlatParameter] = {}
        self._name_of: dict[int, str] = {}
        previous: Unit | None = None
        for chunk, name, named in units:
            if name in self.units:
                raise ConfigError(f"ZeRO-3 unit {name!r} appears twice on this rank")
            new = [(n, p) for n, p in named if id(p) not in flat_of]
            rowed = {id(p) for n, p in new if sparse == "auto" and comm.size > 1 and getattr(p, "sparse_grad", False)
                     and n not in tied}
            alone = [[(n, p)] for n, p in new if n in tied or getattr(p, "tied_to", None) or id(p) in rowed]
            rest = [(n, p) for n, p in new if not (n in tied or getattr(p, "tied_to", None) or id(p) in rowed)]
            for group in ([rest] if rest else []) + alone:
                flat = FlatParameter(len(self.flats), group, comm, replicate,
                                     tied=bool(tied_comm is not None and group is not rest and id(group[0][1]) not in
                                               rowed), rows=sparse if id(group[0][1]) in rowed else None)
                self.flats.append(flat)
                for n, p in group:
                    flat_of[id(p)] = flat
                    self._name_of[id(p)] = n
            used: list[FlatParameter] = []
            for _, p in named:
                if flat_of[id(p)] not in used:
                    used.append(flat_of[id(p)])
            unit = Unit(name, chunk, used, [p for _, p in new])
            if previous is not None and previous.chunk == chunk:
                previous.next, unit.prev = unit, previous
            self.units[name] = unit
            previous = unit
        self._unit_of = {id(p): u for u in self.units.values() for p in u.own}
        self._flat_of = flat_of
        self._slot_of = {id(p): i for f in self.flats for i, p in enumerate(f.params)}
        # Reductions launch in reverse creation order (about the order backward completes them).
        self.order = list(reversed(self.flats))
        self.segments = [s for f in self.flats for s in f.segments]
        self.events: list[tuple[str, Any, float]] = []
        self.gather_wait_s = 0.0
        self._microbatches = 0
        self._next_launch = 0
        self._in_flight: list[FlatParameter] = []
        self._armed = False
        for f in self.flats:
            for p in f.params:
                p.register_grad_hook(self.on_grad)

    # -- gathers --------------------------------------------------------------------------------
    def _acquire(self, unit: Unit, ahead: Unit | None, forward: bool) -> None:
        """Gather `unit` (issuing its gathers unless prefetched), first issuing the prefetches from
        `ahead` on, so that they are under way while this rank waits. `gather_wait_s` counts the
        issue of the unit's own gathers and the wait for them, not the prefetches' issue."""
        t0 = time.perf_counter()
        if any([f.start_gather() for f in unit.flats]):
            self.events.append(("gather", unit.name, t0))
        t1 = time.perf_counter()
        self._prefetch(ahead, forward)
        t2 = time.perf_counter()
        for f in unit.flats:
            f.acquire()
        self.gather_wait_s += (t1 - t0) + (time.perf_counter() - t2)

    def _release(self, unit: Unit) -> None:
        for f in unit.flats:
            f.release()

    def _prefetch(self, unit: Unit | None, forward: bool) -> None:
        """Issue the gathers of `unit` and the `prefetch - 1` units after it (before it in
        backward), nearest first: every rank issues the same gathers in the same order."""
        for _ in range(self.prefetch):
            if unit is None:
                return
            t = time.perf_counter()
            if any([f.start_gather() for f in unit.flats]):
                self.events.append(("gather", unit.name, t))
            unit = unit.next if forward else unit.prev

    # -- the model's hooks -------------------------------------------------------------------------
    def pre_forward(self, name: str) -> None:
        """Before unit `name`'s forward: the gathers of the next `prefetch` units issued, its own
        parameters gathered."""
        unit = self.units[name]
        self._acquire(unit, unit.next, True)
        self.events.append(("forward_begin", name, time.perf_counter()))

    def post_forward(self, name: str, backward: bool) -> None:
        """After unit `name`'s forward; `backward`: a backward of this output will follow (False
        in evaluation). Frees the gathered parameters unless they are kept for the backward."""
        unit = self.units[name]
        self.events.append(("forward_end", name, time.perf_counter()))
        if backward and not self.reshard_after_forward:
            unit.held += 1
        else:
            self._release(unit)
        if unit.next is None:  # end of the chunk's forward: nothing will use a stray prefetch
            for f in self.flats:
                if f.users == 0:
                    f.drop_prefetch()
            if backward and self.backward_follows:  # its backward starts with this unit: gather ahead
                self._prefetch(unit, False)

    def pre_backward(self, name: str) -> None:
        """When unit `name`'s output gradient arrives: its parameters gathered again (unless kept
        from forward), the gathers of the `prefetch` units before it issued, zeroed gradient
        buffers attached."""
        unit = self.units[name]
        if unit.held:
            unit.held -= 1  # the forward's gathered parameters, kept for this backward
            self._prefetch(unit.prev, False)
        else:
            self._acquire(unit, unit.prev, False)
        for f in unit.flats:
            f.ensure_grad()
        unit.hooked = 0
        self.events.append(("backward_begin", name, time.perf_counter()))
        if not unit.own:
            self._backward_done(unit)

    def _backward_done(self, unit: Unit) -> None:
        self.events.append(("backward_end", unit.name, time.perf_counter()))
        self._release(unit)

    def on_grad(self, p) -> None:
        """Grad hook: a parameter's gradient for this pass is complete."""
        unit = self._unit_of[id(p)]
        unit.hooked += 1
        if unit.hooked == len(unit.own):
            unit.hooked = 0
            self._backward_done(unit)
        if not self._armed:
            return
        flat = self._flat_of[id(p)]
        i = self._slot_of[id(p)]
        flat.counts[i] += 1
        if flat.counts[i] > self._microbatches:
            raise RuntimeError(f"parameter {self._name_of[id(p)]} received {flat.counts[i]} gradients in a "
                               f"step of {self._microbatches} micro-batch(es); call begin_step(microbatches=...) "
                               "with the number of backward passes")
        # In a fixed order, every flat whose parameters all have every micro-batch's gradient.
        while self._next_launch < len(self.order) and self._complete_grads(self.order[self._next_launch]):
            self._launch(self.order[self._next_launch])
        self.comm.progress()  # moves the reductions and the prefetched gather on during backward
        while len(self._in_flight) > self.MAX_IN_FLIGHT:
            self._in_flight.pop(0).finish_reduce()

    def _complete_grads(self, flat: FlatParameter) -> bool:
        return all(c == self._microbatches for c in flat.counts)

    def _launch(self, flat: FlatParameter) -> None:
        self.events.append(("reduce_start", flat.index, time.perf_counter()))
        flat.start_reduce()
        self._next_launch += 1
        self._in_flight.append(flat)

    # -- the step -----------------------------------------------------------------------------
    def begin_step(self, microbatches: int) -> None:
        if microbatches < 1:
            raise ConfigError(f"microbatches must be >= 1, got {microbatches}")
        self._microbatches = microbatches
        self._next_launch = 0
        self._in_flight = []
        self._armed = True
        self.events = []
        self.gather_wait_s = 0.0
        for f in self.flats:
            f.counts = [0] * len(f.params)
            f.launched = False
        for u in self.units.values():
            u.held = u.hooked = 0

    def finish_backward(self) -> None:
        """Launch the reductions not yet started (a flat without gradients is reduced as zeros),
        wait for all, average over the replicas (HSDP), sum the tied flats over the embedding
        group. Afterwards every flat's `grad_shard` holds its averaged gradient shard."""
        if not self._armed:
            raise RuntimeError("finish_backward() without begin_step(); call begin_step(microbatches) first")
        while self._next_launch < len(self.order):
            self._launch(self.order[self._next_launch])
        for f in self.order:
            f.finish_reduce()
        self._in_flight = []
        if self.tied_comm is not None:
            for f in self.flats:
                if f.tied:
                    self.tied_comm.iall_reduce(f.grad_shard, op="sum").wait()  # in place
        for f in self.flats:
            f.drop_prefetch()
            if f.users:
                raise RuntimeError(f"ZeRO-3: parameters {f.names[:2]} still gathered after the step "
                                   "(a unit's forward without its backward?)")
        self._armed = False

    def end_forward_only(self) -> None:
        """After an evaluation pass: free any prefetched gather (nothing stays gathered)."""
        for f in self.flats:
            f.drop_prefetch()

    # -- whole parameters (tests, tools, checkpoints of other layouts) ------------------------------
    def gather_all(self) -> None:
        """Gather every flat (collective over the shard group; ends with `release_all`)."""
        for f in self.flats:
            f.acquire()

    def release_all(self) -> None:
        for f in self.flats:
            f.release()

    def gathered_bytes(self) -> int:
        """Bytes of gathered buffers alive now (the shards' memory excluded when n > 1)."""
        return sum(f.gathered.nbytes for f in self.flats if f.gathered is not None and f.comm.size > 1)


class FSDP(ShardedState, DataParallel):
    """ZeRO stage 3: parameters, gradients and optimizer state sharded over the shard group, the
    parameters gathered unit by unit (`ShardedUnits`).

    Args (besides `DataParallel`'s):
        units: (chunk index, unit name, [(name, Parameter)]) in forward order (`GPT.fsdp_units()`
            of every chunk); each chunk's `unit_hooks` must be set to this object's `unit_hooks`
            so that the model gathers its units.
        make_optimizer: builds the optimizer from this rank's segments.
        reshard_after_forward: free a unit's gathered parameters after its forward.
        prefetch: units whose all-gathers are issued ahead of the one computing (`ShardedUnits`).
        sparse_embedding: "auto" or "never" (`train.sparse_embedding`): an untied wte's rows to
            their owners (`FlatParameter.rows`).

    Attributes:
        unit_hooks: the `ShardedUnits`.
        segments: this rank's pieces of the parameters, the optimizer's "parameters".
        events: the `ShardedUnits` events of this step.
    """

    def __init__(self, named_params: Iterable[tuple[str, Any]], mesh, units: Iterable[tuple[int, str, list]] | None,
                 make_optimizer: Callable[[list], Any] = AdamW, *, reshard_after_forward: bool = True,
                 prefetch: int = 3, local_tied: bool = False, groups: tuple | None = None,
                 sparse_embedding: str = "auto"):
        super().__init__(named_params, mesh, local_tied=local_tied, groups=groups)
        if units is None:
            raise ConfigError("zero=3 needs the model's units (make_gradient_sync(..., units=[(chunk, name, "
                              "[(name, param)]), ...]), e.g. from GPT.fsdp_units())")
        units = list(units)
        listed = {id(p) for _, _, ps in units for _, p in ps}
        missing = [n for n, p in zip(self.names, self.params) if id(p) not in listed]
        if missing:
            raise ConfigError(f"zero=3: parameters {missing[:3]} belong to no unit")
        self.unit_hooks = ShardedUnits(units, self.shard_comm, self.replicate_comm, self._tied,
                                       self.embedding_comm, reshard_after_forward, prefetch,
                                       backward_follows=mesh.size(Axis.PP) == 1, sparse=sparse_embedding)
        self.segments = self.unit_hooks.segments
        if self.embedding_comm is not None:
            self._check_tied_match([(f.size, f.dtype) for f in self.unit_hooks.flats if f.tied])
        self.optimizer = make_optimizer(self.segments)
        self._norm_items = self._sharded_norm_items()

    @property
    def overlap(self) -> bool:
        """Reductions always start from grad hooks under FSDP (setting it changes nothing)."""
        return True

    @overlap.setter
    def overlap(self, value: bool) -> None:
        pass

    @property
    def events(self) -> list[tuple[str, Any, float]]:
        return self.unit_hooks.events

    @events.setter
    def events(self, value: list) -> None:
        self.unit_hooks.events = value

    def on_bucket_ready(self, listener: Callable[[Any], None]) -> None:
        raise ConfigError("on_bucket_ready needs gradient buckets (zero 0-2); ZeRO-3 has none")

    def begin_step(self, microbatches: int = 1, step: int | None = None) -> None:
        """Arm the unit hooks (gradient buffers come with each unit's backward)."""
        self.unit_hooks.begin_step(microbatches)

    def _reduce(self) -> None:
        self.unit_hooks.finish_backward()
        flat_of = {id(p): f for f in self.unit_hooks.flats for p in f.params}
        self._sum_local_tied([(flat_of[id(a)].grad_shard, flat_of[id(b)].grad_shard) for a, b in self._local_tied])

    def _grad_buffers(self) -> list:
        return [f.grad_shard for f in self.unit_hooks.flats]

    @property
    def embedding_sync(self) -> dict:
        """The untied embedding's sync to its rows' owners (`BucketedDataParallel.embedding_sync`'s
        form); {} when it is reduce-scattered with its unit."""
        rowed = [f for f in self.unit_hooks.flats if f.rows is not None]
        return {"steps": dict(rowed[0].steps), "last": dict(rowed[0].last)} if rowed else {}

    def uncompressed_bytes(self) -> None:
        """None: no compression under ZeRO-3, what is measured is what an uncompressed step sends."""
        return None

    def full_parameters(self) -> dict[str, Any]:
        """{name: this rank's whole local array}: copies, gathered (collective over the shard group)."""
        self.unit_hooks.gather_all()
        try:
            return {n: p.data.copy() for n, p in zip(self.names, self.params)}
        finally:
            self.unit_hooks.release_all()

    def _parameter_pieces(self) -> list[tuple[Any, str, Any, Any]]:
        """This rank's shards of the parameters (its segments)."""
        return [(seg.param, seg.name, seg.layout, seg.data) for seg in self.segments]

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind: parameter shards, gradients (shards and the full
        buffers alive), optimizer state, gathered buffers (each buffer counted once)."""
        seen: set = set()
        state = [v for st in self.optimizer.state_dict()["state"] for v in st.values()]
        flats = self.unit_hooks.flats
        return {"parameters": distinct_nbytes((f.shard for f in flats), seen),
                "gradients": distinct_nbytes((f.grad_shard for f in flats), seen)
                + distinct_nbytes((f.grad for f in flats), seen),
                "optimizer": distinct_nbytes(state, seen),
                "gathered": distinct_nbytes((f.gathered for f in flats if f.comm.size > 1), seen)}
