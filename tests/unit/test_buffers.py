"""runtime/buffers.py: the MPI buffer specs of host arrays."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.runtime import buffers


@pytest.mark.parametrize("dtype, mpi_type", [
    (np.float64, MPI.DOUBLE), (np.float32, MPI.FLOAT), (np.int32, MPI.INT),
    (np.int64, MPI.INT64_T), (np.uint8, MPI.UNSIGNED_CHAR), (np.bool_, MPI.C_BOOL)])
def test_mpi_buffer_spec(dtype, mpi_type):
    a = np.zeros((3, 5), dtype=dtype)
    buf, count, datatype = buffers.mpi_buffer(a)
    assert buf is a and count == 15
    assert datatype.Get_size() == mpi_type.Get_size()
    assert datatype.Get_envelope() == mpi_type.Get_envelope()


def test_mpi_buffer_falls_back_to_bytes_for_unknown_dtypes():
    a = np.zeros(4, dtype="V6")  # opaque 6-byte records: MPI has no such type
    assert buffers.mpi_datatype(a.dtype) is None
    buf, count, datatype = buffers.mpi_buffer(a)
    assert count == 24 and datatype == MPI.BYTE


def test_float16_travels_as_bytes():
    a = np.zeros(4, dtype=np.float16)  # never MPI's float16 type: some MPIs abort reducing it
    assert buffers.mpi_datatype(a.dtype) is None
    buf, count, datatype = buffers.mpi_buffer(a)
    assert count == 8 and datatype == MPI.BYTE


def test_mpi_buffer_rejects_non_contiguous():
    with pytest.raises(ValueError, match="C-contiguous"):
        buffers.mpi_buffer(np.zeros((4, 4))[:, ::2])
