"""GPT-2 weights in and out: hpcpar checkpoints <-> HuggingFace GPT-2 in safetensors.

    hpcpar ckpt export CKPT --format safetensors --out model.safetensors   # the weights only
    hpcpar ckpt export CKPT --format safetensors --out DIR                 # + config.json, tokenizer.json
    hpcpar ckpt import GPT2_DIR_OR_FILE --out CKPT_DIR [--n-head N] [--tokenizer FILE]

hpcpar's model is GPT-2's architecture (pre-LayerNorm blocks, tanh GELU = HF's "gelu_new",
LayerNorm eps 1e-5, learned positions, LM head tied to wte) under nanoGPT's parameter names, so
the exchange is a renaming plus one transposition: HF's GPT-2 keeps its four projections as
Conv1D, weight [in, out], where hpcpar stores nn.Linear's [out, in]; c_attn, attn.c_proj, c_fc
and mlp.c_proj weights are transposed both ways. HF's names are hpcpar's under ``transformer.``
(files from the hub may lack the prefix; both are read). The LM head is wte: export leaves
``lm_head.weight`` out, as ``save_pretrained`` does (the config says ``tie_word_embeddings``),
and import accepts it only when it equals wte. An untied model (``model.tie_embeddings = false``)
exports its ``lm_head.weight`` with ``tie_word_embeddings: false``, and a file whose config.json
says so imports untied when its ``lm_head.weight`` differs from wte. Biases hpcpar's ``model.bias = false`` drops are
exported as zeros, which is the same function.

An imported checkpoint holds the weights only (meta ``weights_only``): `hpcpar sample` and
`hpcpar eval` use it as is, and ``checkpoint.resume`` starts training from it at step 0 with a
fresh optimizer, on any mesh. Its config is the defaults with the model's shapes (``model.preset``
is set to "gpt2" when they are GPT-2 small's), and its tokenizer is the directory's
``tokenizer.json`` (or vocab.json + merges.txt, or ``--tokenizer``), recorded for `hpcpar sample`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from hpcpar.checkpoint.directory import latest
from hpcpar.checkpoint.load import load
from hpcpar.checkpoint.save import save
from hpcpar.checkpoint.tools import as_dtype
from hpcpar.config.load import loads, to_toml
from hpcpar.config.sections import Config
from hpcpar.data import tokenizer
from hpcpar.data.untrusted import MiB, contained, read_json
from hpcpar.errors import CheckpointError
from hpcpar.interop import safetensors
from hpcpar.layout import Layout
from hpcpar.nn.gpt import PRESETS, GPTConfig
from hpcpar.runtime.solo import SoloCommunicator

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
WEIGHTS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
# HF GPT-2 activations that are the tanh approximation of GELU hpcpar computes.
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_BUFFERS = (".attn.bias", ".attn.masked_bias")   # causal-mask buffers older files carry
_JSON_LIMIT = 64 * MiB   # config.json, the shard index: larger ones are refused unread


def _model_names(cfg: GPTConfig) -> dict[str, tuple]:
    """hpcpar's global parameter names -> shapes, with every bias (HF GPT-2 always has them)."""
    c, v, t = cfg.n_embd, cfg.vocab_size, cfg.block_size
    names = {"transformer.wte.weight": (v, c), "transformer.wpe.weight": (t, c),
             "transformer.ln_f.weight": (c,), "transformer.ln_f.bias": (c,)}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = (v, c)
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        names.update({p + "ln_1.weight": (c,), p + "ln_1.bias": (c,), p + "ln_2.weight": (c,), p + "ln_2.bias": (c,),
                      p + "attn.c_attn.weight": (3 * c, c), p + "attn.c_attn.bias": (3 * c,),
                      p + "attn.c_proj.weight": (c, c), p + "attn.c_proj.bias": (c,),
                      p + "mlp.c_fc.weight": (4 * c, c), p + "mlp.c_fc.bias": (4 * c,),
                      p + "mlp.c_proj.weight": (c, 4 * c), p + "mlp.c_proj.bias": (c,)})
    return names


