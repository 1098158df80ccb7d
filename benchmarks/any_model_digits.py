"""Any model on a real dataset, beside the peers used directly: scikit-learn's handwritten digits (1,797 8 x 8
images in 10 classes, shipped inside the scikit-learn package: no download).

The digits are written as an image folder of ``.npy`` arrays (values / 16), so every prunus stage reads them
through its own ``--data`` path; the held-out split is the image folder's (10% by a hash of each path), the
same for every contender.

1. **train**: a small BatchNorm CNN (:func:`digits_cnn`) with prunus's generic trainer; held-out accuracy.
2. **prune 50% of the channels**: ``prunus compress`` (``prune_channels``, magnitude, then a fine-tune of
   ``--finetune-steps`` with the generic trainer) beside torch-pruning's ``MetaPruner`` called directly with the
   same importance, ratio and kept classifier, then a plain AdamW loop of the same steps, batch and lr.
   Accuracy and parameters.
3. **int8**: ``prunus export --precision int8`` beside ONNX Runtime's ``quantize_static`` called directly, with
   its defaults, on the same fp32 graph and the same calibration samples (128 spread evenly over the training
   split, which the image folder lists class by class).
   Accuracy, and ONNX Runtime latency at batch 1 and 64 in alternating repetitions (one intra-op thread each).

Prints every figure and the ratios prunus / peer.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.any_model_digits [--steps 400] [--finetune-steps 100] [--json F]
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

from benchmarks.harness import alternating_samples, machine_line, ms, show, write_results

SPEC = "benchmarks.any_model_digits:digits_cnn"
CALIB = 128


def digits_cnn(width: int = 32, classes: int = 10) -> nn.Module:
    """conv-BN-ReLU x 3 (a max-pool after the second), global average pool, Linear: 8 x 8 x 1 inputs."""
    def unit(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(*unit(1, width), *unit(width, 2 * width), nn.MaxPool2d(2), *unit(2 * width, 2 * width),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, classes))


def write_digits(root: Path) -> Path:
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        np.save(root / str(label) / f"{i:04d}.npy", (image[None] / 16.0).astype(np.float32))
    return root


def stacked(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(xs), torch.stack(ys)


def accuracy_torch(model: nn.Module, x, y) -> float:
    with torch.no_grad():
        return float((model.eval()(x).argmax(-1) == y).float().mean())


def train(data: Path, out: Path, steps: int) -> Path:
    from prunus.data.module_datasets import module_datasets
    from prunus.train_parallel.module_config import ModuleTrainConfig
    from prunus.train_parallel.module_trainer import train_module

    tr, val = module_datasets(str(data))
    cfg = ModuleTrainConfig(out=str(out), batch_size=64, steps=steps, lr=3e-3, min_lr=3e-4, warmup_steps=20,
                            eval_every=steps, ckpt_every=0, progress=False, device="cpu")
    return train_module(SPEC, tr, "classification", cfg, val_dataset=val).model_dir


def prune_prunus(model_dir: Path, data: Path, out: Path, finetune: int) -> dict:
    from prunus.compress import compress

    args = {"amount": 0.5, "importance": "magnitude", "finetune_steps": finetune, "lr": 1e-3,
            "batch_size": 64}  # the peer's importance
    rows = compress(model_dir, [("prune_channels", args)], out, data=str(data), trust_factory=True,
                    latency=False)["rows"]
    return {"accuracy": rows[-1]["val_accuracy"], "params": rows[-1]["params"]}


def prune_peer(model_dir: Path, train_xy, val_xy, finetune: int, seed: int = 0) -> dict:
    """torch-pruning used directly: MetaPruner, L2 magnitude, 50% of every layer's channels, the classifier
    kept; then a plain AdamW loop."""
    import torch_pruning as tp

    from prunus.models.model_dir import load_model

    model = load_model(model_dir, trust_factory=True).eval()
    example = train_xy[0][:2]
    pruner = tp.pruner.MetaPruner(model, example, importance=tp.importance.MagnitudeImportance(p=2),
                                  pruning_ratio=0.5, ignored_layers=[model[-1]])
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
    return {"accuracy": accuracy_torch(model, *val_xy), "params": sum(p.numel() for p in model.parameters())}


def ort_session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def quantize_peer(fp32: Path, out: Path, calibration: torch.Tensor) -> Path:
    """ONNX Runtime's quantize_static with its defaults on the fp32 graph prunus exported."""
    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    name = ort_session(fp32).get_inputs()[0].name

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{name: calibration[i:i + 16].numpy()} for i in range(0, len(calibration), 16)])

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(fp32), str(out), Reader())
    return out


