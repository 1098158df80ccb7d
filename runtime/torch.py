"""The PyTorch runtime: a model in this process, its ragged batch KV cache, prefill and decode passes.

It serves the :class:`~prunus.runtime.backend.Backend` contract: ``prefill(rows, prompts)`` starts each row
afresh with its prompt (token id lists of any lengths, right-padded into one pass) and returns the logits of each
prompt's last token, (batch, vocab) float32 on the model's device (sampling picks tokens there,
:mod:`prunus.runtime.sampling`: no step copies a whole vocabulary's logits to the host);
``decode(rows, tokens)`` appends one token per row and returns the next logits.

This one also answers ``extend(rows, pieces)``: append each row's piece of its prompt after
what the row holds. A prompt longer than ``prefill_chunk`` tokens is prefilled in chunks of
that many through the cache, so a pass's activations are bounded by the chunk and not by
the prompt, and the scheduler can run other rows' decode steps between a long prompt's
chunks. Only each row's last position goes through the output head (the rest of a prompt
needs no logits): on SmolLM2-135M the head is a fifth of a prefill's matmul work.

Under tensor parallelism each worker runs this same backend over its shard.

Two serving features build on the cache rows here: automatic prefix caching (``prefix_cache_mb``,
:mod:`prunus.runtime.prefix_cache`: ``restore_prefix`` / ``store_prefix``) and speculative decoding
(:mod:`prunus.runtime.speculative`: ``verify`` appends a row's draft tokens and returns the logits at every one of
them, ``truncate`` rolls the row back to the tokens accepted).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from prunus.artifacts.errors import PrunusError

from .backend import BackendBase, Capabilities, checked_chunk
from .batch_cache import BatchKVCache
from .load_options import PREFILL_CHUNK, LoadOptions
from .registry import Loaded

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



def right_padded(pieces: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Token-id lists as one (rows, longest) long tensor padded with 0 on the right, and their lengths."""
    lengths = [len(p) for p in pieces]
    tokens = torch.zeros(len(pieces), max(lengths), dtype=torch.long)
    for i, p in enumerate(pieces):
        tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    return tokens, lengths

