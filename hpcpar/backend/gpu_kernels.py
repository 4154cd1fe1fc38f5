"""Fused GPU kernels (CuPy): one launch where the NumPy composition of an op takes several.

On a GPU the transformer's non-GEMM ops are memory-bound, and a chain of CuPy elementwise
calls reads and writes the whole tensor once per call (plus ~10 us of host time per launch).
Each function here computes the same values as its CPU twin in `backend.cpu` (same
formulas, same order of the arithmetic where it matters; tests/unit/test_gpu.py compares
them) in one pass, or one pass per row:

    gelu_forward / gelu_backward        elementwise, tanh form (saves tanh(u) for backward)
    layer_norm_forward / _backward      one block per row; saves the row's mean and 1/std
    causal_softmax_forward / _backward  one block per attention row, scale and mask folded in
    cross_entropy_forward / _backward   one block per row of logits; never stores probabilities
    adamw_update                        the optimizer step of one parameter, in place

Shapes: rows are the last dim of a C-contiguous array ([..., C] -> rows x C). float32 and
float64 (C++ templates). Compiled by NVRTC on first use and cached by CuPy. Only the autograd
ops and optim call these, and only for CuPy arrays: NumPy never reaches this module.
"""

from __future__ import annotations

import functools
import math

_THREADS = 256  # per block for the row kernels: 8 warps, enough to stream a row of 768..50304

