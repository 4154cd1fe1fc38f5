"""Cache-blocked CPU kernels, the CPU twins of the GPU kernels: one module per fused operation."""
