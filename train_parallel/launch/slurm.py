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
#SBATCH --ntasks-per-node={tasks}
#SBATCH --gpus-per-node={gpus}
#SBATCH --cpus-per-task={cpus}
#SBATCH --output=%x-%j.out
# One task per GPU (prunus reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, the node list) or per node (torchrun).
export OMP_NUM_THREADS={threads}
{launch}
"""


def sbatch_script(cfg, nodes: int, gpus_per_node: int, train_args: list[str], cpus_per_task: int = 8,
                  elastic: tuple[str, int, str | None] | None = None) -> str:
    """The job script running ``prunus train <train_args>`` (which describe ``cfg``, a TrainConfig) on ``nodes``
    hosts of ``gpus_per_node`` GPUs. Raises PrunusError (one line) for a layout the job would refuse.

    ``elastic`` = (``--nnodes`` MIN:MAX, ``--max-restarts``, ``--rdzv-endpoint`` or None): the job asks for MAX
    nodes and runs one torchrun agent per node with those flags (:func:`.elastic.elastic_srun_line`)."""
    if nodes < 1 or gpus_per_node < 1:
        raise PrunusError("--nodes and --gpus-per-node must be at least 1")
    if elastic is None:
        resolve_layout(cfg, nodes * gpus_per_node)
        launch = f"srun prunus train {shlex.join(train_args)}"
        return SBATCH.format(nodes=nodes, gpus=gpus_per_node, tasks=gpus_per_node, cpus=cpus_per_task, threads=cpus_per_task,
                             launch=launch)
    import dataclasses

    from .elastic import check_elastic, elastic_srun_line

    nnodes, restarts, endpoint = elastic
    nodes = check_elastic(dataclasses.replace(cfg, nproc=gpus_per_node), nnodes, restarts, endpoint, need_endpoint=False)[1]
    launch = elastic_srun_line(nnodes, gpus_per_node, restarts, endpoint, train_args)
    return SBATCH.format(nodes=nodes, gpus=gpus_per_node, tasks=1, cpus=cpus_per_task * gpus_per_node,
                         threads=cpus_per_task, launch=launch)
