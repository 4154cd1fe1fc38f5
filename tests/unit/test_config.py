"""Config: loading, overrides, every validation rule with its message, mesh auto rule, round trip."""

import dataclasses
import logging
import os
from pathlib import Path

import pytest

from hpcpar import schema
from hpcpar.config.load import load_config, loads, to_dict, to_toml
from hpcpar.config.memory import estimate_memory, memory_parts, stage_parameters, stage_units
from hpcpar.config.sections import SECTIONS, Config, DataConfig
from hpcpar.config.validate import _RANGES, doubts, validate
from hpcpar.errors import ConfigError, HpcparError, MeshError
from hpcpar.runtime.topology import resolve_degrees
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.parallel.tp import layers as tensor_parallel

REPO = Path(__file__).resolve().parents[2]


def _validate(overrides, world=1, memory=None):
    return validate(load_config(None, overrides), world, memory)


# (overrides, world size, fragment the one-line message must contain)
BAD = [
    # single-value ranges
    (["model.vocab_size=100"], 1, 'model.vocab_size=100 is invalid: must be >= 256 with data.format="bytes"'),
    (["model.vocab_size=0", "data.format=bin"], 1, "model.vocab_size=0 is invalid: must be >= 1"),
    (["model.block_size=1"], 1, "model.block_size=1 is invalid: must be >= 2"),
    (["model.n_layer=0"], 1, "model.n_layer=0 is invalid: must be >= 1"),
    (["model.n_head=0"], 1, "model.n_head=0 is invalid: must be >= 1"),
    (["model.n_embd=0"], 1, "model.n_embd=0 is invalid: must be >= 1"),
    (["model.dropout=1.0"], 1, "model.dropout=1.0 is invalid: must be in [0, 1)"),
    (["model.dropout=-0.1"], 1, "model.dropout=-0.1 is invalid"),
    (["mesh.tp=-1"], 1, "mesh.tp=-1 is invalid: must be >= 0 (0 = auto)"),
    (["mesh.cp=-1"], 1, "mesh.cp=-1 is invalid: must be >= 0 (0 = auto)"),
    (["data.val_fraction=1.0"], 1, "data.val_fraction=1.0 is invalid: must be in [0, 1)"),
    (["train.steps=0"], 1, "train.steps=0 is invalid: must be >= 1"),
    (["train.micro_batch_size=0"], 1, "train.micro_batch_size=0 is invalid"),
    (["train.microbatches=0"], 1, "train.microbatches=0 is invalid: must be >= 1"),
    (["train.lr=-1e-3"], 1, "train.lr=-0.001 is invalid: must be > 0"),
    (["train.lr=0"], 1, "train.lr=0.0 is invalid: must be > 0"),
    (["train.min_lr=-1e-4"], 1, "train.min_lr=-0.0001 is invalid: must be >= 0"),
    (["train.warmup=-1"], 1, "train.warmup=-1 is invalid: must be >= 0"),
    (["train.weight_decay=-0.1"], 1, "train.weight_decay=-0.1 is invalid: must be >= 0"),
    (["train.beta1=1.0"], 1, "train.beta1=1.0 is invalid: must be in (0, 1)"),
    (["train.beta2=0"], 1, "train.beta2=0.0 is invalid: must be in (0, 1)"),
    (["train.eps=0"], 1, "train.eps=0.0 is invalid: must be > 0"),
    (["train.grad_clip=-1"], 1, "train.grad_clip=-1.0 is invalid: must be >= 0"),
    (["train.seed=-5"], 1, "train.seed=-5 is invalid: must be >= 0"),
    (["train.momentum=1.5", "train.optimizer=sgd"], 1, "train.momentum=1.5 is invalid: must be in [0, 1)"),
    (["train.bucket_mb=0"], 1, "train.bucket_mb=0.0 is invalid: must be > 0"),
    (["train.prefetch_units=-1"], 1, "train.prefetch_units=-1 is invalid: must be >= 0"),
    (["train.max_bad_steps=0"], 1, "train.max_bad_steps=0 is invalid: must be >= 1"),
    (["train.sync_every=0"], 1, "train.sync_every=0 is invalid: must be >= 1"),
    (["train.outer_lr=0"], 1, "train.outer_lr=0.0 is invalid: must be > 0"),
    (["train.outer_momentum=1"], 1, "train.outer_momentum=1.0 is invalid: must be in [0, 1)"),
    (["train.sync_fragments=0"], 1, "train.sync_fragments=0 is invalid: must be >= 1"),
    (["train.sync_delay=-1"], 1, "train.sync_delay=-1 is invalid: must be >= 0"),
    (["train.sync_mix=1"], 1, "train.sync_mix=1.0 is invalid: must be in [0, 1)"),
    # local SGD / DiLoCo (parallel/dp/outer.py)
    (["train.sync=diloco", "mesh.dp=4", "mesh.pp=1"], 4, "but mesh.dp_replicate=1: set mesh.dp_replicate >= 2"),
    (["train.sync=local", "mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=2", "model.n_layer=2",
      "train.sync_fragments=3", "train.sync_every=6"], 4, "train.sync_fragments=3 must divide model.n_layer=2"),
    (["train.sync=local", "mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=2", "model.n_layer=2",
      "train.sync_fragments=2", "train.sync_every=5"], 4, "and train.sync_every=5"),
    (["train.sync=diloco", "mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=2", "train.sync_every=4",
      "train.sync_delay=4"], 4, "train.sync_delay=4 must be < train.sync_every=4"),
    (["train.sync=diloco", "mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=2", "train.grad_compression=int8"], 4,
     "train.grad_compression=\"int8\" cannot be combined with train.sync=\"diloco\""),
    (["train.sync=diloco", "mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.dp_replicate=2",
      "train.outer_compression=int8"], 4, "would depend on the layout"),
    (["train.sync=diloco", "mesh.dp=3", "mesh.pp=1", "mesh.dp_replicate=3", "ps.servers=1"], 4,
     "mesh.dp_replicate=3 is not supported with a parameter server"),
    (["train.sync_delay=1"], 1, "train.sync_delay configures train.sync=\"local\" / \"diloco\""),
    # in-memory snapshots, shrink-and-continue (training/resilience.py)
    (["checkpoint.memory_every=-1"], 1, "checkpoint.memory_every=-1 is invalid: must be >= 0"),
    (["run.debug_fail_at=3"], 1, "run.debug_fail_at=\"3\" is invalid: must be \"\" or \"R[,R...]@STEP\""),
    (["checkpoint.memory_dir=/tmp"], 1, "checkpoint.memory_dir=\"/tmp\" writes the in-memory partner snapshots"),
    (["run.on_failure=shrink", "train.sync=diloco", "mesh.dp=2", "mesh.pp=1", "mesh.dp_replicate=2"], 2,
     "run.on_failure=\"shrink\" cannot be combined with train.sync=\"diloco\""),
    (["checkpoint.memory_every=2", "ps.servers=1"], 2, "checkpoint.memory_every cannot be combined with ps.servers=1"),
    (["train.recompute_every=0"], 1, "train.recompute_every=0 is invalid: must be >= 1 (1 = every block)"),
    (["pipeline.chunks=-1"], 1, "pipeline.chunks=-1 is invalid: must be >= 0 (0 = the schedule's own)"),
    (["checkpoint.every=-1"], 1, "checkpoint.every=-1 is invalid: must be >= 0"),
    (["checkpoint.keep=0"], 1, "checkpoint.keep=0 is invalid: must be >= 1"),
    (["run.dir="], 1, 'run.dir="" is invalid: must be a non-empty directory path'),
    (["run.log_every=0"], 1, "run.log_every=0 is invalid: must be >= 1"),
    (["run.eval_every=-1"], 1, "run.eval_every=-1 is invalid: must be >= 0"),
    (["run.eval_batches=0"], 1, "run.eval_batches=0 is invalid: must be >= 1"),
    (["run.timeout=0"], 1, "run.timeout=0.0 is invalid: must be > 0 seconds"),
    (["run.debug_check_every=-2"], 1, "run.debug_check_every=-2 is invalid"),
    (["run.debug_slow_factor=0.5"], 1, "run.debug_slow_factor=0.5 is invalid: must be >= 1 (1 = off)"),
    (["run.mfu_peak=-1e12"], 1, 'run.mfu_peak="-1e12" is invalid: must be "auto", "measure", "a100", "h100" or a '
                                "positive number of FLOP/s per rank"),
    (["run.mfu_peak=v100"], 1, 'run.mfu_peak="v100" is invalid'),
    (["run.debug_slow_ranks=\"1;2\""], 4,
     'run.debug_slow_ranks="1;2" is not a comma-separated list of ranks or "random"'),
    (["run.debug_slow_ranks=\"1,4\""], 4, "run.debug_slow_ranks names rank 4, outside the world of 4 ranks"),
    # parameter server
    (["ps.servers=-1"], 1, "ps.servers=-1 is invalid: must be >= 0 (0 = no parameter server)"),
    (["ps.staleness=-1", "ps.servers=1"], 4, "ps.staleness=-1 is invalid: must be >= 0 (0 = synchronous)"),
    (["ps.stale_weight=1.5", "ps.servers=1"], 4, "ps.stale_weight=1.5 is invalid: must be in [0, 1] (1 = a late "
     "push counts as fresh, 0 = dropped)"),
    (["ps.servers=4"], 4, "ps.servers=4 leaves no worker: the world has 4 ranks and the last 4 would all be "
     "servers; use ps.servers <= 3 or launch more ranks"),
    (["ps.staleness=2"], 4, "ps.staleness / ps.mode configure a parameter server, but ps.servers=0"),
    (["ps.mode=sync"], 1, 'ps.mode="sync" is not one of "bounded", "async"'),
    (["ps.servers=1", "ps.mode=async", "ps.staleness=2"], 4, 'ps.staleness=2 bounds ps.mode="bounded"'),
    (["ps.servers=1", "mesh.dp=3", "train.zero=1"], 4, "train.zero=1 is not supported with a parameter server "
     "(ps.servers=1): the servers already hold the only optimizer state; use train.zero=0 or ps.servers=0"),
    (["ps.servers=1", "mesh.dp=3", "train.grad_compression=int8"], 4, 'train.grad_compression="int8" is not '
     "supported with a parameter server"),
    (["ps.servers=1", "mesh.cp=3"], 4, "mesh.cp=3 is not supported with a parameter server"),
    (["ps.servers=1", "mesh.dp=3", "train.precision=bf16"], 4, 'train.precision="bf16" is not supported with a '
     "parameter server"),
    (["ps.servers=2", "mesh.dp=2", "mesh.dp_replicate=2", "train.zero=1"], 4, "not supported with a parameter server"),
    (["train.lr=nan"], 1, "train.lr=nan is invalid: must be a finite number"),
    (["run.timeout=inf"], 1, "run.timeout=inf is invalid: must be a finite number"),
    # fixed choices
    (["train.zero=4"], 1, "train.zero=4 is not one of 0, 1, 2, 3"),
    (["mesh.dp=4", "mesh.dp_replicate=3", "train.zero=1"], 4,
     "mesh.dp=4 is not divisible by mesh.dp_replicate=3 (HSDP: dp = dp_replicate x dp_shard); choose dp_replicate "
     "in {1, 2, 4} or use dp=6, or mesh.dp_replicate=1"),
    (["mesh.dp=4", "mesh.dp_replicate=2"], 4,
     "mesh.dp_replicate=2 splits dp for HSDP, which shards model state over dp_shard; use train.zero >= 1"),
    (["mesh.dp=4", "train.zero=3", "train.grad_wire_dtype=\"bfloat16\""], 4,
     'train.grad_compression="bf16" compresses the gradient buckets of train.zero 0-2; ZeRO-3 reduce-scatters'),
    (["mesh.dp=4", "train.zero=3", "train.grad_compression=powersgd"], 4,
     "PowerSGD needs whole matrices, which ZeRO-3 never holds"),
    (["train.grad_compression=int4"], 1, 'train.grad_compression="int4" is not one of "none", "fp16", "bf16", '
     '"int8", "topk", "powersgd"; did you mean \'int8\'?'),
    (["train.compression_ratio=0"], 1, "train.compression_ratio=0.0 is invalid: must be in (0, 1]"),
    (["train.compression_ratio=1.5"], 1, "train.compression_ratio=1.5 is invalid: must be in (0, 1]"),
    (["train.powersgd_rank=0"], 1, "train.powersgd_rank=0 is invalid: must be >= 1"),
    (["train.int8_block_size=0"], 1, "train.int8_block_size=0 is invalid: must be >= 1"),
    (["train.compression_start_step=-1"], 1, "train.compression_start_step=-1 is invalid: must be >= 0"),
    (["train.grad_wire_dtype=float16", "train.grad_compression=int8"], 1,
     'train.grad_wire_dtype="float16" (the old name of train.grad_compression="fp16") conflicts with '
     'train.grad_compression="int8"; drop train.grad_wire_dtype'),
    (["mesh.dp_replicate=0"], 1, "mesh.dp_replicate=0 is invalid: must be >= 1"),
    (["train.optimizer=adam"], 1, 'train.optimizer="adam" is not one of "adamw", "sgd"; did you mean \'adamw\'?'),
    (["pipeline.schedule=1F1B"], 1, 'pipeline.schedule="1F1B" is not one of "gpipe", "1f1b", "interleaved", '
                                     '"zbh1", "zbv"'),
    (["model.dtype=float8"], 1, 'model.dtype="float8" is not one of'),
    (["run.backend=torch"], 1, 'run.backend="torch" is not one of "auto", "numpy", "cupy"'),
    (["train.grad_wire_dtype=int8"], 1, 'train.grad_wire_dtype="int8" is not one of "float32", "float16", '
     '"bfloat16"; it is the old name of train.grad_compression'),
    (["mesh.cp_impl=star"], 1, 'mesh.cp_impl="star" is not one of "ring", "ulysses"'),
    (["mesh.cp_impl=ulyses"], 1, "did you mean 'ulysses'?"),
    (["train.recompute=partial"], 1, 'train.recompute="partial" is not one of "none", "full", "selective"'),
    (["train.recompute=ful"], 1, "did you mean 'full'?"),
    (["data.format=parquet"], 1, 'data.format="parquet" is not one of "bytes", "bin", "hdf5"'),
    (["data.token_dtype=int8"], 1, 'data.token_dtype="int8" is not one of "uint16", "uint32"'),
    (["model.preset=gpt3"], 1, 'model.preset="gpt3" is not one of "", "gpt2"; did you mean \'gpt2\'?'),
    # combinations
    (["model.n_embd=130"], 1, "model.n_embd=130 is not divisible by model.n_head=4"),
    (["model.dtype=bfloat16"], 1, 'model.dtype="bfloat16" is the master weights\' dtype and must be "float32" or '
     '"float64"; for bfloat16 activations set train.precision="bf16"'),
    (["model.dtype=float16"], 1, 'for float16 activations set train.precision="fp16"'),
    (["train.precision=half"], 1, 'train.precision="half" is not one of "full", "bf16", "fp16"'),
    (["train.loss_scale=-1", "train.precision=fp16"], 1,
     "train.loss_scale=-1.0 is invalid: must be >= 0 (0 = dynamic)"),
    (["train.loss_scale_backoff=1.5"], 1, "train.loss_scale_backoff=1.5 is invalid: must be in (0, 1)"),
    (["train.loss_scale_growth=1"], 1, "train.loss_scale_growth=1.0 is invalid: must be > 1"),
    (["train.loss_scale_hysteresis=0"], 1, "train.loss_scale_hysteresis=0 is invalid: must be >= 1"),
    (["train.min_loss_scale=0"], 1, "train.min_loss_scale=0.0 is invalid: must be > 0"),
    (["train.initial_loss_scale=0"], 1, "train.initial_loss_scale=0.0 is invalid: must be > 0"),
    (["train.loss_scale_window=0"], 1, "train.loss_scale_window=0 is invalid: must be >= 1"),
    (["train.grad_reduce_dtype=bf16", "train.grad_compression=int8"], 1,
     'train.grad_reduce_dtype="bf16" (16-bit gradients on the wire) conflicts with train.grad_compression="int8"'),
    (["train.min_lr=0.01"], 1, "train.min_lr=0.01 exceeds train.lr=0.003"),
    (["data.val_fraction=0"], 1, "run.eval_every=50 needs held-out data but data.val_fraction=0"),
    # tensor parallelism
    (["model.n_head=6", "model.n_embd=96", "mesh.tp=4"], 4,
     "model.n_head=6 is not divisible by mesh.tp=4 (a tp rank holds whole heads); choose tp in {1, 2, 3, 6}"),
    (["model.block_size=130", "mesh.tp=4", "mesh.sequence_parallel=true"], 4,
     "model.block_size=130 is not divisible by mesh.tp=4 with mesh.sequence_parallel=true"),
    (["model.block_size=130", "mesh.tp=4", "mesh.sequence_parallel=true"], 4, "use block_size=132"),
    (["model.block_size=130", "mesh.tp=4", "mesh.sequence_parallel=true"], 4, "or mesh.sequence_parallel=false"),
    # context parallelism
    (["mesh.cp=4", "model.block_size=12"], 4,
     "model.block_size=12 is not divisible by 2*mesh.cp=8 (ring attention cuts the sequence into 2*cp zigzag "
     "chunks); choose cp in {1, 2, 3, 6} or use block_size=16"),
    (["mesh.cp=3", "model.block_size=128"], 3, "model.block_size=128 is not divisible by 2*mesh.cp=6"),
    (["mesh.cp=3", "mesh.cp_impl=ulysses", "model.block_size=128"], 3,
     "model.block_size=128 is not divisible by mesh.cp=3 (each cp rank holds block_size/cp tokens)"),
    (["mesh.cp=4", "mesh.cp_impl=ulysses", "model.n_head=2", "model.n_embd=64"], 4,
     'model.n_head=2 is not divisible by mesh.tp*mesh.cp=4 (mesh.cp_impl="ulysses" gives every tp x cp rank '
     'whole heads); choose cp in {1, 2} or use n_head=4, or mesh.cp_impl="ring"'),
    (["mesh.cp=2", "mesh.tp=2", "mesh.cp_impl=ulysses", "model.n_head=2", "model.n_embd=64"], 4,
     "model.n_head=2 is not divisible by mesh.tp*mesh.cp=4"),
    (["mesh.cp=2", "mesh.tp=2", "mesh.sequence_parallel=true", "model.block_size=36"], 4,
     "model.block_size=36 is not divisible by 2*mesh.cp*mesh.tp=8 (ring attention cuts the sequence into 2*cp "
     "zigzag chunks, each split over tp by sequence parallelism); choose cp in {1, 3, 9} or use block_size=40"),
    (["mesh.cp=2", "mesh.tp=2", "mesh.sequence_parallel=true", "mesh.cp_impl=ulysses", "model.block_size=6"], 4,
     "model.block_size=6 is not divisible by mesh.cp*mesh.tp=4"),
    # pipeline
    (["model.n_layer=1"], 4, "model.n_layer=1 is fewer than mesh.pp=2 x pipeline.chunks=1 = 2 virtual stages"),
    (["model.n_layer=1"], 4, "or mesh.pp=1 (pp=2 is the auto default)"),
    (["model.n_layer=1", "mesh.pp=2"], 2, "use n_layer >= 2 or fewer stages"),
    (["model.n_layer=3", "pipeline.schedule=interleaved", "pipeline.chunks=2", "mesh.pp=2"], 2,
     "use n_layer >= 4"),
    (["pipeline.chunks=2"], 4, "set pipeline.chunks=1 (got 2) or pipeline.schedule=interleaved"),
    (["pipeline.schedule=interleaved", "pipeline.chunks=2", "train.microbatches=3"], 4,
     "needs train.microbatches (3) to be a multiple of mesh.pp (2), e.g. 4"),
    (["pipeline.schedule=interleaved", "pipeline.chunks=2"], 1, "needs mesh.pp >= 2"),
    # zero-bubble schedules: ZB-V fixes two chunks per rank (a V over 2 pp virtual stages)
    (["pipeline.schedule=zbv", "pipeline.chunks=3", "mesh.pp=2"], 2,
     "pipeline.schedule=zbv runs 2 chunks per rank (a V), fixed by the schedule: leave pipeline.chunks unset (0) "
     "or 2, not 3"),
    (["pipeline.schedule=zbv", "pipeline.chunks=1", "mesh.pp=2"], 2, "leave pipeline.chunks unset (0) or 2, not 1"),
    (["pipeline.schedule=zbv", "model.n_layer=3", "mesh.pp=2"], 2,
     "model.n_layer=3 is fewer than mesh.pp=2 x pipeline.chunks=2 (pipeline.schedule=zbv runs 2 per rank) = 4 "
     "virtual stages (each needs a layer); use n_layer >= 4"),
    (["pipeline.schedule=zbv", "mesh.pp=1"], 1, "pipeline.schedule=zbv needs mesh.pp >= 2"),
    (["pipeline.schedule=zbh1", "pipeline.chunks=2"], 4, "pipeline.schedule=zbh1 runs one chunk per rank"),
    # mixture of experts and expert parallelism
    (["mesh.ep=0"], 1, "mesh.ep=0 is invalid: must be >= 1 (1 = no expert parallelism)"),
    (["model.moe_experts=-1"], 1, "model.moe_experts=-1 is invalid: must be >= 0 (0 = dense)"),
    (["model.moe_top_k=0"], 1, "model.moe_top_k=0 is invalid: must be >= 1"),
    (["model.moe_every=0"], 1, "model.moe_every=0 is invalid: must be >= 1 (1 = every block)"),
    (["model.moe_capacity_factor=-1"], 1, "model.moe_capacity_factor=-1.0 is invalid: must be >= 0 (0 = unlimited)"),
    (["model.moe_aux_loss=-0.1"], 1, "model.moe_aux_loss=-0.1 is invalid: must be >= 0 (0 = off)"),
    (["model.moe_z_loss=-1"], 1, "model.moe_z_loss=-1.0 is invalid: must be >= 0 (0 = off)"),
    (["model.moe_expert_bias_rate=-0.01", "model.moe_experts=4"], 1,
     "model.moe_expert_bias_rate=-0.01 is invalid: must be >= 0 (0 = off)"),
    (["model.moe_expert_bias_rate=0.001"], 1, "model.moe_expert_bias_rate=0.001 balances the experts of a "
     "mixture-of-experts model, but model.moe_experts=0 (dense); set model.moe_experts (e.g. 4) or "
     "model.moe_expert_bias_rate=0"),
    (["model.moe_experts=4", "model.moe_expert_bias_rate=0.01", "train.sync=local", "mesh.dp=4", "mesh.pp=1",
      "mesh.dp_replicate=4"], 4,
     "model.moe_expert_bias_rate=0.01 cannot be combined with train.sync=\"local\": the expert bias follows the "
     "whole global batch's loads every step, which would couple the replicas between their synchronisations; use "
     "model.moe_expert_bias_rate=0 (the aux loss balances each replica)"),
    (["model.moe_experts=4", "model.moe_top_k=5"], 1,
     "model.moe_top_k=5 exceeds model.moe_experts=4 (a token is routed to top_k different experts); choose "
     "moe_top_k in 1..4"),
    (["model.moe_experts=6", "mesh.dp=4", "mesh.pp=1", "mesh.ep=4"], 4,
     "model.moe_experts=6 is not divisible by mesh.ep=4 (each ep rank holds E/ep whole experts); choose ep in "
     "{1, 2, 3, 6} or use moe_experts=8, or mesh.ep=1"),
    (["model.moe_experts=6", "mesh.dp=4", "mesh.pp=1", "mesh.ep=3"], 4,
     "mesh.ep=3 does not divide the 4 dp_shard ranks (dp=4; expert parallelism borrows data-parallel ranks); "
     "choose ep in {1, 2}"),
    (["model.moe_experts=4", "mesh.dp=4", "mesh.pp=1", "mesh.ep=4", "mesh.dp_replicate=2", "train.zero=1"], 4,
     "mesh.ep=4 does not divide the 2 dp_shard ranks (dp=4 / dp_replicate=2;"),
    (["mesh.ep=2", "mesh.dp=2", "mesh.pp=1"], 2, "mesh.ep=2 divides the experts of a mixture-of-experts model, but "
     "model.moe_experts=0 (dense); set model.moe_experts (e.g. 4) or mesh.ep=1"),
    (["model.moe_experts=4", "mesh.cp=2", "mesh.dp=1", "mesh.pp=1"], 2,
     "mesh.cp=2 is not implemented with a mixture-of-experts model (model.moe_experts=4); use mesh.cp=1"),
    (["model.moe_experts=4", "train.zero=3", "mesh.dp=2", "mesh.pp=1"], 2,
     "train.zero=3 is not implemented with a mixture-of-experts model (model.moe_experts=4); use train.zero <= 2"),
    (["model.moe_experts=4", "train.grad_compression=int8", "mesh.dp=2", "mesh.pp=1"], 2,
     "train.grad_compression=\"int8\" is not implemented with a mixture-of-experts model"),
    (["model.moe_experts=4", "mesh.tp=2", "mesh.sequence_parallel=true", "mesh.dp=1", "mesh.pp=1"], 2,
     "mesh.sequence_parallel=true is not implemented with a mixture-of-experts model"),
    (["model.moe_experts=4", "train.precision=bf16"], 1,
     'train.precision="bf16" (16-bit expert GEMMs) is not implemented with a mixture-of-experts model'),
]

