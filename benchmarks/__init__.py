"""prunus's benchmarks: side-by-side measurements that print ratios.

Each one runs from the repository root as ``python -m benchmarks.NAME`` (or ``python benchmarks/NAME.py``)
and measures with :mod:`benchmarks.harness`.
"""
