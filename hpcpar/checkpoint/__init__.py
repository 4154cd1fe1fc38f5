"""Sharded HDF5 checkpoints of global tensors: format, writers, save, load with reshard, tools."""
