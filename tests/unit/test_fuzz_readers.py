"""Every reader of files from elsewhere, fuzzed: safetensors, a HuggingFace model directory, a token
bin with its meta.json, an HDF5 token file, a tokenizer.json, a calibration JSON and a config TOML.

Each test mutates one valid file at a time (`fuzzing.py`: byte flips, truncations, appended bytes,
header fields replaced by hostile values, size lies) and runs the reader: it loads the same
numbers, loads other valid numbers (these formats carry no checksum: a flipped digit is another
valid file), or refuses in one line with its HpcparError subclass; never another exception, a
hang or a write outside the test's directory. Where a loaded result is used further (the tokens
sampled, the figures planned with, the config validated), that use runs too. Then the names a
token directory or a model directory gives are held to their directory (`data.untrusted`), and a
sample of refusals goes through the CLI (exit 2, one line).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import struct
import subprocess
import sys

import h5py
import numpy as np
import pytest

from fuzzing import ROUNDS, Outcomes, byte_mutation, json_mutation, json_text, rng
from hpcpar.checkpoint.load import load as load_checkpoint
from hpcpar.config.load import load_config, to_toml
from hpcpar.config.sections import DataConfig
from hpcpar.config.validate import validate
from hpcpar.data import formats, tokenizer
from hpcpar.data.corpus import get_batch
from hpcpar.data.prepare import prepare
from hpcpar.errors import CheckpointError, ConfigError, DataError, HpcparError
from hpcpar.interop import huggingface, safetensors
from hpcpar.layout import Layout
from hpcpar.nn.gpt import GPTConfig
from hpcpar.planner.hardware import PRESETS, load_hardware, save_hardware
from hpcpar.planner.predict import predict
from hpcpar.runtime.solo import SoloCommunicator

REPO = pathlib.Path(__file__).resolve().parents[2]


def mutate_files(out: Outcomes, files: dict[str, bytes], rng, count: int, call, same, fields=()) -> None:
    """`count` rounds: each file of `files` (path -> original bytes) mutated at the byte level, and those
    in `fields` (JSON) field by field too; the reader runs on each, the file is restored after."""
    for _ in range(count):
        for path, data in files.items():
            mutations = [("bytes", *byte_mutation(data, rng))]
            if path in fields:
                mutations.append(("field", *json_mutation(json.loads(data), rng)))
            for kind, label, mutated in mutations:
                pathlib.Path(path).write_bytes(mutated if isinstance(mutated, bytes) else json_text(mutated).encode())
                out.run(f"{os.path.basename(path)}: {label}", kind, call, same)
                pathlib.Path(path).write_bytes(data)


def header_mutation(data: bytes, rng) -> tuple[str, bytes]:
    """A safetensors header field replaced (the length made to match), or the length itself lied about."""
    n = struct.unpack("<Q", data[:8])[0]
    if rng.random() < 0.25:
        lie = [n + 1, n - 1, 2 * n, len(data), 2**63 + 5, 0][int(rng.integers(6))] % 2**64
        return f"header length {n} -> {lie}", struct.pack("<Q", lie) + data[8:]
    label, value = json_mutation(json.loads(data[8:8 + n]), rng)
    text = json_text(value).encode()
    return f"header {label}", struct.pack("<Q", len(text)) + text + data[8 + n:]


# ------------------------------------------------------------------------------ safetensors

ARRAYS = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.linspace(0, 1, 5),
          "c": np.array([1, -2], np.int64), "empty": np.zeros((0, 3), np.float32), "s": np.array(7, np.int32)}


def test_fuzz_safetensors(tmp_path):
    path = str(tmp_path / "x.safetensors")
    safetensors.write(path, ARRAYS, {"format": "pt"})
    original = pathlib.Path(path).read_bytes()
    out = Outcomes("safetensors", CheckpointError, other_allowed=True, root=str(tmp_path))

    def call():
        return {k: np.array(v) for k, v in safetensors.read(path).items()}   # every byte touched

    def same(got):
        return sorted(got) == sorted(ARRAYS) and all(
            got[k].dtype == a.dtype and np.array_equal(got[k], a) for k, a in ARRAYS.items())

    gen = rng(4710)
    mutate_files(out, {path: original}, gen, 100 * ROUNDS, call, same)
    for _ in range(150 * ROUNDS):
        label, data = header_mutation(original, gen)
        pathlib.Path(path).write_bytes(data)
        out.run(label, "header", call, same)
    out.report()
    assert out.counts["refused"] > 100 and out.counts["same"] > 0


# ------------------------------------------------------------------------------ HF model directory

HF_MODEL = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)


def hf_directory(where: pathlib.Path) -> dict[str, np.ndarray]:
    """A HuggingFace GPT-2 directory (model.safetensors + config.json) of random weights; returns
    hpcpar's arrays it should import as."""
    gen = np.random.default_rng(4711)
    mine = {n: gen.standard_normal(s).astype(np.float32) for n, s in huggingface._model_names(HF_MODEL).items()}
    theirs = {n: np.ascontiguousarray(a.T) if n.endswith(huggingface.CONV1D) else a for n, a in mine.items()}
    where.mkdir(parents=True)
    safetensors.write(str(where / "model.safetensors"), theirs, {"format": "pt"})
    config = {"model_type": "gpt2", "n_head": 2, "n_embd": 8, "n_layer": 1, "vocab_size": 16, "n_positions": 8,
              "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "n_inner": None}
    (where / "config.json").write_text(json.dumps(config))
    return mine


def test_fuzz_huggingface_import(tmp_path):
    src = tmp_path / "gpt2"
    expected = hf_directory(src)
    files = {str(src / name): (src / name).read_bytes() for name in ("model.safetensors", "config.json")}
    out = Outcomes("HF model directory import", CheckpointError, other_allowed=True, root=str(tmp_path))
    target = tmp_path / "imported"

    def call():
        shutil.rmtree(target, ignore_errors=True)
        ckpt = huggingface.import_(str(src), str(target))
        wanted = {f"model/{n}": Layout.replicated(a.shape) for n, a in expected.items()}
        return load_checkpoint(ckpt, wanted, SoloCommunicator())[0]

    def same(got):
        return all(np.array_equal(got[f"model/{n}"], a) for n, a in expected.items())

    gen = rng(4712)
    mutate_files(out, files, gen, 30 * ROUNDS, call, same, fields=(str(src / "config.json"),))
    weights = files[str(src / "model.safetensors")]
    for _ in range(30 * ROUNDS):
        label, data = header_mutation(weights, gen)
        (src / "model.safetensors").write_bytes(data)
        out.run(f"model.safetensors {label}", "header", call, same)
    (src / "model.safetensors").write_bytes(weights)
    # A sharded model: the index names the shard files.
    os.rename(src / "model.safetensors", src / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in expected}}
    (src / huggingface.SHARD_INDEX).write_text(json.dumps(index))
    mutate_files(out, {str(src / huggingface.SHARD_INDEX): (src / huggingface.SHARD_INDEX).read_bytes()}, gen,
                 15 * ROUNDS, call, same, fields=(str(src / huggingface.SHARD_INDEX),))
    out.report()
    assert same(call()) and out.counts["refused"] > 20 and out.counts["same"] > 0


