"""Numba-compiled loops for the CPU kernels and the kernel threads (the `fast` extra)."""
