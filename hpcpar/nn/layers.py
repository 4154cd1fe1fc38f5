"""Linear, Embedding and LayerNorm on one process (replicated parameters).

Weights are created zero-filled; `GPT.init_weights` gives them values by name.
"""

from __future__ import annotations

from hpcpar import backend
from hpcpar.autograd.functional import embedding, layer_norm
from hpcpar.autograd.linear import linear
from hpcpar.nn.module import Module, Parameter


def zeros(shape: tuple, dtype) -> Parameter:
    return Parameter(backend.xp.zeros(shape, dtype=dtype))


class Linear(Module):
    """y = x W^T + b with W [out, in] (nn.Linear layout)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype="float32"):
        super().__init__()
        self.weight = zeros((out_features, in_features), dtype)
        self.bias = Parameter(backend.xp.zeros((out_features,), dtype=dtype), no_decay=True) if bias else None

    def forward(self, x, activation: str | None = None):
        """`activation="gelu"`: gelu(x W^T + b) as one fused op (`linear`)."""
        return linear(x, self.weight, self.bias, activation=activation)


class Embedding(Module):
    """Lookup table W [num, dim]."""

    def __init__(self, num: int, dim: int, dtype="float32"):
        super().__init__()
        self.weight = zeros((num, dim), dtype)

    def forward(self, idx):
        return embedding(idx, self.weight)


class LayerNorm(Module):
    """LayerNorm over the last dim (eps 1e-5), weight ones, optional bias."""

    def __init__(self, dim: int, bias: bool = True, dtype="float32", eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(backend.xp.ones((dim,), dtype=dtype), no_decay=True)
        self.bias = Parameter(backend.xp.zeros((dim,), dtype=dtype), no_decay=True) if bias else None

    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps)
