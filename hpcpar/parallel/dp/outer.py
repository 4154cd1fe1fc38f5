"""Synchronising the data-parallel replicas every H steps instead of every step: local SGD and
DiLoCo, streamed fragment by fragment (`OuterSync`).

The replicas are the `dp_replicate` groups of the mesh. Inside a replica nothing changes: the
gradients are averaged every step over dp_shard x cp (the trainer gives the gradient sync those
groups), and tp, pp, ZeRO/FSDP and experts work as always. Across replicas nothing travels for H
steps; then, for each fragment of the model, with `x_r` replica r's parameters and `anchor` the
parameters of the last synchronisation (the same bits on every replica):

    delta_r = anchor - x_r                 replica r's outer gradient
    delta   = (1/R) sum_r delta_r          one all-reduce over dp_replicate, or with
                                           `compression` an all-gather of bf16 / int8 codes
                                           summed in replica order (error feedback per replica)
    diloco: m = mu m + delta; u = delta + mu m (Nesterov) or m; anchor -= lr u
    local:  anchor -= delta                (= the mean of the replicas' parameters)
    x_r = mix x_r + (1 - mix) anchor       when the result lands (mix 0: every replica takes it)

(Douillard et al., DiLoCo, arXiv 2311.08105: inner AdamW, outer Nesterov lr 0.7, momentum 0.9.)
With H = 1, outer lr 1 and no momentum, a linear inner optimizer (SGD) makes this ordinary data
parallelism; with one replica it is the replica's own training.

Streaming (Streaming DiLoCo, arXiv 2501.18512): the model is cut into F fragments of consecutive
transformer blocks (the embeddings join the first, the final LayerNorm and head the last).
Fragment f syncs after step s when (s + 1) = (f + 1) H/F (mod H): F = 1 after steps H-1, 2H-1,
...; F fragments sync H/F steps apart, so the wire carries 1/F of the model at a time. With
`delay` tau >= 1 the fragment's reduction is started non-blocking after step s and lands after
step s + tau while the replica trains on (its local progress is then mixed with or replaced by
the outer result). The outer update itself is computed when the reduction completes; the
anchor is not read again before the fragment's next sync, H > tau steps later.

Checkpointed (`Checkpointable`): `outer/anchor/<name>` and `outer/momentum/<name>` (the same on
every replica: global tensors in the parameters' layouts), `outer/residual/<name>` (error
feedback, `[R, *shape]`, row r replica r's), and in the metadata the mode, the replica count,
the fragments and the steps at which fragments in flight land. The replicas' own parameters and
inner optimizer state differ: replica 0 saves them under their usual names, replica r > 0 as row
r - 1 of `replicas/<name>` (`saved_by_replica`, `ReplicaView`), so evaluation, sampling and
export read replica 0's model, and a resume is bitwise. A reshard inside the replicas (dp_shard,
tp, pp, cp, ZeRO) is exact; another replica count is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from hpcpar import backend
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout
from hpcpar.parallel.dp.compression.compressors import (accumulation_dtype, decode16, encode16, int8_decode,
                                                        int8_encode)
from hpcpar.parallel.dp.compression.state import with_rows
from hpcpar.runtime.comm import Communicator
from hpcpar.state import SavedState, StoredState

MODES = ("step", "local", "diloco")
OUTER_COMPRESSION = ("none", "bf16", "int8")
ANCHOR, MOMENTUM, RESIDUAL, REPLICAS = "outer/anchor/", "outer/momentum/", "outer/residual/", "replicas/"
_BLOCK = re.compile(r"(?:^|\.)h\.(\d+)\.")


@dataclass(frozen=True)
class OuterConfig:
    """`train.sync` and its knobs (docs/config.md)."""

    mode: str = "diloco"          # "local" or "diloco"
    every: int = 50               # H: steps between a fragment's synchronisations
    lr: float = 0.7               # diloco: outer learning rate
    momentum: float = 0.9         # diloco: outer momentum (0: plain outer SGD)
    nesterov: bool = True
    fragments: int = 1            # F, dividing the blocks
    delay: int = 0                # tau: steps a fragment's reduction overlaps before it lands (< every)
    mix: float = 0.0              # weight of the replica's own parameters when a result lands
    compression: str = "none"     # the outer gradient on the wire: none, bf16, int8
    int8_block_size: int = 256

    @classmethod
    def of(cls, train) -> "OuterConfig":
        """From the train section (`config.sections.TrainConfig`: train.sync and its knobs)."""
        return cls(train.sync, train.sync_every, train.outer_lr, train.outer_momentum, train.outer_nesterov,
                   train.sync_fragments, train.sync_delay, train.sync_mix, train.outer_compression,
                   train.int8_block_size)


def fragment_of(name: str, n_layer: int, fragments: int) -> int:
    """The fragment of parameter `name`: block i's is i // (n_layer / fragments); the embeddings
    (`wte`, `wpe`) belong to the first fragment, everything after the blocks to the last."""
    match = _BLOCK.search(name)
    if match:
        return int(match.group(1)) // (n_layer // fragments)
    return 0 if re.search(r"(?:^|\.)(wte|wpe)\.", name) else fragments - 1


def syncs_after(step: int, fragment: int, every: int, fragments: int) -> bool:
    """Whether `fragment` starts its synchronisation after step `step` (module docstring)."""
    return (step + 1) % every == ((fragment + 1) * (every // fragments)) % every


@dataclass
class _Piece:
    """One array of this rank's parameters (whole, or its shard) and its outer state."""

    key: str          # the global tensor's name (a tied copy: the weight it mirrors)
    layout: Layout
    data: Any         # the live parameter array (updated in place when a result lands)
    anchor: Any
    momentum: Any     # None without outer momentum
    residual: Any     # None without compression


