"""Generic-module training layouts in one process group (one spawn serves every check).

    torchrun --standalone --nproc-per-node N tests/any_model_worker.py SPEC.json OUT.json

SPEC is a list of {"name", "model": factory spec, "data": a synthetic: dataset spec, "task", "config":
ModuleTrainConfig fields, "resume": continue the run in config's out}; rank 0 writes {name: {"losses": [...],
"val_loss": ..., "val_accuracy": ...} or {"error": ...}} to OUT after every job (a later hang keeps what came
before).
"""

import json
import sys
import traceback

import torch.distributed as dist

from prunus.artifacts.atomic import atomic_write_json
from prunus.data.synthetic import synthetic_datasets
from prunus.train_parallel.module_config import ModuleTrainConfig
from prunus.train_parallel.module_trainer import train_module


def main(spec_path: str, out_path: str) -> None:
    results = {}
    for job in json.loads(open(spec_path).read()):
        try:
            train, val = synthetic_datasets(job["data"])
            r = train_module(job["model"], train, job["task"], ModuleTrainConfig(**job["config"]), val_dataset=val,
                             resume=job.get("resume", False))
            results[job["name"]] = {"losses": r.losses, "val_loss": r.metrics.get("val_loss"),
                                    "val_accuracy": r.metrics.get("val_accuracy"),
                                    "model_dir": str(r.model_dir) if r.model_dir else None}
        except Exception as e:  # recorded; the group goes on with the next layout
            results[job["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            print(f"{job['name']}: {traceback.format_exc()}", file=sys.stderr)
        if not dist.is_initialized() or dist.get_rank() == 0:
            atomic_write_json(out_path, results)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