def test_model_directory_names_stay_inside(tmp_path):
    src = tmp_path / "gpt2"
    hf_directory(src)
    os.rename(src / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (src / huggingface.SHARD_INDEX).write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="shard file '../elsewhere.safetensors' leads outside"):
        huggingface.import_(str(src), str(tmp_path / "out"))
    os.symlink(tmp_path / "elsewhere.safetensors", src / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors' is a symbolic link that leads outside"):
        huggingface.import_(str(src), str(tmp_path / "out"))
    # HuggingFace's cache: a snapshot's files are links into the repository's blobs/: imported.
    repo = tmp_path / "models--x--gpt2"
    hf_directory(repo / "blobs")
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        os.symlink(os.path.join("..", "..", "blobs", name), snapshot / name)
    assert huggingface.import_(str(snapshot), str(tmp_path / "cached")).endswith("step-0000000")


# ------------------------------------------------------------------------------ token files


def token_directory(where: pathlib.Path, fmt: str) -> tuple[DataConfig, dict]:
    text = where.parent / f"text-{fmt}.txt"
    text.write_bytes(np.random.default_rng(4713).integers(32, 127, 6000, dtype=np.uint8).tobytes())
    prepare([str(text)], str(where), kind="bytes", fmt=fmt, progress=False)
    cfg = DataConfig(corpus=str(where), format=fmt, val_fraction=0.1)
    data = formats.load(cfg, 256)
    # Copies: a memory map would follow the file as the fuzzing rewrites it.
    return cfg, {"train": np.array(data.train), "val": np.array(data.val), "tokenizer": data.tokenizer}


def fuzz_tokens(tmp_path: pathlib.Path, fmt: str, seed: int) -> Outcomes:
    where = tmp_path / "tokens"
    cfg, expected = token_directory(where, fmt)
    out = Outcomes(f"{fmt} token directory", (DataError, ConfigError), other_allowed=True, root=str(tmp_path))

    def call():
        data = formats.load(cfg, 256)
        get_batch(data.train, 0, 3, range(4), 8)                      # a batch, as a step samples it
        train, val = np.array(data.train), np.array(data.val)       # every token read (copied: see above)
        assert max(train.max(), val.max()) < 256 and min(train.min(), val.min()) >= 0   # what load promises
        return train, val, data.tokenizer

    def same(got):
        return np.array_equal(got[0], expected["train"]) and np.array_equal(got[1], expected["val"]) and \
            got[2] == expected["tokenizer"]

    token_file = formats.BIN_FILE if fmt == "bin" else formats.HDF5_FILE
    files = {str(where / name): (where / name).read_bytes() for name in (token_file, formats.META, formats.TOKENIZER)}
    fields = (str(where / formats.META), str(where / formats.TOKENIZER))
    mutate_files(out, files, rng(seed), 40 * ROUNDS, call, same, fields=fields)
    formats._open_files.clear()
    out.report()
    assert same(call()) and out.counts["refused"] > 10 and out.counts["same"] > 0
    return out


def test_fuzz_token_bin_with_meta(tmp_path):
    fuzz_tokens(tmp_path, "bin", 4714)


def test_fuzz_hdf5_token_file(tmp_path, monkeypatch):
    # A mutated file must be opened again for every case: no cache of open files between cases.
    monkeypatch.setattr(formats, "_open_files", _NoCache())
    fuzz_tokens(tmp_path, "hdf5", 4715)


class _NoCache(dict):
    def __setitem__(self, key, value):
        self.setdefault("_files", []).append(value)   # kept open until the test ends, then closed

    def get(self, key, default=None):
        return default

    def clear(self):
        for f in super().get("_files", []):
            f.close()
        super().clear()


def test_a_token_file_changed_after_its_record_is_refused_where_it_is_read(tmp_path):
    """meta.json's largest id is trusted at start (nothing is scanned); a token changed since then to an
    id the model has no row for is refused when a batch or a whole read meets it."""
    where = tmp_path / "tokens"
    cfg, expected = token_directory(where, "bin")
    tokens = np.fromfile(where / formats.BIN_FILE, dtype=np.uint16)
    tokens[:] = 300                                      # every window holds it
    tokens.tofile(where / formats.BIN_FILE)
    data = formats.load(cfg, 256)                        # the record says < 256: loads without reading
    with pytest.raises(DataError, match=r"tokens.bin' holds token id 300, outside model.vocab_size=256, though its "
                                        r"meta.json record says the largest is \d+: the file changed"):
        get_batch(data.train, 0, 3, range(4), 8)
    with pytest.raises(DataError, match="holds token id 300"):
        np.asarray(data.val)
    os.remove(where / formats.META)                      # without a record the file is scanned at start
    with pytest.raises(DataError, match="holds token id 300, but model.vocab_size=256"):
        formats.load(cfg, 256)


def test_token_directory_names_stay_inside(tmp_path):
    where = tmp_path / "tokens"
    cfg, _ = token_directory(where, "bin")
    meta = json.loads((where / formats.META).read_text())
    shutil.copy(where / formats.TOKENIZER, tmp_path / "tok.json")
    for name in ("../tok.json", str(tmp_path / "tok.json")):
        (where / formats.META).write_text(json.dumps(dict(meta, tokenizer=name)))
        with pytest.raises(DataError, match=f"meta.json: tokenizer '{name}' leads outside"):
            formats.load(cfg, 256)
    (where / formats.META).write_text(json.dumps(meta))
    os.remove(where / formats.TOKENIZER)
    os.symlink(tmp_path / "tok.json", where / formats.TOKENIZER)
    with pytest.raises(DataError, match="tokenizer.json' is a symbolic link that leads outside"):
        formats.load(cfg, 256)
    # An HDF5 token file whose dataset is an external link elsewhere.
    with h5py.File(tmp_path / "outside.h5", "w") as f:
        f["tokens"] = np.arange(100, dtype=np.uint16)
    with h5py.File(tmp_path / "linked.h5", "w") as f:
        f["tokens"] = h5py.ExternalLink(str(tmp_path / "outside.h5"), "/tokens")
    (tmp_path / "inside").mkdir()
    os.rename(tmp_path / "linked.h5", tmp_path / "inside" / "tokens.h5")
    with pytest.raises(DataError, match="external link /tokens to '/.*outside.h5' leads outside"):
        formats.load(DataConfig(corpus=str(tmp_path / "inside"), format="hdf5"), 256)


# ------------------------------------------------------------------------------ tokenizer.json


def bpe_json() -> dict:
    letters = "abcdefgh"
    vocab = {c: i for i, c in enumerate(letters)}
    vocab.update({"ab": 8, "cd": 9, "abcd": 10})
    return {"version": "1.0", "added_tokens": [{"id": 11, "content": "<|endoftext|>", "special": True}],
            "model": {"type": "BPE", "vocab": vocab, "merges": ["a b", ["c", "d"], "ab cd"]}}


def test_fuzz_tokenizer_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(bpe_json()))
    expected = tokenizer.record(tokenizer.read(str(path)))
    assert expected["vocab_size"] == 12
    out = Outcomes("tokenizer.json", DataError, other_allowed=True, root=str(tmp_path))

    def call():
        rec = tokenizer.record(tokenizer.read(str(path)))
        assert 0 < rec["vocab_size"] <= 2 * 13 + 256, rec["vocab_size"]   # what it claims, bounded by what it holds
        return rec

    def same(rec):  # what the tokenizer means (its JSON text may differ: whitespace)
        return {k: v for k, v in rec.items() if k != "json"} == {k: v for k, v in expected.items() if k != "json"}

    mutate_files(out, {str(path): path.read_bytes()}, rng(4716), 150 * ROUNDS, call, same,
                 fields=(str(path),))
    out.report()
    assert out.counts["refused"] > 50 and out.counts["same"] > 0
    sparse = bpe_json()
    sparse["added_tokens"][0]["id"] = 10**9
    path.write_text(json.dumps(sparse))
    with pytest.raises(DataError, match="claims 1000000001 ids but defines 12 tokens"):
        tokenizer.read(str(path))


