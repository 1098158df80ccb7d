"""An EAGLE draft head: one decoder block that reads the target model's own last hidden state.

EAGLE (Li et al., 2024) drafts with the target's features rather than a second model's: at position ``t`` the draft
reads ``h_t``, the target's hidden state there, and the embedding of the token that follows, ``x_{t+1}``, and
predicts ``h_{t+1}`` and with it the token after, ``x_{t+2}``:

    x = fc(concat(h_t, embed(x_{t+1})))    # (2 dim) -> dim, no bias
    x = TransformerBlock(x)                 # one block of the target's own shape (prunus.models.llama), its own cache
    f = norm(x)                             # the draft's guess of h_{t+1}, in the space of the target's final norm
    logits = head(f)                        # the target's head rows of the ``vocab`` most frequent tokens (FR-Spec)

``h_t`` is the **output** of the target's final norm (the input of its output head): the vector the target's own
head reads, so the draft's ``f`` and the target's ``h`` are comparable (a regression loss trains ``f`` towards it)
and the frozen head rows score both alike; it is also of a fixed scale, which a pre-norm residual stream is not.
Drafting the second token on reads the draft's own ``f`` in place of the target's ``h``.

The head covers ``vocab`` tokens (``token_ids``: draft row -> full-vocabulary id, ranked by frequency in the
training corpus); a drafted token is always one of them, and the target checks it over its full vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .config import ModelConfig
from .llama import TransformerBlock, make_norm
from .rope import rope_tables


def block_config(target: ModelConfig) -> ModelConfig:
    """The draft block's config: the target's shape with one layer (and no experts, no sliding window)."""
    return dataclasses.replace(target, n_layers=1, n_experts=0, sliding_window=None, layer_types=None)


class EagleDraft(nn.Module):
    def __init__(self, target: ModelConfig, vocab: int):
        super().__init__()
        cfg = block_config(target)
        self.config, self.vocab = cfg, vocab
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = TransformerBlock(cfg, 0)
        self.norm = make_norm(cfg, cfg.dim)
        self.head = nn.Linear(cfg.dim, vocab, bias=False)
        self.register_buffer("token_ids", torch.arange(vocab, dtype=torch.long))
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, cache=None,
                positions: torch.Tensor | None = None, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, embeds (batch, seq, dim) -> (features (batch, seq, dim), logits over the draft vocabulary).
        ``cache``: any :class:`prunus.models.kv_cache.KVCacheProtocol` (layer id 0); ``positions`` as the target's;
        ``last_only``: the last position's features and logits only (drafting reads nothing else)."""
        x = self.fc(torch.cat([hidden, embeds], dim=-1))
        if positions is None:
            start = cache.seq_len if cache is not None else 0
            cos, sin = self.rope_cos[start:start + x.shape[1]], self.rope_sin[start:start + x.shape[1]]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            if cos.ndim == 2:
                cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        x = self.block(x, cos, sin, cache)
        if cache is not None:
            cache.advance(x.shape[1])
        features = self.norm(x[:, -1:] if last_only else x)
        return features, self.head(features)


def target_embeds(model, tokens: torch.Tensor) -> torch.Tensor:
    """The target's input embeddings of ``tokens``, scaled as its forward pass scales them."""
    h = model.tok_embeddings(tokens)
    if model.config.scale_embeddings:
        h = h * torch.tensor(model.config.dim ** 0.5).to(h.dtype).item()
    return h


FORMAT = "prunus-eagle-draft/1"
HIDDEN = "final_norm_output"  # which of the target's hidden states the draft reads (see the module docstring)


def save_eagle_draft(draft: EagleDraft, path, *, target, tokenizer, record: dict, metrics: dict,
                     overwrite: bool = False, command: str | None = None):
    """Write ``draft`` as a draft dir at ``path``, atomically: config.json (the block's config, the head's size, the
    target's content hash, ``record``: how it was trained), model.safetensors, the target's tokenizer files and the
    manifest, whose parent is the target model dir ``target``."""
    from pathlib import Path

    from safetensors.torch import save_file

    from prunus.artifacts.atomic import atomic_dir, atomic_write_json

    from .model_dir_manifest import CONFIG, WEIGHTS, parent_entry, write_manifest

    parent = parent_entry(target)
    with atomic_dir(Path(path), overwrite=overwrite) as tmp:
        config = {"format": FORMAT, "kind": "eagle_draft", "model": draft.config.to_dict(),
                  "eagle": {"vocab": draft.vocab, "target_vocab": draft.config.vocab_size, "hidden": HIDDEN,
                            "target_hash": parent["hash"], **record},
                  "tokenizer": tokenizer.spec()}
        atomic_write_json(tmp / CONFIG, config)
        state = {k: v.detach().contiguous() for k, v in draft.state_dict().items()}
        save_file(state, tmp / WEIGHTS, metadata={"format": "pt"})
        tokenizer.save(tmp)
        params = sum(p.numel() for p in draft.parameters())
        write_manifest(tmp, stage="eagle", parent_info=parent, command=command, metrics={"params": params, **metrics})
    return Path(path)


def is_eagle_draft(config: dict) -> bool:
    return config.get("kind") == "eagle_draft"


def load_eagle_draft(path, device="cpu") -> tuple[EagleDraft, dict]:
    """(the draft, its config.json) from a draft dir, every file checked against its manifest first."""
    from pathlib import Path

    from safetensors.torch import load_file

    from prunus.artifacts.errors import PrunusError

    from .model_dir_manifest import WEIGHTS, read_config_json, verify_model_dir

    path = Path(path)
    verify_model_dir(path)
    config = read_config_json(path)
    eagle = config.get("eagle")
    if config.get("format") != FORMAT or not isinstance(eagle, dict) or not isinstance(eagle.get("vocab"), int):
        raise PrunusError(f"{path}: not an EAGLE draft dir (config.json format {config.get('format')!r}); "
                          "write one with prunus compress TARGET --distill eagle")
    cfg = ModelConfig.from_dict(config["model"], source=f"{path}/config.json")
    if not 1 <= eagle["vocab"] <= cfg.vocab_size:
        raise PrunusError(f"{path}: eagle.vocab {eagle['vocab']} is not within 1..{cfg.vocab_size}; re-create the draft")
    draft = EagleDraft(cfg, eagle["vocab"])
    state = load_file(path / WEIGHTS)
    try:
        draft.load_state_dict(state)
    except RuntimeError as e:
        raise PrunusError(f"{path}/{WEIGHTS}: does not fit its config.json ({str(e).splitlines()[0][:160]}); "
                          "re-create the draft") from None
    ids = draft.token_ids
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise PrunusError(f"{path}: token_ids outside the vocabulary of {cfg.vocab_size}; re-create the draft")
    return draft.to(device).eval(), config