MESH_BAD = [
    # a parameter server's ranks are not the mesh's: 3 workers cannot hold dp=4
    (["ps.servers=1", "mesh.dp=4", "mesh.pp=1"], 4, "!= world size 3; choose degrees whose product is 3, or set some "
     "to 0 (auto) (the worker ranks: the world of 4 less ps.servers=1)"),
    (["mesh.dp=2", "mesh.tp=2", "mesh.pp=2"], 4, "mesh dp=2, tp=2, pp=2: product 8 != world size 4"),
    (["mesh.dp=3"], 4, "mesh dp=3, tp=1 (auto), pp=1 (auto): product 3 != world size 4"),
    (["mesh.tp=3"], 4, "mesh tp=3 x pp=1 = 3 does not divide the world size 4; choose tp * pp in {1, 2, 4}"),
    (["mesh.pp=2"], 3, "mesh tp=1 x pp=2 = 2 does not divide the world size 3"),
    (["mesh.cp=3"], 4, "mesh cp=3 x tp=1 x pp=1 = 3 does not divide the world size 4; choose cp * tp * pp in "
                       "{1, 2, 4}"),
    (["mesh.cp=2", "mesh.dp=3"], 4, "mesh dp=3, cp=2, tp=1 (auto), pp=1 (auto): product 6 != world size 4"),
]


