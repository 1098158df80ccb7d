"""Run several training layouts in one process group (one spawn serves many checks).

    torchrun --standalone --nproc-per-node N tests/parallel_worker.py SPEC.json OUT.json

SPEC is a list of {"name", "config": TrainConfig fields, "resume": bool, "copy_from": run dir to
resume a copy of}, or of {"name", "distill": {"model_dir", "context", "student", "args"}} (a
distillation run of prunus.compress.distill across the group); rank 0
writes {name: {"losses": [...], "val_loss": ..., "params_local": ...} or {"error": ...}} to OUT.
"""

import json
import os
import shutil
import sys
import traceback

import torch.distributed as dist

from prunus.train_parallel import TrainConfig, resume_config, train


def run_distill(model_dir: str, context: dict, student, args: dict):
    from prunus.compress.context import build_context
    from prunus.compress.distill import distill
    from prunus.compress.student import make_student

    ctx = build_context(model_dir, **context)
    return distill(make_student(ctx.teacher, student), ctx, nproc=int(os.environ["WORLD_SIZE"]), progress=False, **args)


def main(spec_path: str, out_path: str) -> None:
    results = {}
    for job in json.loads(open(spec_path).read()):
        try:
            if job.get("copy_from"):
                if not dist.is_initialized() or dist.get_rank() == 0:
                    shutil.copytree(job["copy_from"], job["config"]["out"])
                if dist.is_initialized():
                    dist.barrier()
            if job.get("distill"):
                r = run_distill(**job["distill"])
            else:
                cfg = (resume_config(job["config"]["out"], **{k: v for k, v in job["config"].items() if k != "out"})
                       if job.get("resume") else TrainConfig(**job["config"]))
                r = train(cfg, resume=job.get("resume", False))
            results[job["name"]] = {"losses": r.losses, "val_loss": r.metrics.get("val_loss")}
        except Exception as e:  # recorded, the group goes on with the next layout
            results[job["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            print(f"rank {dist.get_rank() if dist.is_initialized() else 0}, {job['name']}: {traceback.format_exc()}",
                  file=sys.stderr)
        if not dist.is_initialized() or dist.get_rank() == 0:  # after every layout: a later hang keeps these
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
