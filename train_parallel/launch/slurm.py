"""The Slurm job script of a training run (``prunus train --print-slurm``): one task per GPU, ``srun prunus train``.

Under Slurm each rank reads its place from ``SLURM_PROCID`` / ``SLURM_NTASKS`` /
``SLURM_LOCALID`` and the node list (:func:`.launch.env_ranks`). The layout is
checked against the model for ``nodes x gpus_per_node`` ranks before a script is
written, as the dry run and the trainer check it: a script is never printed for a
job that would fail once it starts on the cluster.
"""

from __future__ import annotations

import shlex

from prunus.artifacts.errors import PrunusError

from ..parallelize import resolve_layout

SBATCH = """#!/bin/bash
#SBATCH --job-name=prunus-train
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={gpus}
#SBATCH --gpus-per-node={gpus}
#SBATCH --cpus-per-task={cpus}
#SBATCH --output=%x-%j.out
# One task per GPU; prunus reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and the node list.
export OMP_NUM_THREADS={cpus}
srun prunus train {args}
"""


def sbatch_script(cfg, nodes: int, gpus_per_node: int, train_args: list[str], cpus_per_task: int = 8) -> str:
    """The job script running ``prunus train <train_args>`` (which describe ``cfg``, a TrainConfig) on ``nodes``
    hosts of ``gpus_per_node`` GPUs. Raises PrunusError (one line) for a layout the job would refuse."""
    if nodes < 1 or gpus_per_node < 1:
        raise PrunusError("--nodes and --gpus-per-node must be at least 1")
    resolve_layout(cfg, nodes * gpus_per_node)
    return SBATCH.format(nodes=nodes, gpus=gpus_per_node, cpus=cpus_per_task, args=shlex.join(train_args))
