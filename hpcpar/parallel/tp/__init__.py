"""Tensor parallelism (Megatron-LM, arXiv 1909.08053; sequence parallelism, arXiv 2205.05198)."""
