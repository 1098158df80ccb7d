"""The ONNX Runtime backend for a genai export (one graph, GroupQueryAttention over a shared KV buffer).

The graph and its buffers are a :class:`prunus.runtime.genai_session.GenaiSession`: per layer one
(n_slots, kv_heads, max_len, head_dim) key and value buffer, bound as both past and present, so a
decode step copies no cache. GroupQueryAttention takes a batch whose buffer has that same batch, so
the rows of a pass must be consecutive slots of the buffer. The scheduler hands out arbitrary rows
(``prunus.serve.scheduler``), so this backend maps each scheduler row to a buffer slot and keeps the
active rows packed in slots ``[0, n)``:

* prefill: the joining rows take the slots after the block (a row the scheduler hands out again
  first leaves its old slot), their prompts right-padded into one pass;
* release: the row has left; the block's last row moves into its slot (one copy of that row's keys
  and values, per leave, never per step);
* decode: every held row in one pass over slots ``[0, n)``; ``input_ids`` follow slot order and the
  logits come back in the scheduler's row order.

A decode step therefore writes n token ids and n lengths into bound arrays and runs the graph; the
binding of a batch size is built once and reused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError

from .artifact import export_dims, export_tokenizer
from .backend import BackendBase, Capabilities
from .load_options import LoadOptions
from .registry import Loaded


# ONNX Runtime's pool threads spin between parallel sections (its default), as llama.cpp's do. SmolLM2-135M, 2 threads,
# batch 1, 64 tokens, Engines alternating on an idle 2-core machine: spinning decoded 1.19x (int8) and 1.10x (int4)
# the tokens/s of sleeping threads. On a busy machine it is the other way round (sleeping took 0.54x the step time
# of spinning, int8): spinning threads take the cores other work needs. One thread has no pool to spin.
SPINNING = True


class GenaiBackend(BackendBase):
    name = "onnxruntime"

    def __init__(self, session, n_slots: int, max_len: int):
        self.session = session
        self.n_slots, self.max_len = n_slots, max_len
        self.vocab_size, self.n_layers = session.vocab_size, session.n_layers
        self.device = torch.device("cpu")
        self.slot_of: dict[int, int] = {}  # scheduler row -> buffer slot
        self.row_at: list[int] = []  # buffer slot -> scheduler row, slots [0, n)
        self.lengths = np.zeros(n_slots, np.int64)  # tokens held per buffer slot

    @property
    def capabilities(self) -> Capabilities:
        # the scheduler thread's only torch work here is sampling: one OpenMP thread keeps torch's
        # pool from waking (or spinning, without OMP_WAIT_POLICY=PASSIVE) beside ONNX Runtime's threads
        return Capabilities(max_batch=self.n_slots, host_threads=1)

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

    def prefill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        for r in rows:  # a row prefilled again starts afresh
            self.release(r)
        start = len(self.row_at)
        if start + len(rows) > self.n_slots:
            raise PrunusError(f"{start + len(rows)} rows exceed the backend's {self.n_slots} slots")
        logits = self.session.prefill(start, prompts)
        for i, (r, p) in enumerate(zip(rows, prompts)):
            self.slot_of[r] = start + i
            self.row_at.append(r)
            self.lengths[start + i] = len(p)
        return torch.from_numpy(logits.copy())

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        missing = [r for r in rows if r not in self.slot_of]
        if missing:
            raise PrunusError(f"decode of row(s) {missing} that were never prefilled")
        n = len(self.row_at)
        if len(rows) != n:  # the block decodes as one: a row that left must have been released
            held = sorted(set(self.row_at) - set(rows))
            raise PrunusError(f"decode of {len(rows)} rows while the block holds {n}: release row(s) {held} first")
        by_slot = np.empty(n, np.int64)
        order = np.fromiter((self.slot_of[r] for r in rows), np.int64, len(rows))
        by_slot[order] = tokens
        logits = self.session.decode(self.lengths[:n], by_slot)
        self.lengths[:n] += 1
        return torch.from_numpy(logits[order])  # fancy indexing copies: the buffer is reused next step

    def close(self) -> None:
        self.session.close()


def load_genai(path: Path, config: dict, options: LoadOptions, native: bool = False) -> Loaded:
    """An export dir whose config.json says ``export.graph == "genai"`` (``options.prompt_graph``: with its prompt twin;
    ``native``: decode in prunus's own kernels, :mod:`prunus.runtime.native`)."""
    from .genai_session import GenaiSession

    tokenizer = export_tokenizer(path, config)
    export = config["export"]
    graph = inside(path, (export.get("graphs") or {}).get("model"), f"{path}/config.json: export.graphs['model']",
                   fix="re-create the export dir with prunus export")  # never a file outside the dir
    n_slots, max_len = options.max_batch, options.max_len
    try:
        session = GenaiSession(graph, **export_dims(path, export), n_slots=n_slots, max_len=max_len,
                               threads=options.threads, spinning=SPINNING, prompt_twin=options.prompt_graph,
                               native=native, kv_dtype=options.kv_dtype if native else "f32")
    except PrunusError:
        raise
    except Exception as e:  # onnxruntime raises its own types for unreadable / invalid graphs
        raise PrunusError(f"{graph}: ONNX Runtime cannot load it ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          "re-create the export dir with prunus export") from None
    info = {"precision": export.get("precision")}
    if options.prompt_graph:
        info["prompt_graph_min_tokens"] = session.prompt_min_tokens
    if native:
        info["native_prompt_tokens"] = session.native_prompt_tokens
        info["kv_dtype"] = options.kv_dtype
    return Loaded(GenaiBackend(session, n_slots, max_len), tokenizer, info)


def load(path: Path, config: dict, options: LoadOptions) -> Loaded:
    return load_genai(path, config, options)