# ------------------------------------------------------------------------------ calibration JSON


SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16", "train.micro_batch_size=2"]


def test_fuzz_calibration_json(tmp_path):
    cfg = validate(load_config(None, SMALL), 2)
    hw = dataclasses.replace(PRESETS["a100"], name="this", layer_times={1: [1e-4, 1e-8, 2e-4, 2e-8, 1e-4, 1e-8],
                             2: [6e-5, 6e-9, 1e-4, 1e-8, 6e-5, 6e-9]}, model={"n_layer": 2, "n_embd": 32},
                             tp_scales={2: 1.3}, cp_hidden=0.5, step_overhead=1e-3, microbatch_overhead=1e-4)
    path = save_hardware(hw, str(tmp_path / "calibration.json"))
    out = Outcomes("calibration JSON", ConfigError, other_allowed=True, root=str(tmp_path))

    def call():
        got = load_hardware("this", path)
        step = predict(cfg, got).step_time                 # the figures are usable by the planner
        assert step >= 0 and not math.isnan(step), step
        return got

    mutate_files(out, {path: pathlib.Path(path).read_bytes()}, rng(4717), 120 * ROUNDS, call,
                 lambda got: got == hw, fields=(path,))
    out.report()
    assert out.counts["refused"] > 50 and call() == hw   # (a JSON file of figures: nearly every change is seen)


