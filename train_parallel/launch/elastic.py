"""Elastic training: ``prunus train --nnodes MIN:MAX --max-restarts K --rdzv-endpoint HOST:PORT`` runs torchrun's agent
with a c10d rendezvous (one agent per host, ``--nproc`` processes each), as ``--nproc`` runs it standalone.

When a host is lost (or a rank dies), every surviving agent restarts the job, up to ``--max-restarts``
times, with the hosts that rendezvous again (at least MIN). A restarted rank sees
``TORCHELASTIC_RESTART_COUNT > 0`` and goes on from the newest complete checkpoint of ``--out``
(:func:`~prunus.train_parallel.run_dir.run_location`), under the world it now has: the data-parallel
layout adapts, since checkpoints load under any layout; a layout that needs more ranks than remain
(``--tp`` or ``--pp`` above the new world) ends the job with one line. A job started again by hand
or by a scheduler with the same settings in the same ``--out`` resumes too (:func:`implied_resume`).

The layout is checked for both ends of the range before any agent starts. ``--print-slurm`` writes
the same command as one ``srun`` task per node (:func:`elastic_srun_line`).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from prunus.artifacts.errors import PrunusError

_NNODES = re.compile(r"^(\d+)(?::(\d+))?$")


def parse_nnodes(text: str) -> tuple[int, int]:
    """'2' -> (2, 2), '1:4' -> (1, 4); one line for anything else."""
    m = _NNODES.match(text.strip())
    low, high = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or low < 1 or high < low:
        raise PrunusError(f"--nnodes {text!r}: give MIN:MAX hosts (1 <= MIN <= MAX), e.g. 1:4, or one number")
    return low, high


def check_elastic(cfg, nnodes: str, max_restarts: int, endpoint: str | None, *, need_endpoint: bool = True) -> tuple[int, int]:
    """The (MIN, MAX) hosts of an elastic job of ``cfg`` (a TrainConfig); one line for settings it would refuse: a
    bad range or endpoint, or a layout that does not fit ``MIN x --nproc`` or ``MAX x --nproc`` ranks."""
    from ..parallelize import resolve_layout

    low, high = parse_nnodes(nnodes)
    if max_restarts < 0:
        raise PrunusError(f"--max-restarts {max_restarts}: give 0 or more restarts")
    if need_endpoint and not endpoint:
        raise PrunusError("--nnodes needs --rdzv-endpoint HOST:PORT, the host and port every agent meets at "
                          "(127.0.0.1:29400 on one host)")
    if endpoint and not re.match(r"^[^\s:]+:\d{1,5}$", endpoint):
        raise PrunusError(f"--rdzv-endpoint {endpoint!r}: give HOST:PORT, e.g. node01:29400")
    for hosts in sorted({low, high}):
        try:
            resolve_layout(cfg, hosts * cfg.nproc)
        except PrunusError as e:
            raise PrunusError(f"--nnodes {nnodes}: on {hosts} host(s) x --nproc {cfg.nproc}: {e}") from None
    return low, high


def torchrun_args(nnodes: str, nproc: int, max_restarts: int, endpoint: str, run_id: str = "prunus") -> list[str]:
    """torchrun's flags for one agent of the elastic job."""
    return ["--nnodes", nnodes, f"--nproc-per-node={nproc}", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--max-restarts", str(max_restarts)]


def implied_resume(cfg) -> bool:
    """Whether ``--out`` already holds this run (its settings, bar the ones a resume may change, and a checkpoint):
    an elastic job started again over it goes on from its newest checkpoint instead of refusing the dir."""
    from ..checkpoint.checkpoint import list_checkpoints
    from ..run_dir import RUN_CONFIG, differing_setting, read_run_config

    out = Path(cfg.out)
    if not (out / RUN_CONFIG).is_file() or not list_checkpoints(out):
        return False
    return differing_setting(cfg, read_run_config(out)) is None


def launch_elastic(cfg, argv: list[str], nnodes: str, max_restarts: int, endpoint: str | None) -> int:
    """Run this host's agent of the elastic job ``prunus <argv>`` (``cfg`` is the TrainConfig it describes);
    return the job's exit code as :func:`.launch.launch_ranks` does."""
    from .launch import launch_ranks

    check_elastic(cfg, nnodes, max_restarts, endpoint)
    if "--resume" not in argv and "--overwrite" not in argv and implied_resume(cfg):
        argv = [*argv, "--resume"]
    return launch_ranks(cfg.nproc, argv, agent=torchrun_args(nnodes, cfg.nproc, max_restarts, endpoint))


def elastic_srun_line(nnodes: str, gpus_per_node: int, max_restarts: int, endpoint: str | None,
                      train_args: list[str]) -> str:
    """The job script's launch line: one torchrun agent per node (``srun --ntasks-per-node=1``), rendezvous at
    ``endpoint`` or at the job's first node."""
    where = shlex.quote(endpoint) if endpoint else '"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1):29400"'
    flags = torchrun_args(nnodes, gpus_per_node, max_restarts, "ENDPOINT", run_id="prunus-$SLURM_JOB_ID")
    line = shlex.join(flags).replace("ENDPOINT", where).replace("'prunus-$SLURM_JOB_ID'", '"prunus-$SLURM_JOB_ID"')
    return f"srun --ntasks-per-node=1 torchrun {line} -m prunus.cli.main train {shlex.join(train_args)}"