class TorchBackend(BackendBase):
    name = "torch"

    def __init__(self, model, n_slots: int, max_len: int, compile: bool = False, prefill_chunk: int | None = PREFILL_CHUNK,
                 prefix_cache_mb: float | None = None):
        self.model = model
        self.n_slots, self.max_len = n_slots, max_len
        self.prefill_chunk = checked_chunk(prefill_chunk)
        self.vocab_size = model.config.vocab_size
        self.device = getattr(model, "input_device", None) or model.tok_embeddings.weight.device  # a device map's
        self.cache = BatchKVCache.for_model(model, n_slots, max_len)
        self.compile = compile
        self.compiled = None  # set by warm_up: pass timing runs eager, then the decode graphs compile
        self.prefix = None
        self.lora = None  # a prunus.runtime.lora_adapters.LoraSet once attach_lora runs
        self.hidden_sink = None  # report_hidden's callable
        self._capture = None  # final_hidden's hook on the output head, made on first use
        self._block_out = None
        if prefix_cache_mb:
            from .prefix_cache import PrefixCache

            self.prefix = PrefixCache(self.cache, prefix_cache_mb)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(max_batch=self.n_slots, extend=True, prefill_chunk=self.prefill_chunk,
                            tunable_threads=self.device.type == "cpu",  # see prunus.serve.pass_threads
                            warm_up=bool(self.compile), device_sampling=self.device.type != "cpu",
                            prefix_cache=self.prefix is not None, verify=True, verify_rows=True, embeddings=True,
                            lora=True, hidden_states=True, prompt_logits=True)

    def release(self, row: int) -> None:
        """The row's request left: it holds nothing now (the next prefill starts it afresh either way)."""
        self.cache.lengths[row] = 0
        if self.lora is not None:
            self.lora.bind(row, None)

    def attach_lora(self, adapters: dict) -> None:
        """Serve LoRA adapters ({name: PEFT adapter dir}) over this model, per row (prunus.runtime.lora_adapters);
        decoding stays eager (the adapters' hooks run in the model's forward)."""
        from .lora_adapters import LoraSet

        if self.lora is None:
            self.lora = LoraSet(self.model)
        self.compile = False
        self.compiled = None  # graphs compiled before the hooks existed would leave the adapters out
        for name, path in adapters.items():
            self.lora.load(name, path)

    def bind_adapter(self, row: int, adapter) -> None:
        """The request that holds ``row`` now runs with ``adapter`` (a loaded Adapter, or None: the base)."""
        if self.lora is not None:
            self.lora.bind(row, adapter)

    def final_hidden(self, tokens: torch.Tensor, adapter=None) -> torch.Tensor:
        """(rows, seq, dim) final hidden states of the right-padded ``tokens`` in one pass without the KV cache, the
        output head not run; ``adapter``: a loaded LoRA adapter for every row (None: the base)."""
        if self._capture is None:
            from .hidden_capture import HiddenCapture

            self._capture = HiddenCapture(self.model)
        if self.lora is not None:
            self.lora.use(adapter, len(tokens))
        return self._capture.run(self.model, tokens.to(self.device))

    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), vocab) logits of one prompt at every position, in a pass without the KV cache."""
        return self.model(torch.tensor([ids], device=self.device))[0]

    def describe(self) -> dict:
        facts = {"compile": self.compiled is not None}
        if self.prefix is not None:
            facts["prefix_cache"] = self.prefix.stats  # live: the engine's info shows the counts as they move
        return facts

    def restore_prefix(self, row: int, ids: list[int]) -> int:
        """Start ``row`` with the longest cached prefix of ``ids``; the tokens it holds (0: start afresh)."""
        if self.lora is not None and row in self.lora.bound:  # the cache holds the base's keys and values
            return 0
        return self.prefix.restore(row, ids)

    def store_prefix(self, row: int, ids: list[int]) -> None:
        """Cache the full blocks of ``ids`` that ``row`` holds."""
        if self.lora is not None and row in self.lora.bound:
            return
        self.prefix.store(row, ids)

    def truncate(self, row: int, length: int) -> None:
        self.cache.truncate(row, length)

    def report_hidden(self, sink) -> None:
        """From now on every pass calls ``sink(row, start, hidden)`` for each row with the final-norm outputs of the
        positions it computed (an EAGLE draft reads them, prunus.runtime.eagle_drafter); decoding stays eager."""
        last = list(self.model.layers.values())[-1]
        last.register_forward_hook(lambda module, args, out: setattr(self, "_block_out", out))
        self.hidden_sink, self.compile, self.compiled = sink, False, None


    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of token ``ids`` (float32, CPU), as the model embeds them."""
        from prunus.models.eagle_draft import target_embeds

        return target_embeds(self.model, ids.to(self.device)).float().cpu()

    def _report(self, rows: list[int], starts: list[int], counts: list[int]) -> None:
        if self.hidden_sink is None:
            return
        normed = self.model.norm(self._block_out)
        for i, row in enumerate(rows):
            self.hidden_sink(row, starts[i], normed[i, :counts[i]])

    @torch.inference_mode()
    def verify(self, row: int, tokens: list[int]) -> torch.Tensor:
        """Append ``tokens`` to ``row`` in one pass; the logits after each of them, (len(tokens), vocab) float32."""
        step = self.cache.step([row], q_len=len(tokens))
        x = torch.tensor([tokens], dtype=torch.long, device=self.device)
        logits = self.model(x, cache=step, positions=step.positions)[0].float()
        self._report([row], step.start_cpu.tolist(), [len(tokens)])
        return logits

    @torch.inference_mode()
    def verify_rows(self, rows: list[int], token_lists: list[list[int]]) -> list[torch.Tensor]:
        """Each row's ``tokens`` appended after what it holds, all rows in one pass (right-padded; each row sees its
        own keys only); the logits after each row's tokens, [(len_i, vocab) float32]."""
        x, counts = right_padded(token_lists)
        step = self.cache.step(rows, q_len=x.shape[1], n_new=counts)
        logits = self.model(x.to(self.device), cache=step, positions=step.positions).float()
        self._report(rows, step.start_cpu.tolist(), counts)
        return [logits[i, :n] for i, n in enumerate(counts)]

    def warm_up(self, set_threads=None) -> None:
        """With ``compile``, compile the decode graphs now (prunus.runtime.compiled_decode). A compile that
        fails (a compiler torch.compile could not run) leaves decoding eager, with a one-line warning."""
        if self.compile and self.compiled is None:
            from .compiled_decode import CompiledDecode, CompileUnavailable

            try:
                compiled = CompiledDecode(self.model, self.cache)
                compiled.warm_up(set_threads)
            except Exception as e:
                self.cache.lengths.zero_()
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                warnings.warn(f"torch.compile failed ({type(e).__name__}: {first}); decoding eagerly", CompileUnavailable)
                self.compile = False
                return
            self.compiled = compiled

    def prefill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Start each row afresh with its prompt, in chunks of ``prefill_chunk`` tokens."""
        self.cache.lengths[torch.tensor(rows, dtype=torch.long)] = 0
        lengths = [len(p) for p in prompts]
        chunk = self.prefill_chunk or max(lengths)
        out: list[torch.Tensor | None] = [None] * len(rows)
        for start in range(0, max(lengths), chunk):
            live = [i for i, n in enumerate(lengths) if n > start]
            logits = self.extend([rows[i] for i in live], [prompts[i][start:start + chunk] for i in live])
            for j, i in enumerate(live):
                if lengths[i] <= start + chunk:  # this chunk holds the row's last prompt token
                    out[i] = logits[j]
        return torch.stack(out)

    def extend(self, rows: list[int], pieces: list[list[int]]) -> torch.Tensor:
        """Append each row's piece (token ids, any lengths) after what the row holds; the logits of
        each piece's last token, (batch, vocab) float32 on the model's device.

        Rows holding the same number of tokens go through one pass: their new queries start at one
        position, so the model's causal layout is exact without a mask, and no padded query can
        reach past the cache (the longest piece of the pass ends inside it).
        """
        held = self.cache.lengths[torch.tensor(rows, dtype=torch.long)].tolist()
        out: list[torch.Tensor | None] = [None] * len(rows)
        for start in sorted(set(held)):
            group = [i for i, h in enumerate(held) if h == start]
            logits = self._pass([rows[i] for i in group], [pieces[i] for i in group])
            for j, i in enumerate(group):
                out[i] = logits[j]
        return torch.stack(out)

    @torch.inference_mode()
    def _pass(self, rows: list[int], pieces: list[list[int]]) -> torch.Tensor:
        tokens, lengths = right_padded(pieces)
        step = self.cache.step(rows, q_len=tokens.shape[1], n_new=lengths)
        last = torch.tensor(lengths, device=self.device) - 1
        logits = self.model(tokens.to(self.device), cache=step, positions=step.positions, logits_at=last)
        self._report(rows, step.start_cpu.tolist(), lengths)
        return logits[:, 0].float()

    @torch.inference_mode()
    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        if self.compiled is not None:
            return self.compiled(rows, tokens)
        step = self.cache.step(rows, q_len=1)
        x = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        logits = self.model(x, cache=step, positions=step.positions)[:, -1].float()
        self._report(rows, step.start_cpu.tolist(), [1] * len(rows))
        return logits

    def close(self) -> None:
        pass


def load(path: Path, config: dict, options: LoadOptions) -> Loaded:
    """A model dir in this process (``device_map``: its modules placed across devices, :mod:`prunus.runtime.device_map`)."""
    from prunus.models import load_model, load_model_tokenizer

    dtype = DTYPES[options.dtype] if options.dtype else None
    info = {}
    if options.device_map is not None:
        from .device_map import load_dispatched, place_cache

        model, placed = load_dispatched(path, options.device_map, options.max_memory, dtype=dtype)
        backend = TorchBackend(model, options.max_batch, options.max_len, prefill_chunk=options.chunk_for(PREFILL_CHUNK))
        place_cache(backend.cache, model)
        info["device_map"] = {k: str(v) for k, v in placed.items()}
    else:
        from .compiled_decode import choose_compile

        model = load_model(path, device=options.device, dtype=dtype)
        info["compile"] = compile = choose_compile(options.compile, model)
        backend = TorchBackend(model, options.max_batch, options.max_len, compile=compile,
                               prefill_chunk=options.chunk_for(PREFILL_CHUNK),
                               prefix_cache_mb=options.features.prefix_cache_mb)
    return Loaded(backend, load_model_tokenizer(path), info)
