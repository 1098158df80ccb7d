"""Context-parallel checks in one process group (one spawn serves many checks).

    torchrun --standalone --nproc-per-node N tests/cp_worker.py SPEC.json OUT.json

SPEC is a list of jobs, each {"name", "kind", ...}:

* ``attention`` (impl, cp, batch, heads, seq, head_dim, optional window / softcap / scale): ring /
  Ulysses attention on each rank's load-balanced chunks against the model's own attention core
  (causal SDPA without variants) on the whole sequence, forward and backward; reports the max
  |difference| of the output and of dq, dk, dv (gathered).
* ``model`` (impl, cp, seq, batch, model overrides or a ``family`` of tests/family_variants.py, whose
  norms and biases are drawn at random): the tiny model with its attention swapped, on the sharded
  batch, loss averaged and gradients averaged over cp (what FSDP / DDP over dp x cp do), against the
  same model on the whole batch in one process.
* ``train`` (config): ``prunus.train_parallel.train``; reports losses and the validation loss.

Rank 0 writes {name: result or {"error", "trace"}} to OUT after every job.
"""

import copy
import json
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from family_variants import family_model
from prunus.models import Transformer, get_preset
from prunus.models.llama import CausalAttention
from prunus.train_parallel import TrainConfig, train
from prunus.train_parallel.context_parallel.context_parallel import apply_cp, shard_batch, unshard
from prunus.train_parallel.context_parallel.ring_attention import RingAttention
from prunus.train_parallel.launch.saved_activations import SavedActivations
from prunus.train_parallel.context_parallel.ulysses import UlyssesAttention


def cp_mesh(cp: int):
    """A mesh whose last dim is cp (the world split into world/cp groups of cp ranks)."""
    world = dist.get_world_size()
    return init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("rest", "cp"))["cp"]


def attention_job(job) -> dict:
    mesh = cp_mesh(job["cp"])
    torch.manual_seed(0)
    shape = (job["batch"], job["heads"], job["seq"], job["head_dim"])
    q, k, v, dout = (torch.randn(shape) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    core = CausalAttention(job.get("window"), job.get("softcap"), job.get("scale"))
    ref = core(*full)  # causal SDPA when the job sets no variant
    ref.backward(dout)
    pos = shard_batch(q[:, 0], q[:, 0], mesh)[2]  # this rank's positions
    local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    if job["impl"] == "ring":
        out = RingAttention(mesh.get_group(), core)(*local)
    else:
        out = UlyssesAttention(mesh.get_group(), core)(*local)
    out.backward(dout[:, :, pos])
    diffs = {"out": (unshard(out.detach(), mesh, dim=2) - ref.detach()).abs().max()}
    for name, mine, theirs in zip(("dq", "dk", "dv"), local, full):
        diffs[name] = (unshard(mine.grad, mesh, dim=2) - theirs.grad).abs().max()
    return {k: float(v) for k, v in diffs.items()}


def model_job(job) -> dict:
    mesh = cp_mesh(job["cp"])
    if job.get("family"):
        model = family_model(job["family"], max_seq_len=job["seq"]).train()
        cfg = model.config
    else:
        torch.manual_seed(0)
        cfg = get_preset("tiny").replace(max_seq_len=job["seq"], **job.get("model", {}))
        model = Transformer(cfg)
        model.init_weights()
    x = torch.randint(0, cfg.vocab_size, (job["batch"], job["seq"]))
    y = torch.randint(0, cfg.vocab_size, (job["batch"], job["seq"]))
    ref_loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    ref_loss.backward()
    cp_model = copy.deepcopy(model)
    cp_model.zero_grad(set_to_none=True)
    apply_cp(cp_model, mesh, job["impl"])
    xs, ys, positions = shard_batch(x, y, mesh)
    with SavedActivations(cp_model) as saved:  # what autograd keeps for backward, as the dry run counts it
        logits = cp_model(xs, positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1), ys.flatten())
    saved.add(logits)
    loss.backward()
    group, cp = mesh.get_group(), mesh.size()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grad_diff = 0.0
    for p, p_ref in zip(cp_model.parameters(), model.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grad_diff = max(grad_diff, float((g / cp - p_ref.grad).abs().max()))
    return {"loss": float(total / cp), "ref_loss": float(ref_loss), "grad_diff": grad_diff, "saved_bytes": saved.bytes,
            "grad_scale": max(float(p.grad.abs().max()) for p in model.parameters())}


def train_job(job) -> dict:
    r = train(TrainConfig(**job["config"]))
    return {"losses": r.losses, "val_loss": r.metrics.get("val_loss")}


KINDS = {"attention": attention_job, "model": model_job, "train": train_job}


def main(spec_path: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    for job in json.loads(open(spec_path).read()):
        try:
            results[job["name"]] = KINDS[job["kind"]](job)
        except Exception as e:  # recorded; the group goes on with the next job
            results[job["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            print(f"rank {dist.get_rank()}, {job['name']}: {traceback.format_exc()}", file=sys.stderr)
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
