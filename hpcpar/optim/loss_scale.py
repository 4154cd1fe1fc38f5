"""Loss scaling for float16 training (Micikevicius et al. 2017, arXiv 1710.03740).

float16 keeps numbers down to about 6e-8 (subnormals); the gradients of a language model's
activations are often smaller. Backpropagating `loss * scale` shifts them into range; the weight
gradients are divided by `scale` again (in the master dtype) before clipping and the update.

`LossScaler` is Megatron-LM's dynamic scaler (DeepSpeed's with `hysteresis`):

- a step whose gradients are not finite (an *overflow*: the scale was too large) is skipped and
  counts against `hysteresis`; when `hysteresis` overflows have happened since the scale last
  grew, the scale is multiplied by `backoff` (never below `min_scale`);
- after `window` steps in a row without overflow the scale is multiplied by `growth` and the
  hysteresis budget is refilled.

A static scale (`dynamic=False`) never changes. The overflow verdict must be the same on every
rank: the trainer takes it from the global gradient norm, which every rank already agrees on.
Checkpoints keep the scale and its counters in their metadata (`checkpoint_state`).
"""

from __future__ import annotations

from hpcpar.errors import CheckpointError
from hpcpar.state import SavedState, StoredState


class LossScaler:
    """The loss scale and its counters (see the module doc). All arguments as in train.*:

    Args:
        scale: initial scale (train.initial_loss_scale, or train.loss_scale when static).
        dynamic: grow and back off (False: a constant scale).
        window: overflow-free steps before the scale grows (train.loss_scale_window).
        growth: growth factor (train.loss_scale_growth, > 1).
        backoff: backoff factor (train.loss_scale_backoff, in (0, 1)).
        hysteresis: overflows tolerated before backing off (train.loss_scale_hysteresis, >= 1).
        min_scale: floor of the scale (train.min_loss_scale).
    """

    def __init__(self, scale: float, dynamic: bool = True, window: int = 1000, growth: float = 2.0,
                 backoff: float = 0.5, hysteresis: int = 2, min_scale: float = 1.0):
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window, self.growth, self.backoff = window, growth, backoff
        self.hysteresis, self.min_scale = hysteresis, min_scale
        self.good_steps = 0                 # overflow-free steps since the scale last changed
        self.hysteresis_left = hysteresis   # overflows still tolerated before a backoff
        self.overflows = 0                  # skipped steps so far (reported)

    @property
    def at_minimum(self) -> bool:
        """Backing off cannot lower the scale any more: an overflow now is not the scale's fault."""
        return self.scale * self.backoff < self.min_scale or not self.dynamic

    def update(self, overflow: bool) -> None:
        """Account one step: `overflow` when its gradients were not finite (the step is skipped)."""
        if overflow:
            self.overflows += 1
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return
        self.good_steps += 1
        if self.good_steps == self.window:
            self.good_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= self.growth

    def checkpoint_state(self) -> SavedState:
        """The scale and its counters, as checkpoint metadata (`loss_scale`): resuming restores
        the exact scale and counters (`Checkpointable`, hpcpar/state.py)."""
        return SavedState(meta={"loss_scale": {"scale": self.scale, "good_steps": self.good_steps,
                                               "hysteresis_left": self.hysteresis_left,
                                               "overflows": self.overflows}})

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """The checkpoint's scale and counters; a weights-only load, or a checkpoint saved without
        fp16, keeps this fresh scaler."""
        if stored.weights_only or "loss_scale" not in stored.meta:
            return
        stored.read({}, lambda _: self._restore(stored.meta["loss_scale"]))

    def _restore(self, state: dict) -> None:
        try:
            self.scale = float(state["scale"])
            self.good_steps = int(state["good_steps"])
            self.hysteresis_left = int(state["hysteresis_left"])
            self.overflows = int(state["overflows"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint's loss_scale state {state!r} is malformed ({e}); expected "
                                  "scale, good_steps, hysteresis_left, overflows") from None
