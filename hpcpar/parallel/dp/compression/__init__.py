"""Gradient compression on the data-parallel wire: compressors, PowerSGD, and their checkpointed state."""
