"""prunus: train a model at scale, make it small, ship it fast.

The top-level folders are the pipeline stages, imported as ``prunus.<folder>``:
models, data, train_parallel, compress, export, serve, cli.

Importing prunus imports no torch and changes nothing in the process (no environment
variables, no matplotlib backend): each stage imports what it uses when it is used.
"""

__version__ = "0.1.0"