# ------------------------------------------------------------------------------ config TOML

TOML_VALUES = ["-1", "0", "1e400", "nan", "inf", '"x"', "true", "[1, 2]", "{ a = 1 }", '"../../x"',
               "99999999999999999999", '"' + "x" * 100_000 + '"', "[" * 3000 + "]" * 3000, '"\\u0000"', "1979-05-27"]


def toml_mutation(text: str, rng) -> tuple[str, str]:
    """A `key = value` line's value replaced by a hostile TOML value, or a number lied about."""
    lines = text.splitlines()
    at = [i for i, line in enumerate(lines) if " = " in line and not line.startswith("#")]
    i = at[int(rng.integers(len(at)))]
    key, _, value = lines[i].partition(" = ")
    if rng.random() < 0.3 and value.lstrip("-").replace(".", "", 1).replace("e-", "", 1).isdigit():
        new = [f"{value}0", f"-{value}", f"{value}1", "9" * 30][int(rng.integers(4))]
    else:
        new = TOML_VALUES[int(rng.integers(len(TOML_VALUES)))]
    lines[i] = f"{key} = {new}"
    return f"{key} = {new[:30]}", "\n".join(lines) + "\n"


def test_fuzz_config_toml(tmp_path):
    cfg = load_config(None, SMALL)
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    expected = validate(cfg, 2)
    out = Outcomes("config TOML", HpcparError, other_allowed=True, root=str(tmp_path))

    def call():
        return validate(load_config(str(path)), 2)

    gen = rng(4718)
    original = path.read_bytes()
    mutate_files(out, {str(path): original}, gen, 100 * ROUNDS, call, lambda got: got == expected)
    for _ in range(100 * ROUNDS):
        label, text = toml_mutation(original.decode(), gen)
        path.write_text(text)
        out.run(label, "field", call, lambda got: got == expected)
    path.write_bytes(original)
    out.report()
    assert out.counts["refused"] > 50 and out.counts["same"] > 0


# ------------------------------------------------------------------------------ the CLI


def hpcpar_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env or {}), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "hpcpar", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def test_the_cli_refuses_mutated_files_in_one_line(tmp_path):
    src = tmp_path / "gpt2"
    hf_directory(src)
    weights = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + weights[8:])       # a header length lie
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"intra": {"alpha": 1e-6, "beta": "fast"}}))
    for args, env, expected in ((["ckpt", "import", str(src), "--out", str(tmp_path / "o")], {}, "bad header length"),
                                (["plan", "--ranks", "4", "--hardware", "this"],
                                 {"HPCPAR_CALIBRATION": str(calibration)}, "intra.beta='fast' is not a positive")):
        run = hpcpar_cli(*args, env=env)
        assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, (args, run.stdout, run.stderr)
        assert run.stderr.startswith("hpcpar: error: ") and expected in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
