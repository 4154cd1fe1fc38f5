"""Model code that runs on one process or any mesh: `module` (Module, Parameter), `layers` (Linear,
Embedding, LayerNorm), `gpt` (the GPT, whole or one pipeline stage), `moe` (mixture of experts),
`init` (parameters as a pure function of seed, name and shape).

Never imports mpi4py: tensor- and context-parallel layers (hpcpar/parallel/tp, cp) call the mappings of
`hpcpar.parallel.mappings` on a `Communicator` they are given.
"""
