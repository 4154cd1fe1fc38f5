"""Optimizers, gradient clipping and the learning-rate schedule.

Optimizers act on any objects with ``.data`` and ``.grad`` arrays (NumPy or CuPy)
and a boolean ``.no_decay`` (biases and LayerNorm weights are not decayed), so
they serve whole ``Parameter`` s as well as the shards ZeRO-1 updates. Updates are
in place on ``.data`` (never rebound: other code holds views of it), and each
parameter's update allocates at most one temporary the size of the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from hpcpar.backend.cpu.adamw import adamw_update as cpu_adamw_update
from hpcpar.backend.cpu.grad_norm import sum_of_squares
from hpcpar.backend import gpu_kernels
from hpcpar.backend import array_module as _array_module
from hpcpar.backend import is_device_array
from hpcpar.errors import CheckpointError, ConfigError


class _Optimizer:
    """Shared parameter list, per-parameter state and (de)serialisation."""

    state_names: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Any], lr: float) -> None:
        self.params = list(params)
        if len({id(p) for p in self.params}) != len(self.params):
            raise ConfigError("optimizer given the same parameter twice; pass each parameter once")
        if lr < 0:
            raise ConfigError(f"learning rate must be >= 0, got {lr}")
        self.lr = lr
        self.step_count = 0
        # State is created up front (zeros), so a checkpoint at step 0 has the same
        # tensors as any later one. Keyed by position in self.params.
        self._state: list[dict[str, Any]] = [
            {name: _array_module(p.data).zeros_like(p.data) for name in self.state_names}
            for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}

    def zero_grad(self) -> None:
        """Drop every gradient (``.grad = None``); the next backward stores fresh arrays."""
        for p in self.params:
            p.grad = None

    def state_of(self, param: Any) -> dict[str, Any]:
        """The state arrays of ``param`` (live references, same shape as ``param.data``)."""
        try:
            return self._state[self._index[id(param)]]
        except KeyError:
            raise ValueError("parameter is not managed by this optimizer") from None

    def state_dict(self) -> dict[str, Any]:
        """``{"step": int, "state": [{name: array} per parameter, in order], **hyperparameters}``.

        The arrays are live references; copy them to keep them past the next step.
        """
        return {"step": self.step_count, "state": self._state, **self._hyper()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy state saved by :meth:`state_dict` (arrays may be NumPy or device) into place."""
        saved = state["state"]
        if len(saved) != len(self.params):
            raise CheckpointError(f"optimizer state has {len(saved)} parameters, the model has "
                                  f"{len(self.params)}; load a checkpoint of the same model")
        for i, (mine, theirs) in enumerate(zip(self._state, saved)):
            if set(theirs) != set(mine):
                raise CheckpointError(f"optimizer state of parameter {i} holds {sorted(theirs)}, "
                                      f"expected {sorted(mine)}; was it saved by another optimizer?")
            for name, dst in mine.items():
                src = theirs[name]
                if tuple(src.shape) != tuple(dst.shape):
                    raise CheckpointError(f"optimizer state {name} of parameter {i} has shape "
                                          f"{tuple(src.shape)}, expected {tuple(dst.shape)}")
                dst[...] = _array_module(dst).asarray(src)
        self.step_count = int(state["step"])

    def _hyper(self) -> dict[str, Any]:
        return {"lr": self.lr}


class AdamW(_Optimizer):
    """Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    Per step t (1-based), for every parameter with a gradient g::

        p  -= lr * weight_decay * p            (skipped where p.no_decay)
        m   = b1 * m + (1 - b1) * g            (state "exp_avg")
        v   = b2 * v + (1 - b2) * g * g        (state "exp_avg_sq")
        p  -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)

    The step count t is global to the optimizer.
    """

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1) -> None:
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ConfigError(f"AdamW betas must be in [0, 1), got {tuple(betas)}")
        if eps <= 0 or weight_decay < 0:
            raise ConfigError(f"AdamW needs eps > 0 and weight_decay >= 0, got eps={eps}, "
                              f"weight_decay={weight_decay}")
        super().__init__(params, lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)

    def step(self, lr: float | None = None) -> None:
        """One update with learning rate ``lr`` (default ``self.lr``) for this step only."""
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.step_count += 1
        t = self.step_count
        step_size = lr / (1.0 - b1 ** t)
        inv_bias2_sqrt = 1.0 / math.sqrt(1.0 - b2 ** t)
        host = []  # (p, g, m, v, decay) of the host arrays: one cache-blocked kernel call for them all
        for p, state in zip(self.params, self._state):
            g = p.grad
            if g is None:
                continue
            m, v = state["exp_avg"], state["exp_avg_sq"]
            decay = 1.0 - lr * self.weight_decay if self.weight_decay and not getattr(p, "no_decay", False) else 1.0
            if is_device_array(p.data):  # one fused kernel per parameter on the GPU: the same arithmetic
                gpu_kernels.adamw_update(p.data, g, m, v, decay, b1, b2, self.eps, step_size, inv_bias2_sqrt)
            else:
                host.append((p.data, g, m, v, decay))
        if host:
            cpu_adamw_update(host, b1, b2, self.eps, step_size, inv_bias2_sqrt)

    def _hyper(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}


