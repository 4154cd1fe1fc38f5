"""A parameter server's rank of a run (`ps.servers`): `ServerRank`.

With `ps.servers` = S the job's last S ranks are servers (`run.build` makes them), each holding
a range of the model's flat parameter space and its optimizer state (`ParameterServer`, see
hpcpar/parallel/ps/server.py); the workers' side is `update.ServerUpdate`. A `ServerRank` has the
same `train`, `save`, `load` and `step` as a `Trainer`, and the same `Checkpointable` pair, each
collective with the workers', so that the job's code treats every rank alike.
"""

from __future__ import annotations

from collections.abc import Callable

from hpcpar import backend
from hpcpar.config.sections import Config
from hpcpar.optim.optimizers import lr_at
from hpcpar.parallel.pp.stages import build_stages
from hpcpar.parallel.ps.ownership import sync_points
from hpcpar.parallel.ps.server import ParameterServer
from hpcpar.runtime.agreement import agree
from hpcpar.runtime.comm import Communicator, mpi_self
from hpcpar.runtime.mesh import Mesh
from hpcpar.state import SavedState, StoredState
from hpcpar.training.trainer import REQUEUE_STATUS, RunResult, Trainer, optimizer_factory


class ServerRank:
    """A parameter server's rank: its range of the model and optimizer state, serving the
    workers' steps. `comm`: the mpi4py communicator of the whole job (workers first)."""

    def __init__(self, cfg: Config, comm):
        self.cfg = cfg
        t, rank = cfg.train, comm.Get_rank()
        workers = comm.Get_size() - cfg.ps.servers
        self.server_comm = Communicator(comm.Split(1, rank), "servers")  # collective with the workers' Split
        self.job = Communicator(comm, "workers+servers")
        # The model as one process builds it (decision 5: the same values as any layout's slices).
        alone = Mesh(comm=mpi_self())
        stages = build_stages(cfg.model, alone, chunks=1, seed=t.seed)
        init = {n: (backend.to_host(p.data), p.no_decay) for s in stages for n, p in s.named_parameters()
                if not p.tied_to}
        del stages
        alone.free()
        self.server = ParameterServer(init, self.job, self.server_comm, workers, optimizer_factory(t),
                                      cfg.ps.mode, cfg.ps.staleness,
                                      lambda step: lr_at(step, t.lr, t.warmup, t.steps, t.min_lr), t.grad_clip,
                                      t.microbatches, cfg.ps.stale_weight)
        self.step = 0
        self.save_in_flight = None

    def free(self) -> None:
        """Release the servers' communicator (collective with the other servers)."""
        self.server_comm.free()

    def train(self, steps: int | None = None, *, files: bool = True, progress: bool | None = None,
              on_step: Callable[[dict], None] | None = None, peak_flops: float | None = None) -> RunResult:
        """Serve the workers' steps from `self.step` (collective with their `Trainer.train`, same arguments)."""
        c, first = self.cfg, self.step
        end = c.train.steps if steps is None else self.step + steps
        every = c.checkpoint.every if files else 0

        def at_point(step: int) -> None:
            self.step = step
            if every and step % every == 0:
                self._checkpoint()
        self.step, stopped = self.server.serve(first, end, sync_points(first, end, every, c.run.eval_every), at_point)
        if files:
            self._checkpoint(final=True)
        self.job.all_gather_object(self.server.report(self.step - first))
        return RunResult(REQUEUE_STATUS if stopped else 0, {})

    def _checkpoint(self, final: bool = False) -> None:
        self.finish_save()
        ck = self.cfg.checkpoint
        self.save(self.cfg.checkpoint_dir, keep=ck.keep, async_save=ck.async_save and not final)

    def checkpoint_state(self) -> SavedState:
        """This server's range of the model and optimizer state, and the run position
        (collective with the workers' `Trainer.checkpoint_state`: the optimizer step goes to them)."""
        return SavedState.merged([SavedState(meta={"step": self.step}), self.server.checkpoint_state()])

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """Learn the workers' verdict on the checkpoint (`ServerUpdate.agree_on`), then take this
        server's range and, unless weights only, the run position."""
        agree(self.job)
        self.server.load_checkpoint_state(stored)
        if not stored.weights_only:
            stored.read({}, lambda _: setattr(self, "step", int(stored.meta["step"])))

    # Saving and loading go by `checkpoint_state` / `load_checkpoint_state` as a Trainer's do, and
    # with the same rule for the asynchronous save in flight.
    save, finish_save, load = Trainer.save, Trainer.finish_save, Trainer.load
