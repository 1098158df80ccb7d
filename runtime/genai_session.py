"""A genai graph (:mod:`prunus.export.genai_graph`) in ONNX Runtime with I/O binding and one preallocated KV buffer.

:class:`GenaiSession` holds, per layer, a key and a value buffer of (n_slots, kv_heads, max_len,
head_dim) float32, allocated once. A pass runs on a block of consecutive slots ``[start, start + b)``:
the block's slice of each buffer (contiguous: the slots are the leading axis) is bound as both
``past`` and ``present``, so GroupQueryAttention appends the new keys in place and no step copies the
cache. The token ids, ``seqlens_k`` and ``total_sequence_length`` are written into preallocated numpy
arrays bound by address, and ``logits`` into a preallocated (n_slots, vocab) array. A decode step's
binding depends only on its batch size and is kept, so a step is: write the ids and lengths, run.

``prompt_twin=True`` loads, for a quantized graph, its prompt twin (:mod:`prunus.runtime.genai_prompt_graph`;
asked of a float graph, or of buffers no pass of which reaches its threshold, it is one PrunusError line):
the same weights with float activations in the matmuls, a second ONNX Runtime session over the same KV
buffers. A prompt pass of at least its token threshold (rows x padded width) runs there; shorter passes and
every decode step run in the graph itself. The twin holds its own copy of the weights (about as much memory
again as the graph) and runs without ONNX Runtime's arena (see :func:`prunus.runtime.ort_session.ort_session`).

ONNX Runtime only: the native kernels serve through :mod:`prunus.runtime.native_backend` (and
:class:`prunus.runtime.native.NativeSession` drives that backend with this class's ``prefill`` / ``decode``, to
compare the two on the same export).

GroupQueryAttention needs the query batch to equal the buffer's batch, hence blocks: the serving
backend (:mod:`prunus.runtime.ort_genai`) keeps its active rows in slots ``[0, n)``.

:meth:`GenaiSession.extend` runs pieces of prompts after what their slots hold (chunked prefill, the rest of a
prompt after a cached prefix): one ONNX Runtime pass per row (GroupQueryAttention takes several new tokens after a
past at batch 1 only); the logits equal a whole prompt's (tests/test_genai_extend.py).

:meth:`GenaiSession.verify` runs a piece after what a slot holds and returns the logits after each of its tokens
(speculative drafts, and the parity check's every-position logits, :mod:`prunus.export.backend_parity`), through a
second session of the graph with its last-token gather bypassed, made on first use.
"""

from __future__ import annotations

import numpy as np

from prunus.artifacts.errors import PrunusError

from .ort_session import ort_session, variant_session


def prompt_twin_of(path_or_bytes, n_slots: int, max_len: int):
    """(the prompt twin, its token threshold) of a genai graph, or one PrunusError line when a twin would never run:
    the graph's weights are float (nothing to rewrite), or no pass of ``n_slots`` x ``max_len`` reaches the
    threshold. Asked for and unused, it would be an option silently ignored."""
    import onnx

    from .genai_prompt_graph import prompt_graph

    if isinstance(path_or_bytes, bytes):
        name, proto = "the genai graph", onnx.load_model_from_string(path_or_bytes)
    else:
        name, proto = str(path_or_bytes), onnx.load(str(path_or_bytes), load_external_data=False)
    twin = prompt_graph(proto)
    if twin is None:
        raise PrunusError(f"{name}: --prompt-graph (prompt_graph) is for an export of int8 / int4 weights, and this "
                          "one's are float (its prompts already run in float); drop --prompt-graph")
    if n_slots * max_len < twin[1]:
        raise PrunusError(f"{name}: --prompt-graph would never run: its twin takes prompt passes of at least "
                          f"{twin[1]} tokens and a pass here holds at most {n_slots} rows x {max_len} positions; "
                          "raise --max-batch or --max-len, or drop --prompt-graph")
    return twin


