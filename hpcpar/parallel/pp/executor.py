"""The pipeline executor: replays one rank's schedule actions with Isend/Irecv (`PipelineExecutor`).

One step replays this rank's action list from `schedules.build` (its chunks from `stages.build_stages`):
    recv_act   Irecv into a fresh buffer of the known activation shape [mbs, T, C] ([mbs, T/tp, C]
               with sequence parallelism; T is the rank's T/cp tokens under context
               parallelism, as the batches it is given), wait, wrap as a leaf Tensor;
    forward    run the chunk's stage (token ids on virtual stage 0, targets on the last); stash
               (input, output) until the backward;
    send_act   Isend the output's array; the handle is kept and waited at the end of the step;
    recv_grad  Irecv the gradient of the output (shape of the stashed output);
    backward   output.backward(grad) (the loss: backward with 1/microbatches), drop the stash;
               where the schedule has a weight action for this (microbatch, chunk) this is B:
               `backward(grad, inputs=(input,), defer=WeightGrads())` computes the input's
               gradient and leaves the parameters' to the weight action (tensor.py);
    send_grad  Isend the input's gradient;
    weight     W: run what B left (`WeightGrads.run`): the parameter gradients accumulate and the
               data-parallel / ZeRO grad hooks fire here, so gradient reductions start after W.
Two consecutive stages on this rank (ZB-V's chunk 0 -> 1 on the last rank) hand over without a
message: the forward's output becomes the next chunk's input leaf, B's input gradient the
previous chunk's output gradient.
Tags come from `schedules.message_tag`, so every MPI message is matched by tag, not by order.
A send and the receive right after it are posted together (`simulate.message_groups`,
`Communicator.isend_irecv`): NCCL has no tags, matches messages in posting order and its sends
wait for their receiver, so 1F1B's "send the activation, then receive a gradient" on both
sides of a boundary would deadlock if posted one by one; as one NCCL group it cannot. Where the
schedule still could (`simulate.check_in_order_transport`: interleaved with m > pp), GPU arrays
go through host memory and MPI instead. Arrays travel with the buffer methods (never pickled). The pp communicator
is per (dp, tp) coordinate, so with tp > 1 every tp rank of a stage talks to the same tp rank of
its neighbour. Data-parallel gradient hooks on the parameters simply fire inside the backwards
(inside the weight actions where the schedule splits them);
the tied embedding/head copies on the first and last stage are kept equal by DataParallel
(gradients summed over `mesh.embedding_comm`). `run(batches, forward_only=True)` evaluates:
forwards only, in `schedules.forward_only` order, no graph. `measured_bubble()` is the idle
fraction of the steps so far (time outside forward/backward/weight over time in `run`);
`peak_stash` the most chunk activations held at once (from a forward until its backward, or its
weight action where the backward is split), the executor's count of what `simulate.simulate` predicts.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy

from hpcpar import backend
from hpcpar.autograd.tensor import Tensor, WeightGrads, no_grad
from hpcpar.parallel.pp import schedules
from hpcpar.parallel.pp.schedules import Action, Kind, Placement
from hpcpar.parallel.pp.simulate import message_groups
from hpcpar.runtime.topology import Axis
from hpcpar.runtime.trace import Tracer


class PipelineExecutor:
    """Replays one rank's schedule actions for a training step (see the module doc).

    Args:
        stages: this rank's chunks (from `stages.build_stages`); anything callable as
            `stage(x, targets=None)` with a `.config` (`n_embd`, `dtype`) works.
        mesh: gives `size/rank("pp")`, `size("tp")` and `comm("pp")`.
        actions: this rank's list, `schedules.build(name, pp, m, chunks)[mesh.rank(Axis.PP)]`.
        microbatches: m; each micro-batch's loss is backpropagated with scale 1/m.
        tracer: a `Tracer`; when enabled, every action becomes a span (pid = its rank,
            tid = the chunk) and the final wait for sends one more.
        in_order_safe: the whole schedule (every rank's list) passes
            `simulate.check_in_order_transport`; if not, GPU arrays travel through host memory.
        placement: where the virtual stages are (`schedules.placement(name, pp, chunks)`);
            default the loop over `len(stages)` chunks.

    Attributes:
        rng_contexts: None, or per micro-batch the `rng_context` (seed, step, sample_ids) that is
            set on the stage before that micro-batch's forward (dropout masks), for the next `run`.
        peak_stash: the most chunk activations this rank held at once in any training step so far
            (`simulate.SimResult.peak_stash` predicts it).
    """

    def __init__(self, stages: Sequence[Any], mesh, actions: Sequence[Action], microbatches: int,
                 tracer: Tracer | None = None, in_order_safe: bool = True, placement: Placement | None = None):
        self.stages = list(stages)
        self.actions = list(actions)
        self.microbatches = microbatches
        self.tracer = tracer
        self.rng_contexts: Sequence[Any] | None = None
        self.pp, self.pp_rank = mesh.size(Axis.PP), mesh.rank(Axis.PP)
        self.tp = mesh.size(Axis.TP)
        self.comm = mesh.comm(Axis.PP)
        self.chunks = len(self.stages)
        self.placement = placement if placement is not None else Placement(self.pp, self.chunks)
        if self.placement.chunks != self.chunks or self.placement.pp != self.pp:
            raise ValueError(f"{self.placement} does not fit {self.chunks} stages on {self.pp} pipeline ranks")
        self.last_stage = self.placement.stages - 1
        # (microbatch, chunk) whose backward is split: B in `backward`, W in `weight`.
        self.split = {(a.microbatch, a.chunk) for a in self.actions if a.kind == Kind.WEIGHT}
        self.step = 0
        self._busy = 0.0   # seconds of forward/backward over all training steps
        self._wall = 0.0   # seconds inside run() over all training steps
        self.peak_stash = 0  # most (microbatch, chunk) activations held at once in a training step
        for a in self.actions:
            if not (0 <= a.chunk < self.chunks and 0 <= a.microbatch < microbatches):
                raise ValueError(f"{a} does not fit {self.chunks} chunks x {microbatches} microbatches")
        config = self.stages[0].config
        # Megatron-SP: activations between blocks are split along the sequence over tp.
        self._split_t = self.tp if getattr(self.stages[0], "sequence_parallel", False) else 1
        # Activations travel in the stages' storage dtype (16 bits under mixed precision).
        self._channels = config.n_embd
        self._dtype = getattr(self.stages[0], "activation_dtype", config.dtype)
        # Each micro-batch's loss is backpropagated times this (fp16 loss scaling; set per step).
        self.loss_scale = 1.0
        self._compute = {Kind.FORWARD: self._forward, Kind.BACKWARD: self._backward, Kind.WEIGHT: self._weight}
        # Pipeline messages of GPU arrays go through host memory (MPI, matched by tag) when this
        # schedule could deadlock on NCCL's in-order matching (`simulate.check_in_order_transport`).
        self.host_messages = backend.name() == "cupy" and not in_order_safe

    def run(self, batches: Sequence[tuple[Any, Any]], forward_only: bool = False) -> list[float]:
        """One step over `batches` (pairs (x, y) of int [mbs, T], or with packed documents triples
        (x, y, `data.packing.Documents`), given to every stage); returns the per-microbatch
        losses on the rank holding the last virtual stage, else [].

        Training (default): exactly `microbatches` batches, replayed per the schedule, gradients
        accumulated into the parameters' `.grad`. `forward_only=True` (evaluation): any number
        of batches, forwards only (`schedules.forward_only`), no graph kept.
        """
        if forward_only:
            actions = schedules.forward_only(self.pp, self.pp_rank, len(batches), self.chunks, self.placement)
            with no_grad():
                return self._replay(actions, _Step(batches, len(batches), backward=False))
        if len(batches) != self.microbatches:
            raise ValueError(f"got {len(batches)} micro-batches, the schedule has {self.microbatches}")
        start = time.perf_counter()
        losses = self._replay(self.actions, _Step(batches, self.microbatches, backward=True,
                                                  contexts=self.rng_contexts))
        self._wall += time.perf_counter() - start
        self.step += 1
        return losses

    def measured_bubble(self) -> float | None:
        """This rank's idle fraction over the training steps run so far: 1 - (time in forward,
        backward and weight actions) / (time in run()); None before the first step. Includes message waits and
        whatever else runs inside a step's backward (e.g. data-parallel hooks count as busy).
        On a GPU the clock measures the host issuing kernels, not the kernels themselves."""
        return 1.0 - self._busy / self._wall if self._wall > 0 else None

    def measured_busy(self) -> float:
        """Seconds this rank spent in forward, backward and weight actions over the training
        steps so far (a step's idle time is its length minus its share of this)."""
        return self._busy

    # -- replay: one handler per action kind ---------------------------------------------------

    def _replay(self, actions: Sequence[Action], st: "_Step") -> list[float]:
        mbs, t = st.batches[0][0].shape
        st.act_shape = (mbs, t // self._split_t, self._channels)
        tracer = self.tracer if self.tracer is not None and self.tracer.enabled else None
        for group in message_groups(actions):
            start = time.perf_counter()
            kind = group[0].kind
            if kind in schedules.COMPUTE:
                self._compute[kind](st, group[0])
            else:
                self._messages(st, group)
            if kind in schedules.COMPUTE or tracer is not None:
                end = time.perf_counter()
                if kind in schedules.COMPUTE and st.backward:
                    self._busy += end - start
                    # Held: stashed for the backward, or (split) what B left for the weight action.
                    self.peak_stash = max(self.peak_stash, len(st.stash) + len(st.weights))
                if tracer is not None:
                    for action in group:
                        tracer.record(action.kind, "compute" if kind in schedules.COMPUTE else "comm", start, end,
                                      tid=action.chunk, args={"step": self.step, "mb": action.microbatch,
                                                              "stage": self._stage(action), "eval": not st.backward})
        start = time.perf_counter()
        for handle in st.sends:
            handle.wait()
        if tracer is not None:
            tracer.record("wait_sends", "comm", start, time.perf_counter(), tid=0,
                          args={"step": self.step, "sends": len(st.sends), "eval": not st.backward})
        assert not (st.stash or st.inputs or st.grads_in or st.grads_out or st.weights), \
            "the schedule left work undone"
        if not st.losses:
            return []
        # One device-to-host copy per step for every micro-batch's loss (not one sync each).
        xp = backend.array_module(st.losses[0])
        return [float(v) for v in backend.to_host(xp.stack([st.losses[j] for j in sorted(st.losses)]))]

    def _stage(self, action: Action) -> int:
        return self.placement.stage(self.pp_rank, action.chunk)

    def _tag(self, action: Action, m: int) -> int:
        return schedules.message_tag(action, self.pp_rank, self.placement, m)

    # -- messages: a send alone, a receive alone, or a send with the receive after it ------------

    def _messages(self, st: "_Step", group: list[Action]) -> None:
        """Post the group's send (Isend, waited at the end of the step) and its receive (waited
        now: the next compute needs it). A send and a receive go out together (one NCCL group);
        `host_messages` moves device arrays through host memory (MPI) instead."""
        send = next((a for a in group if a.kind in schedules.SENDS), None)
        recv = next((a for a in group if a.kind in schedules.RECVS), None)
        xp = numpy if self.host_messages else backend.xp
        data = self._outgoing(st, send) if send is not None else None
        if self.host_messages and data is not None:
            data = backend.to_host(data)
        buf = self._incoming(st, recv, xp) if recv is not None else None
        if send is not None and recv is not None:
            sent, received = self.comm.isend_irecv(data, send.peer, buf, recv.peer, self._tag(send, st.m),
                                                   self._tag(recv, st.m))
        else:
            sent = self.comm.isend(data, send.peer, self._tag(send, st.m)) if send is not None else None
            received = self.comm.irecv(buf, recv.peer, self._tag(recv, st.m)) if recv is not None else None
        if sent is not None:
            st.sends.append(sent)
        if received is not None:
            arrived = received.wait()
            self._arrived(st, recv, backend.to_device(arrived) if self.host_messages else arrived)

    def _outgoing(self, st: "_Step", action: Action):
        """The array a send action moves: the stashed output (send_act), the input gradient (send_grad)."""
        key = st.key(action)
        if action.kind == Kind.SEND_ACT:
            return (st.stash[key][1] if st.backward else st.stash.pop(key)[1]).data
        return st.grads_out.pop(key)

    def _incoming(self, st: "_Step", action: Action, xp):
        """A buffer (of array module `xp`) for what a receive action brings: [mbs, T(/tp), C]
        activations, or the gradient of a stashed output (its shape)."""
        if action.kind == Kind.RECV_ACT:
            return xp.empty(st.act_shape, dtype=self._dtype)
        out = st.stash[st.key(action)][1]
        return xp.empty(out.shape, dtype=out.dtype)

    def _arrived(self, st: "_Step", action: Action, data) -> None:
        """An activation becomes a leaf (its gradient is wanted in training); a gradient waits
        for its backward."""
        if action.kind == Kind.RECV_ACT:
            st.inputs[st.key(action)] = Tensor(data, requires_grad=st.backward)
        else:
            st.grads_in[st.key(action)] = data

    # -- compute ---------------------------------------------------------------------------------

    def _forward(self, st: "_Step", action: Action) -> None:
        """Run the chunk on token ids (first stage) or the received (or handed-over) activation;
        stash (in, out) for the backward, or for the send when evaluating."""
        key, v = st.key(action), self._stage(action)
        stage = self.stages[action.chunk]
        x, y, *packed = st.batches[action.microbatch]   # packed: [data.packing.Documents] or []
        if st.contexts is not None:
            stage.rng_context = st.contexts[action.microbatch]
        inp = x if v == 0 else st.inputs.pop(key)
        documents = {"documents": packed[0]} if packed else {}
        if v == self.last_stage:
            out = stage(inp, y, **documents)
            st.losses[action.microbatch] = out.data  # a device scalar: read once at the end of the step
        else:
            out = stage(inp, **documents)
            assert out.shape == st.act_shape, f"stage {v} produced {out.shape}, expected {st.act_shape}"
        above = self.placement.local(self.pp_rank, action.chunk, +1)
        if above is not None:  # the next stage is on this rank: its input, with no message
            st.inputs[(action.microbatch, above)] = Tensor(out.data, requires_grad=st.backward)
        if st.backward or (v < self.last_stage and above is None):
            st.stash[key] = (inp, out)

    def _backward(self, st: "_Step", action: Action) -> None:
        """The backward of the stashed output; only B (the input's gradient) where the schedule
        has a weight action for it, the rest kept in `st.weights` for that action."""
        key, v = st.key(action), self._stage(action)
        inp, out = st.stash.pop(key)
        # The loss is a mean over the micro-batch; 1/m makes the sum over m a global mean.
        if v == self.last_stage:
            grad = backend.array_module(out.data).asarray(self.loss_scale / st.m, dtype=out.dtype)
        else:
            grad = st.grads_in.pop(key)
        if key in self.split:
            st.weights[key] = WeightGrads()
            out.backward(grad, inputs=(inp,) if v > 0 else (), defer=st.weights[key])
        else:
            out.backward(grad)
        if v > 0:
            below = self.placement.local(self.pp_rank, action.chunk, -1)
            if below is None:
                st.grads_out[key] = inp.grad
            else:  # the previous stage is on this rank: its output gradient, with no message
                st.grads_in[(action.microbatch, below)] = inp.grad

    def _weight(self, st: "_Step", action: Action) -> None:
        """W: the parameter gradients its B left (accumulated into .grad; grad hooks fire here)."""
        st.weights.pop(st.key(action)).run()


class _Step:
    """What one step's replay holds between actions, keyed by (microbatch, chunk)."""

    def __init__(self, batches: Sequence[tuple[Any, Any]], m: int, backward: bool, contexts=None):
        self.batches, self.m, self.backward = batches, m, backward
        self.contexts = contexts if backward else None  # dropout rng contexts, training only
        self.act_shape: tuple = ()
        self.inputs: dict = {}     # received activation (leaf), till its forward
        self.stash: dict = {}      # (input, output), forward till backward (or send, evaluating)
        self.grads_in: dict = {}   # received output gradient, till its backward
        self.grads_out: dict = {}  # input gradient, till it is sent
        self.sends: list = []      # handles of every Isend, waited at the end of the step
        self.losses: dict = {}     # microbatch -> loss (0-d array), last stage only
        self.weights: dict = {}    # tensor.WeightGrads B left, till its weight action

    @staticmethod
    def key(action: Action) -> tuple[int, int]:
        return action.microbatch, action.chunk
