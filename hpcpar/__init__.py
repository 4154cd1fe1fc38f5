"""hpcpar: MPI-native data/tensor/pipeline-parallel transformer training (NumPy / CuPy)."""

__version__ = "0.1.0"
