"""prunus's benchmarks: side-by-side measurements that print ratios.

A dev folder, not part of the installed package: each one runs from the repository root as
``python -m benchmarks.NAME`` (its workers too, with ``-m``) and measures with :mod:`benchmarks.harness`. A
benchmark imports :mod:`benchmarks._omp` before torch (``OMP_WAIT_POLICY=PASSIVE`` unless set).
"""
