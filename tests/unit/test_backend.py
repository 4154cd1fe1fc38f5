"""backend.py: the array module, host/device moves and MPI buffer specs (NumPy only here)."""

import importlib.util

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar import backend
from hpcpar.errors import ConfigError

HAVE_CUPY = importlib.util.find_spec("cupy") is not None


def test_numpy_is_the_default():
    assert backend.name() == "numpy"
    assert backend.xp is np


def test_use_numpy_and_unknown_backend():
    assert backend.use("numpy") is np
    with pytest.raises(ConfigError, match="unknown backend 'jax'; choose one of numpy, cupy"):
        backend.use("jax")
    assert backend.name() == "numpy"


@pytest.mark.skipif(HAVE_CUPY, reason="CuPy is installed")
def test_cupy_without_cupy_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot be imported"):
        backend.use("cupy")
    assert backend.name() == "numpy" and backend.xp is np


def test_array_module_and_moves_on_host_arrays():
    a = np.arange(6.0).reshape(2, 3)
    assert backend.array_module(a) is np
    assert backend.array_module(a, np.ones(2)) is np
    assert not backend.is_device_array(a)
    assert backend.to_host(a) is a
    assert np.array_equal(backend.to_host([1, 2]), np.array([1, 2]))
    moved = backend.to_device(a)
    assert isinstance(moved, np.ndarray) and np.array_equal(moved, a)
    backend.synchronize()  # no-op under numpy, must not fail


@pytest.mark.parametrize("dtype, mpi_type", [
    (np.float64, MPI.DOUBLE), (np.float32, MPI.FLOAT), (np.int32, MPI.INT),
    (np.int64, MPI.INT64_T), (np.uint8, MPI.UNSIGNED_CHAR), (np.bool_, MPI.C_BOOL)])
def test_mpi_buffer_spec(dtype, mpi_type):
    a = np.zeros((3, 5), dtype=dtype)
    buf, count, datatype = backend.mpi_buffer(a)
    assert buf is a and count == 15
    assert datatype.Get_size() == mpi_type.Get_size()
    assert datatype.Get_envelope() == mpi_type.Get_envelope()


def test_mpi_buffer_falls_back_to_bytes_for_unknown_dtypes():
    a = np.zeros(4, dtype="V6")  # opaque 6-byte records: MPI has no such type
    assert backend.mpi_datatype(a.dtype) is None
    buf, count, datatype = backend.mpi_buffer(a)
    assert count == 24 and datatype == MPI.BYTE


def test_mpi_buffer_rejects_non_contiguous():
    with pytest.raises(ValueError, match="C-contiguous"):
        backend.mpi_buffer(np.zeros((4, 4))[:, ::2])