def test_at_least_25_bad_inputs():
    assert len(BAD) + len(MESH_BAD) >= 25


@pytest.mark.parametrize("overrides, world, fragment", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_config(overrides, world, fragment):
    with pytest.raises(ConfigError) as info:
        _validate(overrides, world)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message
    assert info.value.exit_status == 2


@pytest.mark.parametrize("overrides, world, fragment", MESH_BAD, ids=[" ".join(o) for o, _, _ in MESH_BAD])
def test_bad_mesh(overrides, world, fragment):
    with pytest.raises(MeshError) as info:
        _validate(overrides, world)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_every_range_rule_is_tested():
    tested = {o.split("=")[0] for overrides, _, _ in BAD for o in overrides[:1]}
    untested = [name for name, _, _ in _RANGES if name not in tested and name not in ("mesh.dp", "mesh.pp")]
    assert untested == []


def test_defaults_are_valid_at_every_small_world():
    for world in (1, 2, 3, 4, 8):
        validate(Config(), world)


@pytest.mark.parametrize("world, expected", [(1, (1, 1, 1)), (2, (2, 1, 1)), (3, (3, 1, 1)),
                                             (4, (2, 1, 2)), (8, (4, 1, 2)), (6, (3, 1, 2))])
def test_mesh_auto_rule(world, expected):
    assert resolve_degrees(world) == expected + (1,)
    resolved = validate(Config(), world)
    assert (resolved.mesh.dp, resolved.mesh.tp, resolved.mesh.pp, resolved.mesh.cp) == expected + (1,)


@pytest.mark.parametrize("overrides, world, expected", [
    (["mesh.tp=2"], 4, (2, 2, 1)),         # tp given: pp stays 1
    (["mesh.dp=4"], 4, (4, 1, 1)),         # dp given: pp stays 1
    (["mesh.pp=4"], 4, (1, 1, 4)),
    (["mesh.tp=2", "mesh.pp=2"], 8, (2, 2, 2)),
    (["mesh.dp=1", "mesh.tp=2", "mesh.pp=2"], 4, (1, 2, 2)),
    (["mesh.cp=2"], 4, (2, 1, 1, 2)),      # cp given: pp stays 1, dp fills the rest
    (["mesh.cp=2", "mesh.pp=2"], 4, (1, 1, 2, 2)),
    (["mesh.cp=4", "mesh.tp=2"], 8, (1, 2, 1, 4)),
])
def test_mesh_partial_degrees(overrides, world, expected):
    m = load_config(None, overrides).mesh
    expected = expected if len(expected) == 4 else expected + (1,)
    assert resolve_degrees(world, m.dp, m.tp, m.pp, m.cp) == expected


def test_validate_returns_resolved_config_and_is_idempotent():
    cfg = load_config(None, ["train.steps=7"])
    resolved = validate(cfg, 4)
    assert resolved.mesh == dataclasses.replace(cfg.mesh, dp=2, tp=1, pp=2, cp=1)
    assert resolved.train == cfg.train
    assert validate(resolved, 4) == resolved
    with pytest.raises(MeshError):
        validate(resolved, 2)  # explicit degrees no longer fit


def test_vocabulary_need_not_divide_tp_and_small_vocabularies_need_token_files():
    validate(load_config(None, ["model.vocab_size=257", "mesh.tp=2"]), 2)   # padded to 258 in memory
    validate(load_config(None, ["model.vocab_size=100", "data.format=bin"]), 1)


def test_preset_fills_the_keys_not_given():
    cfg = load_config(None, ["model.preset=gpt2", "model.n_layer=2"])
    m = cfg.model
    assert (m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, m.bias) == (50257, 1024, 2, 12, 768, True)
    assert load_config(None, ["model.preset=gpt2"]).model.num_params() == 124_439_808   # GPT-2 small
    assert loads(to_toml(cfg)) == cfg       # written out whole: the round trip needs no preset logic
    assert load_config(None, ["model.preset=\"\""]).model == GPTConfig()


def test_sequence_parallel_is_a_no_op_at_tp_1():
    validate(load_config(None, ["mesh.sequence_parallel=true", "model.block_size=129"]), 1)


def test_bf16_is_refused_on_cupy_and_the_reduce_dtype_folds_into_compression():
    with pytest.raises(ConfigError, match='on the GPU use train.precision="fp16"'):
        validate(load_config(None, ["train.precision=bf16", "run.backend=cupy"]), 1)
    assert validate(load_config(None, ["train.precision=fp16", "run.backend=cupy"]), 1).train.precision == "fp16"
    folded = validate(load_config(None, ["train.grad_reduce_dtype=bf16", "mesh.dp=2"]), 2)
    assert folded.train.grad_compression == "bf16" and validate(folded, 2) == folded


def test_doubts_are_listed_not_logged_by_validate(caplog):
    # validate runs for every planner candidate and more than once per run: it warns about nothing;
    # the run logs doubts once, on rank 0.
    with caplog.at_level(logging.WARNING, logger="hpcpar.config.validate"):
        warm = _validate(["train.warmup=10", "train.steps=10"])
        bubble = _validate(["train.microbatches=1"], world=4)
        idle = _validate(["train.grad_compression=int8"], world=1)
    assert caplog.text == ""
    assert doubts(warm) == ["train.warmup=10 >= train.steps=10: the learning rate never reaches train.lr"]
    assert len(doubts(bubble)) == 1 and doubts(bubble)[0].startswith("train.microbatches=1 < mesh.pp=2: ")
    assert len(doubts(idle)) == 1 and "has nothing to compress" in doubts(idle)[0]
    assert doubts(_validate([], world=4)) == []


# --------------------------------------------------------------------------- overrides


@pytest.mark.parametrize("text, section, key, value", [
    ("model.n_layer=8", "model", "n_layer", 8),
    ("train.lr=3e-4", "train", "lr", 3e-4),
    ("train.lr=1", "train", "lr", 1.0),                      # an integer where a number is expected
    ("pipeline.trace=true", "pipeline", "trace", True),
    ("mesh.sequence_parallel = false", "mesh", "sequence_parallel", False),
    ("data.corpus=/path/x", "data", "corpus", "/path/x"),    # bare string
    ('data.corpus="/path with space"', "data", "corpus", "/path with space"),
    ("run.dir=2024-01-01", "run", "dir", "2024-01-01"),      # TOML would read a date: kept as text
    ("run.dir=123", "run", "dir", "123"),
    ("checkpoint.resume=auto", "checkpoint", "resume", "auto"),
    ("checkpoint.dir=", "checkpoint", "dir", ""),
    ("train.max_bad_steps=1_000", "train", "max_bad_steps", 1000),
])
def test_override_parsing(text, section, key, value):
    cfg = load_config(None, [text])
    got = getattr(getattr(cfg, section), key)
    assert got == value and type(got) is type(value)


def test_later_override_wins_over_earlier_and_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nn_layer = 2\n")
    cfg = load_config(path, ["model.n_layer=6", "model.n_layer=5"])
    assert cfg.model.n_layer == 5
    assert load_config(path, []).model.n_layer == 2


@pytest.mark.parametrize("text, fragments", [
    ("model.n_layers=8", ["unknown key 'model.n_layers'", "did you mean 'n_layer'?",
                          "valid keys in [model]: vocab_size, block_size"]),
    ("modle.n_layer=8", ["unknown config section 'modle'", "did you mean 'model'?",
                         "valid sections: model, mesh, data, train, pipeline, checkpoint, run"]),
    ("train.learning_rate=1", ["unknown key 'train.learning_rate'", "valid keys in [train]"]),
    ("model.n_layer=8.5", ["model.n_layer must be an integer, got 8.5 (float)"]),
    ("model.n_layer=eight", ["model.n_layer must be an integer, got 'eight' (string)"]),
    ("model.n_layer=true", ["model.n_layer must be an integer, got True (boolean)"]),
    ("train.lr=fast", ["train.lr must be a number, got 'fast' (string)"]),
    ("pipeline.trace=yes", ["pipeline.trace must be true or false, got 'yes' (string)"]),
    ("pipeline.trace=1", ["pipeline.trace must be true or false, got 1 (integer)"]),
    ("model.n_layer=[1, 2]", ["model.n_layer must be an integer, got [1, 2] (array)"]),
    ("model.n_layer=8\nn_head=2", ["model.n_layer must be an integer"]),
    ("model.n_layer", ["expected SECTION.KEY=VALUE, e.g. --set model.n_layer=8"]),
    ("n_layer=8", ["expected SECTION.KEY=VALUE"]),
    ("=8", ["expected SECTION.KEY=VALUE"]),
])
def test_bad_override(text, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(None, [text])
    message = str(info.value)
    assert message.startswith(f"--set {text!r}: ")
    for fragment in fragments:
        assert fragment in message


# --------------------------------------------------------------------------- files


def test_file_values_and_int_as_float(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nlr = 1\nsteps = 20\n[data]\ncorpus = "x.txt"\n[mesh]\ntp = 1\n')
    cfg = load_config(str(path), [])
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert cfg.train.steps == 20 and cfg.data.corpus == "x.txt" and cfg.mesh.tp == 1
    assert cfg.model == GPTConfig()


@pytest.mark.parametrize("text, fragments", [
    ("[model]\nn_layer = 4\nn_head = = 2\n", ["is not valid TOML", "line 3"]),
    ("[model\nn_layer = 4\n", ["is not valid TOML", "line 1"]),
    ("[train]\nlr = 1e-3\n\n[model]\nn_layer = 4\nn_layer = 5\n", ["is not valid TOML", "line 6"]),
    ("[model]\nn_layers = 4\n", ["unknown key 'model.n_layers'", "did you mean 'n_layer'?"]),
    ("[trian]\nsteps = 4\n", ["unknown config section 'trian'", "did you mean 'train'?"]),
    ("steps = 4\n", ["top-level key 'steps' must be inside a [section]; put it under [train]"]),
    ("colour = 4\n", ["top-level key 'colour' must be inside a [section]; sections are model, mesh"]),
    ("[model]\nn_layer = \"4\"\n", ["model.n_layer must be an integer, got '4' (string)"]),
    ("[model.n_layer]\nx = 1\n", ["model.n_layer must be an integer", "(table)"]),
    ("[run]\ntimeout = true\n", ["run.timeout must be a number, got True (boolean)"]),
])
def test_bad_file(tmp_path, text, fragments):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), [])
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="not found; give an existing TOML file") as info:
        load_config(str(path), [])
    assert str(path) in str(info.value)


