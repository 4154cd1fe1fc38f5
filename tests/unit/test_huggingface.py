"""GPT-2 weights out to and in from HuggingFace: safetensors, names, Conv1D transposes, tied head.

The two transformers tests are the issue's acceptance: an exported model loads into
`GPT2LMHeadModel` with the same logits (1e-5, float32), and a GPT-2-shaped safetensors made by
transformers (tiny config, random weights, no download) imports with the same logits. They skip
without torch and transformers.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct

import numpy as np
import pytest

from hpcpar import backend
from hpcpar.checkpoint.load import load
from hpcpar.checkpoint.save import save
from hpcpar.config.load import load_config, loads, to_toml
from hpcpar.config.sections import Config
from hpcpar.training import generate
from hpcpar.interop import huggingface, safetensors
from hpcpar.data import tokenizer
from hpcpar.runtime.comm import Communicator
from hpcpar.errors import CheckpointError
from hpcpar.nn.gpt import GPT, GPTConfig

TINY = GPTConfig(vocab_size=301, block_size=32, n_layer=2, n_head=4, n_embd=32)   # 301: not a multiple of anything
TOL = 1e-5


def random_checkpoint(directory, model_cfg: GPTConfig = TINY, seed: int = 0) -> str:
    """An hpcpar checkpoint of `model_cfg` whose every weight is random (LayerNorms near 1)."""
    model = GPT(model_cfg, seed=0)
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        noise = rng.standard_normal(p.shape)
        p.data[...] = backend.to_device(1 + 0.1 * noise if "ln_" in name and name.endswith("weight") else 0.1 * noise)
    cfg = dataclasses.replace(Config(), model=model_cfg)
    meta = {"config": to_toml(cfg), "tokenizer": tokenizer.BYTES_RECORD}
    return save(str(directory), 1, {f"model/{n}": (p.data, p.layout) for n, p in model.named_parameters()},
                meta, Communicator.local(), keep=None)


def hpcpar_logits(path, ids) -> np.ndarray:
    model = generate.load_model(path)
    return backend.to_host(model(ids).data)


def torch_and_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return torch, transformers


IDS = np.random.default_rng(5).integers(0, TINY.vocab_size, (2, TINY.block_size))


# ------------------------------------------------------------------------- safetensors


def test_safetensors_round_trip_and_errors(tmp_path):
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones((2,), np.float64),
              "c": np.array([1, -2], np.int64), "empty": np.zeros((0, 3), np.float32), "s": np.array(7, np.int32)}
    path = str(tmp_path / "x.safetensors")
    safetensors.write(path, arrays, {"format": "pt"})
    header, start = safetensors.read_header(path)
    assert start % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    back = safetensors.read(path)
    for name, a in arrays.items():
        assert back[name].dtype == a.dtype and np.array_equal(back[name], a), name
    st = pytest.importorskip("safetensors.numpy")                  # the reference implementation agrees
    theirs = st.load_file(path)
    assert all(np.array_equal(theirs[n], a) for n, a in arrays.items())
    st.save_file({"w": np.arange(6, dtype=np.float16)}, str(tmp_path / "t.safetensors"))
    assert np.array_equal(safetensors.read(str(tmp_path / "t.safetensors"))["w"], np.arange(6))
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-4])
    with pytest.raises(CheckpointError, match="truncated"):
        safetensors.read(str(tmp_path / "cut.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"hello world, not a header")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        safetensors.read(str(tmp_path / "junk.safetensors"))


def test_bfloat16_reads_as_float32(tmp_path):
    values = np.array([1.0, -2.5, 3.140625], np.float32)           # exactly representable in bfloat16
    raw = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
    (tmp_path / "b.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + raw)
    assert np.array_equal(safetensors.read(str(tmp_path / "b.safetensors"))["w"], values)


# ------------------------------------------------------------------------------ export


def test_export_names_transposes_and_ties(tmp_path):
    ckpt = random_checkpoint(tmp_path / "ck")
    out = huggingface.export(ckpt, str(tmp_path / "w.safetensors"))[0]
    hf = safetensors.read(out)
    model = {n: backend.to_host(p.data) for n, p in generate.load_model(ckpt).named_parameters()}
    assert "lm_head.weight" not in hf and len(hf) == len(model)
    assert np.array_equal(hf["transformer.h.1.attn.c_attn.weight"], model["transformer.h.1.attn.c_attn.weight"].T)
    assert hf["transformer.h.0.mlp.c_fc.weight"].shape == (32, 128)
    assert np.array_equal(hf["transformer.wte.weight"], model["transformer.wte.weight"])


def test_exported_model_gives_transformers_the_same_logits(tmp_path):
    torch, transformers = torch_and_transformers()
    ckpt = random_checkpoint(tmp_path / "ck")
    huggingface.export(ckpt, str(tmp_path / "hf"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(IDS)).logits.numpy()
    ours = hpcpar_logits(ckpt, IDS)
    assert theirs.shape == ours.shape and theirs.dtype == ours.dtype == np.float32
    assert np.abs(theirs - ours).max() < TOL
    # The weights file alone, into a model built from a config: lm_head is tied, nothing else is missing.
    single = huggingface.export(ckpt, str(tmp_path / "w.safetensors"))[0]
    st = pytest.importorskip("safetensors.torch")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(str(tmp_path / "hf"))).eval()
    missing, unexpected = model.load_state_dict(st.load_file(single), strict=False)
    model.tie_weights()
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    with torch.no_grad():
        assert np.abs(model(torch.tensor(IDS)).logits.numpy() - ours).max() < TOL


def test_export_without_biases_writes_zero_biases(tmp_path):
    cfg = dataclasses.replace(TINY, bias=False)
    out = safetensors.read(huggingface.export(random_checkpoint(tmp_path / "ck", cfg),
                                                   str(tmp_path / "w.safetensors"))[0])
    assert not out["transformer.h.0.ln_1.bias"].any() and not out["transformer.h.1.attn.c_proj.bias"].any()
    assert out["transformer.h.0.attn.c_attn.bias"].shape == (96,)


# ------------------------------------------------------------------------------ import


def transformers_model(torch, transformers, directory):
    """A GPT-2-shaped model made by transformers: tiny config, random weights, saved locally."""
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(vocab_size=TINY.vocab_size, n_positions=TINY.block_size, n_embd=TINY.n_embd,
                                     n_layer=TINY.n_layer, n_head=TINY.n_head)
    model = transformers.GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))   # LayerNorms away from (1, 0)
    model.save_pretrained(str(directory))
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def test_transformers_gpt2_imports_with_the_same_logits(tmp_path):
    torch, transformers = torch_and_transformers()
    theirs = transformers_model(torch, transformers, tmp_path / "hf")
    ckpt = huggingface.import_(str(tmp_path / "hf"), str(tmp_path / "imported"))
    ours = hpcpar_logits(ckpt, IDS)
    assert np.abs(theirs - ours).max() < TOL
    _, meta = load(ckpt, {}, Communicator.local())
    assert meta["weights_only"] and loads(meta["config"]).model == dataclasses.replace(TINY, dtype="float32")
    # The weights file alone needs the head count, or a config.json beside it.
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "m.safetensors").write_bytes((tmp_path / "hf" / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="give --n-head N"):
        huggingface.import_(str(alone / "m.safetensors"), str(tmp_path / "x"))
    ckpt = huggingface.import_(str(alone / "m.safetensors"), str(tmp_path / "y"), n_head=TINY.n_head)
    assert np.abs(hpcpar_logits(ckpt, IDS) - theirs).max() < TOL


def test_round_trip_hpcpar_to_hf_to_hpcpar_is_exact(tmp_path):
    ckpt = random_checkpoint(tmp_path / "ck", dataclasses.replace(TINY, dtype="float64"))
    huggingface.export(ckpt, str(tmp_path / "hf"))
    back = huggingface.import_(str(tmp_path / "hf"), str(tmp_path / "back"))
    a, b = dict(generate.load_model(ckpt).named_parameters()), dict(generate.load_model(back).named_parameters())
    assert a.keys() == b.keys() and all(np.array_equal(a[n].data, b[n].data) for n in a)
    _, meta = load(back, {}, Communicator.local())
    assert meta["tokenizer"] is None      # a bytes tokenizer is not a HF tokenizer.json


def test_gpt2_shapes_get_the_preset(tmp_path):
    gpt2 = GPTConfig(**{**dataclasses.asdict(GPTConfig()), "vocab_size": 50257, "block_size": 1024, "n_layer": 12,
                        "n_embd": 768, "n_head": 12})
    tensors = {n: np.zeros(s, np.float32) for n, s in huggingface._model_names(gpt2).items()}
    got = huggingface._architecture(None, tensors, None, "x")          # no config.json: 12 heads from the shapes
    assert got.preset == "gpt2" and got.n_head == 12
    assert load_config(None, ["model.preset=gpt2"]).model == dataclasses.replace(got, dtype="float32")


@pytest.mark.parametrize("change, fragment", [
    (lambda t, c: c.update(activation_function="relu"), "activation_function='relu'"),
    (lambda t, c: c.update(layer_norm_epsilon=1e-6), "layer_norm_epsilon=1e-06"),
    (lambda t, c: c.update(model_type="llama"), "only GPT-2 imports"),
    (lambda t, c: t.update({"lm_head.weight": t["wte.weight"] + 1}), "lm_head.weight differs from wte"),
    (lambda t, c: t.pop("h.1.mlp.c_fc.bias"), "missing transformer.h.1.mlp.c_fc.bias"),
    (lambda t, c: t.update({"h.0.mlp.c_fc.weight": np.zeros((7, 7), np.float32)}), "has shape [7, 7]"),
])
def test_import_refuses_what_hpcpar_does_not_compute(tmp_path, change, fragment):
    tensors = {n.removeprefix("transformer."): (a.T if n.endswith(huggingface.CONV1D) else a)
               for n, a in ((n, np.ones(s, np.float32)) for n, s in huggingface._model_names(TINY).items())}
    hf_cfg = {"model_type": "gpt2", "n_head": 4, "activation_function": "gelu_new"}
    change(tensors, hf_cfg)
    (tmp_path / "src").mkdir()
    safetensors.write(str(tmp_path / "src" / "model.safetensors"), tensors)
    (tmp_path / "src" / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(CheckpointError, match=re.escape(fragment)) as info:
        huggingface.import_(str(tmp_path / "src"), str(tmp_path / "out"))
    assert "\n" not in str(info.value)


def test_import_of_nothing_usable(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        huggingface.import_(str(tmp_path / "nope.safetensors"), str(tmp_path / "o"))
    with pytest.raises(CheckpointError, match="holds neither model.safetensors"):
        huggingface.import_(str(tmp_path), str(tmp_path / "o"))


def bpe_record(n: int, end_of_text: int | None = None) -> dict:
    """The checkpoint record of a byte-level BPE of `n` ids (no merges), with GPT-2's end-of-text
    token as the special token `end_of_text` when given."""
    vocab = {f"t{i}": i for i in range(n if end_of_text is None else n - 1)}
    added = [] if end_of_text is None else [{"id": end_of_text, "content": tokenizer.GPT2_EOT, "special": True}]
    return tokenizer.record(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []},
                                        "added_tokens": added}))


def test_exported_config_names_only_ids_the_tokenizer_has(tmp_path):
    """config.json's bos/eos ids are the tokenizer's end-of-text token, or null: never GPT-2's 50256
    for another vocabulary (transformers fills in 50256 when the keys are missing)."""
    assert huggingface.end_of_text_id(None) is None
    assert huggingface.end_of_text_id(tokenizer.BYTES_RECORD) is None
    assert huggingface.end_of_text_id(bpe_record(8192)) is None                      # trained without it
    assert huggingface.end_of_text_id(bpe_record(8192, end_of_text=8191)) == 8191
    gpt2 = {**{f"t{i}": i for i in range(50256)}, tokenizer.GPT2_EOT: 50256}
    assert huggingface.end_of_text_id(tokenizer.record(json.dumps({"model": {"type": "BPE", "vocab": gpt2,
                                                                             "merges": []}}))) == 50256
    written = huggingface.export(random_checkpoint(tmp_path / "ck"), str(tmp_path / "hf"))
    assert written == [str(tmp_path / "hf" / "model.safetensors"), str(tmp_path / "hf" / "config.json")]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "bos_token_id" in config and config["bos_token_id"] is None and config["eos_token_id"] is None
    out = huggingface._hf_config(TINY, bpe_record(301, end_of_text=300), "float32")
    assert (out["bos_token_id"], out["eos_token_id"]) == (300, 300)
