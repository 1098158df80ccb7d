"""Run an export's prefill and decode graphs in ONNX Runtime: logits, and greedy generation with the KV cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prunus.runtime.ort_session import ort_session

from .graphs import graph_names


class OrtGraphs:
    """The two graphs of an export in ONNX Runtime sessions; tensors in and out are torch tensors."""

    def __init__(self, prefill: str | Path, decode: str | Path, n_layers: int, threads: int | None = None,
                 spinning: bool = True, config: dict | None = None):
        self.prefill_session = ort_session(prefill, threads, spinning, config)
        self.decode_session = ort_session(decode, threads, spinning, config)
        self.names = graph_names(n_layers)

    def _run(self, session, inputs: list) -> tuple[torch.Tensor, list[np.ndarray]]:
        names = [i.name for i in session.get_inputs()]
        feeds = {n: (x.numpy() if isinstance(x, torch.Tensor) else x) for n, x in zip(names, inputs)}
        out = session.run(self.names["outputs"], feeds)
        return torch.from_numpy(out[0]).float(), out[1:]

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        return self._run(self.prefill_session, [ids.long(), positions.long(), mask.long()])

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, past: list[np.ndarray]):
        return self._run(self.decode_session, [ids.long(), positions.long(), mask.long(), *past])

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) -> logits, like the PyTorch model without a cache."""
        b, s = tokens.shape
        return self.prefill(tokens, torch.arange(s).expand(b, s), torch.ones(b, s, dtype=torch.long))[0]

    def greedy(self, prompt: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
               follow: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, prompt_len) left-padded prompts -> (batch, max_new_tokens) greedy tokens, with the KV cache.
        ``follow`` (batch, max_new_tokens): feed these tokens instead of the argmaxes (teacher forcing through the
        cache); the argmax of every step is still returned."""
        b, s = prompt.shape
        mask = torch.ones(b, s, dtype=torch.long) if attention_mask is None else attention_mask.long()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits, past = self.prefill(prompt, positions, mask)
        nxt = positions[:, -1:] + 1
        out = []
        for i in range(max_new_tokens):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out.append(tok)
            if i + 1 == max_new_tokens:
                break
            if follow is not None:
                tok = follow[:, i:i + 1].long()
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
            logits, past = self.decode(tok, nxt, mask, past)
            nxt = nxt + 1
        return torch.cat(out, dim=1)