def test_an_override_where_the_config_file_goes_says_how_to_repeat_set():
    with pytest.raises(ConfigError, match=r"\(an override\? each takes its own --set: --set train.steps=5\)"):
        load_config("train.steps=5", [])


def test_directory_and_non_utf8_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path), [])
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[data]\ncorpus = \"caf\xe9\"\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(line 2\)"):
        load_config(str(path), [])


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    path = tmp_path / "secret.toml"
    path.write_text("[model]\n")
    path.chmod(0)
    with pytest.raises(ConfigError, match="cannot read config file .*Permission denied"):
        load_config(str(path), [])


def test_non_utf8_path_rejected_by_validate():
    # A path argument with undecodable bytes arrives as surrogate escapes (os.fsdecode).
    bad = os.fsdecode(b"/data/caf\xe9")
    cfg = dataclasses.replace(Config(), data=DataConfig(corpus=bad))
    with pytest.raises(ConfigError, match="data.corpus=.* is not valid UTF-8"):
        validate(cfg, 1)


def test_wrong_type_built_in_code_is_caught_by_validate():
    cfg = dataclasses.replace(Config(), train=dataclasses.replace(Config().train, steps="10"))
    with pytest.raises(ConfigError, match="train.steps must be an integer, got '10' \\(string\\)"):
        validate(cfg, 1)


