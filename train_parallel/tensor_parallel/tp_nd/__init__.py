"""2D (SUMMA / Optimus), 2.5D (Tesseract) and 3D tensor parallelism, on torch.distributed collectives.

One file per mode (``summa_2d.py``, ``tesseract_2p5d.py``, ``cube_3d.py``), the layers they drive
(``layers.py``), the collectives they are written with (``collectives.py``), how they are applied to
the unmodified model (``apply.py``), the grid checks (``shape.py``, no torch) and the planned
communication volume (``comm_plan.py``).
"""