_ROW_KERNELS = r"""
// -infinity without <math.h> (NVRTC has no INFINITY): the identity of max.
template <typename T> __device__ __forceinline__ T neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float((int)0xff800000u); }
template <> __device__ __forceinline__ double neg_inf<double>() {
    return __longlong_as_double((long long)0xfff0000000000000ull);
}

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <typename T> __device__ __forceinline__ T warp_max(T v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Sum (or max) over the block; every thread gets the result. `red` holds 33 values.
template <typename T> __device__ T block_sum(T v, T* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // the previous reduction's readers are done with red
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? red[lane] : T(0);
        v = warp_sum(v);
        if (lane == 0) red[32] = v;
    }
    __syncthreads();
    return red[32];
}
template <typename T> __device__ T block_max(T v, T* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? red[lane] : neg_inf<T>();
        v = warp_max(v);
        if (lane == 0) red[32] = v;
    }
    __syncthreads();
    return red[32];
}

// Causal softmax of scale * s over each row of [rows, n] in place. The rows come in blocks of
// `queries` consecutive queries starting at query `first` (a chunk of one head's queries), so
// row r is query first + r % queries and sees keys 0 .. that query: later columns get 0 (the
// -inf mask of the autograd causal_attention).
template <typename T>
__global__ void causal_softmax_forward(T* s, long long rows, int n, int queries, int first, T scale) {
    __shared__ T red[33];
    long long r = blockIdx.x;
    T* row = s + r * n;
    int last = first + (int)(r % queries);
    T m = neg_inf<T>();
    for (int j = threadIdx.x; j <= last; j += blockDim.x) m = max(m, row[j] * scale);
    m = block_max(m, red);
    T total = 0;
    for (int j = threadIdx.x; j <= last; j += blockDim.x) {
        T e = exp(row[j] * scale - m);
        row[j] = e;
        total += e;
    }
    total = block_sum(total, red);
    for (int j = threadIdx.x; j < n; j += blockDim.x) row[j] = j <= last ? row[j] / total : T(0);
}

// dS = scale * P * (dP - sum_j dP P), in place on dP (rows as in the forward).
template <typename T>
__global__ void causal_softmax_backward(const T* p, T* g, long long rows, int n, T scale) {
    __shared__ T red[33];
    long long r = blockIdx.x;
    const T* prow = p + r * n;
    T* grow = g + r * n;
    T dot = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) dot += grow[j] * prow[j];
    dot = block_sum(dot, red);
    for (int j = threadIdx.x; j < n; j += blockDim.x) grow[j] = (grow[j] - dot) * prow[j] * scale;
}

// y = (x - mean) / sqrt(var + eps) * w (+ b) per row of [rows, c]; saves mean and 1/std.
template <typename T>
__global__ void layer_norm_forward(const T* x, const T* w, const T* b, T* y, T* mean, T* rstd,
                                   int c, T eps) {
    __shared__ T red[33];
    long long r = blockIdx.x;
    const T* xr = x + r * c;
    T* yr = y + r * c;
    T s = 0;
    for (int j = threadIdx.x; j < c; j += blockDim.x) s += xr[j];
    T mu = block_sum(s, red) / c;
    T v = 0;
    for (int j = threadIdx.x; j < c; j += blockDim.x) { T d = xr[j] - mu; v += d * d; }
    T rs = T(1) / sqrt(block_sum(v, red) / c + eps);
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        T o = (xr[j] - mu) * rs * w[j];
        yr[j] = b ? o + b[j] : o;
    }
    if (threadIdx.x == 0) { mean[r] = mu; rstd[r] = rs; }
}

// dx = (g w - mean(g w) - xhat mean(g w xhat)) / std per row; gx_hat = g * xhat (for dweight).
template <typename T>
__global__ void layer_norm_backward(const T* x, const T* w, const T* mean, const T* rstd, const T* g,
                                    T* dx, T* g_xhat, int c) {
    __shared__ T red[33];
    long long r = blockIdx.x;
    const T* xr = x + r * c;
    const T* gr = g + r * c;
    T mu = mean[r], rs = rstd[r];
    T a = 0, bsum = 0;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        T xh = (xr[j] - mu) * rs, gw = gr[j] * w[j];
        a += gw;
        bsum += gw * xh;
    }
    a = block_sum(a, red) / c;
    bsum = block_sum(bsum, red) / c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        T xh = (xr[j] - mu) * rs;
        dx[r * c + j] = (gr[j] * w[j] - a - xh * bsum) * rs;
        g_xhat[r * c + j] = gr[j] * xh;
    }
}

// Per row of logits [rows, v]: nll = log(sum exp(z - max)) - (z[t] - max), 0 where t == ignore;
// saves lse = max + log(sum exp(z - max)) for the backward.
template <typename T>
__global__ void cross_entropy_forward(const T* z, const long long* t, T* nll, T* lse, int v,
                                      long long ignore) {
    __shared__ T red[33];
    long long r = blockIdx.x;
    const T* zr = z + r * v;
    T m = neg_inf<T>();
    for (int j = threadIdx.x; j < v; j += blockDim.x) m = max(m, zr[j]);
    m = block_max(m, red);
    T total = 0;
    for (int j = threadIdx.x; j < v; j += blockDim.x) total += exp(zr[j] - m);
    total = block_sum(total, red);
    if (threadIdx.x == 0) {
        long long target = t[r];
        nll[r] = target == ignore ? T(0) : log(total) - (zr[target] - m);
        lse[r] = m + log(total);
    }
}

// dz = (softmax(z) - onehot(t)) * coef, coef = g / count (0 on ignored rows).
template <typename T>
__global__ void cross_entropy_backward(const T* z, const long long* t, const T* lse, const T* coef, T* dz,
                                       int v, long long ignore) {
    long long r = blockIdx.x;
    long long target = t[r];
    T k = target == ignore ? T(0) : coef[0];
    const T* zr = z + r * v;
    T* dr = dz + r * v;
    T l = lse[r];
    for (int j = threadIdx.x; j < v; j += blockDim.x) dr[j] = (exp(zr[j] - l) - (j == target ? T(1) : T(0))) * k;
}
// Deterministic scatter-add of rows: out[ids[r]] += g[r] for every r, each output row summed in
// the order of r (NumPy's add.at order) instead of atomics, whose order varies run to run.
// `order` lists the rows sorted by (id, r); segment s is order[start[s] : start[s + 1]], all
// with id seg_id[s]. One thread per (segment, column).
template <typename T>
__global__ void scatter_add_rows(const T* g, const long long* order, const long long* start,
                                 const long long* seg_id, T* out, int c, long long segments) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= segments * c) return;
    long long s = i / c;
    int j = (int)(i % c);
    T acc = out[seg_id[s] * c + j];
    for (long long r = start[s]; r < start[s + 1]; ++r) acc += g[order[r] * c + j];
    out[seg_id[s] * c + j] = acc;
}
"""