class GenaiSession:
    def __init__(self, path_or_bytes, n_layers: int, n_kv_heads: int, head_dim: int, vocab_size: int, n_slots: int,
                 max_len: int, threads: int | None = None, spinning: bool = True, config: dict | None = None,
                 prompt_twin: bool = False):
        twin = prompt_twin_of(path_or_bytes, n_slots, max_len) if prompt_twin else None  # refused before any load
        self.session = ort_session(path_or_bytes, threads, spinning, config)
        self.prompt_session, self.prompt_min_tokens, self.verify_session = None, None, None
        self._source, self._options = path_or_bytes, (threads, spinning, config)
        self.n_layers, self.n_slots, self.max_len, self.vocab_size = n_layers, n_slots, max_len, vocab_size
        shape = (n_slots, n_kv_heads, max_len, head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(n_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(n_layers)]
        self.logits = np.zeros((n_slots, vocab_size), np.float32)
        self.step_ids = np.zeros((n_slots, 1), np.int64)
        self.seqlens = np.zeros(n_slots, np.int32)
        self.total = np.zeros((), np.int32)
        self._decode_bindings: dict[int, object] = {}
        if twin is not None:
            self._load_prompt_twin(path_or_bytes, twin, threads, spinning, config)

    def _load_prompt_twin(self, path_or_bytes, twin, threads, spinning, config) -> None:
        """The twin's session (``twin``: :func:`prompt_twin_of`), run twice on a pass of its threshold: its first
        passes grow ONNX Runtime's arena for the dequantized weights (SmolLM2 int8, 512 tokens, 2 threads: 2.7 s
        and 1.9 s, then 1.0 s; two passes of another length warm it as well)."""
        self.prompt_session = variant_session(path_or_bytes, twin[0], "prompt", threads, spinning, config, lean=True)
        self.prompt_min_tokens = twin[1]
        rows = -(-twin[1] // self.max_len)  # the fewest rows whose padded width reaches the threshold
        warm = [[0] * -(-twin[1] // rows)] * rows
        for _ in range(2):
            self.prefill(0, warm)

    def _bind(self, ids: np.ndarray, start: int, session=None, out: int = 0, logits: np.ndarray | None = None):
        """An I/O binding of ``ids`` (b, seq) on slots [start, start + b), logits into rows [out, out + b) (or into
        ``logits``)."""
        b = ids.shape[0]
        binding = (session or self.session).io_binding()

        def array(name, a, output=False):
            bind = binding.bind_output if output else binding.bind_input
            bind(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)

        array("input_ids", ids)
        array("seqlens_k", self.seqlens[:b])
        array("total_sequence_length", self.total)
        for i in range(self.n_layers):
            for t, buf in (("key", self.k[i]), ("value", self.v[i])):
                view = buf[start:start + b]
                array(f"past.{i}.{t}", view)
                array(f"present.{i}.{t}", view, output=True)
        array("logits", self.logits[out:out + b] if logits is None else logits, output=True)
        return binding

    def prefill(self, start: int, prompts: list) -> np.ndarray:
        """Prompts (token id lists) into slots [start, start + len(prompts)), right-padded into one pass; returns
        each one's last-token logits, a view of the shared logits array (valid until the next pass)."""
        b = len(prompts)
        if start < 0 or start + b > self.n_slots:
            raise ValueError(f"slots [{start}, {start + b}) outside the buffer's {self.n_slots}")
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        if width > self.max_len:
            raise ValueError(f"a prompt of {width} tokens exceeds the buffer's {self.max_len} positions")
        ids = _padded(prompts, width)
        self.seqlens[:b] = np.asarray(lengths, np.int32) - 1
        self.total[...] = width
        session = self.session
        if self.prompt_session is not None and b * width >= self.prompt_min_tokens:
            session = self.prompt_session
        session.run_with_iobinding(self._bind(ids, start, session))
        return self.logits[:b]

    def extend(self, start: int, held, pieces: list) -> np.ndarray:
        """Each of slots [start, start + len(pieces)) goes on after the ``held[i]`` positions it holds with its piece
        of a prompt (chunked prefill, a prompt after its cached prefix); returns each piece's last-token logits, a
        view of the shared logits array (valid until the next pass).

        GroupQueryAttention takes a pass of several new tokens after a past only at batch 1 ("batch_size must be 1
        when sequence_length > 1 and past context is given"), so each row is its own pass (its slot bound alone:
        slots need not be consecutive there), its logits into its own row of the shared array."""
        b = len(pieces)
        if start < 0 or start + b > self.n_slots:
            raise ValueError(f"slots [{start}, {start + b}) outside the buffer's {self.n_slots}")
        counts = [len(p) for p in pieces]
        ends = [int(h) + c for h, c in zip(held, counts)]
        if min(counts) < 1 or max(ends) > self.max_len:
            raise ValueError(f"pieces of 1 to {self.max_len} positions after what a row holds; got {counts} after "
                             f"{[int(h) for h in held]}")
        for i, (piece, end) in enumerate(zip(pieces, ends)):
            self.seqlens[:1], self.total[...] = end - 1, end
            session = self.session
            if self.prompt_session is not None and len(piece) >= self.prompt_min_tokens:
                session = self.prompt_session
            ids = np.asarray([piece], np.int64)  # bound by address: alive until the run returns
            session.run_with_iobinding(self._bind(ids, start + i, session, out=i))
        return self.logits[:b]

    def verify(self, slot: int, held: int, piece: list) -> np.ndarray:
        """Slot ``slot`` goes on after the ``held`` positions it holds with ``piece``; returns the logits after each
        of its tokens, (len(piece), vocab) float32, a new array. One pass at batch 1 (as :meth:`extend`) through the
        graph with its last-token gather bypassed: a second session of the same weights, made on first use."""
        end = int(held) + len(piece)
        if not 0 <= slot < self.n_slots or not piece or end > self.max_len:
            raise ValueError(f"a piece of 1 to {self.max_len} positions after slot {slot}'s {held}; got {len(piece)}")
        if self.verify_session is None:
            import onnx

            from .genai_prompt_graph import all_positions_graph

            proto = (onnx.load_model_from_string(self._source) if isinstance(self._source, bytes)
                     else onnx.load(str(self._source), load_external_data=False))
            self.verify_session = variant_session(self._source, all_positions_graph(proto), "all_positions",
                                                  *self._options)
        self.seqlens[:1], self.total[...] = end - 1, end
        ids = np.asarray([piece], np.int64)  # bound by address: alive until the run returns
        out = np.empty((1, len(piece), self.vocab_size), np.float32)
        self.verify_session.run_with_iobinding(self._bind(ids, slot, self.verify_session, logits=out))
        return out[0]

    def decode(self, lengths: np.ndarray, tokens) -> np.ndarray:
        """One new token for each of slots [0, b) whose current lengths are ``lengths``; returns (b, vocab) logits
        (a view, valid until the next pass). The caller advances its lengths."""
        b = len(lengths)
        if int(np.max(lengths)) >= self.max_len:
            raise ValueError(f"a row is full: its {self.max_len} positions are used")
        self.step_ids[:b, 0] = tokens
        self.seqlens[:b] = lengths
        self.total[...] = int(np.max(lengths)) + 1
        binding = self._decode_bindings.get(b)
        if binding is None:
            binding = self._decode_bindings[b] = self._bind(self.step_ids[:b], 0)
        self.session.run_with_iobinding(binding)
        return self.logits[:b]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions to slot ``dst`` in every layer (compacting a block)."""
        for buf in (*self.k, *self.v):
            buf[dst, :, :length] = buf[src, :, :length]

    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Exchange slots ``a`` and ``b`` (their first ``length_a`` / ``length_b`` positions) in every layer."""
        for buf in (*self.k, *self.v):
            held = buf[a, :, :length_a].copy()
            buf[a, :, :length_b] = buf[b, :, :length_b]
            buf[b, :, :length_a] = held

    def close(self) -> None:
        self._decode_bindings.clear()
        self.session = self.prompt_session = self.verify_session = None


def _padded(pieces: list, width: int) -> np.ndarray:
    """Token id lists right-padded (with 0) into one (len(pieces), width) int64 array."""
    ids = np.zeros((len(pieces), width), np.int64)
    for i, p in enumerate(pieces):
        ids[i, :len(p)] = p
    return ids
