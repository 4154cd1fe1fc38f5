"""Autograd-lite: the Tensor, differentiable ops (each forward next to its gradient), recomputation."""