def int8_rows(model_dir: Path, data: Path, tmp: Path, train_xy, val_xy, reps: int) -> dict:
    from prunus.export import export_model
    from prunus.export.module_int8 import spread_indices

    export_model(model_dir, tmp / "fp32", trust_factory=True, data=str(data), progress=False)
    export_model(model_dir, tmp / "int8", precision="int8", trust_factory=True, data=str(data), progress=False)
    graphs = {"fp32 (ONNX Runtime)": tmp / "fp32" / "model.onnx", "prunus int8": tmp / "int8" / "model.onnx",
              "quantize_static int8": quantize_peer(tmp / "fp32" / "model.onnx", tmp / "peer.onnx",
                                                    train_xy[0][spread_indices(len(train_xy[0]), CALIB)])}
    sessions = {k: ort_session(p) for k, p in graphs.items()}
    rows = {}
    for k, s in sessions.items():
        name = s.get_inputs()[0].name
        out = s.run(None, {name: val_xy[0].numpy()})[0]
        rows[k] = {"accuracy": float((torch.from_numpy(out).argmax(-1) == val_xy[1]).float().mean()),
                   "bytes": graphs[k].stat().st_size}
    for batch in (1, 64):
        x = val_xy[0][:batch].numpy()
        fns = {k: (lambda s=s: s.run(None, {s.get_inputs()[0].name: x})) for k, s in sessions.items()}
        for k, times in alternating_samples(fns, reps).items():
            rows[k][f"latency_b{batch}"] = times
    return rows


def report(trained: float, pruned: dict, int8: dict, dense_params: int) -> None:
    show("train: digits CNN (prunus generic trainer)", ["", "held-out accuracy", "params"],
         [["prunus", f"{trained:.4f}", f"{dense_params:,}"]], width=60)
    show("prune 50% of channels + fine-tune", ["", "accuracy", "params", "params / dense"],
         [[k, f"{v['accuracy']:.4f}", f"{v['params']:,}", f"{v['params'] / dense_params:.3f}"] for k, v in pruned.items()])
    show("int8 (ONNX Runtime, 1 thread)", ["", "accuracy", "graph bytes", "ms batch 1", "ms batch 64"],
         [[k, f"{v['accuracy']:.4f}", f"{v['bytes']:,}", ms(v["latency_b1"]), ms(v["latency_b64"])]
          for k, v in int8.items()])
    p, t = pruned["prunus"], pruned["torch-pruning"]
    a, b = int8["prunus int8"], int8["quantize_static int8"]
    med = lambda v: float(np.median(v))  # noqa: E731
    print(f"ratio prunus / torch-pruning: accuracy {p['accuracy'] / t['accuracy']:.3f}, params "
          f"{p['params'] / t['params']:.3f}")
    print(f"ratio prunus int8 / quantize_static: accuracy {a['accuracy'] / b['accuracy']:.3f}, latency batch 1 "
          f"{med(a['latency_b1']) / med(b['latency_b1']):.3f}, batch 64 {med(a['latency_b64']) / med(b['latency_b64']):.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps (batch 64)")
    parser.add_argument("--finetune-steps", type=int, default=100, help="fine-tune steps after pruning (batch 64)")
    parser.add_argument("--reps", type=int, default=200, help="latency repetitions per graph and batch size")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    from prunus.data.image_folder import image_folder_datasets

    print(machine_line())
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prunus-digits-") as tmp:
        tmp = Path(tmp)
        data = write_digits(tmp / "digits")
        train_xy, val_xy = (stacked(d) for d in image_folder_datasets(data, 0.1))
        model_dir = train(data, tmp / "run", args.steps)
        from prunus.models.model_dir import load_model

        dense = load_model(model_dir, trust_factory=True)
        trained, dense_params = accuracy_torch(dense, *val_xy), sum(p.numel() for p in dense.parameters())
        pruned = {"prunus": prune_prunus(model_dir, data, tmp / "pruned", args.finetune_steps),
                  "torch-pruning": prune_peer(model_dir, train_xy, val_xy, args.finetune_steps)}
        int8 = int8_rows(model_dir, data, tmp, train_xy, val_xy, args.reps)
    print(f"digits: {len(train_xy[0])} training, {len(val_xy[0])} held-out samples; {time.perf_counter() - t0:.0f} s")
    report(trained, pruned, int8, dense_params)
    if args.json:
        write_results(args.json, vars(args), {"train_accuracy": trained, "dense_params": dense_params,
                                              "prune": pruned, "int8": int8})


if __name__ == "__main__":
    main()
