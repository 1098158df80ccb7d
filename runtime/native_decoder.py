"""A genai export's native weights packed for prunus's kernels, and a native decoder over the native runtime's KV
buffers with each linear layer's row grouping measured on this machine (:mod:`prunus.runtime.native_backend`)."""

from __future__ import annotations

from pathlib import Path

from prunus.artifacts.errors import PrunusError
from prunus.native.build import isa
from prunus.native.decoder import NativeDecoder
from prunus.native.plan import load_plan
from prunus.native.weights import PackedModel, native_weights_file, read_native_weights


def pack_export(graph: str | Path | bytes, dims: dict) -> PackedModel:
    """The native weights beside the genai graph at ``graph`` (in its export dir), packed for the kernels."""
    if isinstance(graph, bytes):
        raise PrunusError("native decoding reads an export dir's native_weights.safetensors; give the graph's path, "
                          "not its bytes")
    return read_native_weights(native_weights_file(Path(graph).parent), dims)


def native_decoder(source, dims: dict, k_buffers: list, v_buffers: list, n_slots: int, max_len: int,
                   threads: int | None = None, packed: PackedModel | None = None) -> NativeDecoder:
    """A decoder over ``k_buffers`` / ``v_buffers`` (one per layer, (n_slots, kv_heads, max_len, head_dim) float32);
    ``packed``: weights already packed by the caller, else read from the export dir of the graph at ``source``."""
    decoder = NativeDecoder(packed if packed is not None else pack_export(source, dims), k_buffers, v_buffers, n_slots,
                            max_len, threads)
    try:  # each linear layer's row grouping, measured on this machine (or cached, or the fixed rules)
        decoder.use_plan(load_plan(decoder.packed, decoder.lib, decoder.pool, isa(), decoder.threads))
    except BaseException:
        decoder.close()
        raise
    return decoder
