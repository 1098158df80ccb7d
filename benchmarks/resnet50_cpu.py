"""ResNet-50 at 224 x 224 on the CPU: torch eager, ONNX Runtime fp32 and ONNX Runtime int8, both graphs written
by prunus's export path.

The model is the standard ResNet-50 (torchvision's architecture, written here: :func:`resnet50`; Bottleneck
blocks [3, 4, 6, 3], stride on the 3 x 3 convolution, 7 x 7 stem and max-pool) with random weights: the figures
are speed, not accuracy. It is saved as a generic model dir and exported with ``export_model`` at fp32 and at
int8 (static, calibrated on the seeded random inputs of the recorded shape, prunus's default without data).

Images/s at batch 1 and 32 with 1 and 2 threads (``torch.set_num_threads`` / ONNX Runtime's intra-op threads),
the contenders alternating within each setting, and the ratio int8 / fp32 of ONNX Runtime.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.resnet50_cpu [--reps-b1 10] [--reps-b32 3] [--json F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import torch
from torch import nn

from benchmarks.harness import alternating_samples, machine_line, show, write_results

SPEC = "benchmarks.resnet50_cpu:resnet50"


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        cin, stages = 64, []
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            layer = []
            for i in range(blocks):
                layer.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(classes: int = 1000) -> nn.Module:
    return ResNet50(classes)


def export_graphs(tmp: Path) -> tuple[nn.Module, dict[str, Path], dict]:
    """The module (seeded random weights), its fp32 and int8 ONNX graphs by prunus's export, their parity reports."""
    from prunus.export import export_model
    from prunus.models.module_dir import input_spec, save_module
    from prunus.models.module_factory import ModuleFactory

    torch.manual_seed(0)
    module = resnet50().eval()
    save_module(module, tmp / "model", stage="train", factory=ModuleFactory(SPEC, {}), task="classification",
                input=input_spec(torch.zeros(3, 224, 224)))
    graphs, parity = {}, {}
    for precision in ("fp32", "int8"):
        t0 = time.perf_counter()
        result = export_model(tmp / "model", tmp / precision, precision=precision, trust_factory=True,
                              progress=False, verify=False)
        graphs[precision] = tmp / precision / "model.onnx"
        parity[precision] = {**{k: v for k, v in result.parity.items() if not isinstance(v, (dict, list))},
                             "export_s": round(time.perf_counter() - t0, 1)}
    return module, graphs, parity


def contenders(module: nn.Module, graphs: dict[str, Path], x: torch.Tensor, threads: int) -> dict:
    import onnxruntime as ort

    def session(path: Path):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        s = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        return lambda: s.run(None, {s.get_inputs()[0].name: x.numpy()})

    def eager():
        torch.set_num_threads(threads)
        with torch.inference_mode():
            module(x)

    return {"torch eager fp32": eager, "ORT fp32": session(graphs["fp32"]), "ORT int8": session(graphs["int8"])}


def measure(module, graphs, batches, threads, reps) -> dict:
    """{(batch, threads): {contender: seconds per call}}."""
    out = {}
    for b in batches:
        x = torch.randn(b, 3, 224, 224, generator=torch.Generator().manual_seed(b))
        for t in threads:
            out[(b, t)] = alternating_samples(contenders(module, graphs, x, t), reps[b])
            torch.set_num_threads(max(threads))
            print(f"batch {b}, {t} threads: " + ", ".join(f"{k} {b / statistics.median(v):.2f} images/s"
                                                          for k, v in out[(b, t)].items()), flush=True)
    return out


def report(times: dict, reps: dict) -> None:
    rows = []
    for (b, t), got in times.items():
        ips = {k: b / statistics.median(v) for k, v in got.items()}
        rows.append([str(b), str(t), str(reps[b])] + [f"{ips[k]:.1f}" for k in got]
                    + [f"{ips['ORT int8'] / ips['ORT fp32']:.2f}", f"{ips['ORT fp32'] / ips['torch eager fp32']:.2f}"])
    names = list(next(iter(times.values())))
    show("ResNet-50 224x224, random weights: images/s (median)", ["batch", "threads", "reps"] + names
         + ["int8 / fp32 (ORT)", "ORT fp32 / eager"], rows, width=140)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps-b1", type=int, default=10, help="timed calls per contender at batch 1")
    parser.add_argument("--reps-b32", type=int, default=3, help="timed calls per contender at batch 32")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    reps = {1: args.reps_b1, 32: args.reps_b32}
    print(machine_line())
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="prunus-resnet50-") as tmp:
        module, graphs, parity = export_graphs(Path(tmp))
        print(f"export: {parity}", flush=True)
        times = measure(module, graphs, [1, 32], threads, reps)
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; one warm-up call per contender "
          "and setting, then the timed calls alternating")
    report(times, reps)
    if args.json:
        write_results(args.json, vars(args), {f"b{b}_t{t}": v for (b, t), v in times.items()}, parity=parity)


if __name__ == "__main__":
    main()