class SGD(_Optimizer):
    """SGD with momentum, as ``torch.optim.SGD`` (dampening 0, not Nesterov).

    Weight decay is L2 added to the gradient (torch's convention), skipped where p.no_decay::

        d    = g + weight_decay * p
        buf  = momentum * buf + d              (state "momentum_buffer"; only when momentum > 0)
        p   -= lr * buf
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        if momentum < 0 or weight_decay < 0:
            raise ConfigError(f"SGD needs momentum >= 0 and weight_decay >= 0, got momentum={momentum}, "
                              f"weight_decay={weight_decay}")
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.state_names = ("momentum_buffer",) if momentum else ()
        super().__init__(params, lr)

    def step(self, lr: float | None = None) -> None:
        """One update with learning rate ``lr`` (default ``self.lr``) for this step only."""
        lr = self.lr if lr is None else lr
        self.step_count += 1
        for p, state in zip(self.params, self._state):
            g = p.grad
            if g is None:
                continue
            xp = _array_module(p.data)
            tmp = None  # at most one temporary: the decayed gradient, then the step
            if self.weight_decay and not getattr(p, "no_decay", False):
                tmp = xp.multiply(p.data, self.weight_decay)
                tmp += g
            d = g if tmp is None else tmp
            if self.momentum:
                buf = state["momentum_buffer"]
                buf *= self.momentum
                buf += d
                d = buf
            if tmp is None:
                tmp = xp.multiply(d, lr)
            else:
                xp.multiply(d, lr, out=tmp)
            p.data -= tmp

    def _hyper(self) -> dict[str, Any]:
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}


def grad_norm_sq(params: Iterable[Any]) -> float:
    """Sum of squares of every ``.grad`` (None skipped), accumulated in float64."""
    total: Any = 0.0  # stays a device scalar for CuPy grads: one synchronisation, at the end
    for p in params:
        g = p.grad
        if g is None:
            continue
        if not is_device_array(g):
            total = total + sum_of_squares(g)
            continue
        flat = g.reshape(-1)
        if flat.dtype != np.float64:
            flat = flat.astype(np.float64)
        total = total + _array_module(g).dot(flat, flat)
    return float(total)


def clip_grad_norm(params: Iterable[Any], max_norm: float,
                   norm_sq_reduce: Callable[[float], float] | None = None) -> float:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``.

    Args:
        params: parameters whose local ``.grad`` s count.
        max_norm: the bound; ``<= 0`` only measures.
        norm_sq_reduce: maps this rank's sum of squares to the global one (a distributed
            caller sums across ranks, counting each replicated parameter once).

    Returns:
        The global norm before clipping. As ``torch.nn.utils.clip_grad_norm_``, gradients
        are multiplied by ``max_norm / (norm + 1e-6)`` when that is below 1.
    """
    params = list(params)
    sq = grad_norm_sq(params)
    if norm_sq_reduce is not None:
        sq = float(norm_sq_reduce(sq))
    norm = math.sqrt(sq)
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad *= coef
    return norm


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_lr: float) -> float:
    """Learning rate of 0-based ``step``: linear warm-up, then cosine decay.

    ``base_lr * (step + 1) / warmup`` for ``step < warmup``; then cosine from ``base_lr``
    at ``warmup`` down to ``min_lr`` at ``total``; ``min_lr`` from ``total`` on.
    """
    if warmup < 0 or total < 0:
        raise ConfigError(f"warmup and total steps must be >= 0, got warmup={warmup}, total={total}")
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / (total - warmup)
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
