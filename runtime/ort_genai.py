"""The ONNX Runtime backend for a genai export (one graph, GroupQueryAttention over a shared KV buffer).

The graph and its buffers are a :class:`prunus.runtime.genai_session.GenaiSession`: per layer one
(n_slots, kv_heads, max_len, head_dim) key and value buffer, bound as both past and present, so a
decode step copies no cache. GroupQueryAttention takes a batch whose buffer has that same batch, so
the rows of a pass must be consecutive slots of the buffer. The scheduler hands out arbitrary rows
(``prunus.serve.scheduler``), so this backend maps each scheduler row to a buffer slot and keeps the
active rows packed in slots ``[0, n)``:

* prefill: the joining rows take the slots after the block (a row the scheduler hands out again
  first leaves its old slot), their prompts right-padded into one pass;
* extend (chunked prefill, ``capabilities.extend``): each row goes on after what it holds with its piece of a
  prompt, one pass per row (GroupQueryAttention takes a piece after a past at batch 1 only);
* release: the row has left; the block's last row moves into its slot (one copy of that row's keys
  and values, per leave, never per step);
* decode: the rows whose prompts are in, moved (where a row still prefilling holds one of them) into slots
  ``[0, n)`` by exchanging two rows' keys and values, once per row that joins; one pass over slots ``[0, n)``,
  ``input_ids`` in slot order and the logits back in the scheduler's row order;
* verify_rows / verify / truncate: each row goes on after what it holds with its tokens, one pass per row through
  the graph with its last-token gather bypassed (:meth:`GenaiSession.verify`), the logits after each token back;
  truncate keeps a row's first tokens (the parity check of an export reads every position's logits so);
* restore_prefix / store_prefix (``prefix_cache_mb``): the prefix cache (:mod:`prunus.runtime.prefix_cache`) copies
  cached blocks into a slot after the block, and a row's full blocks out, through tensors over the numpy buffers.

The native kernels serve a genai export in a runtime of their own, rows never compacted
(:mod:`prunus.runtime.native_backend`).

A decode step of an unchanged block therefore writes n token ids and n lengths into bound arrays and runs the
graph; the binding of a batch size is built once and reused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError

from .artifact import export_dims, export_tokenizer
from .backend import BackendBase, Capabilities, checked_chunk
from .load_options import LoadOptions
from .registry import Loaded


# ONNX Runtime's pool threads spin between parallel sections (its default), as llama.cpp's do: faster on an idle
# machine, slower on a busy one (docs/defaults.md). One thread has no pool to spin.
SPINNING = True

# Prompt tokens per row per pass of ``extend`` when the load leaves ``prefill_chunk`` at "auto" (the torch backend
# takes 256): a prompt in chunks of 64 costs no more than whole, and every decode step beside it waits one chunk's
# pass instead of the whole prompt's (docs/defaults.md). With --prompt-graph the chunk is the twin's threshold, so
# that a row's chunk reaches the twin.
PREFILL_CHUNK_GENAI = 64


def ort_batch_invariant(export: dict) -> bool:
    """Whether ONNX Runtime gives a row the same logits bits alone and batched over this export's genai graph:
    fp32 and 8-bit MatMulNBits at accuracy level 4 (what prunus writes) do; int4 does not, and no session setting
    makes it so (docs/defaults.md has the per-node and per-model measurements)."""
    precision = export.get("precision")
    return precision == "fp32" or precision == "int8" and export.get("int8_style") == "matmulnbits"


class GenaiBackend(BackendBase):
    name = "onnxruntime"

    def __init__(self, session, n_slots: int, max_len: int, prefill_chunk: int | None = PREFILL_CHUNK_GENAI,
                 prefix_cache_mb: float | None = None):
        self.session = session
        self.n_slots, self.max_len = n_slots, max_len
        self.prefill_chunk = checked_chunk(prefill_chunk)
        self.vocab_size, self.n_layers = session.vocab_size, session.n_layers
        self.device = torch.device("cpu")
        self.slot_of: dict[int, int] = {}  # scheduler row -> buffer slot
        self.row_at: list[int] = []  # buffer slot -> scheduler row, slots [0, n)
        self.lengths = np.zeros(n_slots, np.int64)  # tokens held per buffer slot
        self.prefix = None
        if prefix_cache_mb:
            from .prefix_cache import ArrayRows, PrefixCache

            self.prefix = PrefixCache(ArrayRows(session.k, session.v, self.lengths), prefix_cache_mb)

    @property
    def capabilities(self) -> Capabilities:
        # the scheduler thread's only torch work here is sampling: one OpenMP thread keeps torch's
        # pool from waking (or spinning, without OMP_WAIT_POLICY=PASSIVE) beside ONNX Runtime's threads
        return Capabilities(max_batch=self.n_slots, host_threads=1, extend=True, prefill_chunk=self.prefill_chunk,
                            prefix_cache=self.prefix is not None, verify=True, verify_rows=True)

    def describe(self) -> dict:
        return {"prefix_cache": self.prefix.stats} if self.prefix is not None else {}

    def release(self, row: int) -> None:
        """Drop ``row`` from the block (a row never prefilled: nothing); the last slot's row moves into its slot."""
        if row not in self.slot_of:
            return
        slot = self.slot_of.pop(row)
        last = len(self.row_at) - 1
        if slot != last:
            moved = self.row_at[last]
            self.session.move(last, slot, int(self.lengths[last]))
            self.lengths[slot] = self.lengths[last]
            self.row_at[slot] = moved
            self.slot_of[moved] = slot
        self.row_at.pop()
        self.lengths[last] = 0

    def _join(self, rows: list[int]) -> int:
        """Rows that start afresh take the slots after the block (each leaves its old slot first); the first one's."""
        for r in rows:
            self.release(r)
        start = len(self.row_at)
        if start + len(rows) > self.n_slots:
            raise PrunusError(f"{start + len(rows)} rows exceed the backend's {self.n_slots} slots")
        for i, r in enumerate(rows):
            self.slot_of[r] = start + i
            self.row_at.append(r)
        return start

    def _held(self, rows: list[int], verb: str) -> None:
        missing = [r for r in rows if r not in self.slot_of]
        if missing:
            raise PrunusError(f"{verb} of row(s) {missing} that were never prefilled")

    def _place(self, rows: list[int], at: int) -> None:
        """Move the held ``rows`` into slots [at, at + len(rows)) (in any order), swapping each one outside them
        with a row inside that is not one of them: one exchange per row that joins a block, never per step."""
        target = range(at, at + len(rows))
        wanted = set(rows)
        outside = [r for r in rows if self.slot_of[r] not in target]
        spare = [s for s in target if self.row_at[s] not in wanted]
        for r, b in zip(outside, spare):
            a, other = self.slot_of[r], self.row_at[b]
            self.session.swap(a, b, int(self.lengths[a]), int(self.lengths[b]))
            self.lengths[[a, b]] = self.lengths[[b, a]]
            self.row_at[a], self.row_at[b] = other, r
            self.slot_of[r], self.slot_of[other] = b, a

    def prefill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        start = self._join(rows)
        logits = self.session.prefill(start, prompts)
        for i, p in enumerate(prompts):
            self.lengths[start + i] = len(p)
        return torch.from_numpy(logits.copy())

    def extend(self, rows: list[int], pieces: list[list[int]]) -> torch.Tensor:
        """Each row goes on after what it holds with its piece of a prompt; the rows move to the block's end (the
        rows decoding stay in its first slots)."""
        self._held(rows, "extend")
        at = len(self.row_at) - len(rows)
        self._place(rows, at)
        slots = np.fromiter((self.slot_of[r] for r in rows), np.int64, len(rows))
        order = np.argsort(slots)  # the pass runs in slot order
        held = self.lengths[slots[order]]
        logits = self.session.extend(at, held, [pieces[i] for i in order])
        self.lengths[slots] += [len(p) for p in pieces]
        out = np.empty((len(rows), self.vocab_size), np.float32)
        out[order] = logits
        return torch.from_numpy(out)

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """One token for each of ``rows`` (those whose prompts are in: rows still prefilling wait in later slots)."""
        self._held(rows, "decode")
        n = len(rows)
        self._place(rows, 0)
        by_slot = np.empty(n, np.int64)
        order = np.fromiter((self.slot_of[r] for r in rows), np.int64, n)
        by_slot[order] = tokens
        logits = self.session.decode(self.lengths[:n], by_slot)
        self.lengths[:n] += 1
        return torch.from_numpy(logits[order])  # fancy indexing copies: the buffer is reused next step

    def verify_rows(self, rows: list[int], token_lists: list[list[int]]) -> list[torch.Tensor]:
        """Each row goes on after what it holds with its tokens; the logits after each, (len_i, vocab) per row."""
        self._held(rows, "verify")
        out = []
        for r, tokens in zip(rows, token_lists):
            slot = self.slot_of[r]
            out.append(torch.from_numpy(self.session.verify(slot, self.lengths[slot], tokens)))
            self.lengths[slot] += len(tokens)
        return out

    def verify(self, row: int, tokens: list[int]) -> torch.Tensor:
        return self.verify_rows([row], [tokens])[0]

    def truncate(self, row: int, length: int) -> None:
        """Keep the row's first ``length`` tokens (what was verified and accepted)."""
        self._held([row], "truncate")
        self.lengths[self.slot_of[row]] = length

    def restore_prefix(self, row: int, ids: list[int]) -> int:
        """Start ``row`` with the longest cached prefix of ``ids`` in a slot after the block; the tokens it holds
        (0: none cached, the row holds nothing)."""
        slot = self._join([row])
        held = self.prefix.restore(slot, ids)
        if not held:
            self.release(row)
        return held

    def store_prefix(self, row: int, ids: list[int]) -> None:
        """Cache the full blocks of ``ids`` that ``row`` holds."""
        if row in self.slot_of:
            self.prefix.store(self.slot_of[row], ids)

    def close(self) -> None:
        self.session.close()


