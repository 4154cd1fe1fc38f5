"""The run configuration's eight frozen sections and the `Config` that holds them.

A `Config` is eight sections: model, mesh, data, train, pipeline, checkpoint, run, ps. The
`[model]` section is the model's own config, `nn.gpt.GPTConfig`, so `GPT(cfg.model)` needs no
translation. Every field carries its documentation in `metadata["doc"]` (and its allowed values in
`metadata["choices"]` where there is a fixed set; see `schema.field`); `load.to_toml` writes those
as comments, so the shipped `hpcpar/defaults/default.toml` and `docs/config.md` describe the same
fields as the code.

`SECTIONS` maps each section's name to its class in file order, `FIELD_TYPES` each key to its
Python type. Reading a TOML file is `config.load`, checking values `config.validate`, the memory
model `config.memory`.
"""

import dataclasses
import os
import typing
from dataclasses import dataclass, field

from hpcpar.backend.precision import PRECISIONS
from hpcpar.nn.gpt import RECOMPUTE_MODES, GPTConfig
from hpcpar.schema import field as _field

# run.mfu_peak's named peaks: the planner's vendor presets (planner.hardware.PRESETS, a layer above;
# tests/unit/test_config.py checks that the two agree).
MFU_PEAK_PRESETS = ("a100", "h100")
# train.grad_compression's choices (hpcpar.parallel.dp.compression.compressors.KINDS, which imports MPI: loading a
# config must not) and the old 16-bit wire key it replaces, kept as an alias: every config.toml
# written before it (every checkpoint's too) names train.grad_wire_dtype.
COMPRESSION_KINDS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
WIRE_DTYPE_ALIAS = {"float32": "none", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class MeshConfig:
    """Parallel degrees; their product is the number of ranks. 0 = auto (`topology.resolve_degrees`)."""

    dp: int = _field(0, "data-parallel degree (0 = auto: world // (tp * pp * cp))")
    tp: int = _field(0, "tensor-parallel degree (0 = auto: 1)")
    pp: int = _field(0, "pipeline stages (0 = auto: 2 when the world is even and >= 4 and dp, tp, "
                        "cp are auto, else 1)")
    sequence_parallel: bool = _field(False, "split LayerNorm/dropout activations along the sequence "
                                            "across tp ranks (Megatron-SP); a no-op when tp == 1")
    cp: int = _field(0, "context-parallel degree: the sequence is split over cp ranks (0 = auto: 1)")
    cp_impl: str = _field("ring", "context parallelism: ring attention (K/V passed around the cp ring, "
                                  "zigzag-balanced; block_size divisible by 2*cp) or ulysses (all-to-all "
                                  "to whole heads; n_head divisible by tp*cp)", ("ring", "ulysses"))
    dp_replicate: int = _field(1, "HSDP: dp = dp_replicate x dp_shard; ZeRO (train.zero >= 1) shards model "
                                  "state over dp_shard (x cp), ideally inside a node, and replicates it across "
                                  "dp_replicate (1 = no HSDP: the shard group is dp x cp); divides dp")
    ep: int = _field(1, "expert parallelism: the MoE experts (model.moe_experts) are divided among ep ranks "
                        "borrowed from dp_shard; divides dp_shard and moe_experts (1 = every rank holds every "
                        "expert)")


@dataclass(frozen=True)
class DataConfig:
    corpus: str = _field("", "bytes: a text file or directory of text files (\"\" = the Python standard "
                             "library's source, embedded); bin/hdf5: a token file, or a directory from "
                             "`hpcpar data prepare` (or nanoGPT's train.bin + val.bin)")
    val_fraction: float = _field(0.05, "fraction of the corpus (its tail) held out for evaluation, "
                                       "0 <= val_fraction < 1 (a directory with val.bin or a val dataset: "
                                       "that instead)")
    format: str = _field("bytes", "how the corpus is read: bytes = text as byte tokens (vocabulary 256); "
                                  "bin = a flat token file, memory-mapped (nanoGPT layout); hdf5 = a 1-D "
                                  "token dataset, read by hyperslab; each rank reads only its samples",
                         ("bytes", "bin", "hdf5"))
    token_dtype: str = _field("uint16", "integer type of a bin token file (hdf5 uses its dataset's type)",
                              ("uint16", "uint32"))
    packing: str = _field("none", "none = windows of the token stream, attention and positions across "
                                  "documents; documents = the same windows, each document start inside one "
                                  "begins a segment attended on its own (positions from 0, no attention across, "
                                  "the target crossing a boundary left out of the loss)", ("none", "documents"))
    balance: str = _field("none", "how a global batch's packed windows are dealt to dp ranks and micro-batches: "
                                  "none = in sample-id order; attention = longest first onto the least loaded, "
                                  "balancing attention work sum(len^2) per dp rank and micro-batch (needs "
                                  "packing = documents)", ("none", "attention"))


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _field(300, "optimizer steps")
    micro_batch_size: int = _field(12, "sequences per micro-batch per data-parallel rank")
    microbatches: int = _field(2, "micro-batches per step (gradient accumulation / pipeline micro-batches); "
                                  "global batch = dp * micro_batch_size * microbatches sequences")
    lr: float = _field(3e-3, "peak learning rate, after warm-up (> 0)")
    min_lr: float = _field(3e-4, "learning rate at the end of the cosine decay, 0 <= min_lr <= lr")
    warmup: int = _field(20, "linear warm-up steps (>= 0; a warning when >= steps)")
    weight_decay: float = _field(0.1, "decoupled weight decay (AdamW; not applied to biases and LayerNorm)")
    beta1: float = _field(0.9, "AdamW first-moment decay, 0 < beta1 < 1")
    beta2: float = _field(0.95, "AdamW second-moment decay, 0 < beta2 < 1")
    eps: float = _field(1e-8, "AdamW denominator epsilon (> 0)")
    grad_clip: float = _field(1.0, "clip the global gradient norm to this (0 = no clipping)")
    seed: int = _field(1337, "seed of parameter initialisation and batch sampling (>= 0)")
    zero: int = _field(0, "ZeRO stage: 0 = everything replicated, 1 = optimizer state sharded over dp, "
                          "2 = gradients too, 3 = parameters too (FSDP: gathered unit by unit)", (0, 1, 2, 3))
    reshard_after_forward: bool = _field(True, "ZeRO-3: free each unit's gathered parameters after its forward "
                                               "and gather them again for backward (false: keep them from "
                                               "forward to backward, one all-gather fewer, more memory)")
    prefetch_units: int = _field(3, "ZeRO-3: units (blocks, embedding, head) whose all-gathers are issued ahead of "
                                    "the one computing, >= 0 (0 = each gathered when needed; each one more unit "
                                    "of gathered parameters in memory)")
    optimizer: str = _field("adamw", "optimizer", ("adamw", "sgd"))
    momentum: float = _field(0.9, "SGD momentum, 0 <= momentum < 1 (optimizer = \"sgd\" only)")
    bucket_mb: float = _field(25.0, "data-parallel gradient bucket size in MiB (> 0); with ps.servers, the size of "
                              "the push pieces sent during backward")
    sparse_embedding: str = _field("auto", "untied embeddings (model.tie_embeddings = false), no compression: "
                                           "auto = each step wte's gradient travels as (row id, row) pairs of the "
                                           "rows touched (zero 1-3: each row to its owner only) when that is fewer "
                                           "bytes than the dense all-reduce (reduce-scatter), else dense (the same "
                                           "choice on every rank); with ps.servers, a worker pushes the rows it "
                                           "touched and pulls the rows its next step looks up (every row before an "
                                           "evaluation, checkpoint or the end); never = always dense. Compression: "
                                           "always dense",
                                   ("auto", "never"))
    grad_compression: str = _field("none", "gradient compression on the data-parallel wire: none; fp16/bf16 = "
                                           "16-bit values summed in float32; int8 = blockwise absmax int8, two "
                                           "compressed phases; topk = the compression_ratio largest entries per "
                                           "bucket as (index, value) pairs; powersgd = rank-powersgd_rank factors "
                                           "of every matrix (zero 0-2; under HSDP the dp_replicate axis is "
                                           "compressed, PowerSGD all of dp)", COMPRESSION_KINDS)
    compression_ratio: float = _field(0.01, "top-k: fraction of each bucket's entries sent, 0 < ratio <= 1")
    powersgd_rank: int = _field(4, "PowerSGD: rank of the factors P [a, r] and Q [b, r] of each [a, b] "
                                   "gradient matrix (>= 1; min(rank, a, b) per matrix)")
    compression_start_step: int = _field(0, "steps before this one reduce gradients uncompressed (warm-up), "
                                            "as PyTorch's PowerSGD hook does; topk and powersgd with error "
                                            "feedback need one (about a third of a short run): from step 0 the "
                                            "residual pays the first steps' large gradients back late")
    error_feedback: bool = _field(True, "int8, topk, powersgd: add what compression dropped (the residual, "
                                        "kept per bucket and saved in checkpoints) to the next step's gradient; "
                                        "the 16-bit wires keep none")
    int8_block_size: int = _field(256, "int8: values per float32 absmax scale (>= 1)")
    sync: str = _field("step", "how the data-parallel replicas (the mesh.dp_replicate groups) stay together: "
                               "step = gradients averaged over all of dp every step; local = local SGD: inside a "
                               "replica every step, across replicas the parameters averaged every sync_every steps; "
                               "diloco = the replicas' averaged parameter change every sync_every steps is the "
                               "gradient of an outer Nesterov SGD (outer_lr, outer_momentum)",
                       ("step", "local", "diloco"))
    sync_every: int = _field(50, "local / diloco: steps between two synchronisations of a fragment, H (>= 1)")
    outer_lr: float = _field(0.7, "diloco: outer learning rate (> 0; DiLoCo's 0.7)")
    outer_momentum: float = _field(0.9, "diloco: outer momentum, 0 <= momentum < 1 (0 = plain outer SGD)")
    outer_nesterov: bool = _field(True, "diloco: Nesterov outer momentum (false: heavy ball)")
    sync_fragments: int = _field(1, "local / diloco, streaming: the model cut into this many fragments of "
                                    "consecutive blocks (divides model.n_layer and sync_every), synchronised "
                                    "sync_every / sync_fragments steps apart")
    sync_delay: int = _field(0, "local / diloco, streaming: steps a fragment's reduction runs behind the "
                                "training before its result lands (0 = at once; < sync_every)")
    sync_mix: float = _field(0.0, "local / diloco: when a result lands, the replica's parameters become "
                                  "mix * its own + (1 - mix) * the outer result, 0 <= mix < 1")
    outer_compression: str = _field("none", "local / diloco: the outer gradient on the replicas' wire: none; "
                                            "bf16; int8 (blockwise absmax, int8_block_size); both with error "
                                            "feedback per replica", ("none", "bf16", "int8"))
    max_bad_steps: int = _field(3, "abort after this many consecutive steps with a NaN/Inf loss or "
                                   "gradient norm (each is skipped)")
    recompute: str = _field("none", "activation recomputation: none = keep every activation for backward; "
                                    "full = a block keeps only its input and runs its forward again in "
                                    "backward; selective = attention keeps no [T, T] probabilities and "
                                    "recomputes them (results are bitwise those of none)",
                            RECOMPUTE_MODES)
    recompute_every: int = _field(1, "recompute every k-th block: the blocks whose global index % k == 0 "
                                     "(1 = every block)")
    precision: str = _field("full", "full = every array in model.dtype; bf16 / fp16 = mixed precision: "
                                    "activations stored in 16 bits and computed in float32, weights read "
                                    "rounded to 16 bits; master weights, gradients and optimizer state stay "
                                    "in model.dtype (fp16 with loss scaling)", PRECISIONS)
    grad_reduce_dtype: str = _field("fp32", "dtype of the data-parallel gradient reduction: fp32 = the "
                                            "gradients' own (model.dtype); bf16 / fp16 = 16-bit values summed in "
                                            "float32 (the same as grad_compression = \"bf16\" / \"fp16\")",
                                    ("fp32", "bf16", "fp16"))
    loss_scale: float = _field(0.0, "precision = fp16: a static loss scale (> 0), or 0 = dynamic loss scaling")
    initial_loss_scale: float = _field(65536.0, "dynamic loss scaling: the first scale (> 0)")
    loss_scale_window: int = _field(1000, "dynamic loss scaling: steps without overflow before the scale "
                                          "grows (>= 1)")
    loss_scale_growth: float = _field(2.0, "dynamic loss scaling: growth factor (> 1)")
    loss_scale_backoff: float = _field(0.5, "dynamic loss scaling: backoff factor after an overflow, in (0, 1)")
    loss_scale_hysteresis: int = _field(2, "dynamic loss scaling: overflows tolerated since the last growth "
                                           "before the scale backs off (>= 1)")
    min_loss_scale: float = _field(1.0, "dynamic loss scaling: the scale never backs off below this (> 0); an "
                                        "overflow at the minimum counts as a bad step (train.max_bad_steps)")


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = _field("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved (chunks > 1), zbh1 / zbv "
                                   "(zero bubble: backward split into B and W; zbv runs two chunks per rank in a V)",
                           ("gpipe", "1f1b", "interleaved", "zbh1", "zbv"))
    chunks: int = _field(0, "model chunks per pipeline rank (0 = the schedule's own: 2 for zbv, else 1; "
                            "> 1 only with schedule = \"interleaved\")")
    trace: bool = _field(False, "write a per-rank timeline of pipeline actions into the run directory")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = _field("", "checkpoint directory (\"\" = <run.dir>/checkpoints)")
    every: int = _field(0, "save every this many steps (0 = only at the end)")
    keep: int = _field(3, "keep the newest this many checkpoints (>= 1)")
    resume: str = _field("", "\"\" = start fresh, \"auto\" = newest checkpoint in dir if any, "
                             "or a checkpoint path")
    async_save: bool = _field(False, "write checkpoints in a background thread while training goes on")
    format: str = _field("per_rank", "per_rank: every writing rank its own HDF5 file (any h5py); shared: one HDF5 "
                                     "file written collectively through MPI-IO (h5py built with MPI, parallel HDF5)",
                         ("per_rank", "shared"))
    location: str = _field("auto", "whether checkpoint.dir is one filesystem every node sees (shared) or each "
                                   "node's own disk, the same path on every node (node-local: every node keeps a "
                                   "full copy, replicated over MPI, so a resume on other or more nodes finds it); "
                                   "auto: probed when the run starts", ("auto", "shared", "node-local"))
    memory_every: int = _field(0, "in-memory partner snapshots every this many steps (0 = off): each rank keeps "
                                  "its state and a copy of a partner's, on the next node, sent while the next "
                                  "step runs; what run.on_failure = \"shrink\" rolls back to, and (with "
                                  "memory_dir) what a requeued run resumes from")
    memory_dir: str = _field("", "with memory_every: a node-local directory (e.g. /tmp, /dev/shm) where every "
                                 "snapshot a node holds is also written, so that a requeued run resumes from the "
                                 "survivors' copies when they are newer than the last checkpoint (\"\" = memory "
                                 "only)")


@dataclass(frozen=True)
class RunConfig:
    dir: str = _field("runs/default", "run directory: metrics.jsonl, config.toml, summary, checkpoints")
    log_every: int = _field(10, "log training metrics every this many steps (>= 1)")
    eval_every: int = _field(50, "evaluate on held-out data every this many steps (0 = never)")
    eval_batches: int = _field(2, "global batches of held-out samples per evaluation (>= 1)")
    timeout: float = _field(300.0, "watchdog: seconds a collective may wait before the job aborts (> 0)")
    backend: str = _field("auto", "array backend: numpy (CPU), cupy (GPU), or auto = the HPCPAR_BACKEND "
                                  "environment variable, else numpy", ("auto", "numpy", "cupy"))
    progress: bool = _field(True, "progress bar on rank 0 when its stderr is a terminal; otherwise (a batch job's "
                                  "output file, a pipe) a plain line every log_every steps")
    overwrite: bool = _field(False, "a fresh start (checkpoint.resume = \"\") in a run directory that holds another "
                                    "run's metrics.jsonl or checkpoints deletes them first (false: refused)")
    mfu_peak: str = _field("auto", "the peak MFU is relative to: \"measure\" = the best of several GEMM timings "
                                   "at start-up; \"auto\" = that or, when higher, the calibration `hpcpar plan "
                                   "--calibrate` stored for this machine and model.dtype (CPU); \"a100\" / "
                                   "\"h100\" = the vendor's dense 16-bit peak per rank; or a number: FLOP/s per "
                                   "rank (e.g. \"989e12\")")
    debug_slow_ranks: str = _field("", "debug (stragglers for study): comma-separated world ranks whose steps are "
                                   "slowed by run.debug_slow_factor (a sleep after their forward/backward), or "
                                   "\"random\": at every step one worker rank drawn from (seed, step)")
    debug_slow_factor: float = _field(1.0, "debug: the slowed ranks' forward/backward takes this many times as "
                                      "long (>= 1; 1 = off)")
    debug_check_every: int = _field(0, "every this many ops, check that all ranks issued the same "
                                       "collectives (0 = off)")
    on_failure: str = _field("abort", "a rank or node lost mid-run: abort = the job ends (requeue it to resume); "
                                      "shrink = where the MPI has ULFM (Open MPI 5, mpirun --with-ft ulfm), the "
                                      "survivors roll back to the last partner snapshot (checkpoint.memory_every; "
                                      "else the last checkpoint) and go on with fewer data-parallel replicas and the "
                                      "same global batch", ("abort", "shrink"))
    debug_fail_at: str = _field("", "tests: \"R[,R...]@S\" ends world ranks R (os._exit) at the start of step S; "
                                    "\"R@S/exchange\" right after step S's partner snapshot exchange starts")


@dataclass(frozen=True)
class PSConfig:
    servers: int = _field(0, "parameter-server ranks: the last `servers` ranks of the world own the parameters and "
                          "the optimizer; the others train (0 = off: all-reduce data parallelism)")
    staleness: int = _field(0, "parameter server, mode = \"bounded\": a worker replica may run at most this many "
                            "steps ahead of the slowest (0 = synchronous: each step averages every replica's gradient)")
    mode: str = _field("bounded", "parameter server: bounded = staleness-bounded (0: synchronous; k > 0: stale "
                       "synchronous parallel); async = no bound, each replica's push joins the open step as it arrives",
                       ("bounded", "async"))
    stale_weight: float = _field(0.0, "parameter server, SSP and async: a push computed on parameters tau optimizer "
                                 "steps old enters its step's mean with weight stale_weight**tau, 0 <= stale_weight "
                                 "<= 1 (1 = as fresh; 0 = dropped, as a backup worker's)")


@dataclass(frozen=True)
class Config:
    """The whole run configuration; `validate` returns one with the mesh degrees resolved."""

    model: GPTConfig = field(default_factory=GPTConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    ps: PSConfig = field(default_factory=PSConfig)

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints go: checkpoint.dir, or <run.dir>/checkpoints when that is ""."""
        return self.checkpoint.dir or os.path.join(self.run.dir, "checkpoints")


# Section name -> section class, in file order.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}
# Section name -> key -> Python type (resolved: a module with postponed annotations, like
# nn/gpt.py, leaves `Field.type` a string).
FIELD_TYPES: dict[str, dict[str, type]] = {name: typing.get_type_hints(cls) for name, cls in SECTIONS.items()}
