"""Mixed precision: 16-bit activations and weights in the forward, float32 arithmetic, fp32 masters.

`train.precision` names the policy:

    full   every array in `model.dtype` (float32 or float64): today's arithmetic, bit for bit
    bf16   activations (and the gradients that flow between ops) stored as bfloat16
    fp16   the same as float16, with dynamic loss scaling (see `optim/loss_scale.py`)

Under bf16/fp16 the parameters stay in `model.dtype` (the master weights the optimizer updates,
the checkpoints hold and ZeRO shards); each op that reads a weight uses it rounded to the 16-bit
dtype (`rounded`), as a model kept in 16 bits would. An op that computes takes its 16-bit
inputs up to float32 (`up`), computes there (GEMMs, LayerNorm statistics, softmax, the loss) and
stores its output back in 16 bits (`down`). Weight gradients come out of the float32 GEMMs and are
accumulated straight into the master dtype (Megatron's fp32 `main_grad`), so gradient
synchronisation, clipping and the optimizer see the same arrays as in full precision.

NumPy has no bfloat16: `ml_dtypes` provides the storage type. On the CPU the GEMMs run in float32
(BLAS has no 16-bit GEMM), so 16-bit costs casts and saves memory, not time.
"""

from __future__ import annotations

import ml_dtypes  # noqa: F401 - registers "bfloat16" with NumPy
import numpy as np

PRECISIONS = ("full", "bf16", "fp16")
LOW_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
_LOW = (np.dtype("bfloat16"), np.dtype("float16"))


def activation_dtype(precision: str, master_dtype: str) -> str:
    """The dtype activations are stored in: the master dtype in full precision, else 16 bits."""
    return LOW_DTYPES.get(precision, master_dtype)


def is_low(dtype) -> bool:
    """A 16-bit float storage dtype (bfloat16, float16): arithmetic happens in float32."""
    return np.dtype(dtype) in _LOW


def up(a):
    """`a` as float32 when it is stored in 16 bits, else `a` itself (no copy)."""
    return a.astype(np.float32) if a.dtype in _LOW else a


def up_dtype(dtype):
    """The dtype `up` gives arrays of `dtype`: float32 for 16-bit ones, else `dtype` itself."""
    return np.dtype(np.float32) if np.dtype(dtype) in _LOW else np.dtype(dtype)


def down(a, dtype):
    """`a` stored as `dtype` (rounded to nearest even), or `a` itself when it already is."""
    return a if a.dtype == dtype else a.astype(dtype)


def rounded(w, dtype):
    """Weight `w` (master dtype) as an op computing for `dtype` activations reads it: rounded to
    the 16-bit `dtype` and held in float32; in full precision `w` itself."""
    return w.astype(dtype).astype(np.float32) if dtype in _LOW else w