class _InFlight:
    """A fragment's reduction between its start and its landing."""

    def __init__(self, handle, due: int):
        self.handle, self.due, self.done = handle, due, False


class OuterSync:
    """The outer loop over the replicas (module docstring); one per rank.

    Args:
        config: the mode and its knobs.
        pieces: (global name, Layout, live array) of every parameter array this rank holds (the
            gradient sync's `parameter_pieces()`: whole arrays, or under ZeRO-3 its shards).
        replicas: the dp_replicate communicator (R ranks, one per replica).
        n_layer: the model's blocks (fragments are consecutive blocks).
        shards: the ranks of this replica that hold the same `pieces` (dp_shard x cp without
            ZeRO-3; None: none does). Each sends 1/S of the outer gradient over `replicas` and
            the S results are all-gathered inside the replica, so the slow axis carries the
            model once per replica, not once per rank.
    Call `after_step(step)` on every rank after each step's update (collective over `replicas`
    at the steps a fragment starts or lands).
    """

    def __init__(self, config: OuterConfig, pieces: list[tuple[str, Layout, Any]], replicas: Communicator,
                 n_layer: int, shards: Communicator | None = None):
        self.cfg, self.comm = config, replicas
        self.shards = shards if shards is not None and shards.size > 1 else None
        self.fragments: list[list[_Piece]] = [[] for _ in range(config.fragments)]
        for key, layout, data in pieces:
            xp = backend.array_module(data)
            piece = _Piece(key, layout, data, data.copy(),
                           xp.zeros_like(data) if config.mode == "diloco" and config.momentum else None,
                           xp.zeros_like(data) if config.compression != "none" else None)
            self.fragments[fragment_of(key, n_layer, config.fragments)].append(piece)
        self.in_flight: dict[int, _InFlight] = {}

    @property
    def pieces(self) -> list[_Piece]:
        return [p for fragment in self.fragments for p in fragment]

    # -- the schedule ---------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        """Land the fragments due after `step`, then start those whose turn it is (a start with
        no delay lands at once)."""
        for f in sorted(self.in_flight):
            if self.in_flight[f].due == step:
                self._land(f)
        for f in range(self.cfg.fragments):
            if syncs_after(step, f, self.cfg.every, self.cfg.fragments):
                if f in self.in_flight:  # validation keeps delay < every: a bug if it happens
                    raise RuntimeError(f"outer fragment {f} starts again before its last reduction landed")
                self.in_flight[f] = _InFlight(self._start(f), step + self.cfg.delay)
                if self.cfg.delay == 0:
                    self._land(f)

    def complete_in_flight(self) -> None:
        """Finish every reduction in flight and its outer update (before a checkpoint); the
        results still land at their steps."""
        for f in sorted(self.in_flight):
            self._complete(f)

    # -- one fragment ---------------------------------------------------------------------------
    def _flat_delta(self, f: int):
        """[n] this replica's outer gradient of fragment f, its pieces back to back (plus, with
        compression, the error-feedback residual)."""
        pieces = self.fragments[f]
        if not pieces:
            return None
        xp = backend.array_module(pieces[0].data)
        parts = [(p.anchor - p.data).reshape(-1) for p in pieces]
        if self.cfg.compression != "none":
            parts = [d + p.residual.reshape(-1) for d, p in zip(parts, pieces)]
        return xp.concatenate(parts) if len(parts) > 1 else parts[0]

    def _start(self, f: int):
        """Start fragment f's reduction over the replicas (this rank's 1/S slice of it with
        `shards`); returns its handle (None: no pieces)."""
        delta = self._flat_delta(f)
        if delta is None:
            return None
        payload = delta if self.cfg.compression == "none" else self._encode(f, delta)
        mine = self._my_slice(payload)
        if self.cfg.compression == "none":
            return self.comm.iall_reduce(mine, op="sum")
        return self.comm.iall_gather(mine[None, :], dim=0)

    def _my_slice(self, payload):
        """`payload` [L], or with `shards` (S ranks) this rank's slice of it padded to S equal ones."""
        if self.shards is None:
            return payload
        xp = backend.array_module(payload)
        S, k = self.shards.size, self.shards.rank
        n = -(-payload.size // S)
        padded = xp.zeros(n * S, dtype=payload.dtype)
        padded[:payload.size] = payload
        return padded[k * n:(k + 1) * n].copy()

    def _whole(self, received, length: int):
        """The received slices made whole again (all-gathered over `shards`; the last dim)."""
        if self.shards is None:
            return received
        return self.shards.all_gather(received, dim=received.ndim - 1)[..., :length]

    def _encode(self, f: int, delta):
        """The fragment's compressed outer gradient as one uint8 row; each piece's residual keeps
        what the codes do not carry (exactly: `delta - decode(encode(delta))`)."""
        sizes = self._piece_sizes(f)
        codes = self._encode_only(delta, sizes)
        decoded = self._decode(codes, sizes, delta.dtype)
        at = 0
        for p, n in zip(self.fragments[f], sizes):
            p.residual[...] = (delta[at:at + n] - decoded[at:at + n]).reshape(p.residual.shape)
            at += n
        return codes

    def _piece_sizes(self, f: int) -> list[int]:
        return [int(p.data.size) for p in self.fragments[f]]

    def _code_bytes(self, sizes: list[int]) -> int:
        """Bytes of `_encode_only`'s codes for pieces of `sizes` elements."""
        if self.cfg.compression == "bf16":
            return 2 * sum(sizes)
        b = self.cfg.int8_block_size
        return sum(n + 4 * -(-n // b) for n in sizes)

    def _encode_only(self, delta, sizes: list[int]):
        """uint8 codes of `delta`: bf16 bits, or per piece int8 values with one float32 scale per
        block (blocks never straddle two pieces, so a parameter's codes do not depend on which
        pieces sit next to it)."""
        xp = backend.array_module(delta)
        if self.cfg.compression == "bf16":
            return encode16(delta, "bfloat16").view(xp.uint8)
        out, at = [], 0
        for n in sizes:
            q, scales = int8_encode(delta[None, at:at + n], self.cfg.int8_block_size)
            out += [q.reshape(-1).view(xp.uint8), scales.reshape(-1).view(xp.uint8)]
            at += n
        return xp.concatenate(out)

    def _decode(self, codes, sizes: list[int], dtype):
        """`_encode_only`'s codes back to values [sum(sizes)] in `dtype`."""
        xp = backend.array_module(codes)
        if self.cfg.compression == "bf16":
            return decode16(codes.view(xp.uint16), "bfloat16").astype(dtype)
        out, at = [], 0
        for n in sizes:
            blocks = -(-n // self.cfg.int8_block_size)
            q = codes[at:at + n].view(xp.int8)[None, :]
            scales = codes[at + n:at + n + 4 * blocks].copy().view(xp.float32)[None, :]
            out.append(int8_decode(q, scales, self.cfg.int8_block_size, accumulation_dtype(dtype))[0].astype(dtype))
            at += n + 4 * blocks
        return xp.concatenate(out)

    def _complete(self, f: int) -> None:
        """Wait for fragment f's reduction and apply the outer update to its anchor (and momentum)."""
        flight = self.in_flight[f]
        if flight.done:
            return
        flight.done = True
        if flight.handle is None:
            return
        pieces = self.fragments[f]
        sizes = self._piece_sizes(f)
        R = self.comm.size
        if self.cfg.compression == "none":
            mean = self._whole(flight.handle.wait(), sum(sizes)) / R
        else:
            dtype = pieces[0].data.dtype
            codes = self._whole(flight.handle.wait(), self._code_bytes(sizes))
            acc = None
            for r in range(R):  # in replica order: the same bits on every replica
                row = self._decode(codes[r], sizes, dtype).astype(accumulation_dtype(dtype))
                acc = row if acc is None else acc + row
            mean = (acc / R).astype(dtype)
        at = 0
        cfg = self.cfg
        for p in pieces:
            delta = mean[at:at + p.data.size].reshape(p.data.shape)
            at += p.data.size
            if cfg.mode == "local":
                p.anchor -= delta
            elif p.momentum is not None:
                p.momentum *= cfg.momentum
                p.momentum += delta
                update = delta + cfg.momentum * p.momentum if cfg.nesterov else p.momentum
                p.anchor -= cfg.lr * update
            else:
                p.anchor -= cfg.lr * delta

    def _land(self, f: int) -> None:
        """Fragment f's outer result replaces (or, with `mix`, blends into) this replica's parameters."""
        self._complete(f)
        del self.in_flight[f]
        mix = self.cfg.mix
        for p in self.fragments[f]:
            if mix:
                p.data *= mix
                p.data += (1.0 - mix) * p.anchor
            else:
                p.data[...] = p.anchor

    # -- checkpoints ----------------------------------------------------------------------------
    def meta(self) -> dict:
        c = self.cfg
        state = ["anchor"] + (["momentum"] if c.mode == "diloco" and c.momentum else []) + (
            ["residual"] if c.compression != "none" else [])
        return {"mode": c.mode, "replicas": self.comm.size, "fragments": c.fragments, "every": c.every,
                "state": state, "landing": {str(f): flight.due for f, flight in sorted(self.in_flight.items())}}

    def checkpoint_state(self) -> SavedState:
        """The outer state (module docstring); in-flight reductions are completed first."""
        self.complete_in_flight()
        tensors: dict[str, tuple[Any, Layout]] = {}
        R, r = self.comm.size, self.comm.rank
        for p in self.pieces:
            tensors[ANCHOR + p.key] = (p.anchor, p.layout)
            if p.momentum is not None:
                tensors[MOMENTUM + p.key] = (p.momentum, p.layout)
            if p.residual is not None:
                tensors[RESIDUAL + p.key] = (p.residual, with_rows(p.layout, r, R))
        return SavedState(tensors, {"sync": self.meta()})

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """The outer state of a checkpoint saved in the same mode with as many replicas and
        fragments (`check_resumable`, which the caller applies first); from a
        checkpoint without one (saved with train.sync = "step", or a weights-only load) every
        anchor starts at the loaded parameters, momentum and residuals at zero."""
        saved = None if stored.weights_only else stored.meta.get("sync")
        if saved is None:
            # After the parameters are in place (the loader calls `then`s in the order asked).
            stored.read({}, lambda _: self._restart_from_parameters())
            return
        # Ask for every outer tensor the checkpoint holds (a load must read all its tensors),
        # keep what this run uses; what it lacks (momentum or residuals) starts at zero.
        kinds = saved.get("state", ["anchor"])
        wanted = {}
        for p in self.pieces:
            wanted[ANCHOR + p.key] = p.layout
            if "momentum" in kinds:
                wanted[MOMENTUM + p.key] = p.layout
            if "residual" in kinds:
                wanted[RESIDUAL + p.key] = with_rows(p.layout, self.comm.rank, self.comm.size)

        def take(arrays: dict) -> None:
            for p in self.pieces:
                for prefix, target in ((ANCHOR, p.anchor), (MOMENTUM, p.momentum), (RESIDUAL, p.residual)):
                    if target is not None:
                        got = arrays.get(prefix + p.key)
                        target[...] = backend.to_device(got) if got is not None else 0
            self.in_flight = {int(f): _InFlight(None, int(due)) for f, due in saved.get("landing", {}).items()}
            for flight in self.in_flight.values():
                flight.done = True
        stored.read(wanted, take)

    def _restart_from_parameters(self) -> None:
        for p in self.pieces:
            p.anchor[...] = p.data
            for state in (p.momentum, p.residual):
                if state is not None:
                    state[...] = 0
        self.in_flight = {}


def check_resumable(stored: StoredState, mode: str, replicas: int, fragments: int) -> None:
    """Refuse (one line, the same on every rank) a checkpoint whose replicas' states this run
    cannot take: saved in another sync mode, or with another number of replicas or fragments."""
    saved = stored.meta.get("sync")
    if saved is None or stored.weights_only:
        return
    if (saved["mode"], int(saved["replicas"]), int(saved["fragments"])) != (mode, replicas, fragments):
        now = f"train.sync=\"{mode}\" with {replicas} replica(s)" if mode != "step" else "train.sync=\"step\""
        raise CheckpointError(
            f"checkpoint {stored.path} was saved with train.sync=\"{saved['mode']}\", {saved['replicas']} "
            f"replicas (mesh.dp_replicate) and train.sync_fragments={saved['fragments']}, whose replicas hold "
            f"different parameters; this run has {now}: resume with the checkpoint's mode, mesh.dp_replicate and "
            "fragments, or start from replica 0's weights (hpcpar ckpt export --format safetensors, then hpcpar "
            "ckpt import: a weights-only checkpoint)")


def saved_by_replica(state: SavedState, replica: int, replicas: int) -> SavedState:
    """A replica's share of the model and optimizer state in a checkpoint: replica 0's as it is;
    replica r > 0's under `replicas/<name>`, row r - 1 of a leading dim of R - 1 rows."""
    if replica == 0:
        return state
    return SavedState({REPLICAS + name: (array, with_rows(layout, replica - 1, replicas - 1))
                       for name, (array, layout) in state.tensors.items()}, state.meta)


class ReplicaView:
    """A `StoredState` as replica r > 0 reads its own model and optimizer state (`saved_by_replica`);
    a weights-only load or a checkpoint without replicas reads the plain names."""

    def __init__(self, stored: StoredState, replica: int, replicas: int):
        self.stored, self.replica, self.replicas = stored, replica, replicas
        self.path, self.meta, self.weights_only = stored.path, stored.meta, stored.weights_only

    def read(self, wanted: Mapping[str, Layout], then: Callable[[dict[str, Any]], None]) -> None:
        n = len(REPLICAS)
        renamed = {REPLICAS + name: with_rows(layout, self.replica - 1, self.replicas - 1)
                   for name, layout in wanted.items()}
        self.stored.read(renamed, lambda arrays: then({name[n:]: a for name, a in arrays.items()}))


def replica_view(stored: StoredState, replica: int, replicas: int) -> StoredState:
    """What replica `replica` reads its model and optimizer state from (`ReplicaView`, or `stored`)."""
    if replica == 0 or stored.weights_only or stored.meta.get("sync") is None:
        return stored
    return ReplicaView(stored, replica, replicas)
