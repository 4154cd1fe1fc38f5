"""Fixtures shared by the one-process tests."""

import pytest

from hpcpar import backend


@pytest.fixture
def numpy_backend():
    """Run the test on NumPy whatever HPCPAR_BACKEND says (for autograd bookkeeping that is the
    same on every array backend, checked against NumPy references)."""
    previous = backend.name()
    backend.use("numpy")
    yield
    backend.use(previous)
