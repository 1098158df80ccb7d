"""The four model kinds and their data, shared by :mod:`benchmarks.prune_vs_torch_pruning` and
:mod:`benchmarks.int8_vs_quantize_static`: a ViT-like classifier (``nn.MultiheadAttention`` blocks) on scikit-learn's
``load_digits``, an ``nn.TransformerEncoder`` over tokens on a synthetic sequence task, a 1-D CNN regressing a
property of synthetic signals, and an MLP regressor on ``load_diabetes``. Every data set is written as an ``.npz``
table, so prunus reads it through its own ``--data FILE?...`` path and the peers get the very same split (the
table's seeded permutation, 10% held out). No download: both scikit-learn sets ship inside the package."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm attention + MLP block over ``(N, T, width)`` tokens."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class DigitsViT(nn.Module):
    """8 x 8 digits -> 16 patches of 2 x 2 -> ``depth`` blocks -> mean-pooled tokens -> classes."""

    def __init__(self, width: int = 48, heads: int = 4, depth: int = 2, classes: int = 10):
        super().__init__()
        self.patch, self.pos = nn.Conv2d(1, width, 2, 2), nn.Embedding(16, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, x):
        t = self.patch(x.unsqueeze(1)).flatten(2).transpose(1, 2)
        t = self.blocks(t + self.pos(torch.arange(16, device=x.device)))
        return self.head(self.norm(t).mean(1))


class TokenEncoder(nn.Module):
    """Token ids -> embeddings + positions -> ``nn.TransformerEncoder`` -> mean-pooled -> classes."""

    def __init__(self, vocab: int = 12, length: int = 16, width: int = 48, heads: int = 4, depth: int = 2,
                 classes: int = 3):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, width), nn.Embedding(length, width)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.emb(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.head(self.enc(h).mean(1))


def signal_cnn(width: int = 32) -> nn.Module:
    """1-D CNN over ``(N, T)`` signals -> one value."""
    def unit(cin, cout, stride=1):
        return [nn.Conv1d(cin, cout, 5, stride, padding=2, bias=False), nn.BatchNorm1d(cout), nn.ReLU()]

    return nn.Sequential(nn.Unflatten(1, (1, -1)), *unit(1, width), *unit(width, 2 * width, 2),
                         *unit(2 * width, 2 * width, 2), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                         nn.Linear(2 * width, 1))


def diabetes_mlp(inputs: int = 10, hidden: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 1))


def digits_vit(**kw) -> nn.Module:
    return DigitsViT(**kw)


def token_encoder(**kw) -> nn.Module:
    return TokenEncoder(**kw)


# --- data: each an .npz table -------------------------------------------------------------------------------------

def write_digits(path: Path) -> Path:
    from sklearn.datasets import load_digits

    d = load_digits()
    np.savez(path, x=(d.images / 16.0).astype(np.float32), y=d.target.astype(np.int64))
    return path


def write_tokens(path: Path, n: int = 3000, length: int = 16, vocab: int = 12, seed: int = 0) -> Path:
    """Which of the tokens 0, 1 and 2 a sequence holds most often (ties: the smaller)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, (n, length))
    counts = np.stack([(x == t).sum(1) for t in range(3)], 1)
    np.savez(path, x=x.astype(np.int64), y=counts.argmax(1).astype(np.int64))
    return path


def write_signals(path: Path, n: int = 3000, length: int = 64, seed: int = 0) -> Path:
    """A sum of two noisy sines; the target is the first one's frequency (standardised)."""
    rng = np.random.default_rng(seed)
    t = np.arange(length)[None] / length
    f1, f2 = rng.uniform(1, 8, (n, 1)), rng.uniform(8, 16, (n, 1))
    x = np.sin(2 * np.pi * f1 * t + rng.uniform(0, 6.3, (n, 1))) + 0.5 * np.sin(2 * np.pi * f2 * t)
    x += 0.2 * rng.standard_normal((n, length))
    y = (f1[:, 0] - 4.5) / 2.0
    np.savez(path, x=x.astype(np.float32), y=y.astype(np.float32))
    return path


def write_diabetes(path: Path) -> Path:
    from sklearn.datasets import load_diabetes

    d = load_diabetes()
    x = (d.data - d.data.mean(0)) / d.data.std(0)
    np.savez(path, x=x.astype(np.float32), y=((d.target - d.target.mean()) / d.target.std()).astype(np.float32))
    return path


@dataclass(frozen=True)
class Kind:
    """One model kind of the benchmarks: its factory, data, task, training steps and metric."""

    name: str
    spec: str
    write: object
    task: str
    steps: int
    lr: float = 2e-3

    @property
    def metric(self) -> str:
        return "accuracy" if self.task == "classification" else "MSE"

    def data(self, root: Path) -> str:
        return str(self.write(root / f"{self.name}.npz"))


HERE = "benchmarks._prune_models"
KINDS = (Kind("vit-digits", f"{HERE}:digits_vit", write_digits, "classification", 600),
         Kind("token-transformer", f"{HERE}:token_encoder", write_tokens, "classification", 600),
         Kind("cnn1d-signals", f"{HERE}:signal_cnn", write_signals, "regression", 500),
         Kind("mlp-diabetes", f"{HERE}:diabetes_mlp", write_diabetes, "regression", 300, 1e-3))


def stacked(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(xs), torch.stack(ys)


def metric(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str) -> float:
    """Held-out accuracy (classification) or mean squared error (regression) of ``model``."""
    with torch.no_grad():
        out = model.eval()(x)
    if task == "classification":
        return float((out.argmax(-1) == y).float().mean())
    return float(nn.functional.mse_loss(out.float(), y.reshape(out.shape).float()))


def train(kind: Kind, data: str, out: Path, seed: int = 0) -> Path:
    """``kind``'s module trained by prunus's generic trainer; its model dir."""
    from prunus.data.module_datasets import module_datasets
    from prunus.train_parallel.module_config import ModuleTrainConfig
    from prunus.train_parallel.module_trainer import train_module

    tr, val = module_datasets(data, task=kind.task)
    cfg = ModuleTrainConfig(out=str(out), task=kind.task, batch_size=64, steps=kind.steps, lr=kind.lr,
                            min_lr=kind.lr / 10, warmup_steps=30, eval_every=kind.steps, ckpt_every=0,
                            progress=False, device="cpu", seed=seed)
    return train_module(kind.spec, tr, kind.task, cfg, val_dataset=val).model_dir
