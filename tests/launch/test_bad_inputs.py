"""Bad input through the real CLI: one line `hpcpar: error: ...`, exit status 2, no traceback.

Each case runs `python -m hpcpar ...` (one process, or `mpiexec -n 4` for mesh cases) and checks
that stderr holds exactly one error line containing the expected text, that the status is 2 and
that no traceback is shown. Paths in the table are templates filled from the `place` fixture:
a corpus, an empty corpus, a bad TOML file, a plain file, a small trained checkpoint, a corrupt
copy of it, and (when this process may mount) a read-only and a 64 KiB tmpfs.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpcpar.checkpoint.directory import latest
from hpcpar.data import prepare

PY = sys.executable
REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=8", "train.micro_batch_size=1",
        "train.microbatches=1", "train.steps=1", "train.warmup=0", "run.progress=false", "run.eval_every=0"]


def train(*overrides: str) -> list[str]:
    args = ["train"]
    for item in [*TINY, "data.corpus={corpus}", "run.dir={tmp}/run", *overrides]:
        args += ["--set", item]
    return args


# (id, hpcpar arguments, ranks, expected text in the one error line)
CASES = [
    ("unknown-flag-4-ranks", ["train", "--steps", "5"], 4, "unrecognized arguments: --steps (see: hpcpar --help)"),
    ("unknown-verb", ["trian"], 1, "invalid choice: 'trian'"),
    ("mesh-product", train("mesh.dp=3", "mesh.tp=1", "mesh.pp=1"), 4,
     "product 3 != world size 4"),
    ("mesh-product-1-rank", train("mesh.dp=2"), 1,
     "mesh dp=2, tp=1 (auto), pp=1 (auto): product 2 != world size 1"),
    ("heads-by-tp", train("mesh.tp=4", "mesh.dp=1", "mesh.pp=1", "model.n_head=6", "model.n_embd=48"), 4,
     "model.n_head=6 is not divisible by mesh.tp=4"),
    ("heads-by-tp-2", train("mesh.tp=2", "mesh.dp=2", "mesh.pp=1", "model.n_head=3", "model.n_embd=24"), 4,
     "model.n_head=3 is not divisible by mesh.tp=2"),
    ("interleaved-microbatches", train("model.n_layer=4", "pipeline.schedule=interleaved", "pipeline.chunks=2",
                                       "mesh.pp=2", "mesh.dp=2", "mesh.tp=1", "train.microbatches=3"), 4,
     "pipeline.schedule=interleaved needs train.microbatches (3) to be a multiple of mesh.pp (2)"),
    ("layers-by-stages", train("model.n_layer=1", "mesh.pp=2", "mesh.dp=2", "mesh.tp=1"), 4,
     "model.n_layer=1 is fewer than mesh.pp=2"),
    # ZB-V fixes two chunks per rank (a V): chunks set to something else, and a V with too few layers.
    ("zbv-chunks", train("model.n_layer=4", "pipeline.schedule=zbv", "pipeline.chunks=3", "mesh.pp=2", "mesh.dp=2"), 4,
     "pipeline.schedule=zbv runs 2 chunks per rank (a V), fixed by the schedule: leave pipeline.chunks unset (0) "
     "or 2, not 3"),
    ("zbv-layers", train("model.n_layer=6", "pipeline.schedule=zbv", "mesh.pp=4", "mesh.dp=1"), 4,
     "model.n_layer=6 is fewer than mesh.pp=4 x pipeline.chunks=2 (pipeline.schedule=zbv runs 2 per rank) = 8 "
     "virtual stages"),
    ("zbh1-chunks", train("pipeline.schedule=zbh1", "pipeline.chunks=2", "mesh.pp=2", "mesh.dp=1"), 2,
     "pipeline.schedule=zbh1 runs one chunk per rank: set pipeline.chunks=1 (got 2)"),
    ("ring-block-by-2cp", train("mesh.cp=4", "mesh.pp=1", "model.block_size=12"), 4,
     "model.block_size=12 is not divisible by 2*mesh.cp=8 (ring attention cuts the sequence into 2*cp zigzag chunks)"),
    ("ulysses-heads", train("mesh.cp=4", "mesh.cp_impl=ulysses", "mesh.pp=1"), 4,
     'model.n_head=2 is not divisible by mesh.tp*mesh.cp=4 (mesh.cp_impl="ulysses" gives every tp x cp rank'),
    ("unknown-cp-impl", train("mesh.cp_impl=tree"), 1, 'mesh.cp_impl="tree" is not one of "ring", "ulysses"'),
    ("dp-replicate-by-dp", train("mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=3", "train.zero=3"), 4,
     "mesh.dp=4 is not divisible by mesh.dp_replicate=3 (HSDP: dp = dp_replicate x dp_shard)"),
    ("zero-stage", train("train.zero=4"), 1, "train.zero=4 is not one of 0, 1, 2, 3"),
    # mixture of experts: E by ep, top_k <= E, ep by dp, combinations not implemented with experts
    ("experts-by-ep", train("model.moe_experts=6", "mesh.dp=4", "mesh.pp=1", "mesh.ep=4"), 4,
     "model.moe_experts=6 is not divisible by mesh.ep=4 (each ep rank holds E/ep whole experts)"),
    ("top-k-over-experts", train("model.moe_experts=2", "model.moe_top_k=3"), 1,
     "model.moe_top_k=3 exceeds model.moe_experts=2"),
    ("ep-by-dp", train("model.moe_experts=6", "mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.ep=3"), 4,
     "mesh.ep=3 does not divide the 2 dp_shard ranks (dp=2; expert parallelism borrows data-parallel ranks)"),
    ("experts-with-cp", train("model.moe_experts=4", "mesh.cp=2", "mesh.dp=2", "mesh.pp=1", "mesh.ep=2"), 4,
     "mesh.cp=2 is not implemented with a mixture-of-experts model (model.moe_experts=4); use mesh.cp=1"),
    ("experts-with-zero3", train("model.moe_experts=4", "mesh.dp=4", "mesh.pp=1", "train.zero=3"), 4,
     "train.zero=3 is not implemented with a mixture-of-experts model"),
    ("plan-no-allocation", ["plan"], 1, "give the allocation as --ranks N or as --nodes N --gpus-per-node G"),
    ("plan-parameter-server", ["plan", "--ranks", "4", "--set", "ps.servers=1"], 1,
     "ps.servers=1: hpcpar plan models all-reduce data parallelism, not parameter servers"),
    ("ps-no-worker", train("ps.servers=4"), 4, "ps.servers=4 leaves no worker: the world has 4 ranks"),
    ("ps-with-zero", train("ps.servers=1", "mesh.dp=3", "mesh.pp=1", "train.zero=2"), 4,
     "train.zero=2 is not supported with a parameter server (ps.servers=1)"),
    ("ps-mesh-too-big", train("ps.servers=2", "mesh.dp=4", "mesh.pp=1"), 4,
     "product 4 != world size 2; choose degrees whose product is 2, or set some to 0 (auto) (the worker ranks: the "
     "world of 4 less ps.servers=2)"),
    ("plan-unknown-hardware", ["plan", "--ranks", "4", "--hardware", "tpu"], 1,
     "--hardware='tpu' is not one of a100, h100, this"),
    ("plan-model-fits-nowhere", ["plan", "--preset", "70b", "--ranks", "8", "--hardware", "a100"], 1,
     "no layout of 8 ranks fits the"),
    ("16-bit-master", train("model.dtype=bfloat16"), 1,
     'model.dtype="bfloat16" is the master weights\' dtype and must be "float32" or "float64"; for bfloat16 '
     'activations set train.precision="bf16"'),
    ("reduce-dtype-conflict", train("train.grad_reduce_dtype=fp16", "train.grad_compression=topk"), 1,
     'train.grad_reduce_dtype="fp16" (16-bit gradients on the wire) conflicts with train.grad_compression="topk"'),
    ("loss-scale-backoff", train("train.precision=fp16", "train.loss_scale_backoff=2"), 1,
     "train.loss_scale_backoff=2.0 is invalid: must be in (0, 1)"),
    ("hsdp-without-zero", train("mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=2"), 4,
     "mesh.dp_replicate=2 splits dp for HSDP, which shards model state over dp_shard; use train.zero >= 1"),
    ("wire16-zero3", train("mesh.dp=4", "mesh.pp=1", "train.zero=3", "train.grad_wire_dtype=bfloat16"), 4,
     'train.grad_compression="bf16" compresses the gradient buckets of train.zero 0-2'),
    ("powersgd-zero3", train("mesh.dp=4", "mesh.pp=1", "train.zero=3", "train.grad_compression=powersgd"), 4,
     "PowerSGD needs whole matrices, which ZeRO-3 never holds"),
    ("unknown-compressor", train("train.grad_compression=onebit"), 1,
     'train.grad_compression="onebit" is not one of "none", "fp16", "bf16", "int8", "topk", "powersgd"'),
    ("topk-ratio", train("train.grad_compression=topk", "train.compression_ratio=0"), 1,
     "train.compression_ratio=0.0 is invalid: must be in (0, 1]"),
    ("topk-ratio-above-1", train("train.grad_compression=topk", "train.compression_ratio=2"), 1,
     "train.compression_ratio=2.0 is invalid: must be in (0, 1]"),
    ("powersgd-rank", train("train.grad_compression=powersgd", "train.powersgd_rank=0"), 1,
     "train.powersgd_rank=0 is invalid: must be >= 1"),
    ("unknown-recompute", train("train.recompute=partial"), 4,
     'train.recompute="partial" is not one of "none", "full", "selective"'),
    ("recompute-every-0", train("train.recompute=full", "train.recompute_every=0"), 1,
     "train.recompute_every=0 is invalid: must be >= 1"),
    ("negative-lr", train("train.lr=-1"), 1, "train.lr=-1.0 is invalid: must be > 0"),
    ("zero-micro-batch", train("train.micro_batch_size=0"), 1,
     "train.micro_batch_size=0 is invalid: must be >= 1"),
    ("width-by-heads", train("model.n_embd=17"), 1, "model.n_embd=17 is not divisible by model.n_head=2"),
    ("zero-timeout", train("run.timeout=0"), 1, "run.timeout=0.0 is invalid"),
    ("unknown-choice", train("run.backend=tpu"), 1, 'run.backend="tpu" is not one of "auto", "numpy", "cupy"'),
    ("missing-corpus", train("data.corpus={tmp}/nope.txt"), 1, "nope.txt' does not exist"),
    ("empty-corpus", train("data.corpus={empty}"), 1, "empty.txt' holds no bytes"),
    ("non-utf8-corpus-path", train("data.corpus={tmp}/bad\udcff.txt"), 1, "is not valid UTF-8"),
    ("unknown-section", train("foo.bar=1"), 1, "unknown config section 'foo'"),
    ("unknown-key", train("model.n_layers=2"), 1, "unknown key 'model.n_layers'; did you mean 'n_layer'?"),
    ("set-syntax", ["train", "--set", "model.n_layer"], 1, "expected SECTION.KEY=VALUE"),
    ("wrong-type", train("model.n_layer=abc"), 1, "model.n_layer must be an integer, got 'abc' (string)"),
    ("bad-toml", ["train", "{badtoml}"], 1, "is not valid TOML"),
    ("missing-config", ["train", "{tmp}/missing.toml"], 1, "missing.toml' not found"),
    ("resume-missing", train("checkpoint.resume={tmp}/no-such-ckpt"), 1, "no checkpoint at"),
    ("resume-other-model", train("model.n_embd=32", "checkpoint.resume={ckpt}"), 1,
     "has global shape [256, 16], expected [256, 32] (checkpoint of another model?)"),
    ("resume-corrupt", train("checkpoint.resume={corrupt}"), 1, "rank-00000.h5: cannot read tensor"),
    ("run-dir-under-a-file", train("run.dir={afile}/sub"), 1, "is not writable (Not a directory)"),
    ("run-dir-read-only", train("run.dir={ro}/run"), 1, "is not writable (Read-only file system)"),
    # A run directory of their own: {tmp}/run holds a run, and a fresh start there is refused first.
    ("checkpoint-dir-is-a-file", train("checkpoint.dir={afile}", "run.dir={tmp}/run-ckpt-file"), 1,
     "is not writable (File exists); set checkpoint.dir to a writable directory"),
    ("disk-full", train("checkpoint.dir={full}/ckpt", "run.dir={tmp}/run-disk-full"), 1, "no space left on device"),
    ("sample-bad-checkpoint", ["sample", "{afile}"], 1, "no checkpoint at"),
    ("sample-corrupt-checkpoint", ["sample", "{corrupt}"], 1, "corrupt data"),
    ("sample-temperature", ["sample", "{ckpt}", "--temperature", "0"], 1, "--temperature must be a finite number > 0"),
    ("sample-temperature-nan", ["sample", "{ckpt}", "--temperature", "nan", "--tokens", "3"], 1,
     "--temperature must be a finite number > 0, got nan"),
    ("sample-negative-seed", ["sample", "{ckpt}", "--seed", "-1", "--tokens", "3"], 1, "--seed must be >= 0, got -1"),
    ("sample-negative-top-k", ["sample", "{ckpt}", "--top-k", "-1"], 1,
     "--top-k must be >= 0 (0 samples from every token), got -1"),
    ("sample-4-ranks", ["sample", "{ckpt}", "--seed", "-1"], 4, "--seed must be >= 0, got -1"),
    ("eval-negative-max-tokens", ["eval", "{ckpt}", "--data", "{prep}", "--max-tokens", "-5"], 1,
     "--max-tokens must be >= 0 (0 evaluates every token), got -5"),
    ("eval-json-missing-dir", ["eval", "{ckpt}", "--data", "{prep}", "--json", "{tmp}/no/x.json"], 1,
     "no/x.json': directory"),
    ("plot-out-missing-dir", ["plot", "{tmp}/run", "--out", "{tmp}/no/x.png"], 1, "no/x.png': directory"),
    ("ckpt-info-missing-2-ranks", ["ckpt", "info", "{tmp}/nothing"], 2, "no checkpoint at"),
    ("debug-after-verb", ["train", "--debug"], 1, "unrecognized arguments: --debug (see: hpcpar --help)"),
    ("ckpt-export-no-out", ["ckpt", "export", "{ckpt}"], 1, "ckpt export needs --out FILE.npz"),
    ("ckpt-info-missing", ["ckpt", "info", "{tmp}/nothing"], 1, "no checkpoint at"),
    ("ckpt-verify-corrupt", ["ckpt", "verify", "{corrupt}"], 1, "rank-00000.h5: corrupt"),
    ("job-render-bad-time", ["job", "render", "--scheduler", "slurm", "--time", "99"], 1,
     "job option time must be HH:MM:SS (e.g. 01:30:00), got '99'"),
    ("info-bad-dp", ["info", "--dp", "3"], 1, "mesh dp=3 x tp=1 x pp=1 = 3 ranks, but the world has 1 ranks"),
    ("info-zero-dp", ["info", "--dp", "0"], 1, "dp must be a positive integer"),
    ("plot-missing-run", ["plot", "{tmp}/norun", "--out", "{tmp}/x.png"], 1, "has no metrics.jsonl"),
    # token data, tokenizers, GPT-2 weights
    ("token-id-over-vocab", train("data.format=bin", "data.corpus={bigid}"), 1,
     "holds token id 300, but model.vocab_size=256; set model.vocab_size >= 301"),
    ("token-id-over-vocab-4-ranks", train("data.format=bin", "data.corpus={bigid}", "mesh.dp=4"), 4,
     "holds token id 300, but model.vocab_size=256"),
    ("truncated-bin", train("data.format=bin", "data.corpus={odd}"), 1,
     "is 3 bytes, not a whole number of uint16 tokens (2 bytes each): truncated"),
    ("truncated-prepared-bin", train("data.format=bin", "data.corpus={cut}"), 1,
     "truncated or replaced since it was prepared"),
    ("bin-dtype-of-record", train("data.format=bin", "data.corpus={prep}", "data.token_dtype=uint32"), 1,
     "is read as uint32 tokens but"),
    ("bin-without-corpus", train("data.format=bin", "data.corpus="), 1, 'data.format="bin" needs data.corpus'),
    ("hdf5-not-hdf5", train("data.format=hdf5", "data.corpus={odd}"), 1, "cannot read HDF5 file"),
    ("resume-other-tokenizer", train("data.format=bin", "data.corpus={bpe}", "checkpoint.resume={ckpt}"), 1,
     "tokenizer mismatch: checkpoint"),
    ("eval-other-tokenizer", ["eval", "{ckpt}", "--data", "{bpe}"], 1, "tokenizer mismatch: checkpoint"),
    ("sample-other-tokenizer", ["sample", "{ckpt}", "--tokenizer", "{bpe}/tokenizer.json"], 1,
     "but --tokenizer"),
    ("eval-too-little-data", ["eval", "{ckpt}", "--data", "{prep}", "--max-tokens", "5"], 1,
     "fewer than one window of block_size + 1 = 9"),
    ("prepare-bpe-no-vocab-size", ["data", "prepare", "{corpus}", "--out", "{tmp}/p", "--tokenizer", "bpe"], 1,
     "--tokenizer bpe needs --vocab-size N"),
    ("prepare-missing-input", ["data", "prepare", "{tmp}/nope", "--out", "{tmp}/p"], 1, "does not exist"),
    ("import-missing", ["ckpt", "import", "{tmp}/nothing.safetensors", "--out", "{tmp}/imp"], 1, "does not exist"),
    ("import-not-safetensors", ["ckpt", "import", "{afile}", "--out", "{tmp}/imp"], 1, "not a safetensors file"),
    ("export-safetensors-no-out", ["ckpt", "export", "{ckpt}", "--format", "safetensors"], 1,
     "ckpt export needs --out FILE.safetensors or DIR"),
    ("shared-checkpoint-async", train("mesh.dp=4", "mesh.pp=1", "checkpoint.format=shared",
                                      "checkpoint.async_save=true"), 4,
     'checkpoint.async_save=true needs checkpoint.format="per_rank"'),
]
if not h5py.get_config().mpi:  # the pip wheel: a shared-file checkpoint is refused before training
    CASES.append(("shared-checkpoint-without-parallel-h5py",
                  train("mesh.dp=4", "mesh.pp=1", "checkpoint.format=shared"), 4,
                  'checkpoint.format="shared" needs h5py built with MPI (parallel HDF5)'))


def _mount_tmpfs(path: str, options: str) -> bool:
    os.makedirs(path, exist_ok=True)
    if not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                          capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """Template values for the table; mounts a read-only and a 64 KiB tmpfs when permitted."""
    tmp = tmp_path_factory.mktemp("bad-inputs")
    rng = np.random.default_rng(0)
    (tmp / "corpus.txt").write_bytes(rng.integers(32, 127, size=4000, dtype=np.uint8).tobytes())
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "bad.toml").write_text("[model\nn_layer = 2\n")
    (tmp / "afile").write_text("a file where a directory is expected\n")
    values = {"tmp": str(tmp), "corpus": str(tmp / "corpus.txt"), "empty": str(tmp / "empty.txt"),
              "badtoml": str(tmp / "bad.toml"), "afile": str(tmp / "afile")}
    values.update(_token_files(tmp))
    made = run(1, train(), values)
    assert made.returncode == 0, made.output
    values["ckpt"] = latest(str(tmp / "run" / "checkpoints"))
    corrupt = tmp / "corrupt" / "step-0000001"
    shutil.copytree(values["ckpt"], corrupt)
    shard = corrupt / "rank-00000.h5"
    data = bytearray(shard.read_bytes())
    for k in range(1, 20):  # a flipped byte every 5% of the file: model and optimizer tensors alike
        data[len(data) * k // 20] ^= 0xFF
    shard.write_bytes(bytes(data))
    values["corrupt"] = str(corrupt)
    mounted = []
    for name, options in (("ro", "ro,size=64k"), ("full", "size=64k")):
        if _mount_tmpfs(str(tmp / name), options):
            mounted.append(str(tmp / name))
            values[name] = str(tmp / name)
    yield values
    for path in mounted:
        subprocess.run(["umount", path], capture_output=True)


def _token_files(tmp: pathlib.Path) -> dict:
    """Token data for the data cases: an id past the vocabulary, a cut file, a prepared directory
    and a truncated copy of it, and data that comes with another tokenizer (a BPE of 256 ids)."""
    ids = np.random.default_rng(1).integers(0, 256, 4000).astype(np.uint16)
    ids[1234] = 300
    ids.tofile(tmp / "bigid.bin")
    (tmp / "odd.bin").write_bytes(b"\x01\x00\x02")
    prepare.prepare([str(tmp / "corpus.txt")], str(tmp / "prep"), progress=False)
    shutil.copytree(tmp / "prep", tmp / "cut")
    with open(tmp / "cut" / "tokens.bin", "r+b") as f:
        f.truncate(2000)
    shutil.copytree(tmp / "prep", tmp / "bpe")
    bpe = {"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(256)}, "merges": []}}
    (tmp / "bpe" / "tokenizer.json").write_text(json.dumps(bpe))
    return {k: str(tmp / k) for k in ("prep", "cut", "bpe")} | {k: str(tmp / f"{k}.bin") for k in ("bigid", "odd")}


def run(n: int, args: list[str], values: dict, debug: bool = False, mpirun=None):
    argv = ([] if not debug else ["--debug"]) + [a.format(**values) for a in args]
    if n > 1:
        return mpirun(n, [PY, "-m", "hpcpar", *argv], timeout=60)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([PY, "-m", "hpcpar", *argv], capture_output=True, timeout=60, env=env, cwd=REPO)
    out, err = (os.fsdecode(b) for b in (proc.stdout, proc.stderr))
    return type("Job", (), {"returncode": proc.returncode, "stdout": out, "stderr": err, "output": out + err,
                            "timed_out": False})()


@pytest.mark.parametrize("args,n,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_with_status_2(place, mpirun, args, n, expected):
    needs = {k for a in args for k in ("ro", "full") if "{" + k + "}" in a}
    missing = needs - place.keys()
    if missing:
        pytest.skip(f"cannot mount a tmpfs here ({', '.join(sorted(missing))}); needs root and mount permission")
    job = run(n, args, place, mpirun=mpirun)
    assert not job.timed_out
    errors = [line for line in job.stderr.splitlines() if line.startswith("hpcpar: error")]
    assert job.returncode == 2, job.output
    assert len(errors) == 1 and expected in errors[0], job.output
    assert "Traceback" not in job.output


def test_bad_timeout_in_the_environment_is_one_line_with_status_2(place, mpirun):
    # Read where the first communicator is made, on every rank alike: not inside a later wait,
    # where the ranks would find it at different times (one error per rank, then an abort).
    argv = [a.format(**place) for a in train("train.steps=2", "run.dir={tmp}/timeout-run")]
    job = mpirun(4, [PY, "-m", "hpcpar", *argv], timeout=60, env={"HPCPAR_TIMEOUT": "abc"})
    assert not job.timed_out
    errors = [line for line in job.stderr.splitlines() if "error" in line]
    assert job.returncode == 2, job.output
    assert errors == ["hpcpar: error: HPCPAR_TIMEOUT='abc' is not a positive number of seconds (e.g. 600)"], job.output
    assert "Traceback" not in job.output


def test_debug_shows_the_traceback(place):
    job = run(1, train("train.lr=-1"), place, debug=True)
    assert job.returncode == 2
    assert "Traceback (most recent call last)" in job.stderr and "ConfigError" in job.stderr
    assert job.stderr.rstrip().splitlines()[-1] == "hpcpar: error: train.lr=-1.0 is invalid: must be > 0"


def test_at_least_25_cases():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)