def _hf_config(cfg: GPTConfig, tok: dict | None, dtype: str) -> dict:
    """config.json of GPT2LMHeadModel for this architecture."""
    out = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
           "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
           "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new",
           "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": 0.0,  # no attention dropout
           "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
           "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
           "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True, "torch_dtype": dtype}
    # Written even when None: transformers' GPT2Config otherwise fills in GPT-2's 50256, an id a
    # smaller vocabulary does not have (and warns about).
    out["bos_token_id"] = out["eos_token_id"] = end_of_text_id(tok)
    return out


def end_of_text_id(tok: dict | None) -> int | None:
    """The id of GPT-2's end-of-text token `<|endoftext|>` in the tokenizer recorded as `tok`
    (GPT-2's own: 50256), or None when it has none (bytes, a BPE trained without it)."""
    if tok is None or tok["kind"] == "bytes":
        return None
    try:
        obj = json.loads(tok["json"])
    except ValueError:
        return None
    ids = {a.get("content"): a.get("id") for a in obj.get("added_tokens") or [] if isinstance(a, dict)}
    vocab = (obj.get("model") or {}).get("vocab")
    found = ids.get(tokenizer.GPT2_EOT, vocab.get(tokenizer.GPT2_EOT) if isinstance(vocab, dict) else None)
    return found if isinstance(found, int) and 0 <= found < tok["vocab_size"] else None


# ------------------------------------------------------------------------------ export


def export(path: str, out: str, dtype: str | None = None) -> list[str]:
    """Write the checkpoint at `path` (or its latest) in HF GPT-2 naming. `out` ending in
    .safetensors: that file; else a directory with model.safetensors, config.json and, when the
    checkpoint records a BPE tokenizer, tokenizer.json. `dtype`: the weights' dtype (default the
    checkpoint's; bfloat16 and float16 are written as BF16 / F16). Returns the files written,
    the weights first."""
    ckpt = latest(path) or path
    _, meta = load(ckpt, {}, SoloCommunicator())
    cfg = loads(meta["config"], origin=f"config stored in {ckpt}").model
    if cfg.moe_experts:
        raise CheckpointError(f"{ckpt} is a mixture-of-experts model (model.moe_experts={cfg.moe_experts}); HF GPT-2 "
                              "has no experts, so only dense checkpoints export")
    shapes = _model_names(cfg)
    stored = {n: s for n, s in shapes.items() if cfg.bias or not n.endswith(".bias")}
    arrays, _ = load(ckpt, {f"model/{n}": Layout.replicated(s) for n, s in stored.items()}, SoloCommunicator())
    dtype = np.dtype(dtype or cfg.dtype)
    arrays = as_dtype(arrays, dtype.name)
    tensors = {}
    for name, shape in shapes.items():
        a = arrays.get(f"model/{name}")
        a = np.zeros(shape, dtype) if a is None else a        # a bias the model does without
        tensors[name] = np.ascontiguousarray(a.T) if name.endswith(CONV1D) else a
    directory = not out.endswith(".safetensors")
    target = os.path.join(out, WEIGHTS) if directory else out
    try:
        if directory:
            os.makedirs(out, exist_ok=True)
        safetensors.write(target, tensors, {"format": "pt", "producer": "hpcpar", "source": ckpt})
        written = [target]
        if directory:
            tok = meta.get("tokenizer")
            written.append(os.path.join(out, "config.json"))
            with open(written[-1], "w") as f:
                json.dump(_hf_config(cfg, tok, dtype.name), f, indent=2)
            if tok is not None and tok["kind"] != "bytes":
                written.append(os.path.join(out, "tokenizer.json"))
                with open(written[-1], "w", encoding="utf-8") as f:
                    f.write(tok["json"])
    except OSError as err:
        raise CheckpointError(f"cannot write {target}: {err.strerror}") from None
    return written


# ------------------------------------------------------------------------------ import


def _root(where: str) -> str:
    """The directory a model directory's files must stay in (`data.untrusted.contained`): itself, or
    for a snapshot of HuggingFace's cache (`<repo>/snapshots/<revision>/`, whose files are links
    into `<repo>/blobs/`) its repository folder."""
    parent = os.path.dirname(os.path.abspath(where))
    return os.path.dirname(parent) if os.path.basename(parent) == "snapshots" else os.path.abspath(where)


