"""The model the serving-feature benchmarks run: SmolLM2-135M as a prunus model dir where one is given or found at
``/tmp/smol/model-dir``, else a random model of that shape (said so in the output)."""

from __future__ import annotations

import tempfile
from pathlib import Path

SMOL_DIR = Path("/tmp/smol/model-dir")


def smol_model_dir(given: str | None, max_seq_len: int = 2048) -> tuple[Path, str]:
    """(a model dir, what it is in words)."""
    if given:
        return Path(given), given
    if (SMOL_DIR / "config.json").is_file():
        return SMOL_DIR, f"SmolLM2-135M ({SMOL_DIR})"
    import torch

    from prunus.models import ModelConfig, Transformer, save_model

    torch.manual_seed(0)
    cfg = ModelConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, vocab_size=49152,
                      max_seq_len=max_seq_len, head_dim=64, tie_embeddings=True, rope_theta=100000.0)
    model = Transformer(cfg)
    model.init_weights()
    out = Path(tempfile.mkdtemp(prefix="prunus-smol-shape-")) / "model"
    save_model(model.eval(), out, stage="benchmark")
    return out, "a random model of SmolLM2-135M's shape (no /tmp/smol/model-dir here)"


def text_ids(tokenizer, n: int, source: str = "text") -> list[int]:
    """``n`` token ids of real text: Python's own source files (the built-in corpus), repeated if need be."""
    import inspect
    import json

    text = inspect.getsource(json) if source == "text" else source
    ids = tokenizer.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]
