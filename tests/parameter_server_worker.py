"""Run parameter-server and DDP jobs in one torchrun process group (tests/test_parameter_server.py).

    torchrun --standalone --nproc-per-node N tests/parameter_server_worker.py SPEC.json OUT.json

SPEC: a list of {"name", "config": TrainConfig fields, "slow_workers": {worker index: seconds}}; a job whose
config has ``nproc`` below the group's size runs on the first ``nproc`` ranks (a DDP reference beside the
parameter server). Rank 0 writes {name: {"losses", "val_loss", "ps"} or {"error"}} to OUT.
"""

import json
import sys
import traceback

import torch.distributed as dist

from prunus.artifacts.atomic import atomic_write_json
from prunus.train_parallel import TrainConfig, train
from prunus.train_parallel.data_parallel.ps_worker import train_parameter_server


def main(spec_path: str, out_path: str) -> None:
    results = {}
    for job in json.loads(open(spec_path).read()):
        try:
            cfg = TrainConfig(**job["config"])
            if cfg.dp_mode == "ps":
                slow = {int(k): v for k, v in job.get("slow_workers", {}).items()}
                r = train_parameter_server(cfg, slow_workers=slow)
            else:
                r = train(cfg)
            results[job["name"]] = {"losses": r.losses, "val_loss": r.metrics.get("val_loss"), "ps": r.metrics.get("ps")}
        except Exception as e:  # recorded, the group goes on with the next job
            results[job["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            print(f"rank {dist.get_rank() if dist.is_initialized() else 0}, {job['name']}: {traceback.format_exc()}",
                  file=sys.stderr)
        if not dist.is_initialized() or dist.get_rank() == 0:
            atomic_write_json(out_path, results)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
