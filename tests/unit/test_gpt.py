"""The GPT against an independent PyTorch implementation (float64), and its
naming/initialisation contracts."""

import math
from dataclasses import dataclass

import numpy as np
import pytest

from hpcpar import backend
from hpcpar.nn.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32, dtype="float64")


def batch(b=3, t=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (b, t))
    return x, rng.integers(0, 256, (b, t))


def torch_gpt_loss(torch, params, cfg, x, y):
    """nanoGPT's forward written with torch ops on tensors named as in our model."""
    F = torch.nn.functional
    p = params
    b, t = x.shape
    h = p["transformer.wte.weight"][x] + p["transformer.wpe.weight"][:t]
    for i in range(cfg.n_layer):
        pre = f"transformer.h.{i}."
        a = F.layer_norm(h, (cfg.n_embd,), p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], 1e-5)
        qkv = F.linear(a, p[pre + "attn.c_attn.weight"], p[pre + "attn.c_attn.bias"])
        q, k, v = qkv.split(cfg.n_embd, dim=2)
        shape = (b, t, cfg.n_head, cfg.n_embd // cfg.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = att.transpose(1, 2).reshape(b, t, cfg.n_embd)
        h = h + F.linear(att, p[pre + "attn.c_proj.weight"], p[pre + "attn.c_proj.bias"])
        m = F.layer_norm(h, (cfg.n_embd,), p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], 1e-5)
        m = F.gelu(F.linear(m, p[pre + "mlp.c_fc.weight"], p[pre + "mlp.c_fc.bias"]), approximate="tanh")
        h = h + F.linear(m, p[pre + "mlp.c_proj.weight"], p[pre + "mlp.c_proj.bias"])
    h = F.layer_norm(h, (cfg.n_embd,), p["transformer.ln_f.weight"], p["transformer.ln_f.bias"], 1e-5)
    logits = F.linear(h, p["transformer.wte.weight"])
    return F.cross_entropy(logits.view(-1, cfg.vocab_size), y.view(-1))


def test_loss_and_every_gradient_match_pytorch_float64():
    torch = pytest.importorskip("torch")
    model = GPT(CFG, seed=3)
    x, y = batch()
    loss = model(x, y)
    loss.backward()
    tparams = {n: torch.tensor(backend.to_host(p.data), requires_grad=True) for n, p in model.named_parameters()}
    tloss = torch_gpt_loss(torch, tparams, CFG, torch.tensor(x), torch.tensor(y))
    tloss.backward()
    assert abs(loss.item() - tloss.item()) <= 1e-10 * abs(tloss.item())
    for name, p in model.named_parameters():
        ref = tparams[name].grad.numpy()
        err = np.abs(backend.to_host(p.grad) - ref).max() / max(np.abs(ref).max(), 1e-30)
        assert err < 1e-10, f"{name}: relative error {err:.2e}"


def test_names_follow_nanogpt_and_tied_head_appears_once():
    names = [n for n, _ in GPT(CFG).named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert "transformer.h.1.attn.c_attn.weight" in names and "transformer.h.1.mlp.c_proj.bias" in names
    assert len(names) == len(set(names)) == 2 + 2 * 12 + 2
    shapes = dict((n, p.shape) for n, p in GPT(CFG).named_parameters())
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (96, 32)      # out x in
    assert shapes["transformer.h.0.mlp.c_fc.weight"] == (128, 32)


def test_init_is_a_function_of_seed_name_and_shape():
    whole = dict(GPT(CFG, seed=7).named_parameters())
    stage = dict(GPT(CFG, seed=7, layers=[1], embed=False, head=True).named_parameters())
    for name, p in stage.items():
        ref = whole[p.tied_to or name]
        np.testing.assert_array_equal(backend.to_host(p.data), backend.to_host(ref.data))
    assert stage["lm_head.weight"].tied_to == "transformer.wte.weight"
    c_proj = backend.to_host(whole["transformer.h.0.attn.c_proj.weight"].data)
    assert abs(c_proj.std() - 0.02 / math.sqrt(2 * CFG.n_layer)) < 0.003
    assert abs(backend.to_host(whole["transformer.h.0.attn.c_attn.weight"].data).std() - 0.02) < 0.003
    assert not np.array_equal(backend.to_host(GPT(CFG, seed=8).transformer.wte.weight.data),
                              backend.to_host(whole["transformer.wte.weight"].data))


def test_stages_compose_to_the_whole_model():
    x, y = batch()
    whole = GPT(CFG, seed=1)
    first = GPT(CFG, seed=1, layers=[0], embed=True, head=False)
    last = GPT(CFG, seed=1, layers=[1], embed=False, head=True)
    assert abs(whole(x, y).item() - last(first(x), y).item()) < 1e-12


def test_initial_loss_is_near_uniform():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16), seed=0)
    x, y = batch()
    assert abs(model(x, y).item() - math.log(256)) < 0.1
    assert model(x).shape == (3, 16, 256)


@dataclass
class Ranks:
    """Stands in for a tp Communicator where only the group's size and my rank matter (layer setup)."""

    size: int
    rank: int = 0


def elements(model) -> int:
    """Parameter elements this rank holds (its shards, the head's own copy of wte included)."""
    return sum(p.data.size for _, p in model.named_parameters())


@pytest.mark.parametrize("bias", [True, False])
def test_parameter_counts_are_the_elements_of_a_built_gpt(bias):
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=3, n_head=4, n_embd=16, bias=bias)
    assert cfg.num_params() == elements(GPT(cfg))
    b = int(bias)
    c, layers, v, t = 16, 3, 256, 8
    assert cfg.num_params() == 12 * layers * c * c + 2 * layers * c + 11 * layers * c * b + v * c + t * c + c + c * b
    whole = dict(GPT(cfg).named_parameters())
    outside_embeddings = sum(p.data.size for n, p in whole.items() if not n.startswith(("transformer.wte",
                                                                                        "transformer.wpe")))
    assert cfg.non_embedding_params() == outside_embeddings
    for tp in (1, 2, 4):
        for rank in range(tp):
            tp_comm = Ranks(tp, rank) if tp > 1 else None
            assert cfg.num_params(tp) == elements(GPT(cfg, tp_comm=tp_comm))
            # pipeline stages: blocks only, embedding + blocks, blocks + head holding its own wte copy
            for embed, head in ((False, False), (True, False), (False, True), (True, True)):
                stage = GPT(cfg, tp_comm=tp_comm, layers=[1, 2], embed=embed, head=head)
                assert cfg.stage_params(2, embed, head, tp) == elements(stage), (tp, rank, embed, head)
    assert cfg.num_params(4) < cfg.num_params(2) < cfg.num_params()
