"""Pipeline parallelism: split the layers into stages, and replay a schedule with Isend/Irecv.

Virtual stages. With `chunks` = v model chunks per pipeline rank there are V = pp * v virtual
stages; chunk c of pp rank r is virtual stage v = c * pp + r (as in `schedule.stage_of`).
Virtual stage 0 holds the embedding and reads token ids; virtual stage V - 1 holds ln_f, the
LM head and the loss. Each is one `GPT(config, layers=range(a, b), embed=..., head=...)`.

Layer split (`split_layers`). Cost unit: one transformer block's forward FLOPs per token,
24 C^2 (QKV 6C^2 + projection 2C^2 + MLP 16C^2, 2 FLOPs per multiply-add; attention's T-dependent
part is ignored). The LM head costs 2 C V per token, i.e. `head_cost = V / (12 C)` blocks
(~0.17 for the byte-level default V=256, C=128; ~5.5 for GPT-2's V=50257, C=768). The
embedding is a gather and costs ~0. The split is contiguous, gives every virtual stage at least
one block, minimises the most expensive stage and then maximises the cheapest; remaining ties
give the head stage the fewest blocks, and leftover blocks go to the earliest stages.

Executor (`PipelineExecutor`). One step replays this rank's action list from `schedule.build`:
    recv_act   Irecv into a fresh buffer of the known activation shape [mbs, T, C] ([mbs, T/tp, C]
               with sequence parallelism), wait, wrap as a leaf Tensor(requires_grad=True);
    forward    run the chunk's stage (token ids on virtual stage 0, targets on the last); stash
               (input, output) until the backward;
    send_act   Isend the output's array; the handle is kept and waited at the end of the step;
    recv_grad  Irecv the gradient of the output (shape of the stashed output);
    backward   output.backward(grad) (the loss: backward with 1/microbatches), drop the stash;
    send_grad  Isend the input's gradient.
Tags come from `schedule.message_tag`, so every MPI message is matched by tag, not by order
(NCCL has no tags and its sends can block the stream until the peer's recv is posted; CuPy
arrays on an NCCL communicator therefore rely on the schedule's message order, which is
untested on GPUs). Arrays travel with the buffer methods (never pickled). The pp communicator
is per (dp, tp) coordinate, so with tp > 1 every tp rank of a stage talks to the same tp rank of
its neighbour. Data-parallel gradient hooks on the parameters simply fire inside the backwards;
the tied embedding/head copies on the first and last stage are kept equal by DataParallel
(gradients summed over `mesh.embedding_comm`). `run(batches, forward_only=True)` evaluates:
forwards only, in `forward_only_actions` order, no graph. `measured_bubble()` is the idle
fraction of the steps so far (time outside forward/backward over time in `run`).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from hpcpar import backend
from hpcpar.errors import ConfigError
from hpcpar.mesh import Axis
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.parallel import schedule
from hpcpar.parallel.schedule import Action
from hpcpar.tensor import Tensor, no_grad
from hpcpar.trace import Tracer


def head_cost(config: GPTConfig) -> float:
    """Cost of ln_f + LM head + loss in transformer blocks: 2 C V / (24 C^2) = V / (12 C)."""
    return config.vocab_size / (12 * config.n_embd)


def split_layers(n_layer: int, virtual_stages: int, head_cost: float = 0.0) -> list[range]:
    """Contiguous block ranges, one per virtual stage, balanced by cost (see the module doc).

    A block costs 1; the last virtual stage also pays `head_cost`. Every stage gets >= 1 block.
    Returns `virtual_stages` ranges covering 0 .. n_layer - 1 in order.
    """
    if virtual_stages < 1 or n_layer < virtual_stages:
        raise ConfigError(f"model.n_layer={n_layer} cannot be split into {virtual_stages} virtual pipeline "
                          "stages (mesh.pp x pipeline.chunks) of >= 1 layer each; need n_layer >= "
                          f"{max(virtual_stages, 1)}")
    if head_cost < 0:
        raise ValueError(f"head_cost must be >= 0, got {head_cost}")
    rest = virtual_stages - 1
    if rest == 0:
        return [range(n_layer)]

    def spread(last: int) -> tuple[float, float]:
        """(costliest, -cheapest) stage cost when the head stage takes `last` blocks."""
        others = n_layer - last
        return (max(last + head_cost, -(-others // rest)), -min(last + head_cost, others // rest))

    # Most balanced: smallest maximum, then largest minimum; on a tie the fewest head-stage blocks.
    last = min(range(1, n_layer - rest + 1), key=spread)
    base, extra = divmod(n_layer - last, rest)
    sizes = [base + (1 if s < extra else 0) for s in range(rest)] + [last]
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def build_stages(gpt_config: GPTConfig, mesh, chunks: int, seed: int,
                 sequence_parallel: bool = False) -> list[GPT]:
    """This rank's model chunks: element c is virtual stage c * pp + pp_rank.

    Parameters are initialised from the seed by global name, so they equal the whole model's.
    """
    pp, rank = mesh.size(Axis.PP), mesh.rank(Axis.PP)
    n_virtual = pp * chunks
    ranges = split_layers(gpt_config.n_layer, n_virtual, head_cost(gpt_config))
    stages = []
    for chunk in range(chunks):
        v = schedule.stage_of(rank, chunk, pp)
        stages.append(GPT(gpt_config, tp_comm=mesh.comm(Axis.TP), layers=ranges[v], embed=v == 0,
                          head=v == n_virtual - 1, sequence_parallel=sequence_parallel, seed=seed))
    return stages


def forward_only_actions(pp: int, rank: int, microbatches: int, chunks: int = 1) -> list[Action]:
    """Rank `rank`'s actions for forwards alone (evaluation): recv_act, forward, send_act per
    (chunk, microbatch) in lexicographic order. Deadlock-free: every recv waits on an action that
    comes earlier in the global order (chunk, microbatch, rank), and sends never block."""
    last = pp * chunks - 1
    actions = []
    for chunk in range(chunks):
        v = schedule.stage_of(rank, chunk, pp)
        for mb in range(microbatches):
            if v > 0:
                actions.append(Action("recv_act", mb, chunk, (rank - 1) % pp))
            actions.append(Action("forward", mb, chunk))
            if v < last:
                actions.append(Action("send_act", mb, chunk, (rank + 1) % pp))
    return actions


class PipelineExecutor:
    """Replays one rank's schedule actions for a training step (see the module doc).

    Args:
        stages: this rank's chunks (from `build_stages`); anything callable as
            `stage(x, targets=None)` with a `.config` (`n_embd`, `dtype`) works.
        mesh: gives `size/rank("pp")`, `size("tp")` and `comm("pp")`.
        actions: this rank's list, `schedule.build(name, pp, m, chunks)[mesh.rank(Axis.PP)]`.
        microbatches: m; each micro-batch's loss is backpropagated with scale 1/m.
        tracer: a `Tracer`; when enabled, every action becomes a span (pid = its rank,
            tid = the chunk) and the final wait for sends one more.

    Attributes:
        rng_contexts: None, or per micro-batch the `rng_context` (seed, step, sample_ids) that is
            set on the stage before that micro-batch's forward (dropout masks), for the next `run`.
    """

    def __init__(self, stages: Sequence[Any], mesh, actions: Sequence[Action], microbatches: int,
                 tracer: Tracer | None = None):
        self.stages = list(stages)
        self.actions = list(actions)
        self.microbatches = microbatches
        self.tracer = tracer
        self.rng_contexts: Sequence[Any] | None = None
        self.pp, self.pp_rank = mesh.size(Axis.PP), mesh.rank(Axis.PP)
        self.tp = mesh.size(Axis.TP)
        self.comm = mesh.comm(Axis.PP)
        self.chunks = len(self.stages)
        self.last_stage = self.pp * self.chunks - 1
        self.step = 0
        self._busy = 0.0   # seconds of forward/backward over all training steps
        self._wall = 0.0   # seconds inside run() over all training steps
        for a in self.actions:
            if not (0 <= a.chunk < self.chunks and 0 <= a.microbatch < microbatches):
                raise ValueError(f"{a} does not fit {self.chunks} chunks x {microbatches} microbatches")
        config = self.stages[0].config
        # Megatron-SP: activations between blocks are split along the sequence over tp.
        self._split_t = self.tp if getattr(self.stages[0], "sequence_parallel", False) else 1
        self._channels, self._dtype = config.n_embd, config.dtype

    def run(self, batches: Sequence[tuple[Any, Any]], forward_only: bool = False) -> list[float]:
        """One step over `batches` (pairs (x, y) of int [mbs, T]); returns the per-microbatch
        losses on the rank holding the last virtual stage, else [].

        Training (default): exactly `microbatches` batches, replayed per the schedule, gradients
        accumulated into the parameters' `.grad`. `forward_only=True` (evaluation): any number
        of batches, forwards only (`forward_only_actions`), no graph kept.
        """
        if forward_only:
            actions = forward_only_actions(self.pp, self.pp_rank, len(batches), self.chunks)
            with no_grad():
                return self._replay(actions, batches, len(batches), backward=False)
        if len(batches) != self.microbatches:
            raise ValueError(f"got {len(batches)} micro-batches, the schedule has {self.microbatches}")
        start = time.perf_counter()
        losses = self._replay(self.actions, batches, self.microbatches, backward=True)
        self._wall += time.perf_counter() - start
        self.step += 1
        return losses

    def measured_bubble(self) -> float | None:
        """This rank's idle fraction over the training steps run so far: 1 - (time in forward and
        backward) / (time in run()); None before the first step. Includes message waits and
        whatever else runs inside a step's backward (e.g. data-parallel hooks count as busy)."""
        return 1.0 - self._busy / self._wall if self._wall > 0 else None

    def _replay(self, actions: Sequence[Action], batches: Sequence[tuple[Any, Any]], m: int,
                backward: bool) -> list[float]:
        xp = backend.xp
        mbs, t = batches[0][0].shape
        act_shape = (mbs, t // self._split_t, self._channels)
        contexts = self.rng_contexts if backward else None
        inputs: dict[tuple[int, int], Any] = {}      # received activation (leaf), till its forward
        stash: dict[tuple[int, int], tuple] = {}     # (input, output), forward till backward/send
        grads_in: dict[tuple[int, int], Any] = {}    # received output gradient, till its backward
        grads_out: dict[tuple[int, int], Any] = {}   # input gradient, till it is sent
        sends = []
        losses: dict[int, float] = {}
        tracer = self.tracer if self.tracer is not None and self.tracer.enabled else None
        for action in actions:
            key = (action.microbatch, action.chunk)
            kind = action.kind
            v = schedule.stage_of(self.pp_rank, action.chunk, self.pp)
            start = time.perf_counter()
            if kind == "recv_act":
                buf = xp.empty(act_shape, dtype=self._dtype)
                data = self.comm.irecv(buf, action.peer, self._tag(action, m)).wait()
                inputs[key] = Tensor(data, requires_grad=backward)
            elif kind == "forward":
                stage = self.stages[action.chunk]
                x, y = batches[action.microbatch]
                if contexts is not None:
                    stage.rng_context = contexts[action.microbatch]
                inp = xp.asarray(x) if v == 0 else inputs.pop(key)
                if v == self.last_stage:
                    out = stage(inp, xp.asarray(y))
                    losses[action.microbatch] = float(out.item())
                else:
                    out = stage(inp)
                    assert out.shape == act_shape, f"stage {v} produced {out.shape}, expected {act_shape}"
                if backward or v < self.last_stage:
                    stash[key] = (inp, out)
            elif kind == "send_act":
                out = stash[key][1] if backward else stash.pop(key)[1]
                sends.append(self.comm.isend(out.data, action.peer, self._tag(action, m)))
            elif kind == "recv_grad":
                out = stash[key][1]
                buf = xp.empty(out.shape, dtype=out.dtype)
                grads_in[key] = self.comm.irecv(buf, action.peer, self._tag(action, m)).wait()
            elif kind == "backward":
                inp, out = stash.pop(key)
                # The loss is a mean over the micro-batch; 1/m makes the sum over m a global mean.
                out.backward(xp.asarray(1.0 / m, dtype=out.dtype) if v == self.last_stage else grads_in.pop(key))
                if v > 0:
                    grads_out[key] = inp.grad
            else:  # send_grad
                sends.append(self.comm.isend(grads_out.pop(key), action.peer, self._tag(action, m)))
            if kind in schedule.COMPUTE or tracer is not None:
                end = time.perf_counter()
                if kind in schedule.COMPUTE and backward:
                    self._busy += end - start
                if tracer is not None:
                    tracer.record(kind, "compute" if kind in schedule.COMPUTE else "comm", start, end,
                                  tid=action.chunk, args={"step": self.step, "mb": action.microbatch,
                                                          "stage": v, "eval": not backward})
        start = time.perf_counter()
        for handle in sends:
            handle.wait()
        if tracer is not None:
            tracer.record("wait_sends", "comm", start, time.perf_counter(), tid=0,
                          args={"step": self.step, "sends": len(sends), "eval": not backward})
        assert not (stash or inputs or grads_in or grads_out), "the schedule left work undone"
        return [losses[j] for j in sorted(losses)]

    def _tag(self, action: Action, m: int) -> int:
        return schedule.message_tag(action, self.pp, self.chunks, m)
