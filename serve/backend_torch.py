"""The PyTorch backend: a model, its ragged batch KV cache, prefill and decode passes.

Every backend answers the same two calls, which is all the scheduler needs:

* ``prefill(rows, prompts)`` starts each row afresh with its prompt (token id lists of
  any lengths, right-padded into one pass) and returns the logits of each prompt's
  last token, (batch, vocab) float32 on the CPU;
* ``decode(rows, tokens)`` appends one token per row and returns the next logits.

Under tensor parallelism each worker runs this same backend over its shard.
"""

from __future__ import annotations

import torch

from .batch_cache import BatchKVCache


class TorchBackend:
    name = "torch"

    def __init__(self, model, n_slots: int, max_len: int, compile: bool = False):
        self.model = model
        self.n_slots, self.max_len = n_slots, max_len
        self.vocab_size = model.config.vocab_size
        self.device = getattr(model, "input_device", None) or model.tok_embeddings.weight.device  # a device map's
        self.cache = BatchKVCache.for_model(model, n_slots, max_len)
        self.tunable_threads = self.device.type == "cpu"  # see prunus.serve.pass_threads
        self.compile = compile
        self.compiled = None  # set by warm_up: pass timing runs eager, then the decode graphs compile

    def warm_up(self, set_threads=None) -> None:
        """With ``compile``, compile the decode graphs now (prunus.serve.compiled_decode)."""
        if self.compile and self.compiled is None:
            from .compiled_decode import CompiledDecode

            compiled = CompiledDecode(self.model, self.cache)
            compiled.warm_up(set_threads)
            self.compiled = compiled

    @torch.inference_mode()
    def prefill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        tokens = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        step = self.cache.step(rows, new_lengths=lengths, q_len=width)
        logits = self.model(tokens.to(self.device), cache=step, positions=step.positions)
        last = torch.tensor(lengths, device=self.device) - 1
        return logits[torch.arange(len(prompts), device=self.device), last].float().cpu()

    @torch.inference_mode()
    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        if self.compiled is not None:
            return self.compiled(rows, tokens)
        step = self.cache.step(rows, q_len=1)
        x = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        return self.model(x, cache=step, positions=step.positions)[:, -1].float().cpu()

    def close(self) -> None:
        pass
