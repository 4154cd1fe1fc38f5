"""Model code: modules, layers, the GPT, and tensor-parallel layers.

Never imports mpi4py: tensor-parallel layers call the mappings of `hpcpar.parallel.mappings` on a
`Communicator` they are given.
"""

from hpcpar.nn.module import Module, Parameter
from hpcpar.nn.layers import Embedding, LayerNorm, Linear
from hpcpar.nn.gpt import GPT, GPTConfig

__all__ = ["Module", "Parameter", "Linear", "Embedding", "LayerNorm", "GPT", "GPTConfig"]