def load_genai(path: Path, config: dict, options: LoadOptions) -> Loaded:
    """An export dir whose config.json says ``export.graph == "genai"`` (``options.prompt_graph``: with its prompt
    twin)."""
    from .genai_session import GenaiSession

    tokenizer = export_tokenizer(path, config)
    export = config["export"]
    graph = inside(path, (export.get("graphs") or {}).get("model"), f"{path}/config.json: export.graphs['model']",
                   fix="re-create the export dir with prunus export")  # never a file outside the dir
    n_slots, max_len = options.max_batch, options.max_len
    try:
        session = GenaiSession(graph, **export_dims(path, export), n_slots=n_slots, max_len=max_len,
                               threads=options.threads, spinning=SPINNING, prompt_twin=options.prompt_graph)
    except PrunusError:
        raise
    except Exception as e:  # onnxruntime raises its own types for unreadable / invalid graphs
        raise PrunusError(f"{graph}: ONNX Runtime cannot load it ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          "re-create the export dir with prunus export") from None
    invariant = not options.prompt_graph and ort_batch_invariant(export)  # a prompt twin runs long prompts in float
    info = {"precision": export.get("precision"), "batch_invariant": invariant}
    if options.prompt_graph:
        info["prompt_graph_min_tokens"] = session.prompt_min_tokens
    chunk = options.chunk_for(max(PREFILL_CHUNK_GENAI, session.prompt_min_tokens or 0))  # "auto": its own (above)
    backend = GenaiBackend(session, n_slots, max_len, prefill_chunk=chunk,
                           prefix_cache_mb=options.features.prefix_cache_mb)
    return Loaded(backend, tokenizer, info)


def load(path: Path, config: dict, options: LoadOptions) -> Loaded:
    return load_genai(path, config, options)
