"""ResNet-18 through every prunus stage on scikit-learn's handwritten digits, beside the peers used directly.

The digits (1,797 8 x 8 images in 10 classes, shipped inside scikit-learn: no download) are upsampled to
32 x 32 (bilinear) and written as an image folder of one-channel ``.npy`` arrays; every prunus stage reads them
through its own data path, with the image folder's held-out split (10% by a hash of each path).

The model is ResNet-18 with the CIFAR stem (:func:`resnet18`: a 3 x 3 convolution, no max-pool, BasicBlocks
[2, 2, 2, 2], global average pool, Linear), its stem taking one channel. ``--width`` is the first stage's
channels (64 is the standard ResNet-18; the default here is narrower so that the whole run fits in minutes
on two CPU cores: the depth and the layout are ResNet-18's).

1. **train** with prunus's generic trainer (``train_module``): held-out accuracy.
2. **int8 static PTQ**: prunus's export (``precision="int8"``) beside ONNX Runtime's ``quantize_static`` with
   its defaults on the same fp32 graph and the same calibration samples (spread over the training split):
   accuracy, and latency at batch 1 / 64.
3. **prune 50% of the channels + fine-tune**: prunus (``prune_channels``, magnitude, then its trainer) beside
   torch-pruning's ``MetaPruner`` called directly (same importance, ratio and kept classifier) and a plain AdamW
   loop of the same steps, batch and lr: accuracy, params and FLOPs.
4. **distillation**: prunus's ``distill_module`` into a narrower ResNet-18 (at most half the parameters).

Prints every figure, the deltas against fp32 and the ratios prunus / peer.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.resnet_digits [--width 16] [--steps 300] [--json F]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import numpy as np
import torch
from torch import nn

from benchmarks.any_model_digits import accuracy_torch, int8_rows, stacked
from benchmarks.harness import machine_line, ms, show, write_results

SPEC = "benchmarks.resnet_digits:resnet18"


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18, CIFAR stem: conv3x3-BN-ReLU, four stages of two BasicBlocks (stride 1, 2, 2, 2), pool, fc."""

    def __init__(self, width: int = 64, channels: int = 1, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        widths, cin, layers = [width, 2 * width, 4 * width, 8 * width], width, []
        for i, w in enumerate(widths):
            layers.append(nn.Sequential(BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(width: int = 64, channels: int = 1, classes: int = 10) -> nn.Module:
    return ResNet18(width, channels, classes)


def write_digits32(root: Path) -> Path:
    """The digits as ROOT/<class>/<i>.npy, 1 x 32 x 32 float32 in [0, 1] (bilinear upsampling of 8 x 8)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images[:, None] / 16.0).float()
    images = nn.functional.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False).clamp(0, 1)
    for i, (image, label) in enumerate(zip(images.numpy(), digits.target)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        np.save(root / str(label) / f"{i:04d}.npy", image)
    return root


def train(data: Path, out: Path, steps: int, width: int) -> Path:
    from prunus.data.module_datasets import module_datasets
    from prunus.train_parallel.module_config import ModuleTrainConfig
    from prunus.train_parallel.module_trainer import train_module

    tr, val = module_datasets(str(data))
    cfg = ModuleTrainConfig(out=str(out), batch_size=64, steps=steps, lr=3e-3, min_lr=3e-5, warmup_steps=20,
                            eval_every=steps, ckpt_every=0, progress=False, device="cpu", model_args={"width": width})
    return train_module(SPEC, tr, "classification", cfg, val_dataset=val).model_dir


def flops_params(model: nn.Module, example: torch.Tensor) -> tuple[int, int]:
    import torch_pruning as tp

    flops, params = tp.utils.count_ops_and_params(model.eval(), example)
    return int(flops), int(params)


def compress_rows(model_dir: Path, data: Path, out: Path, args, train_xy, val_xy) -> dict:
    """prunus prune + fine-tune, torch-pruning + AdamW, prunus distillation: accuracy, params, FLOPs each."""
    from prunus.compress import compress
    from prunus.models.model_dir import load_model

    example = train_xy[0][:2]
    prune = {"amount": 0.5, "importance": "magnitude", "finetune_steps": args.finetune_steps, "lr": 1e-3,
             "batch_size": 64}  # the peer's importance
    student = {"student": SPEC, "student_args": {"width": args.student_width}, "steps": args.distill_steps,
               "lr": 3e-3, "batch_size": 64}
    rows = {}
    for label, passes, where in (("prunus prune 50% + fine-tune", [("prune_channels", prune)], out / "pruned"),
                                 ("prunus distill", [("distill_module", student)], out / "student")):
        compress(model_dir, passes, where, data=str(data), trust_factory=True, latency=False)
        model = load_model(where, trust_factory=True)
        rows[label] = {"accuracy": accuracy_torch(model, *val_xy), **dict(zip(("flops", "params"),
                                                                            flops_params(model, example)))}
    got = prune_peer_model(load_model(model_dir, trust_factory=True), train_xy, val_xy, args.finetune_steps)
    rows["torch-pruning 50% + AdamW"] = {**got, **dict(zip(("flops", "params"), flops_params(got.pop("model"),
                                                                                             example)))}
    return rows


def prune_peer_model(model: nn.Module, train_xy, val_xy, finetune: int, seed: int = 0) -> dict:
    """torch-pruning used directly on ``model`` (MetaPruner, L2 magnitude, 50%, fc kept), then plain AdamW."""
    import torch_pruning as tp

    model.eval()
    pruner = tp.pruner.MetaPruner(model, train_xy[0][:2], importance=tp.importance.MagnitudeImportance(p=2),
                                  pruning_ratio=0.5, ignored_layers=[model.fc])
    pruner.step()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(finetune):
        idx = torch.randint(len(train_xy[0]), (64,), generator=gen)
        loss = nn.functional.cross_entropy(model(train_xy[0][idx]), train_xy[1][idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"accuracy": accuracy_torch(model, *val_xy), "model": model}


def report(fp32: dict, int8: dict, compressed: dict) -> None:
    base = fp32["accuracy"]
    show("ResNet-18 (CIFAR stem) on digits 32x32: held-out accuracy vs fp32", ["", "accuracy", "delta vs fp32",
         "params", "params / fp32", "FLOPs / fp32"],
         [["fp32 (prunus trainer)", f"{base:.4f}", "-", f"{fp32['params']:,}", "1.000", "1.000"]]
         + [[k, f"{v['accuracy']:.4f}", f"{v['accuracy'] - base:+.4f}", f"{v['params']:,}",
             f"{v['params'] / fp32['params']:.3f}", f"{v['flops'] / fp32['flops']:.3f}"] for k, v in compressed.items()],
         width=120)
    show("int8 static PTQ (ONNX Runtime, 1 thread)", ["", "accuracy", "delta vs fp32", "graph bytes", "ms batch 1",
                                                      "ms batch 64"],
         [[k, f"{v['accuracy']:.4f}", f"{v['accuracy'] - base:+.4f}", f"{v['bytes']:,}", ms(v["latency_b1"]),
           ms(v["latency_b64"])] for k, v in int8.items()], width=120)
    med = lambda v: float(np.median(v))  # noqa: E731
    a, b, f = int8["prunus int8"], int8["quantize_static int8"], int8["fp32 (ONNX Runtime)"]
    print(f"ratio prunus int8 / quantize_static: accuracy {a['accuracy'] / b['accuracy']:.3f}, latency batch 1 "
          f"{med(a['latency_b1']) / med(b['latency_b1']):.3f}, batch 64 {med(a['latency_b64']) / med(b['latency_b64']):.3f}")
    print(f"ratio prunus int8 / fp32 latency: batch 1 {med(a['latency_b1']) / med(f['latency_b1']):.3f}, batch 64 "
          f"{med(a['latency_b64']) / med(f['latency_b64']):.3f}")
    p, t = compressed["prunus prune 50% + fine-tune"], compressed["torch-pruning 50% + AdamW"]
    print(f"ratio prunus prune / torch-pruning: accuracy {p['accuracy'] / t['accuracy']:.3f}, params "
          f"{p['params'] / t['params']:.3f}, FLOPs {p['flops'] / t['flops']:.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=16, help="first-stage channels (64: standard ResNet-18)")
    parser.add_argument("--student-width", type=int, default=11, help="the distilled student's first-stage channels")
    parser.add_argument("--steps", type=int, default=300, help="training steps (batch 64)")
    parser.add_argument("--finetune-steps", type=int, default=100, help="fine-tune steps after pruning (batch 64)")
    parser.add_argument("--distill-steps", type=int, default=300, help="distillation steps (batch 64)")
    parser.add_argument("--reps", type=int, default=50, help="latency repetitions per graph and batch size")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    from prunus.data.image_folder import image_folder_datasets
    from prunus.models.model_dir import load_model

    print(machine_line())
    t0, seconds = time.perf_counter(), {}
    with tempfile.TemporaryDirectory(prefix="prunus-resnet-digits-") as tmp:
        tmp = Path(tmp)
        data = write_digits32(tmp / "digits")
        train_xy, val_xy = (stacked(d) for d in image_folder_datasets(data, 0.1))
        model_dir = train(data, tmp / "run", args.steps, args.width)
        seconds["train"] = time.perf_counter() - t0
        dense = load_model(model_dir, trust_factory=True)
        flops, params = flops_params(dense, train_xy[0][:2])
        fp32 = {"accuracy": accuracy_torch(dense, *val_xy), "params": params, "flops": flops}
        t1 = time.perf_counter()
        int8 = int8_rows(model_dir, data, tmp, train_xy, val_xy, args.reps)
        seconds["int8"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        compressed = compress_rows(model_dir, data, tmp, args, train_xy, val_xy)
        seconds["prune_distill"] = time.perf_counter() - t1
    seconds["total"] = time.perf_counter() - t0
    print(f"digits 32x32: {len(train_xy[0])} training, {len(val_xy[0])} held-out samples; ResNet-18 width "
          f"{args.width}; seconds " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    report(fp32, int8, compressed)
    if args.json:
        write_results(args.json, vars(args), {"fp32": fp32, "int8": int8, "compressed": compressed,
                                              "seconds": seconds})


if __name__ == "__main__":
    main()
