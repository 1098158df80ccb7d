"""What every compression pass is given: the input model, data and a way to score.

A pass is a function ``(model, ctx, **args) -> model``. The context holds what
passes need beyond the model itself, built once per ``prunus compress`` run:

* ``teacher``: the model the run started from (frozen, eval mode), for
  distillation and for greedy-agreement in the report;
* calibration batches drawn from the corpus's training split, the same for every
  pass and every run with the same seed;
* held-out tokens and the tokenizer's byte lengths, for bits per byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from prunus.data.batches import get_batch
from prunus.data.corpus import load_corpus
from prunus.data.evaluate import evaluate
from prunus.models import load_model, load_model_tokenizer


@dataclass
class PassContext:
    teacher: torch.nn.Module
    tokenizer: object
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    token_bytes: torch.Tensor
    seq_len: int
    seed: int = 0
    device: str = "cpu"
    eval_tokens: int = 65536  # held-out tokens scored per report row
    source: Path | None = None  # the input model dir, when there is one
    data: str | None = None  # the corpus spec, passed on to distillation runs
    _calibration: dict = field(default_factory=dict, repr=False)

    def calibration(self, n_batches: int = 8, batch_size: int = 4, seq_len: int | None = None) -> list[torch.Tensor]:
        """``n_batches`` token batches (batch_size, seq_len) from the training split; cached."""
        seq_len = min(seq_len or self.seq_len, len(self.train_tokens) - 1)
        key = (n_batches, batch_size, seq_len)
        if key not in self._calibration:
            self._calibration[key] = [
                get_batch(self.train_tokens, seed=self.seed + 7919, step=i, micro_batch=batch_size, seq_len=seq_len)[0]
                for i in range(n_batches)
            ]
        return self._calibration[key]

    def evaluate(self, model, max_tokens: int | None = None) -> dict:
        """val_loss, val_bpb and val_tokens of ``model`` on the held-out split."""
        return evaluate(model, self.val_tokens, self.token_bytes, seq_len=self.seq_len, batch_size=8,
                        max_tokens=max_tokens or self.eval_tokens, device=self.device)


def build_context(model_dir: str | Path, *, data: str | None = None, seq_len: int | None = None, seed: int = 0,
                  max_corpus_bytes: int | None = 16 << 20, eval_tokens: int = 65536, device: str = "cpu") -> PassContext:
    """The context for compressing ``model_dir`` on ``data`` (default: the built-in corpus)."""
    teacher = load_model(model_dir, device=device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    tokenizer = load_model_tokenizer(model_dir)
    corpus = load_corpus(data, tokenizer, max_bytes=max_corpus_bytes, vocab_size=teacher.config.vocab_size)
    limit = teacher.config.max_seq_len
    return PassContext(
        teacher=teacher, tokenizer=tokenizer, train_tokens=corpus.train, val_tokens=corpus.val,
        token_bytes=tokenizer.token_bytes(), seq_len=min(seq_len or limit, limit), seed=seed, device=device,
        eval_tokens=eval_tokens, source=Path(model_dir), data=data,
    )