def test_errors_are_hpcpar_errors():
    assert issubclass(ConfigError, HpcparError) and issubclass(MeshError, HpcparError)


# --------------------------------------------------------------------------- writing


def test_round_trip(tmp_path):
    cfg = load_config(None, ["model.n_layer=8", "train.lr=3e-4", "train.eps=1e-12", "pipeline.trace=true",
                             'data.corpus=/tmp/we"ird\\path\tx\x7f', "run.dir=runs/é", "mesh.tp=2",
                             "run.timeout=1.5", "train.seed=0", "checkpoint.resume=auto"])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    assert load_config(path, []) == cfg
    assert load_config(path, []).data.corpus == '/tmp/we"ird\\path\tx\x7f'
    resolved = validate(cfg, 4)
    path.write_text(to_toml(resolved), encoding="utf-8")
    assert load_config(path, []) == resolved


def test_to_toml_marks_changed_values():
    text = to_toml(load_config(None, ["model.n_layer=8"]))
    assert "n_layer = 8" in text and "(default 4)" in text
    assert "(default" not in to_toml(Config())


def test_to_dict():
    d = to_dict(load_config(None, ["train.steps=9"]))
    assert d["train"]["steps"] == 9 and d["model"]["n_embd"] == 128
    assert set(d) == set(SECTIONS)