def _beside(where: str, name: str) -> str:
    """`where/name`, refused when it resolves outside the model directory (`_root`)."""
    return contained(where, name, f"{where}: file", CheckpointError, root=_root(where))


def _weights_files(src: str) -> tuple[list[str], str]:
    """(the safetensors files of `src`, the directory that may hold config.json / tokenizer files).
    A sharded model's index names its shards: each must lie in the model directory."""
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, WEIGHTS)):
            return [_beside(src, WEIGHTS)], src
        index = os.path.join(src, SHARD_INDEX)
        if os.path.isfile(index):
            weight_map = read_json(_beside(src, SHARD_INDEX), _JSON_LIMIT, "weight index", CheckpointError)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: no weight_map of tensor names to shard files (not a model index)")
            return [contained(src, shard, f"{index}: shard file", CheckpointError, root=_root(src))
                    for shard in sorted(set(map(str, weight_map.values())))], src
        raise CheckpointError(f"{src} holds neither {WEIGHTS} nor {SHARD_INDEX}; give a GPT-2 safetensors file "
                              "or a HuggingFace model directory (PyTorch .bin weights are not read: "
                              "convert them with save_pretrained(safe_serialization=True))")
    if not os.path.isfile(src):
        raise CheckpointError(f"{src} does not exist; give a GPT-2 safetensors file or a HuggingFace model directory")
    return [src], os.path.dirname(os.path.abspath(src))


def _architecture(hf: dict | None, tensors: dict, n_head: int | None, origin: str) -> GPTConfig:
    """The GPTConfig of the weights: from config.json, else from the shapes (+ n_head)."""
    wte, wpe = tensors.get("transformer.wte.weight"), tensors.get("transformer.wpe.weight")
    if wte is None or wpe is None:
        raise CheckpointError(f"{origin}: no wte/wpe weights; not a GPT-2 model")
    if wte.ndim != 2 or wpe.ndim != 2 or 0 in wte.shape or 0 in wpe.shape:
        raise CheckpointError(f"{origin}: wte {list(wte.shape)} and wpe {list(wpe.shape)} are not matrices; "
                              "not a GPT-2 model")
    layers = [n.split(".")[2] for n in tensors if n.startswith("transformer.h.")]
    n_layer = 1 + max((int(i) for i in layers if i.isdecimal() and len(i) < 10), default=-1)
    if 12 * n_layer > len(tensors):  # a layer is 12 tensors: a name may not claim layers the file lacks
        raise CheckpointError(f"{origin}: names a layer {n_layer - 1} but holds {len(tensors)} tensors; not the "
                              "GPT-2 of its own shapes")
    v, c = wte.shape
    shape = {"vocab_size": v, "block_size": wpe.shape[0], "n_layer": n_layer, "n_embd": c, "bias": True}
    if hf is not None:
        from_config = _hf_checked(hf, c, origin)
        n_head = n_head or from_config
    if n_head is not None and (not isinstance(n_head, int) or isinstance(n_head, bool) or n_head < 1):
        raise CheckpointError(f"{origin}: n_head={n_head!r}; the head count is a positive integer")
    if not n_head:
        gpt2 = PRESETS["gpt2"]
        if all(shape[k] == gpt2[k] for k in ("n_embd", "n_layer")):
            n_head = gpt2["n_head"]
        else:
            raise CheckpointError(f"{origin}: no config.json beside the weights, and the head count cannot be "
                                  "read from shapes; give --n-head N")
    preset = "gpt2" if all(shape[k] == v for k, v in PRESETS["gpt2"].items() if k in shape) \
        and n_head == PRESETS["gpt2"]["n_head"] else ""
    if c % n_head:
        raise CheckpointError(f"{origin}: n_embd={c} is not divisible by n_head={n_head}")
    dtype = "float64" if wte.dtype == np.float64 else "float32"
    return GPTConfig(**shape, n_head=n_head, dtype=dtype, preset=preset)


