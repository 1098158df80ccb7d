"""What every compression pass is given: the input model, data and a way to score.

A pass is a function ``(model, ctx, **args) -> model`` that returns the model it made
(the same module when it changed it in place, a new one when it rebuilt it; the runner
goes on with what it returns) and records what it did in the model's CompressionState
(``prunus.models.compression_state``), which travels with the model into config.json.
The context holds what passes need beyond the model itself, built once per
``prunus compress`` run:

* ``teacher``: the model the run started from (frozen, eval mode), for
  distillation and for greedy-agreement in the report;
* calibration batches drawn from the corpus's training split, the same for every
  pass and every run with the same seed (windows of at most ``CALIBRATION_WINDOW``
  tokens, so a long-context model calibrates in bounded time and memory);
* held-out tokens and the tokenizer's byte lengths, for bits per byte, scored by
  ``prunus.data.evaluate`` on the same slice as ``prunus eval`` (windows of ``seq_len``);
* notes: one line per fact a pass wants in the report (what it actually removed, say).

With no corpus given, a model with a pretrained tokenizer is calibrated and scored on
English prose, a byte-level one on the built-in corpus (``prunus.data.default_data``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from prunus.data.batches import get_batch
from prunus.data.corpus import default_data, load_corpus
from prunus.data.evaluate import DEFAULT_EVAL_TOKENS, default_seq_len, evaluate
from prunus.artifacts.errors import PrunusError
from prunus.models import load_model, load_model_tokenizer

CALIBRATION_WINDOW = 512  # tokens per calibration row at most
CALIBRATION_ROW_TOKENS = 1024  # rows x window per calibration batch, beyond 4 rows of a short window


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
    eval_tokens: int = DEFAULT_EVAL_TOKENS  # held-out tokens scored per report row
    source: Path | None = None  # the input model dir, when there is one
    data: str | None = None  # the corpus spec, passed on to distillation runs
    corpus_name: str = ""
    notes: list[str] = field(default_factory=list)  # lines for the report of the pass running now
    _calibration: dict = field(default_factory=dict, repr=False)

    def calibration_shape(self, batch_size: int | None = None, seq_len: int | None = None) -> tuple[int, int]:
        """(rows, window) of a calibration batch: a window of at most CALIBRATION_WINDOW tokens,
        4 rows while they hold at most CALIBRATION_ROW_TOKENS tokens (fewer for longer windows)."""
        seq_len = min(seq_len or min(self.seq_len, CALIBRATION_WINDOW), len(self.train_tokens) - 1)
        if batch_size is None:
            batch_size = 4 if 4 * seq_len <= CALIBRATION_ROW_TOKENS else max(1, CALIBRATION_ROW_TOKENS // seq_len)
        return batch_size, seq_len

    def calibration(self, n_batches: int = 8, batch_size: int | None = None, seq_len: int | None = None) -> list[torch.Tensor]:
        """``n_batches`` token batches (rows, window) from the training split (see calibration_shape); cached."""
        batch_size, seq_len = self.calibration_shape(batch_size, seq_len)
        key = (n_batches, batch_size, seq_len)
        if key not in self._calibration:
            self._calibration[key] = [
                get_batch(self.train_tokens, seed=self.seed + 7919, step=i, micro_batch=batch_size, seq_len=seq_len)[0]
                for i in range(n_batches)
            ]
        return self._calibration[key]

    def evaluate(self, model, max_tokens: int | None = None) -> dict:
        """val_loss, val_bpb, val_tokens and seq_len of ``model`` on the held-out slice."""
        return evaluate(model, self.val_tokens, self.token_bytes, seq_len=self.seq_len,
                        max_tokens=max_tokens or self.eval_tokens, device=self.device)

    def note(self, line: str) -> None:
        """Add a line to the report of the pass running now."""
        self.notes.append(line)

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes


def build_context(model_dir: str | Path, *, data: str | None = None, seq_len: int | None = None, seed: int = 0,
                  max_corpus_bytes: int | None = 16 << 20, eval_tokens: int = DEFAULT_EVAL_TOKENS,
                  device: str = "cpu") -> PassContext:
    """The context for compressing ``model_dir`` on ``data`` (default: ``prunus.data.default_data``);
    ``seq_len`` is the evaluation window (default: the model's context, at most 1,024 tokens)."""
    teacher = load_model(model_dir, device=device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    limit = teacher.config.max_seq_len
    if seq_len is not None and not 1 <= seq_len <= limit:
        raise PrunusError(f"--seq-len {seq_len}: must be between 1 and the model's max_seq_len {limit}")
    if eval_tokens is not None and eval_tokens < 1:
        raise PrunusError(f"--eval-tokens {eval_tokens} must be at least 1")
    tokenizer = load_model_tokenizer(model_dir)
    data = default_data(data, tokenizer)
    corpus = load_corpus(data, tokenizer, max_bytes=max_corpus_bytes, vocab_size=teacher.config.vocab_size)
    return PassContext(
        teacher=teacher, tokenizer=tokenizer, train_tokens=corpus.train, val_tokens=corpus.val,
        token_bytes=tokenizer.token_bytes(), seq_len=seq_len or default_seq_len(limit), seed=seed, device=device,
        eval_tokens=eval_tokens, source=Path(model_dir), data=data, corpus_name=corpus.name,
    )
