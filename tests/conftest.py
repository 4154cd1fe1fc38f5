"""Setup shared by every test suite: one BLAS thread per process before NumPy loads.

Tests run many processes on few cores (`mpiexec -n 4` on a laptop); BLAS thread
pools per process would oversubscribe the cores many times over.
"""

from hpcpar import environment

environment.set_default_threads()
