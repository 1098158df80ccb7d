"""Data-parallel training on the CPU: prunus's generic trainer under DDP x 2 (gloo) beside the hand-written loop
every tutorial shows (``DistributedSampler`` + ``DataLoader`` + ``DistributedDataParallel`` + SGD), with the same
model, data and global batch; and the data readers' images/s beside the model's step, to show which bounds.

Models: a two-Linear classifier (64 -> 256 -> 10) and a small CNN (conv-BN-ReLU x 2, pool, Linear; 3 x 32 x 32).
Data: prunus's seeded synthetic classification set (map-style, in memory), read by both. Both runs go through
torchrun (``--standalone``, 2 ranks, one thread each). Throughput is the global batch times the steps after
``--warmup`` over the wall time between the end of the warm-up and the end of the last step, data waits
included. prunus uses its defaults (DDP, AdamW, gradient clipping at 1.0, a metrics record per step, the losses
averaged over the ranks every ``log_every`` steps); the hand-written loop uses SGD and records nothing: that
work is part of what is compared. A third row runs the hand-written loop with prunus's optimizer (AdamW, clipping
at 1.0), so what is left between it and prunus is the trainer's own work. ``--zero3`` adds prunus with ``zero=3`` (FSDP2, the whole module one unit),
the layout prunus chose by default before DDP, for the record.

Data readers: an image folder of 32 x 32 PNGs and the same samples as tar shards (``write_shards``), read in
batches of the global batch with 0 and 2 DataLoader workers (images/s).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.ddp_vs_handwritten [--steps 60] [--zero3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import torch
from torch import nn

from benchmarks.harness import machine_line, show, write_results

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"two_linear": ("benchmarks.ddp_vs_handwritten:two_linear", "synthetic:classification?n=4096&shape=64&classes=10"),
          "small_cnn": ("benchmarks.ddp_vs_handwritten:small_cnn",
                        "synthetic:classification?n=2048&shape=3x32x32&classes=10")}


def two_linear(d_in: int = 64, hidden: int = 256, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def small_cnn(width: int = 16, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
                         nn.BatchNorm2d(2 * width), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(2 * width, classes))


# --- the two contenders, each run in every rank -----------------------------------------------------------------

def rate(ends: list[float], warmup: int, batch: int) -> float:
    """Samples/s over the steps after ``warmup`` (``ends``: the time each step ended)."""
    return batch * (len(ends) - 1 - warmup) / (ends[-1] - ends[warmup])


def run_prunus(model: str, steps: int, batch: int, out: Path, zero: int | None = None) -> list[float]:
    from prunus.data.synthetic import synthetic_datasets
    from prunus.train_parallel import module_trainer
    from prunus.train_parallel.module_config import ModuleTrainConfig

    ends, step = [], module_trainer.ModuleTrainer.train_step

    def timed(self, *a, **k):
        record = step(self, *a, **k)
        ends.append(time.perf_counter())
        return record

    module_trainer.ModuleTrainer.train_step = timed
    spec, data = MODELS[model]
    cfg = ModuleTrainConfig(out=str(out), batch_size=batch, steps=steps, lr=1e-3, warmup_steps=0, eval_every=steps,
                            ckpt_every=0, progress=False, device="cpu", zero=zero)
    module_trainer.train_module(spec, synthetic_datasets(data)[0], "classification", cfg)
    return ends


def _optimizer(net, like_prunus: bool):
    """SGD with momentum (the textbook's), or prunus's defaults: AdamW (2e-3, betas 0.9 / 0.95, weight decay 0.1 on
    parameters of 2 or more dimensions) with the gradients' global norm clipped at 1.0 (no schedule: a scalar)."""
    if not like_prunus:
        return torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
    params = [p for p in net.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=2e-3, betas=(0.9, 0.95))


def run_handwritten(model: str, steps: int, batch: int, like_prunus: bool = False) -> list[float]:
    """The textbook loop: DistributedSampler, DataLoader, DistributedDataParallel, SGD (``like_prunus``: AdamW and
    gradient clipping as prunus runs them, so the difference left is the trainer's own work)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from prunus.data.synthetic import synthetic_datasets
    from prunus.models.module_factory import build_module

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    spec, data = MODELS[model]
    dataset = synthetic_datasets(data)[0]
    net = DistributedDataParallel(build_module(spec, {}))
    opt = _optimizer(net, like_prunus)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch // dist.get_world_size(), sampler=sampler, drop_last=True)
    ends, epoch = [], 0
    while len(ends) < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            if like_prunus:
                nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            ends.append(time.perf_counter())
            if len(ends) == steps:
                break
        epoch += 1
    dist.destroy_process_group()
    return ends


def worker(mode: str, model: str, steps: int, batch: int, out: str) -> None:
    if mode.startswith("handwritten"):
        ends = run_handwritten(model, steps, batch, like_prunus=mode == "handwritten-adamw")
    else:
        ends = run_prunus(model, steps, batch, Path(out).with_suffix(".run"), 3 if mode == "prunus-zero3" else None)
    if os.environ.get("RANK", "0") == "0":
        Path(out).write_text(json.dumps(ends))


def launch(mode: str, model: str, steps: int, batch: int, tmp: Path) -> list[float]:
    """``worker`` in 2 ranks under torchrun (one thread each); rank 0's step end times."""
    out = tmp / f"{mode}_{model}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "benchmarks.ddp_vs_handwritten", "--worker", mode, model, str(steps), str(batch), str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if run.returncode != 0:
        raise SystemExit(f"{mode} {model}: exit {run.returncode}\n{run.stderr[-3000:]}")
    return json.loads(out.read_text())


# --- the data readers ---------------------------------------------------------------------------------------------

def write_images(root: Path, n: int) -> Path:
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        (root / str(i % 10)).mkdir(parents=True, exist_ok=True)
        pixels = torch.randint(0, 256, (32, 32, 3), generator=gen, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(root / str(i % 10) / f"{i:05d}.png")
    return root


def reader_rates(tmp: Path, n: int, batch: int, workers: tuple[int, ...]) -> dict:
    """{reader: images/s} of the image folder (DataLoader) and the tar shards (prunus's stream)."""
    from torch.utils.data import DataLoader

    from prunus.data.global_batches import step_batches
    from prunus.data.module_datasets import module_datasets
    from prunus.data.write_shards import write_shards

    folder = write_images(tmp / "images", n)
    write_shards(folder, tmp / "shards", per_shard=max(1, n // 8))
    rates = {}
    for w in workers:
        train = module_datasets(str(folder))[0]
        t0 = time.perf_counter()
        seen = sum(len(y) for _, y in DataLoader(train, batch_size=batch, shuffle=True, num_workers=w))
        rates[f"image folder (PNG), {w} workers"] = seen / (time.perf_counter() - t0)
        stream = module_datasets(str(tmp / "shards"))[0]
        batches = step_batches(stream, batch, seed=0, workers=w)
        steps = len(stream) // batch
        t0 = time.perf_counter()
        seen = sum(len(batches.batch(s)[1]) for s in range(steps))
        rates[f"tar shards (PNG), {w} workers"] = seen / (time.perf_counter() - t0)
    return rates


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, mode, model, steps, batch, out = sys.argv[1:7]
        return worker(mode, model, int(steps), int(batch), out)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the rate")
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over the 2 ranks)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each contender, alternating")
    parser.add_argument("--images", type=int, default=1024, help="images written for the reader figures")
    parser.add_argument("--zero3", action="store_true", help="add prunus with zero=3 (FSDP2) as a third row")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    print(machine_line())
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="prunus-ddp-") as tmp:
        tmp = Path(tmp)
        for model in MODELS:
            labels = {"prunus": "prunus DDP x2", "handwritten": "hand-written DDP x2",
                      "handwritten-adamw": "hand-written DDP x2, AdamW + clipping"}
            if args.zero3:
                labels["prunus-zero3"] = "prunus FSDP2 (zero=3) x2"
            got = {label: [] for label in labels.values()}
            for r in range(args.rounds):
                order = list(labels) if r % 2 == 0 else list(labels)[::-1]
                (tmp / f"r{r}").mkdir(exist_ok=True)
                for mode in order:
                    ends = launch(mode, model, args.steps, args.batch, tmp / f"r{r}")
                    got[labels[mode]].append(rate(ends, args.warmup, args.batch))
            results[model] = got
        results["readers"] = reader_rates(tmp, args.images, args.batch, (0, 2))
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    report(results, args)
    if args.json:
        write_results(args.json, vars(args), results)


def report(results: dict, args) -> None:
    import statistics

    rows = []
    for model in MODELS:
        got = results[model]
        a, b, c, *z3 = (statistics.median(v) for v in got.values())
        rows.append([model] + [" / ".join(f"{x:,.0f}" for x in v) for v in got.values()]
                    + [f"{a / b:.3f}", f"{a / c:.3f}"] + [f"{z / b:.3f}" for z in z3])
    labels = list(results[next(iter(MODELS))])
    show(f"samples/s, global batch {args.batch}, 2 ranks x 1 thread, gloo ({args.rounds} runs each of "
         f"{args.steps} steps, first {args.warmup} left out)",
         ["model", *labels, "prunus DDP / hand-written SGD", "prunus DDP / hand-written AdamW + clipping"]
         + (["FSDP2 / hand-written SGD"] if len(labels) > 3 else []), rows, width=160)
    cnn = statistics.median(results["small_cnn"]["prunus DDP x2"])
    show(f"data readers, images/s (batch {args.batch}, one process) beside the small CNN's training step",
         ["reader", "images/s", "reader / CNN step"],
         [[k, f"{v:,.0f}", f"{v / cnn:.2f}"] for k, v in results["readers"].items()]
         + [["small CNN, prunus DDP x2 step", f"{cnn:,.0f}", "1.00"]])


if __name__ == "__main__":
    main()
