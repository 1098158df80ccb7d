"""Process-group setup and launch: torchrun (one host or many), Slurm, or ``--nproc N`` on this host.

* Under torchrun the environment gives RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT.
* Under Slurm (srun, one task per device) SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID
  give rank, world and local rank; the first host of SLURM_JOB_NODELIST is the master.
* ``prunus train --nproc N`` re-runs the same command under ``torchrun --standalone``
  (a free port on this host).

The collective timeout ends a hang with an error naming the rank.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys

import torch
import torch.distributed as dist

from prunus.models.errors import PrunusError

LAUNCHED = "PRUNUS_LAUNCHED"


def first_slurm_host(nodelist: str) -> str:
    """'node[03-05,7],gpu1' -> 'node03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise PrunusError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read its first host; set MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def env_ranks() -> tuple[int, int, int, str]:
    """(rank, world_size, local_rank, init_method) from torchrun's or Slurm's environment; alone (0, 1, 0, "")."""
    env = os.environ
    if "WORLD_SIZE" in env and "RANK" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "env://"
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "localhost"))
        port = env.get("MASTER_PORT") or str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000)
        return (int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                f"tcp://{addr}:{port}")
    return 0, 1, 0, ""


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Join the process group when launched with several processes; return (rank, world, device)."""
    rank, world, local, init_method = env_ranks()
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = restart_safe_store(timeout)
        dist.init_process_group(backend, init_method=None if store else init_method, store=store, rank=rank,
                                world_size=world, timeout=timeout, device_id=device if device.type == "cuda" else None)
    return rank, world, device


def restart_safe_store(timeout: datetime.timedelta) -> dist.Store | None:
    """torchrun's shared store, with keys scoped to this restart attempt; None when not under torchrun's agent.

    torchrun (2.x) hosts one TCPStore in its agent for the whole job and hands it to
    every attempt's workers without a per-attempt prefix. After a restart, the new
    workers can read the dead attempt's Gloo addresses from it and fail with
    "connectFullMesh failed ... Connection refused". A prefix per attempt avoids it.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"prunus/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run ``prunus <argv>`` in ``nproc`` processes on this host with torchrun; return its exit code."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    env = {**os.environ, LAUNCHED: "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "prunus.cli.main", *argv]
    return subprocess.call(cmd, env=env)


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


def sbatch_script(nodes: int, gpus_per_node: int, train_args: list[str], cpus_per_task: int = 8) -> str:
    if nodes < 1 or gpus_per_node < 1:
        raise PrunusError("--nodes and --gpus-per-node must be at least 1")
    import shlex

    return SBATCH.format(nodes=nodes, gpus=gpus_per_node, cpus=cpus_per_task, args=shlex.join(train_args))