_NAMES = ("causal_softmax_forward", "causal_softmax_backward", "layer_norm_forward", "layer_norm_backward",
          "cross_entropy_forward", "cross_entropy_backward", "scatter_add_rows")


@functools.cache
def _module():
    import cupy
    return cupy.RawModule(code=_ROW_KERNELS, options=("--std=c++17",),
                          name_expressions=[f"{n}<{t}>" for n in _NAMES for t in ("float", "double")])


def _kernel(name: str, dtype):
    import numpy
    ctype = {numpy.dtype("float32"): "float", numpy.dtype("float64"): "double"}[numpy.dtype(dtype)]
    return _module().get_function(f"{name}<{ctype}>")


def _scalar(dtype, value):
    import numpy
    return numpy.dtype(dtype).type(value)


def _i32(n: int):
    import numpy
    return numpy.int32(n)


def _i64(n: int):
    import numpy
    return numpy.int64(n)


def _NULL():  # noqa: N802 - a null pointer argument (an absent bias)
    import numpy
    return numpy.uint64(0)


def supported(a) -> bool:
    """Whether the fused kernels take this CuPy array's dtype (float32 or float64)."""
    return str(a.dtype) in ("float32", "float64")


# -- elementwise -------------------------------------------------------------------------------

@functools.cache
def _gelu_kernels():
    import cupy
    c = repr(math.sqrt(2.0 / math.pi))
    forward = cupy.ElementwiseKernel(
        "T x", "T y, T t",
        f"T u = ((x * x * (T)0.044715 + (T)1) * x) * (T){c}; t = tanh(u); y = (t + (T)1) * x * (T)0.5;",
        "hpcpar_gelu_forward")
    backward = cupy.ElementwiseKernel(
        "T x, T t, T g", "T dx",
        f"T x2 = (x * x * (T)(3 * 0.044715) + (T)1) * (T){c};"
        "dx = (((T)1 - t * t) * x * x2 + t + (T)1) * (T)0.5 * g;",
        "hpcpar_gelu_backward")
    return forward, backward


def gelu_forward(x):
    """(y, t): y = 0.5 x (1 + t), t = tanh(sqrt(2/pi) (x + 0.044715 x^3)) (kept for backward)."""
    return _gelu_kernels()[0](x)


def gelu_backward(x, t, g):
    """dx of gelu_forward's y given its saved t."""
    return _gelu_kernels()[1](x, t, g)


@functools.cache
def _adamw_kernel():
    import cupy
    return cupy.ElementwiseKernel(
        "T g, float64 decay, float64 b1, float64 b2, float64 eps, float64 step_size, float64 inv_bias2_sqrt",
        "T p, T m, T v",
        # The order of optim.optimizers.AdamW.step: decay first, then the moments, then the update.
        "p = p * (T)decay;"
        "v = v * (T)b2 + g * g * (T)(1.0 - b2);"
        "m = m * (T)b1 + g * (T)(1.0 - b1);"
        "p = p + m / (sqrt(v) * (T)inv_bias2_sqrt + (T)eps) * (T)(-step_size);",
        "hpcpar_adamw")


def adamw_update(p, g, m, v, decay: float, b1: float, b2: float, eps: float, step_size: float,
                 inv_bias2_sqrt: float) -> None:
    """One AdamW step of one parameter in place (p, m, v updated; `decay` = 1 - lr * wd or 1)."""
    _adamw_kernel()(g, decay, b1, b2, eps, step_size, inv_bias2_sqrt, p, m, v)


# -- one block per row -------------------------------------------------------------------------

def _rows(a) -> tuple[int, int]:
    n = a.shape[-1]
    return a.size // n if n else 0, n


def causal_softmax_forward(scores, scale: float, first_query: int = 0):
    """In place on C-contiguous scores [..., Q, K] of queries first_query .. first_query + Q - 1
    against keys 0 .. K - 1: softmax over the last dim of scale * scores with the causal mask
    (key j > query i -> 0). Returns the probabilities (the same array)."""
    rows, n = _rows(scores)
    queries = scores.shape[-2]
    _kernel("causal_softmax_forward", scores.dtype)(
        (rows,), (_THREADS,),
        (scores, _i64(rows), _i32(n), _i32(queries), _i32(first_query), _scalar(scores.dtype, scale)))
    return scores