def test_shipped_default_toml_is_current():
    shipped = REPO / "hpcpar" / "defaults" / "default.toml"
    assert shipped.read_text() == to_toml(Config()), "regenerate with to_toml(Config()) (docs/config.md)"
    assert load_config(shipped, []) == Config()


def test_docs_cover_every_key():
    text = (REPO / "docs" / "config.md").read_text()
    for section, cls in SECTIONS.items():
        assert f"[{section}]" in text
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in text, f"{section}.{f.name} missing from docs/config.md"


def test_checkpoint_dir():
    assert Config().checkpoint_dir == os.path.join("runs/default", "checkpoints")
    assert load_config(None, ["checkpoint.dir=/scratch/ck"]).checkpoint_dir == "/scratch/ck"


# --------------------------------------------------------------------------- memory


def test_memory_estimate_scales_as_documented():
    base = Config()
    m0 = estimate_memory(base, 1, 1, 1)
    wide = load_config(None, ["model.n_embd=256", "model.n_head=4"])
    assert estimate_memory(wide, 1, 1, 1) > m0
    # ZeRO-1 shards only the optimizer state: the saving is 2 moments x (1 - 1/dp) of the params.
    zero = load_config(None, ["train.zero=1"])
    state, _ = memory_parts(base, 4, 1, 1)
    state_z, _ = memory_parts(zero, 4, 1, 1)
    params = stage_parameters(base, 1, 1, 0)
    assert state == 4 * params * 4 and state_z == 2 * params * 4 + params * 2 * 4 // 4
    # tp splits the matrices; pp splits the layers; the busiest rank holds less.
    assert estimate_memory(base, 1, 2, 1) < m0
    assert stage_parameters(base, 1, 2, 1) < stage_parameters(base, 1, 1, 0)
    # GPipe stashes every micro-batch; 1F1B at most pp.
    many = ["train.microbatches=8"]
    gpipe = load_config(None, many + ["pipeline.schedule=gpipe"])
    one_f = load_config(None, many + ["pipeline.schedule=1f1b"])
    assert memory_parts(gpipe, 1, 1, 2)[1] > memory_parts(one_f, 1, 1, 2)[1]


