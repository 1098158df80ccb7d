"""Run several training layouts in one process group (one spawn serves many checks).

    torchrun --standalone --nproc-per-node N tests/parallel_worker.py SPEC.json OUT.json

SPEC is a list of {"name", "config": TrainConfig fields, "resume": bool, "copy_from": run dir to
resume a copy of}, of {"name", "distill": {"model_dir", "context", "student", "args"}} (a
distillation run of prunus.compress.distill across the group), or of {"name", "tp_model": {"family",
"loss_parallel"}} (one forward and backward of a family's tiny model, every weight random, under
tensor + sequence parallelism over the whole group against the same model in this process: the
largest |loss difference| and |gradient difference|, and the parameters left plain tensors); rank 0
writes {name: {"losses": [...], "val_loss": ..., "params_local": ...} or {"error": ...}} to OUT.
"""

import json
import os
import shutil
import sys
import traceback

import torch.distributed as dist

from prunus.artifacts.atomic import atomic_write_json
from prunus.train_parallel import TrainConfig, resume_config, train


def run_distill(model_dir: str, context: dict, student, args: dict):
    from prunus.compress.context import build_context
    from prunus.compress.distill import distill
    from prunus.compress.student import make_student

    ctx = build_context(model_dir, **context)
    return distill(make_student(ctx.teacher, student), ctx, nproc=int(os.environ["WORLD_SIZE"]), progress=False, **args)


def run_train(job: dict):
    cfg = (resume_config(job["config"]["out"], **{k: v for k, v in job["config"].items() if k != "out"})
           if job.get("resume") else TrainConfig(**job["config"]))
    return train(cfg, resume=job.get("resume", False))


def run_tp_model(family: str, loss_parallel: bool = True) -> dict:
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from family_variants import family_model
    from prunus.train_parallel.parallelize import cross_entropy, local_value
    from prunus.train_parallel.tensor_parallel.tensor_parallel import apply_tp, loss_context

    model = family_model(family, seed=1).train()
    gen = torch.Generator().manual_seed(2)
    x, y = (torch.randint(0, model.config.vocab_size, (2, 16), generator=gen) for _ in range(2))
    ref = cross_entropy(model(x), y)
    ref.backward()
    tp_model = copy.deepcopy(model)
    tp_model.zero_grad(set_to_none=True)
    apply_tp(tp_model, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)), loss_parallel)
    with loss_context(loss_parallel):
        loss = cross_entropy(tp_model(x), y)
        loss.backward()
    grad_diff, plain = 0.0, []
    for (name, p), p_ref in zip(tp_model.named_parameters(), model.parameters()):
        if not isinstance(p, DTensor):
            plain.append(name)
        grad_diff = max(grad_diff, float((local_value(p.grad) - p_ref.grad).abs().max()))
    return {"loss_diff": abs(float(local_value(loss)) - float(ref)), "grad_diff": grad_diff, "plain_params": plain,
            "grad_scale": max(float(p.grad.abs().max()) for p in model.parameters())}


def main(spec_path: str, out_path: str) -> None:
    results = {}
    for job in json.loads(open(spec_path).read()):
        try:
            if job.get("copy_from"):
                if not dist.is_initialized() or dist.get_rank() == 0:
                    shutil.copytree(job["copy_from"], job["config"]["out"])
                if dist.is_initialized():
                    dist.barrier()
            if job.get("tp_model"):
                if not dist.is_initialized():
                    dist.init_process_group("gloo")
                results[job["name"]] = run_tp_model(**job["tp_model"])
            else:
                r = run_distill(**job["distill"]) if job.get("distill") else run_train(job)
                results[job["name"]] = {"losses": r.losses, "val_loss": r.metrics.get("val_loss")}
        except Exception as e:  # recorded, the group goes on with the next layout
            results[job["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            print(f"rank {dist.get_rank() if dist.is_initialized() else 0}, {job['name']}: {traceback.format_exc()}",
                  file=sys.stderr)
        if not dist.is_initialized() or dist.get_rank() == 0:  # after every layout: a later hang keeps these
            atomic_write_json(out_path, results)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