def _hf_checked(hf: dict, c: int, origin: str):
    """config.json's n_head, once its model is the function hpcpar computes (else CheckpointError)."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"{origin}: model_type {hf.get('model_type')!r}; only GPT-2 imports")
    problems = []
    if hf.get("activation_function", "gelu_new") not in _TANH_GELU:
        problems.append(f"activation_function={hf['activation_function']!r} (hpcpar computes gelu_new)")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not abs(eps - 1e-5) <= 1e-12:
        problems.append(f"layer_norm_epsilon={hf['layer_norm_epsilon']} (hpcpar uses 1e-5)")
    if hf.get("n_inner") not in (None, 4 * c):
        problems.append(f"n_inner={hf['n_inner']} (hpcpar's MLP is 4*n_embd)")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("attention scaling other than 1/sqrt(head size)")
    if problems:
        raise CheckpointError(f"{origin}: this GPT-2 variant computes another function: " + "; ".join(problems))
    return hf.get("n_head")


def _tokenizer_of(where: str, explicit: str | None) -> dict | None:
    if explicit:
        return tokenizer.record(tokenizer.read(explicit))
    path = os.path.join(where, "tokenizer.json")
    if os.path.isfile(path):
        return tokenizer.record(tokenizer.read(_beside(where, "tokenizer.json")))
    vocab, merges = os.path.join(where, "vocab.json"), os.path.join(where, "merges.txt")
    if os.path.isfile(vocab) and os.path.isfile(merges):
        vocab, merges = _beside(where, "vocab.json"), _beside(where, "merges.txt")
        return tokenizer.record(tokenizer.gpt2(vocab, merges).to_json())
    return None


def import_(src: str, out: str, n_head: int | None = None, tokenizer_file: str | None = None) -> str:
    """Import GPT-2 weights (`src`: a safetensors file or a HF model directory) into a new
    weights-only hpcpar checkpoint in the directory `out`; returns its path."""
    files, where = _weights_files(src)
    raw: dict[str, np.ndarray] = {}
    for f in files:
        raw.update(safetensors.read(f))
    tensors = {}
    for name, a in raw.items():
        if name.endswith(_BUFFERS):
            continue
        full = name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"
        tensors[full] = a
    hf = None
    if os.path.isfile(os.path.join(where, "config.json")):
        hf = read_json(_beside(where, "config.json"), _JSON_LIMIT, "model config", CheckpointError)
        if not isinstance(hf, dict):
            raise CheckpointError(f"{os.path.join(where, 'config.json')}: not a model config (a JSON object expected)")
    cfg = _architecture(hf, tensors, n_head, src)
    head = tensors.get("lm_head.weight")
    if head is not None and not np.array_equal(head, tensors["transformer.wte.weight"]):
        if hf is None or hf.get("tie_word_embeddings", True):
            raise CheckpointError(f"{src}: lm_head.weight differs from wte, and no config.json says "
                                  "tie_word_embeddings: false; hpcpar ties the LM head to the embedding")
        cfg = dataclasses.replace(cfg, tie_embeddings=False)  # an untied head: kept as lm_head.weight
    else:
        tensors.pop("lm_head.weight", None)
    expected = _model_names(cfg)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        what = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(extra[:3])}"
        raise CheckpointError(f"{src}: not the GPT-2 of its own shapes: {what}")
    arrays = {}
    for name, shape in expected.items():
        a = tensors[name]
        a = a.T if name.endswith(CONV1D) else a
        if tuple(a.shape) != shape:
            raise CheckpointError(f"{src}: {name} has shape {list(tensors[name].shape)}, expected "
                                  f"{list(shape[::-1] if name.endswith(CONV1D) else shape)}")
        arrays[f"model/{name}"] = np.ascontiguousarray(a, dtype=cfg.dtype)
    run_cfg = dataclasses.replace(Config(), model=cfg)
    tok = _tokenizer_of(where, tokenizer_file)
    if tok is not None and tok["vocab_size"] > cfg.vocab_size:
        raise CheckpointError(f"{src}: the tokenizer has {tok['vocab_size']} ids but the model only {cfg.vocab_size}")
    meta = {"config": to_toml(run_cfg), "weights_only": True, "optimizer_step": 0,
            "imported_from": os.path.abspath(src), "tokenizer": tok,
            "mesh": {"dp": 1, "tp": 1, "pp": 1, "zero": 0}}
    return save(out, 0, {n: (a, Layout.replicated(a.shape)) for n, a in arrays.items()}, meta, SoloCommunicator(),
                keep=None)

