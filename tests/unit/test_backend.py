"""backend: the array module (chosen by HPCPAR_BACKEND, else NumPy) and host/device moves."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hpcpar import backend
from hpcpar.errors import ConfigError

HAVE_CUPY = importlib.util.find_spec("cupy") is not None
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def restore_backend():
    """Put the backend of this session back after a test that switches it (later tests in the
    same process build their models with it)."""
    previous = backend.name()
    yield
    backend.use(previous)


def test_default_is_hpcpar_backend_when_set_else_numpy():
    expected = os.environ.get("HPCPAR_BACKEND", "numpy").strip().lower() or "numpy"
    assert backend.name() == expected
    assert backend.xp is (np if expected == "numpy" else importlib.import_module(expected))
    # Unset: numpy, in a fresh interpreter that imports the backend anew.
    env = {k: v for k, v in os.environ.items() if k != "HPCPAR_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    code = "import numpy; from hpcpar import backend; print(backend.name(), backend.xp is numpy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["numpy", "True"], out.stdout + out.stderr


def test_use_numpy_and_unknown_backend(restore_backend):
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
    moved = backend.to_device(a)  # an array of the current backend: NumPy (the same values) or CuPy
    assert isinstance(moved, backend.xp.ndarray) and np.array_equal(backend.to_host(moved), a)
    backend.synchronize()  # no-op under numpy, must not fail
