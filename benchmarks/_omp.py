"""Imported by a benchmark before torch and numpy: OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, as
every prunus command sets it) unless the environment says otherwise. It must precede torch's import to apply."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