def test_memory_estimate_by_zero_stage():
    """Model state by ZeRO stage (docs/config.md): the ZeRO paper's terms plus what a step keeps
    alive at its peak (buckets in flight, gathered units); HSDP shards over dp_shard only."""
    one = ["train.microbatches=1", "train.bucket_mb=0.25"]
    p = stage_parameters(Config(), 1, 1, 0)
    s, n = 4, 4
    state = {z: memory_parts(load_config(None, one + [f"train.zero={z}"]), n, 1, 1)[0] for z in range(4)}
    assert state[0] == 16 * p
    assert state[1] == 8 * p + -(-8 * p // n)
    bucket = int(0.25 * 2**20) // s
    assert state[2] == 4 * p + min(p, 3 * bucket) * s + p * s // n + -(-8 * p // n)
    units = stage_units(Config(), 1, 1, 0)
    largest = max(units)
    m = Config().model
    assert largest == m.block_params() and units[-1] == m.head_params(1, tied=False) + 128 * 128  # head: + wte, wpe
    assert state[3] == 2 * (p * s // n) + -(-8 * p // n) + min(p, 4 * largest) * s + min(p, 4 * largest) * s
    assert state[0] > state[1] > state[2]
    # ZeRO-3's peak holds a few whole units (four gathered, up to four gradients in flight): it pays
    # off once a unit is a small part of the model.
    deep = {z: memory_parts(load_config(None, one + ["model.n_layer=24", f"train.zero={z}"]), n, 1, 1)[0]
            for z in (2, 3)}
    assert deep[3] < deep[2]
    # Accumulation keeps every full gradient until the last micro-batch; keeping units from
    # forward to backward keeps all parameters gathered.
    acc = memory_parts(load_config(None, ["train.zero=3", "train.microbatches=2"]), n, 1, 1)[0]
    keep = memory_parts(load_config(None, one + ["train.zero=3", "train.reshard_after_forward=false"]),
                                n, 1, 1)[0]
    assert acc > state[3] and keep > state[3]
    # HSDP: dp = 4 as 2 replicas x 2 shards holds what ZeRO over 2 ranks holds.
    hsdp = load_config(None, one + ["train.zero=3", "mesh.dp_replicate=2"])
    assert memory_parts(hsdp, 4, 1, 1)[0] == memory_parts(
        load_config(None, one + ["train.zero=3"]), 2, 1, 1)[0]


def test_memory_estimate_divides_activations_by_cp():
    """Context parallelism shards no weight: the model state stays, the activations of a rank's
    T/cp tokens shrink. Ring keeps no [T, T] probabilities; Ulysses keeps them for H/cp heads."""
    long = ["model.block_size=1024", "train.micro_batch_size=1", "model.n_layer=2"]
    plain = memory_parts(load_config(None, long), 1, 1, 1)
    for impl in ("ring", "ulysses"):
        cfg = load_config(None, long + [f"mesh.cp_impl={impl}"])
        parts = {cp: memory_parts(cfg, 1, 1, 1, cp) for cp in (1, 2, 4)}
        assert parts[1] == plain and all(state == plain[0] for state, _ in parts.values())
        assert parts[4][1] < parts[2][1] < parts[1][1]
        # About 1/cp: everything but Ulysses' [T, T] causal mask (one per rank) scales with T/cp.
        assert parts[4][1] <= 0.5 * parts[2][1] * (1.05 if impl == "ring" else 1.25)
    ring = memory_parts(load_config(None, long + ["mesh.cp_impl=ring"]), 1, 1, 1, 4)[1]
    ulysses = memory_parts(load_config(None, long + ["mesh.cp_impl=ulysses"]), 1, 1, 1, 4)[1]
    assert ring < ulysses                                      # no [T, T] per layer
    # The resolved config carries cp; ZeRO-1 shards the optimizer state over dp x cp.
    zero = validate(load_config(None, long + ["mesh.cp=4", "train.zero=1"]), 4)
    assert estimate_memory(zero, 1, 1, 1) == sum(memory_parts(zero, 1, 1, 1, 4))
    assert memory_parts(zero, 1, 1, 1)[0] < plain[0]


def test_memory_estimate_counts_recomputation():
    """full: a recomputed block keeps its input B n C / r (plus one block re-run per rank);
    selective: the (2 + d) B H T^2 / (tp u) probabilities go; the model state never changes."""
    shape = ["model.block_size=256", "model.n_layer=4", "train.micro_batch_size=2", "model.dropout=0.1",
             "mesh.pp=1"]

    def parts(*extra, tp=1, cp=1):
        return memory_parts(load_config(None, shape + list(extra)), 1, tp, 1, cp)

    none, selective, full = (parts(f"train.recompute={m}") for m in ("none", "selective", "full"))
    assert none[0] == selective[0] == full[0]
    s, b, t, c, h, layers = 4, 2, 256, 128, 4, 4
    scores = s * b * h * 3 * t * t                   # (2 + d) B H T^2 s, d = 1
    assert none[1] - selective[1] == layers * scores
    per_layer = (none[1] - full[1] + s * b * t * c * layers) / (layers - 1)  # kept: input only, + one re-run
    assert per_layer == s * b * t * (8 * c + 12 * c + h * 3 * t)
    # Every 2nd block (0 and 2 of 4): half the saving.
    assert none[1] - parts("train.recompute=selective", "train.recompute_every=2")[1] == 2 * scores
    # Sequence parallelism divides the kept input by tp; ring attention keeps no probabilities.
    sp = ["train.recompute=full", "mesh.sequence_parallel=true"]
    assert parts(*sp, tp=2)[1] < parts("train.recompute=full", tp=2)[1]
    ring = ["mesh.cp_impl=ring"]
    assert parts(*ring, "train.recompute=selective", cp=2) == parts(*ring, cp=2)
    assert parts("mesh.cp_impl=ulysses", "train.recompute=selective", cp=2)[1] < parts("mesh.cp_impl=ulysses",
                                                                                      cp=2)[1]


def test_memory_estimate_keeps_zero_and_recompute_terms_apart():
    """ZeRO shards model state (weights, gradients, optimizer; HSDP over dp_shard); recomputation
    drops activations: each stage x mode pair is the zero stage's state plus the mode's activations,
    and a padded vocabulary (tp not dividing it) counts its padding rows in the sharded state."""
    shape = ["model.block_size=256", "model.n_layer=4", "train.micro_batch_size=2", "model.dropout=0.1",
             "mesh.pp=1", "train.microbatches=1", "train.bucket_mb=0.25"]
    parts = {(z, r): memory_parts(load_config(None, shape + [f"train.zero={z}", f"train.recompute={r}"]),
                                          4, 1, 1)
             for z in range(4) for r in ("none", "selective", "full")}
    for z in range(4):
        assert parts[(z, "none")][0] == parts[(z, "selective")][0] == parts[(z, "full")][0]
        assert parts[(z, "none")][1] > parts[(z, "selective")][1] > parts[(z, "full")][1]
    for r in ("none", "selective", "full"):
        assert len({parts[(z, r)][1] for z in range(4)}) == 1
        assert parts[(0, r)][0] > parts[(1, r)][0] > parts[(2, r)][0]
    hsdp = load_config(None, shape + ["train.zero=3", "train.recompute=full", "mesh.dp_replicate=2"])
    assert memory_parts(hsdp, 4, 1, 1) == memory_parts(
        load_config(None, shape + ["train.zero=3", "train.recompute=full"]), 2, 1, 1)
    odd = load_config(None, shape + ["model.vocab_size=257", "train.zero=3"])
    even = load_config(None, shape + ["model.vocab_size=258", "train.zero=3"])
    assert memory_parts(odd, 4, 2, 1)[0] == memory_parts(even, 4, 2, 1)[0]


def test_parameter_count_matches_nanogpt_formula():
    # Whole model, tied embedding: 12 L C^2 + 13 L C (biases, LayerNorms) + V C + T C + 2 C.
    cfg = Config()
    c, layers, v, t = 128, 4, 256, 128
    assert stage_parameters(cfg, 1, 1, 0) == 12 * layers * c * c + 13 * layers * c + v * c + t * c + 2 * c
    assert stage_parameters(cfg, 1, 1, 0) == cfg.model.num_params()


def test_memory_estimate_uses_the_executors_layer_split():
    # 5 layers on 2 stages: the executor gives the head stage 2 blocks ([0, 3), [3, 5)), not ceil(5/2) = 3.
    cfg = load_config(None, ["model.n_layer=5"])
    m = cfg.model
    assert stage_parameters(cfg, 1, 2, 0) == m.stage_params(3, embed=True, head=False)
    assert stage_parameters(cfg, 1, 2, 1) == m.stage_params(2, embed=False, head=True)
    # Interleaved, 2 chunks per rank on 2 ranks: rank 0 holds virtual stages 0 and 2, rank 1 holds 1 and 3.
    inter = load_config(None, ["model.n_layer=6", "pipeline.schedule=interleaved", "pipeline.chunks=2",
                               "train.microbatches=4"])
    m = inter.model
    assert stage_parameters(inter, 2, 2, 0) == (m.stage_params(2, embed=True, head=False, tp=2)
                                                        + m.stage_params(1, embed=False, head=False, tp=2))
    assert stage_parameters(inter, 2, 2, 1) == (m.stage_params(2, embed=False, head=False, tp=2)
                                                        + m.stage_params(1, embed=False, head=True, tp=2))


# --------------------------------------------------------------------------- shared pieces


def test_the_model_section_is_the_models_config():
    cfg = load_config(None, ["model.n_layer=2", "model.dtype=float64"])
    assert type(cfg.model) is GPTConfig and cfg.model == GPTConfig(n_layer=2, dtype="float64")
    assert GPT(cfg.model).config is cfg.model
    with pytest.raises(ConfigError, match='set train.precision="bf16"'):
        GPT(GPTConfig(dtype="bfloat16"))


def test_divisibility_message():
    assert schema.divisors(1) == [1] and schema.divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    schema.require_divisible("model.n_head", 8, "mesh.tp", 4)
    with pytest.raises(ConfigError) as info:
        schema.require_divisible("model.n_head", 6, "mesh.tp", 4, "(a tp rank holds whole heads)")
    assert str(info.value) == ("model.n_head=6 is not divisible by mesh.tp=4 (a tp rank holds whole heads); "
                               "choose tp in {1, 2, 3, 6} or use n_head=8")
    with pytest.raises(ConfigError, match=r"; choose tp in \{1, 7\} or use T=8, or a shorter batch$"):
        schema.require_divisible("T", 7, "tp", 2, alternative="a shorter batch")


def test_layer_guards_say_what_config_validation_says():
    with pytest.raises(ConfigError) as by_config:
        _validate(["model.n_head=6", "model.n_embd=96", "mesh.tp=4"], world=4)
    with pytest.raises(ConfigError) as by_layer:
        tensor_parallel.check_config(GPTConfig(n_head=6, n_embd=96), 4)
    assert str(by_layer.value) == str(by_config.value).replace("model.", "").replace("mesh.", "")


def test_memory_check():
    need = estimate_memory(validate(Config(), 1), 1, 1, 1)
    validate(Config(), 1, available_memory_bytes=need)
    with pytest.raises(ConfigError) as info:
        validate(Config(), 1, available_memory_bytes=need - 1)
    message = str(info.value)
    assert "estimated memory per rank" in message and "exceeds the available" in message
    assert "smaller train.micro_batch_size" in message and "MiB" in message
    assert 'train.recompute="full"' in message
    full = load_config(None, ["train.recompute=full", "train.recompute_every=2"])
    with pytest.raises(ConfigError, match="train.recompute_every=1 "):
        validate(full, 1, available_memory_bytes=estimate_memory(validate(full, 1), 1, 1, 1) - 1)
    with pytest.raises(ConfigError, match="train.zero=1"):
        _validate(["model.n_embd=1024", "model.n_layer=8", "model.n_head=8", "train.micro_batch_size=1",
                   "model.block_size=16", "mesh.dp=4"], world=4, memory=2**20)


def test_the_memory_estimate_counts_16_bit_activations_and_full_model_state():
    """Under bf16/fp16 the masters, gradients and optimizer state stay in model.dtype (no 16-bit
    weight copy), and every stored activation takes 2 bytes instead of 4."""
    full = load_config(None, ["model.dropout=0.1"])
    for precision in ("bf16", "fp16"):
        low = load_config(None, ["model.dropout=0.1", f"train.precision={precision}"])
        state_full, act_full = memory_parts(full, 2, 1, 2, 1)
        state_low, act_low = memory_parts(low, 2, 1, 2, 1)
        assert state_low == state_full
        # Halved, except for the float32 working sets (attention in backward, the loss's probabilities).
        assert 0.5 * act_full < act_low < 0.7 * act_full


@pytest.mark.parametrize("mpi", [False, True])
def test_shared_checkpoints_need_parallel_h5py(monkeypatch, mpi):
    import types

    import h5py
    monkeypatch.setattr(h5py, "get_config", lambda: types.SimpleNamespace(mpi=mpi))
    if mpi:
        assert _validate(["checkpoint.format=shared"]).checkpoint.format == "shared"
    else:
        with pytest.raises(ConfigError, match=r'checkpoint.format="shared" needs h5py built with MPI .*'
                                              r'libhdf5-openmpi-dev.*checkpoint.format="per_rank"'):
            _validate(["checkpoint.format=shared"])
    with pytest.raises(ConfigError, match='checkpoint.async_save=true needs checkpoint.format="per_rank"'):
        _validate(["checkpoint.format=shared", "checkpoint.async_save=true"])
    assert _validate([]).checkpoint.format == "per_rank"  # the default needs nothing


def test_mfu_peak_names_the_planners_presets_and_takes_numbers():
    """run.mfu_peak's named peaks are the planner's presets (config/ cannot import planner/), and a
    number is FLOP/s per rank."""
    from hpcpar.config.sections import MFU_PEAK_PRESETS
    from hpcpar.config.validate import mfu_peak_flops
    from hpcpar.planner.hardware import PRESETS
    assert MFU_PEAK_PRESETS == tuple(PRESETS)
    for ok in ("auto", "measure", "a100", "h100", "989e12", "2.5e11"):
        assert validate(load_config(None, [f"run.mfu_peak={ok}"]), 1).run.mfu_peak == ok
    assert [mfu_peak_flops(v) for v in ("989e12", "0", "-1", "inf", "nan", "auto")] == [989e12, None, None, None,
                                                                                        None, None]
