"""prunus: train a model at scale, make it small, ship it fast.

The top-level folders are the pipeline stages, imported as ``prunus.<folder>``:
models, data, train_parallel, compress, export, serve, cli.
"""

import os as _os

# Two-thread torch on CPU was 3-10x slower at times with OpenMP's default active
# waiting; passive waiting is the fast setting for every stage here. It must be
# set before torch starts its thread pool, so it is set on the first prunus import.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