def causal_softmax_backward(probs, grad, scale: float):
    """In place on `grad` (dP, C-contiguous like probs): dS = scale * P (dP - rowsum(dP P))."""
    rows, n = _rows(probs)
    _kernel("causal_softmax_backward", probs.dtype)((rows,), (_THREADS,),
                                                    (probs, grad, _i64(rows), _i32(n), _scalar(probs.dtype, scale)))
    return grad


def layer_norm_forward(x, w, b, eps: float):
    """x [..., C] C-contiguous -> (y, mean [rows], rstd [rows])."""
    import cupy
    rows, c = _rows(x)
    y = cupy.empty_like(x)
    mean = cupy.empty(rows, dtype=x.dtype)
    rstd = cupy.empty(rows, dtype=x.dtype)
    _kernel("layer_norm_forward", x.dtype)((rows,), (_THREADS,),
                                           (x, w, b if b is not None else _NULL(), y, mean, rstd, _i32(c),
                                            _scalar(x.dtype, eps)))
    return y, mean, rstd


def layer_norm_backward(x, w, mean, rstd, g):
    """(dx [..., C], g * xhat [rows, C]) for layer_norm_forward's saved mean and rstd."""
    import cupy
    rows, c = _rows(x)
    dx = cupy.empty_like(x)
    g_xhat = cupy.empty((rows, c), dtype=x.dtype)
    _kernel("layer_norm_backward", x.dtype)((rows,), (_THREADS,), (x, w, mean, rstd, g, dx, g_xhat, _i32(c)))
    return dx, g_xhat


def cross_entropy_forward(logits2d, targets, ignore_index: int):
    """logits [rows, V] C-contiguous, targets int64 [rows] -> (nll [rows], lse [rows])."""
    import cupy
    rows, v = _rows(logits2d)
    nll = cupy.empty(rows, dtype=logits2d.dtype)
    lse = cupy.empty(rows, dtype=logits2d.dtype)
    _kernel("cross_entropy_forward", logits2d.dtype)((rows,), (_THREADS,),
                                                     (logits2d, targets, nll, lse, _i32(v), _i64(ignore_index)))
    return nll, lse


def cross_entropy_backward(logits2d, targets, lse, coef, ignore_index: int):
    """(softmax(z) - onehot(t)) * coef per row; coef a 1-element device array (g / count)."""
    import cupy
    rows, v = _rows(logits2d)
    dz = cupy.empty_like(logits2d)
    _kernel("cross_entropy_backward", logits2d.dtype)((rows,), (_THREADS,),
                                                      (logits2d, targets, lse, coef, dz, _i32(v), _i64(ignore_index)))
    return dz


def scatter_add_rows(out, ids, g):
    """out[ids[r]] += g[r], in place and deterministic: out [V, C], ids int [N], g [N, C] (C-contiguous).

    CuPy's `add.at` adds with atomics, so equal ids meet in a different order each run and the
    float sums differ in their last bits (a gradient that is not reproducible, and recomputation
    that is not bitwise). Here each output row sums its rows in index order, as NumPy does.
    """
    import cupy
    n, c = g.shape
    if n == 0:
        return out
    ids = ids.astype(cupy.int64, copy=False)
    order = cupy.argsort(ids * n + cupy.arange(n, dtype=cupy.int64))   # unique keys: (id, r) order
    sorted_ids = ids[order]
    first = cupy.flatnonzero(cupy.concatenate([cupy.ones(1, bool), sorted_ids[1:] != sorted_ids[:-1]]))
    start = cupy.concatenate([first, cupy.asarray([n], dtype=first.dtype)]).astype(cupy.int64)
    seg_id = sorted_ids[first]
    segments = int(first.size)
    blocks = (segments * c + _THREADS - 1) // _THREADS
    _kernel("scatter_add_rows", out.dtype)((blocks,), (_THREADS,),
                                           (g, order, start, seg_id, out, _i32(c), _i64(segments)))
    return out
