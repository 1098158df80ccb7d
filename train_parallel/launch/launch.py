"""Process-group setup and launch: torchrun (one host or many), Slurm, or ``--nproc N`` on this host.

(The Slurm job script ``prunus train --print-slurm`` prints is written by :mod:`.slurm`.)

* Under torchrun the environment gives RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT.
* Under Slurm (srun, one task per device) SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID
  give rank, world and local rank; the first host of SLURM_JOB_NODELIST is the master.
* ``prunus train --nproc N`` runs torchrun's agent (``--standalone``, a free port on
  this host) inside the ``prunus`` process itself, which starts the N ranks. A signal
  to that one process (Ctrl-C, ``kill PID``, a hang-up) reaches the whole job: the
  agent sends it to every rank and waits for them (SIGKILL after 30 s). If the
  ``prunus`` process dies outright, the kernel ends its ranks (``PR_SET_PDEATHSIG``).

The collective timeout (``--timeout``) ends a hang: each waiting rank exits with one
line naming itself and the collective that timed out (:func:`collective_timeout`).
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import sys

import torch
import torch.distributed as dist

from prunus.artifacts.errors import PrunusError

LAUNCHED = "PRUNUS_LAUNCHED"
LAUNCHER_PID = "PRUNUS_LAUNCHER_PID"


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
    if os.environ.get(LAUNCHED):
        die_with_launcher()
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


def die_with_launcher() -> None:
    """In a rank started by ``prunus train --nproc``: the kernel ends this process when the launcher
    (its parent) dies; one that is already gone ends it now."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher and os.getppid() != int(launcher):  # the launcher died before the line above
        os._exit(128 + signal.SIGTERM)


def launch_local(cfg, argv: list[str]) -> int:
    """Run ``prunus <argv>`` in ``cfg.nproc`` processes on this host under torchrun's agent, in this process;
    return the job's exit code (the first failed rank's, or 128 + the signal that stopped it).

    ``cfg`` (the TrainConfig ``argv`` describes) is checked first, layout against the model included
    (:func:`~.parallelize.resolve_layout`): a layout a run would refuse starts no process."""
    from ..parallelize import resolve_layout

    resolve_layout(cfg, cfg.nproc)
    return launch_ranks(cfg.nproc, argv)


def run_module_ranks(nproc: int, module: str, args: list[str]) -> int:
    """``python -m MODULE ARGS`` on ``nproc`` local processes under ``torchrun --standalone`` (a stage that spawns
    its own ranks: distillation, an EAGLE draft), each with its share of the cores; the job's exit code."""
    import subprocess

    threads = max(1, (os.cpu_count() or 1) // nproc)
    env = {**os.environ, LAUNCHED: "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={nproc}", "-m", module, *args], env=env)


def launch_ranks(nproc: int, argv: list[str], agent: list[str] | None = None) -> int:
    """Run ``prunus <argv>`` in ``nproc`` processes on this host under torchrun's agent (see :func:`launch_local`;
    the caller has checked the settings ``argv`` gives, as a generic module's run does its own). ``agent``:
    torchrun's flags in place of ``--standalone`` (an elastic job's, :mod:`.elastic`)."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    threads = max(1, (os.cpu_count() or 1) // nproc)
    os.environ.update({LAUNCHED: "1", LAUNCHER_PID: str(os.getpid())})
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # the ranks say what went wrong, each in one line; the agent's own report would repeat it as a page
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    agent = agent or ["--standalone", f"--nproc-per-node={nproc}"]
    args = get_args_parser().parse_args([*agent, "--monitor-interval=0.2",
                                         "-m", "prunus.cli.main", *argv])
    try:
        run(args)
    except ChildFailedError as e:
        code = e.get_first_failure()[1].exitcode
        return code if code > 0 else 128 - code
    except SignalException as e:
        print(f"prunus train: stopped by {signal.Signals(e.sigval).name}; all {nproc} ranks have exited", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter_tensor",
                "broadcast", "broadcast_object_list", "barrier", "all_to_all_single", "all_to_all", "send", "recv",
                "batch_isend_irecv", "gather", "scatter", "reduce", "monitored_barrier"}


def collective_timeout(e: BaseException, timeout_s: float) -> PrunusError | None:
    """One line for a collective that timed out on this rank (a rank hung or died), else None."""
    text = str(e)
    if not isinstance(e, RuntimeError) or not any(w in text for w in ("Timed out", "timed out", "Timeout", "timeout")):
        return None
    op, where = None, None
    tb = e.__traceback__
    while tb is not None:  # the innermost torch.distributed collective on the stack, and our innermost frame
        code, module = tb.tb_frame.f_code, tb.tb_frame.f_globals.get("__name__", "")
        if code.co_name in _COLLECTIVES and module.startswith("torch.distributed"):
            op = code.co_name
        if module.startswith("prunus."):
            where = f"{module}.{code.co_name} line {tb.tb_lineno}"
        tb = tb.tb_next
    # DDP's gradient all-reduce runs in autograd (C++): then only the place in prunus is known
    what = op or "a collective" + (f" (in {where})" if where else "")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else env_ranks()[0]
    return PrunusError(f"rank {rank}: {what} timed out after --timeout {timeout_s:g} s waiting for the "
                       "other ranks (one of them hung or died; see its output); raise --timeout if a step is "
                       "legitimately slower")


def reports_collective_timeouts(fn):
    """Decorate ``fn(cfg, ...)``: a collective timeout inside becomes :func:`collective_timeout`'s one line."""
    import functools

    @functools.wraps(fn)
    def wrapper(cfg, *args, **kwargs):
        try:
            return fn(cfg, *args, **kwargs)
        except RuntimeError as e:
            err = collective_timeout(e, cfg.timeout_s)
            if err is None:
                raise
            raise err from None

    return wrapper
