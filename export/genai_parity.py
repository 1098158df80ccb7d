"""A genai export's graph in ONNX Runtime as the parity check sees it (:mod:`prunus.export.parity`): every
position's logits through the same graph with its last-token gather bypassed, and greedy generation through the
written graph itself in a :class:`prunus.runtime.genai_session.GenaiSession` (the counterpart of
:class:`prunus.export.ort_graphs.OrtGraphs` for the torch graphs). The native kernels are checked through the
backend that serves them instead (:mod:`prunus.export.backend_parity`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prunus.runtime.genai_session import GenaiSession
from prunus.runtime.ort_session import variant_session


class GenaiGraphs:
    """A genai export's graph for the parity check: ``graphs(tokens)`` -> every position's logits and
    ``graphs.greedy(prompts, n)``, as :class:`prunus.export.ort_graphs.OrtGraphs` offers for the torch graphs."""

    def __init__(self, path: str | Path, dims: dict, threads: int | None = None, config: dict | None = None):
        import onnx

        from .genai_graph import all_positions_graph

        self.path, self.dims, self.threads, self.config = Path(path), dims, threads, config
        proto = onnx.load(str(path), load_external_data=False)
        self.all_positions = variant_session(self.path, all_positions_graph(proto), "all_positions", threads,
                                             config=config)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab), like the PyTorch model without a cache."""
        b, s = tokens.shape
        d = self.dims
        feeds = {"input_ids": tokens.long().numpy(), "seqlens_k": np.full(b, s - 1, np.int32),
                 "total_sequence_length": np.array(s, np.int32)}
        for i in range(d["n_layers"]):
            for t in ("key", "value"):
                feeds[f"past.{i}.{t}"] = np.zeros((b, d["n_kv_heads"], s, d["head_dim"]), np.float32)
        return torch.from_numpy(self.all_positions.run(["logits"], feeds)[0])

    def greedy(self, prompt: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
               follow: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, prompt_len) prompts -> (batch, max_new_tokens) greedy tokens through the written graph, its KV
        buffer shared between passes. ``attention_mask`` (1 = real token) trims left padding off each prompt.
        ``follow`` (batch, max_new_tokens): feed these tokens instead of the argmaxes (teacher forcing through the
        cache); the argmax of every step is still returned."""
        b, s = prompt.shape
        rows = [p.tolist() if attention_mask is None else p[attention_mask[i].bool()].tolist()
                for i, p in enumerate(prompt)]
        sess = GenaiSession(self.path, **self.dims, n_slots=b, max_len=s + max_new_tokens, threads=self.threads,
                            config=self.config)
        lengths = np.array([len(r) for r in rows], np.int64)
        logits = sess.prefill(0, rows)
        out = []
        for i in range(max_new_tokens):
            tok = logits.argmax(-1)
            out.append(torch.from_numpy(tok.astype(np.int64)))
            if i + 1 == max_new_tokens:
                break
            if follow is not None:
                tok = follow[:, i].numpy().astype(tok.dtype)
            logits = sess.decode(lengths, tok)
            lengths += 1
        sess.close()
        return torch.stack(out, dim=1)
