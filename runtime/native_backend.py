"""The native runtime: every pass of a model in prunus's own CPU kernels (:mod:`prunus.native`: ``decode.c``,
compiled on first use; AVX2, AVX-VNNI, AVX-512, AVX-512 VNNI or AMX linear kernels, chosen from the CPU at load and
named in the engine's info as ``native_isa``), over KV buffers of its own, with no ONNX Runtime session in memory.

It loads two artifacts, the same numbers either way:

* a transformer model dir, its stored float / int8 / int4 weights read directly and packed in memory
  (:func:`prunus.runtime.native_tensors.model_dir_tensors`: the tensors a genai export of the dir writes), no export
  written;
* a genai export dir, from the ``native_weights.safetensors`` it wrote beside its graph (the graph is never read).

:class:`NativeBackend` holds per layer one (n_slots, kv_heads, max_len, head_dim) key and one value buffer, float32
or float16 (``kv_dtype="f16"``: keys and values rounded to halves as written, half the memory of a long context). A
scheduler row *is* a buffer slot: the kernels take each row of a pass at its own slot and position, so rows are never
moved or compacted; a released row's slot is simply free. Prefill, chunked prefill (``extend``), decode steps, the
drafts of speculative decoding (``verify`` / ``verify_rows``, every position's logits) are each one native pass over
the rows given. With ``report_hidden`` every pass also hands the final-norm outputs to an EAGLE draft. Each linear
layer groups its rows as measured on this machine (:mod:`prunus.native.plan`, cached; the info's ``native_plan``). The
kernels sum a row the same way at every row count, so a row's logits do not depend on its neighbours
(``batch_invariant``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prunus.artifacts.errors import PrunusError
from prunus.native.build import isa
from prunus.native.decoder import KV_DTYPES, check_native
from prunus.native.weights import PackedModel

from .backend import BackendBase, Capabilities, checked_chunk
from .load_options import LoadOptions
from .native_decoder import native_decoder
from .registry import Loaded

# Prompt tokens per row per pass of ``extend`` when the load leaves ``prefill_chunk`` at "auto": a prompt in chunks of
# 64 costs no more than whole in the native kernels, while every decode step beside it waits one chunk's pass instead
# of the whole prompt's (docs/defaults.md)
PREFILL_CHUNK = 64


def _padded(pieces: list, width: int) -> np.ndarray:
    """Token id lists right-padded (with 0) into one (len(pieces), width) int64 array."""
    ids = np.zeros((len(pieces), width), np.int64)
    for i, p in enumerate(pieces):
        ids[i, :len(p)] = p
    return ids


class NativeBackend(BackendBase):
    name = "native"

    def __init__(self, packed: PackedModel, n_slots: int, max_len: int, threads: int | None = None,
                 kv_dtype: str = "f32", prefill_chunk: int | None = PREFILL_CHUNK, prefix_cache_mb: float | None = None):
        d = packed.dims
        if max_len > packed.cos.shape[0]:
            raise PrunusError(f"max_len={max_len} exceeds the {packed.cos.shape[0]} positions of the model's rotary "
                              "tables; lower --max-len")
        self.n_slots, self.max_len, self.prefill_chunk = n_slots, max_len, checked_chunk(prefill_chunk)
        self.vocab_size, self.n_layers = d["vocab_size"], d["n_layers"]
        self.device = torch.device("cpu")
        shape = (n_slots, d["n_kv_heads"], max_len, d["head_dim"])
        self.k = [np.zeros(shape, KV_DTYPES[kv_dtype]) for _ in range(self.n_layers)]
        self.v = [np.zeros(shape, KV_DTYPES[kv_dtype]) for _ in range(self.n_layers)]
        self.decoder = native_decoder(None, d, self.k, self.v, n_slots, max_len, threads, packed)
        self.packed = packed
        self.lengths = np.zeros(n_slots, np.int64)  # tokens held per row (= slot)
        self.held: set[int] = set()  # rows prefilled and not released
        self.logits = np.zeros((n_slots, self.vocab_size), np.float32)
        self._every = np.zeros((17, self.vocab_size), np.float32)  # every position's logits (verify)
        self.hidden_sink = None  # report_hidden's callable
        self.prefix = None
        if prefix_cache_mb:
            from .prefix_cache import ArrayRows, PrefixCache

            self.prefix = PrefixCache(ArrayRows(self.k, self.v, self.lengths), prefix_cache_mb)

    @property
    def capabilities(self) -> Capabilities:
        # the scheduler thread's only torch work here is sampling: one OpenMP thread keeps torch's pool from waking
        # beside the kernels' own threads
        return Capabilities(max_batch=self.n_slots, host_threads=1, extend=True, prefill_chunk=self.prefill_chunk,
                            prefix_cache=self.prefix is not None, verify=True, verify_rows=True, hidden_states=True)

    def describe(self) -> dict:
        return {"prefix_cache": self.prefix.stats} if self.prefix is not None else {}

    def _slots(self, rows: list[int], verb: str, fresh: bool = False) -> np.ndarray:
        """``rows`` as slots, checked: each a slot of the buffer, none twice, each held (``fresh``: taken now)."""
        if len(set(rows)) != len(rows) or any(not 0 <= r < self.n_slots for r in rows):
            raise PrunusError(f"{verb} of rows {rows}: each row once, from 0 to {self.n_slots - 1}")
        if fresh:
            self.held.update(rows)
        elif not self.held.issuperset(rows):
            raise PrunusError(f"{verb} of row(s) {sorted(set(rows) - self.held)} that were never prefilled")
        return np.asarray(rows, np.int32)

    def run(self, rows: list[int], pieces: list[list[int]], start: np.ndarray, every: bool = False) -> np.ndarray:
        """One native pass: each row's piece at its positions ``start[i]...``; the last-token logits (every token's
        with ``every``), a view valid until the next pass; the hidden states reported; the rows' lengths set."""
        counts = np.fromiter((len(p) for p in pieces), np.int32, len(pieces))
        if counts.min() < 1 or int((start + counts).max()) > self.max_len:
            raise PrunusError(f"pieces of 1 to {self.max_len} positions after what a row holds; got "
                              f"{counts.tolist()} after {start.tolist()}")
        slots = np.asarray(rows, np.int32)
        total = int(counts.sum())
        if every and self._every.shape[0] < total:
            self._every = np.zeros((max(total, 2 * self._every.shape[0]), self.vocab_size), np.float32)
        out = self._every if every else self.logits
        hidden = None
        if self.hidden_sink is not None:
            hidden = np.empty((total, self.packed.emb.shape[1]), np.float32)
        logits = self.decoder.forward(_padded(pieces, int(counts.max())), start.astype(np.int32), counts, slots, out,
                                      every_position=every, hidden=hidden)
        self.lengths[slots] = start + counts
        if hidden is not None:
            at = 0
            for row, s, n in zip(rows, start.tolist(), counts.tolist()):
                self.hidden_sink(row, int(s), torch.from_numpy(hidden[at:at + n]))
                at += n
        return logits

    def prefill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        self._slots(rows, "prefill", fresh=True)
        return torch.from_numpy(self.run(rows, prompts, np.zeros(len(rows), np.int64)).copy())

    def extend(self, rows: list[int], pieces: list[list[int]]) -> torch.Tensor:
        """Each row goes on after what it holds with its piece of a prompt, all rows in one pass."""
        slots = self._slots(rows, "extend")
        return torch.from_numpy(self.run(rows, pieces, self.lengths[slots].copy()).copy())

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        slots = self._slots(rows, "decode")
        return torch.from_numpy(self.run(rows, [[t] for t in tokens], self.lengths[slots].copy()).copy())

    def verify(self, row: int, tokens: list[int]) -> torch.Tensor:
        """Append ``tokens`` to ``row`` in one pass; the logits after each of them, (len(tokens), vocab)."""
        return self.verify_rows([row], [tokens])[0]

    def verify_rows(self, rows: list[int], token_lists: list[list[int]]) -> list[torch.Tensor]:
        """Each row's tokens after what it holds, every row in one pass; the logits after each row's tokens."""
        slots = self._slots(rows, "verify")
        logits = self.run(rows, token_lists, self.lengths[slots].copy(), every=True)
        out, at = [], 0
        for tokens in token_lists:
            out.append(torch.from_numpy(logits[at:at + len(tokens)].copy()))
            at += len(tokens)
        return out

    def truncate(self, row: int, length: int) -> None:
        """Keep the row's first ``length`` tokens (rejected draft tokens' positions are overwritten later)."""
        if not 0 <= length <= int(self.lengths[row]):
            raise ValueError(f"row {row} holds {int(self.lengths[row])} tokens; cannot truncate it to {length}")
        self.lengths[row] = length

    def release(self, row: int) -> None:
        """The row's slot is free: nothing moves."""
        self.held.discard(row)
        if 0 <= row < self.n_slots:
            self.lengths[row] = 0

    def draft_runner(self, draft):
        """An EAGLE draft's passes in the native kernels at int8, on this backend's thread pool: the whole pass where
        the kernels mirror its block, else its linear layers in them and the rest in torch."""
        from .eagle_drafter import TorchDraft
        from .eagle_native import NativeDraft, native_linears

        try:
            return NativeDraft(draft, self.decoder, self.n_slots, self.max_len)
        except PrunusError:
            return TorchDraft(native_linears(draft, self.decoder), self.n_slots, self.max_len)

    def report_hidden(self, sink) -> None:
        """From now on every pass calls ``sink(row, start, hidden)`` for each row with the final-norm outputs of the
        positions it computed (an EAGLE draft reads them, prunus.runtime.eagle_drafter)."""
        self.hidden_sink = sink

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of token ``ids`` (float32, CPU), from the packed table."""
        return torch.from_numpy(self.packed.emb[ids.numpy()])

    def restore_prefix(self, row: int, ids: list[int]) -> int:
        """Start ``row`` with the longest cached prefix of ``ids``; the tokens it holds (0: none cached)."""
        self.release(row)
        held = self.prefix.restore(row, ids)
        if held:
            self.held.add(row)
        return held

    def store_prefix(self, row: int, ids: list[int]) -> None:
        """Cache the full blocks of ``ids`` that ``row`` holds."""
        if row in self.held:
            self.prefix.store(row, ids)

    def close(self) -> None:
        self.decoder.close()


def pack_model(path: Path, model) -> PackedModel:
    """The native weights of ``model``, loaded from the model dir at ``path``, packed in memory."""
    from prunus.native.weights import pack_tensors

    from .native_tensors import model_dir_tensors

    cfg = model.config
    dims = {"n_layers": len(model.layers), "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size}
    tensors, meta = model_dir_tensors(model)
    return pack_tensors(Path(path) / "model.safetensors", tensors, meta, dims)


def _model_dir_weights(path: Path) -> tuple[PackedModel, object, str]:
    """(packed weights, tokenizer, precision) of a transformer model dir, read directly (manifest verified)."""
    from prunus.models import load_model, load_model_tokenizer

    model = load_model(path).float()
    packed = pack_model(path, model)
    return packed, load_model_tokenizer(path), packed_precision(packed)


def packed_precision(packed: PackedModel) -> str:
    """"int4" where any linear layer holds int4 codes, else "int8" where any holds int8 codes, else "fp32"."""
    kinds = {lin.kind for layer in packed.layers for lin in layer.values() if hasattr(lin, "kind")}
    return "int4" if "q4" in kinds else "int8" if "q8" in kinds else "fp32"


def _export_weights(path: Path, config: dict) -> tuple[PackedModel, object, str]:
    """(packed weights, tokenizer, precision) of a genai export dir, from its ``native_weights.safetensors``."""
    from prunus.native.weights import native_weights_file, read_native_weights

    from .artifact import export_dims, export_tokenizer

    export = config["export"]
    packed = read_native_weights(native_weights_file(path), export_dims(path, export))
    return packed, export_tokenizer(path, config), export.get("precision")


def load(path: Path, config: dict, options: LoadOptions) -> Loaded:
    """A transformer model dir or a genai export dir, every pass in the native kernels."""
    check_native(str(path))
    exported = "export" in config
    packed, tokenizer, precision = _export_weights(path, config) if exported else _model_dir_weights(path)
    backend = NativeBackend(packed, options.max_batch, options.max_len, options.threads, options.kv_dtype,
                            prefill_chunk=options.chunk_for(PREFILL_CHUNK),
                            prefix_cache_mb=options.features.prefix_cache_mb)
    info = {"precision": precision, "batch_invariant": True, "kv_dtype": options.kv_dtype,
            "native_isa": isa(), "weights": "native_weights.safetensors" if exported else "the model dir's, packed at load"}
    if backend.decoder.plan is not None:
        info["native_plan"] = backend.decoder.plan.how  # calibrated / cached / default, and why
    return Loaded(backend, tokenizer, info)
