"""The one contract every runtime serves under: :class:`Backend`, and what it can do, :class:`Capabilities`.

A backend holds ``capabilities.max_batch`` cache rows of up to ``max_len`` tokens each. The scheduler
(:mod:`prunus.serve.scheduler`) gives every request a row and calls, on its one thread:

* ``prefill(rows, prompts)``: start each row afresh with its prompt (token id lists of any lengths);
  returns the logits of each prompt's last token, (batch, vocab) float, on ``device``;
* ``extend(rows, pieces)``: append each row's piece of its prompt after what the row holds (chunked
  prefill), where ``capabilities.extend`` says so; the same logits as ``prefill``;
* ``decode(rows, tokens)``: one token per row; the next logits;
* ``release(row)``: the row's request has left (finished, cancelled or failed); the row may be handed out
  again and its contents are garbage;
* ``warm_up(set_threads)``: once before the first request, where ``capabilities.warm_up`` says so;
* ``describe()``: facts for the engine's info once warmed up (e.g. whether decoding compiled);
* ``restore_prefix(row, ids)`` / ``store_prefix(row, ids)``: where ``capabilities.prefix_cache`` says so, start a
  row from the longest cached prefix of a prompt (returns the tokens it holds), and cache a row's full blocks
  (:mod:`prunus.runtime.prefix_cache`);
* ``verify(row, tokens)`` / ``truncate(row, length)``: where ``capabilities.verify`` says so, append tokens and return
  the logits after each (len, vocab), and keep a row's first ``length`` tokens (:mod:`prunus.runtime.speculative`);
  ``verify_rows(rows, token_lists)`` where ``capabilities.verify_rows`` says so: the same for several rows in one
  pass, a list of (len_i, vocab);
* ``final_hidden(tokens, adapter)`` where ``capabilities.embeddings`` says so: the final hidden states (the output
  head's input) of a right-padded (rows, seq) batch in one pass without the KV cache, the head not run
  (:mod:`prunus.serve.embeddings` pools them);
* ``attach_lora(adapters)`` / ``bind_adapter(row, adapter)`` where ``capabilities.lora`` says so: load PEFT adapters
  ({name: dir}), and run a row with one of them (None: the base); ``lora`` holds the loaded ones (a
  :class:`prunus.runtime.lora_adapters.LoraSet`, None before the first);
* ``prompt_logits(ids)`` where ``capabilities.prompt_logits`` says so: every position's logits (len, vocab) of one
  prompt in a pass without the KV cache, on the calling thread (``echo`` with ``logprobs``,
  :mod:`prunus.serve.prompt_logprobs`);
* ``report_hidden(sink)`` / ``embed_tokens(ids)`` where ``capabilities.hidden_states`` says so: every pass hands its
  rows' final hidden states to ``sink``, and token ids' input embeddings (an EAGLE draft reads both,
  :mod:`prunus.runtime.eagle_drafter`), and ``draft_runner(draft)`` runs a draft's passes in the backend's own
  kernels where it has them (:class:`BackendBase`: torch);
* ``close()``.

A non-generative backend (``capabilities.predict``) serves one forward pass instead: ``predict(batch)``
(a numpy array, ``batch`` rows of the sample shape ``inputs[0]`` describes) returns the outputs as a numpy
array, one row per input row; ``inputs`` / ``outputs`` describe its tensors (:mod:`prunus.runtime.tensor_spec`);
up to ``capabilities.max_batch`` rows go in one pass (:mod:`prunus.serve.dynamic_batcher` merges callers' rows).

Logits may stay on the backend's device: :func:`prunus.runtime.sampling.sample` picks tokens where they are
and hands back token ids only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it can do; the scheduler reads these fields and nothing else."""

    max_batch: int  # cache rows: requests decoded together
    extend: bool = False  # ``extend(rows, pieces)``: a prompt may go through the cache in chunks
    prefill_chunk: int | None = None  # prompt tokens per row per pass with ``extend`` (None: whole prompts)
    tunable_threads: bool = False  # CPU threads per pass chosen by timing at start (prunus.serve.pass_threads)
    host_threads: int | None = None  # torch threads of the scheduler's thread (its torch work is sampling only)
    warm_up: bool = False  # ``warm_up(set_threads)`` must run before the first request
    device_sampling: bool = False  # logits stay on an accelerator; tokens are picked there
    predict: bool = False  # a non-generative model: ``predict(batch)`` maps a batch of inputs to outputs, no cache
    prefix_cache: bool = False  # ``restore_prefix(row, ids)`` / ``store_prefix(row, ids)``: prunus.runtime.prefix_cache
    verify: bool = False  # ``verify(row, tokens)`` / ``truncate(row, length)``: speculative decoding can check drafts
    verify_rows: bool = False  # ``verify_rows(rows, token_lists)``: several rows' drafts checked in one pass
    embeddings: bool = False  # ``final_hidden(tokens, adapter)``: a padded batch's final hidden states, no cache
    lora: bool = False  # ``attach_lora(adapters)`` / ``bind_adapter(row, adapter)``: LoRA adapters per row
    hidden_states: bool = False  # ``report_hidden(sink)``: each pass's final hidden states to a drafter (EAGLE)
    prompt_logits: bool = False  # ``prompt_logits(ids)``: every position's logits of a prompt, no cache

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch={self.max_batch!r} must be a positive integer")
        if self.prefill_chunk is not None and not self.extend:
            raise ValueError("prefill_chunk needs extend")


@runtime_checkable
class Backend(Protocol):
    name: str
    n_slots: int
    max_len: int
    vocab_size: int

    @property
    def capabilities(self) -> Capabilities: ...

    def prefill(self, rows: list[int], prompts: list[list[int]]): ...

    def extend(self, rows: list[int], pieces: list[list[int]]): ...

    def decode(self, rows: list[int], tokens: list[int]): ...

    def release(self, row: int) -> None: ...

    def warm_up(self, set_threads: Callable[[int], None] | None = None) -> None: ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


def checked_chunk(prefill_chunk):
    """A backend's ``prefill_chunk``: a positive integer, or None (whole prompts); else one PrunusError line."""
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        from prunus.artifacts.errors import PrunusError

        raise PrunusError(f"prefill_chunk={prefill_chunk!r} must be a positive integer (or None: whole prompts)")
    return prefill_chunk


class BackendBase:
    """Defaults for the optional parts of :class:`Backend`: no chunked prefill, no warm-up, nothing to describe.
    ``release`` and ``capabilities`` are each backend's own."""

    def extend(self, rows: list[int], pieces: list[list[int]]):
        raise NotImplementedError(f"the {self.name} backend prefills whole prompts (capabilities.extend is False)")

    def warm_up(self, set_threads: Callable[[int], None] | None = None) -> None:
        pass

    def describe(self) -> dict:
        return {}

    def draft_runner(self, draft):
        """The passes of an EAGLE draft served beside this backend (:mod:`prunus.runtime.eagle_drafter`), in this
        backend's own kernels where it has any; here: the draft module in torch."""
        from .eagle_drafter import TorchDraft

        return TorchDraft(draft, self.n_slots, self.max_len)
