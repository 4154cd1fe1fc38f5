"""Autograd-lite: the Tensor (tensor), and differentiable ops by family, each forward next to its
gradient: ops (elementwise, reductions, shape ops), linear, functional (embedding, softmax,
layer_norm, cross_entropy), attention, dispatch (mixture-of-experts row moves), dropout,
recompute."""
