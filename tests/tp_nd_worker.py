"""2D / 2.5D / 3D tensor parallelism checks in one process group (one spawn serves every case).

    torchrun --standalone --nproc-per-node 8 tests/tp_nd_worker.py SPEC.json OUT.json

SPEC is a list of {"name", "grid": {"mode", "dims": [mesh dim names], "shape": [sizes], "model": ModelConfig
changes, "batch": sequences}} (one forward and backward of the tiny model, every weight random, under the
grid made of the dims named ``tp_*``, against the same model in this process: the loss, every gradient,
every weight gathered back, a summed loss over an uneven batch, and the bytes each layer sent, counted by
the collectives) or of {"name", "config": TrainConfig fields} (a training run); rank 0 writes
{name: {...} or {"error": ...}} to OUT.
"""

import copy
import json
import sys
import traceback

import torch
import torch.distributed as dist

from prunus.artifacts.atomic import atomic_write_json


def layer_of(label: str) -> str:
    """The layer a collective's label belongs to: ``layers.N`` for anything inside block N."""
    parts = label.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


class LocalShards:
    """The model's local shards and buffers, as SavedActivations reads a model (DTensors have no storage of their own)."""

    def __init__(self, model):
        self.model = model

    def parameters(self):
        return [p.to_local() for p in self.model.parameters()]

    def buffers(self):
        return list(self.model.buffers())


def run_grid(mode: str, dims: list, shape: list, model: dict, batch: int, seq: int = 16) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from prunus.models import Transformer
    from prunus.models.config import get_preset
    from prunus.train_parallel.parallelize import cross_entropy
    from prunus.train_parallel.tensor_parallel.tp_nd.apply import apply_tp_nd
    from prunus.train_parallel.launch.saved_activations import SavedActivations
    from prunus.train_parallel.tensor_parallel.tp_nd.collectives import count_bytes
    from prunus.train_parallel.tensor_parallel.tp_nd.layers import GridLinear

    cfg = get_preset("tiny").replace(**model)
    torch.manual_seed(1)
    ref = Transformer(cfg).train()
    ref.init_weights()
    with torch.no_grad():  # random norms and biases too, so their gradients are checked against something
        for name, p in ref.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    gen = torch.Generator().manual_seed(2)
    x, y = (torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen) for _ in range(2))
    nd = copy.deepcopy(ref)
    ref_loss = cross_entropy(ref(x), y)
    ref_loss.backward()
    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(dims))
    grid = apply_tp_nd(nd, mode, mesh[tuple(n for n in dims if n.startswith("tp_"))])

    with count_bytes() as sent:
        with SavedActivations(LocalShards(nd)) as saved:
            loss = grid.loss(nd(x), y)
        loss.backward()
    ref_params = dict(ref.named_parameters())
    grad_diff = weight_diff = 0.0
    for name, p in nd.named_parameters():
        grad_diff = max(grad_diff, float((p.grad.full_tensor() - ref_params[name].grad).abs().max()))
        weight_diff = max(weight_diff, float((p.full_tensor() - ref_params[name]).abs().max()))
    with torch.no_grad():  # an evaluation batch that does not split evenly: padded, the pads ignored
        odd = batch - 1
        sum_diff = abs(float(grid.loss(nd(x[:odd]), y[:odd], "sum")) - float(cross_entropy(ref(x[:odd]), y[:odd], "sum")))
    per_layer: dict = {}
    for label, nbytes in sent.items():
        per_layer[layer_of(label)] = per_layer.get(layer_of(label), 0.0) + nbytes
    return {"loss_diff": abs(float(loss) - float(ref_loss)), "grad_diff": grad_diff, "weight_diff": weight_diff,
            "sum_diff": sum_diff, "loss": float(loss), "n_params": len(list(nd.parameters())),
            "n_ref_params": len(list(ref.parameters())),
            "local_params": sum(p.to_local().numel() for p in nd.parameters()),
            "sent": {k: round(v) for k, v in per_layer.items()}, "saved_bytes": saved.bytes,
            # the weights the linears gathered (q times their shards), kept for backward
            "gathered_weight_bytes": sum(m.weight.to_local().numel() * grid.q * 4 for m in nd.modules()
                                         if isinstance(m, GridLinear))}


def run_train(config: dict) -> dict:
    from prunus.train_parallel import TrainConfig, train

    r = train(TrainConfig(**config))
    return {"losses": r.losses, "val_loss": r.metrics.get("val_loss")}


def main(spec_path: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    for job in json.loads(open(spec_path).read()):
        try:
            results[job["name"]] = run_grid(**job["grid"]) if "grid" in job else run_train(job["config"])
        except Exception as e:  # recorded; the group goes on with the next case
            results[job["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            print(f"rank {dist.get_rank()}, {job['name']}: {traceback.format_exc()}", file=sys.stderr)
        if dist.get_rank() == 0:
            atomic_write_json(out_path, results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
