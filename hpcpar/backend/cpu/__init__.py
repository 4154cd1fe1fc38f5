"""Cache-blocked CPU kernels, the CPU twins of `gpu_kernels`: one module per fused operation.

    blocks          how a kernel runs: blocks, threads, scratch arrays, NumPy or compiled loops
    gelu            gelu_forward / _backward, bias_gelu_forward / _backward (fused with a linear's bias)
    bias            add_bias / column_sums: a linear's bias and its gradient
    layer_norm      layer_norm_forward / _backward over rows of [N, C]
    attention       causal_attention_forward / _backward, kept_probabilities
    cross_entropy   cross_entropy_forward / _backward over rows of logits [N, V]
    adamw           adamw_update: every parameter of a step in place
    grad_norm       sum_of_squares: a gradient norm's share, in float64

A chain of NumPy calls over a whole activation ([B T, 4C] floats, megabytes) streams the array
through main memory once per call, and every call allocates a result as large. Here each chain
runs over blocks small enough (`blocks.BLOCK_BYTES`) that all its intermediates stay in a core's L2
cache, in scratch arrays reused from block to block and step to step, so memory sees each input
and output about once. With the `fast` extra a block's chain is one compiled loop instead
(`jit.kernels`, Numba: NumPy keeps tanh and exp). With more than one thread per rank
(`threads.blas_threads()`, or `kernel_pool.set_threads`) the blocks are shared out to the rank's
compute threads (`kernel_pool`), the caller included: NumPy calls and the compiled loops release
the GIL, so the threads compute at once. With Numba, LayerNorm, large bias adds and column sums,
and AdamW's step go to the threads as compiled tasks (`jit.pool`: runs of whole blocks, no Python
on the threads).

The elementwise kernels compute what the plain NumPy composition computes (the same operations on
each element in the same order; tests/unit/test_cpu_kernels.py holds them to it); LayerNorm's row
statistics and the attention's softmax are rearranged (row sums by einsum or in eight lanes,
exponentials without the max shift, normalisation after P V: see each docstring) and equal the
textbook formulas to rounding. 16-bit inputs (bf16/fp16 activations, `precision`) are taken up
to float32 block by block and the results rounded once. Results do not depend on the thread
count: blocks are cut from the shape alone, each element's (each row's) arithmetic is the same in
whichever block it lands, and the reductions across rows (weight and bias gradients) add
per-block partial sums in block order.
"""
