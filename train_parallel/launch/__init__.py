"""Starting a run: process groups, torchrun and ``--nproc`` (``launch.py``), the Slurm job script (``slurm.py``),
and the dry run that plans each rank's memory before anything starts (``dry_run.py``, its table
``dry_run_table.py``, and ``saved_activations.py``, which measures what it estimates)."""
